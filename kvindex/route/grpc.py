"""gRPC over kvindex's HTTP/2 connection (``kvindex.route.h2``): calls by path, length-prefixed
messages, status in trailers; the listener, and the standard health service.

Invariants:
- A stream becomes a call only when it is ``POST`` with a ``content-type`` of
  ``application/grpc[+proto]`` and a path in ``methods``; any other is answered at once with a
  trailers-only response: UNIMPLEMENTED (12) for an unknown path, INVALID_ARGUMENT (3) for a
  request that is not gRPC. Nothing of it reaches a handler.
- A call's messages reach its handler whole and in order; a compressed message (this server
  accepts no encoding) or one over ``max_message_bytes`` ends the call with INTERNAL / RESOURCE_EXHAUSTED,
  counted. A handler is told ``end()`` once when the client half-closes and ``cancel()`` at most
  once (the stream reset or the connection gone); it answers through its ``Call``, whose
  ``finish()`` is idempotent. An exception in a handler ends that call with INTERNAL and is
  counted and logged (``on_error``), never the connection.
- ``GrpcServer.stop(grace)``: the listener closes, every connection gets GOAWAY (calls in flight
  finish), then, after ``grace`` seconds at most, what is left is closed.
- Health (``grpc.health.v1.Health/Check``): ``status(service)`` answers each service name
  (SERVING 1, NOT_SERVING 2, SERVICE_UNKNOWN 3); the two protobuf messages are read and written
  here by hand (one field each), so no health package is needed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from kvindex.route import hpack
from kvindex.route.h2 import Connection, Limits

log = logging.getLogger("kvindex.route.grpc")

OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 0, 3, 8, 12, 13, 14
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3
HEALTH_CHECK = b"/grpc.health.v1.Health/Check"
_RESPONSE_HEADERS = hpack.STATUS_200 + hpack.literal(b"content-type", b"application/grpc")


class Handler(Protocol):
    def message(self, data: bytes) -> None: ...
    def end(self) -> None: ...
    def cancel(self) -> None: ...


class Call:
    """One call's outbound side: ``send`` messages, then ``finish`` with a status; ``metadata``:
    the request's headers (pseudo-headers included), as they came."""

    __slots__ = ("_conn", "sid", "_started", "finished", "metadata")

    def __init__(self, conn: Connection, sid: int, metadata: dict[bytes, bytes] | None = None) -> None:
        self._conn, self.sid, self.metadata = conn, sid, metadata or {}
        self._started = False
        self.finished = False

    def send(self, message: bytes) -> None:
        if self.finished:
            return
        if not self._started:
            self._started = True
            self._conn.send_headers(self.sid, _RESPONSE_HEADERS)
        self._conn.send_data(self.sid, b"\x00" + len(message).to_bytes(4, "big") + message)

    def finish(self, status: int = OK, message: str = "") -> None:
        if self.finished:
            return
        self.finished = True
        trailers = hpack.literal(b"grpc-status", str(status).encode())
        if message:
            trailers += hpack.literal(b"grpc-message", _percent(message))
        if not self._started:  # trailers-only
            trailers = _RESPONSE_HEADERS + trailers
        self._conn.send_headers(self.sid, trailers, end_stream=True)


def _percent(text: str) -> bytes:
    """grpc-message's percent-encoding of what is not printable ASCII (and of ``%``)."""
    return b"".join(bytes([b]) if 0x20 <= b < 0x7F and b != 0x25 else b"%%%02X" % b for b in text.encode()[:1024])


Method = Callable[[Call], Handler]


class _Live:
    __slots__ = ("call", "handler", "buf")

    def __init__(self, call: Call, handler: Handler) -> None:
        self.call, self.handler, self.buf = call, handler, bytearray()


class Session:
    """The gRPC side of one HTTP/2 connection (``kvindex.route.h2.StreamApp``)."""

    def __init__(self, methods: dict[bytes, Method], max_message_bytes: int, on_error: Callable[[str], None]) -> None:
        self._methods, self._max, self._on_error = methods, max_message_bytes, on_error
        self._calls: dict[int, _Live] = {}

    def opened(self, conn: Connection, sid: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        h = dict(headers)
        call = Call(conn, sid, h)
        method = self._methods.get(h.get(b":path", b""))
        if h.get(b":method") != b"POST" or not h.get(b"content-type", b"").startswith(b"application/grpc"):
            self._on_error("not_grpc")
            call.finish(INVALID_ARGUMENT, "not a gRPC request")
            return
        if method is None:
            self._on_error("unknown_method")
            call.finish(UNIMPLEMENTED, f"no method {h.get(b':path', b'').decode('latin-1')[:200]}")
            return
        live = _Live(call, method(call))
        self._calls[sid] = live
        if end_stream:
            self.data(sid, b"", True)

    def data(self, sid: int, data: bytes, end_stream: bool) -> None:
        live = self._calls.get(sid)
        if live is None:
            return
        try:
            if data:
                self._messages(live, data)
            if end_stream and not live.call.finished:
                if live.buf:
                    self._fail(live, INTERNAL, "truncated_message", "the stream ended inside a message")
                else:
                    live.handler.end()
        except Exception:  # noqa: BLE001 -- a handler's bug ends its call, never the connection
            log.exception("gRPC handler failed")
            self._fail(live, INTERNAL, "handler_failed", "internal error")
        if end_stream or live.call.finished:
            self._calls.pop(sid, None)

    def _messages(self, live: _Live, data: bytes) -> None:
        buf = live.buf
        buf += data
        while len(buf) >= 5 and not live.call.finished:
            if buf[0]:
                self._fail(live, INTERNAL, "compressed_message", "compressed messages are not accepted")
                return
            n = int.from_bytes(buf[1:5], "big")
            if n > self._max:
                self._fail(live, RESOURCE_EXHAUSTED, "message_too_large", f"message over {self._max} bytes")
                return
            if len(buf) < 5 + n:
                return
            message = bytes(buf[5:5 + n])
            del buf[:5 + n]
            live.handler.message(message)

    def _fail(self, live: _Live, status: int, reason: str, text: str) -> None:
        self._on_error(reason)
        live.buf.clear()
        if not live.call.finished:
            live.handler.cancel()
        live.call.finish(status, text)

    def reset(self, sid: int) -> None:
        live = self._calls.pop(sid, None)
        if live is not None:
            live.call.finished = True
            live.handler.cancel()

    def error(self, reason: str) -> None:
        self._on_error(reason)


class GrpcServer:
    """A listener whose connections speak gRPC to ``methods`` (path -> handler factory)."""

    def __init__(self, methods: dict[bytes, Method], *, max_message_bytes: int = 16 << 20,
                 limits: Limits = Limits(), on_error: Callable[[str], None] = lambda reason: None) -> None:
        self._methods, self._max, self._limits, self._on_error = methods, max_message_bytes, limits, on_error
        self._server: asyncio.Server | None = None
        self._connections: set[Connection] = set()
        self.port: int | None = None

    def _connection(self) -> Connection:
        conn = Connection(Session(self._methods, self._max, self._on_error), self._limits)
        self._connections.add(conn)
        conn.closed.add_done_callback(lambda _: self._connections.discard(conn))
        return conn

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    def open_streams(self) -> int:
        """Streams open on this port's connections: its calls in flight."""
        return sum(len(conn.streams) for conn in self._connections)

    async def stop(self, grace: float = 5.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for conn in list(self._connections):
            conn.goaway()
        waiting = [conn.closed for conn in self._connections]
        if waiting:
            await asyncio.wait(waiting, timeout=grace)
        for conn in list(self._connections):
            conn.close()
        await server.wait_closed()


class HealthCheck:
    """``grpc.health.v1.Health/Check``: one request (field 1, the service name), one answer."""

    def __init__(self, call: Call, status: Callable[[str], int]) -> None:
        self._call, self._status, self._service = call, status, ""

    def message(self, data: bytes) -> None:
        self._service = _field1_string(data)

    def end(self) -> None:
        self._call.send(bytes((0x08, self._status(self._service))))  # HealthCheckResponse{status}
        self._call.finish()

    def cancel(self) -> None:
        pass


def _field1_string(data: bytes) -> str:
    """Field 1 (a string) of a protobuf message; other fields skipped; "" when absent or bad."""
    pos, found = 0, ""
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            wire = key & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 2:
                n, pos = _varint(data, pos)
                if key >> 3 == 1:
                    found = data[pos:pos + n].decode("utf-8", "replace")
                pos += n
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                return found
    except IndexError:
        return ""
    return found


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80 or shift > 63:
            return value, pos
