"""A minimal HTTP/2 server connection (RFC 9113), enough for gRPC from one proxy: frames in,
per-stream calls out; headers, data and trailers back with flow control.

Why not grpcio's server: with Envoy in front, grpcio's asyncio server added 1.0-1.1 ms to every
request in FULL_DUPLEX_STREAMED mode before doing any work (its threads and completion queues,
measured here on 2 cores); this one adds about 0.4 ms (benchmarks/gateway.py). It carries no
TLS, no server push, no priorities: a sidecar's loopback port for Envoy.

Invariants:
- One ``Connection`` per TCP connection; it parses every byte the peer sends into frames and
  validates them (frame sizes, stream ids, CONTINUATION order, SETTINGS values, window updates).
  A connection error sends GOAWAY with its code and closes; a stream error sends RST_STREAM; both
  are reported to ``StreamApp.error(reason)`` (a metric label) and nothing raises out of
  ``data_received``. A hostile or broken peer costs only its own connection.
- Inbound data is bounded by flow control: a stream may have at most ``Limits.stream_window``
  unacknowledged bytes and the connection ``Limits.connection_window``; windows are reopened as
  the app is handed the data (it keeps what it needs, bounded by its own limits). Header blocks
  are at most ``Limits.max_header_bytes``, streams at most ``Limits.max_streams`` at once (more
  are refused with REFUSED_STREAM).
- Outbound data obeys the peer's windows and frame size: what does not fit waits, per stream, in
  order (trailers after data), and goes out on WINDOW_UPDATE; what waits for one connection is
  bounded by ``Limits.max_pending_bytes`` (past it the connection is closed as stuck).
- The app sees a stream opened once, its data in order, its end once, and ``reset`` at most once
  (a RST_STREAM from the peer or the connection lost); after ``reset`` or after it ended its side
  (``send_headers(..., end_stream=True)``), sends on that stream are dropped.
- ``goaway()`` stops new streams (graceful: streams in flight finish); ``close()`` ends at once.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Protocol, cast

from kvindex.route.h2frames import (
    ACK, CANCEL, COMPRESSION_ERROR, CONTINUATION, DATA, DEFAULT_FRAME, DEFAULT_WINDOW, END_HEADERS, END_STREAM,
    FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, GOAWAY, HEADERS, INTERNAL_ERROR, MAX_WINDOW, NO_ERROR, PADDED, PING, PREFACE,
    PRIORITY, PRIORITY_FLAG, PROTOCOL_ERROR, PUSH_PROMISE, REFUSED_STREAM, RST_STREAM, S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST, SETTINGS, STREAM_CLOSED, WINDOW_UPDATE, Limits,
    ProtocolViolation, StreamState, frame,
)
from kvindex.route.hpack import Decoder, HpackError

class StreamApp(Protocol):
    """Who is told about a connection's streams (``kvindex.route.grpc``)."""

    def opened(self, conn: Connection, sid: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None: ...
    def data(self, sid: int, data: bytes, end_stream: bool) -> None: ...
    def reset(self, sid: int) -> None: ...
    def error(self, reason: str) -> None: ...



class Connection(asyncio.Protocol):
    def __init__(self, app: StreamApp, limits: Limits = Limits()) -> None:
        self.app, self.limits = app, limits
        self.decoder = Decoder(max_list_bytes=limits.max_header_bytes)
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._preface = False
        self.streams: dict[int, StreamState] = {}
        self._last_sid = 0
        self._peer_window = DEFAULT_WINDOW  # initial window of a new stream, from the peer's SETTINGS
        self._peer_frame = DEFAULT_FRAME
        self._send_window = DEFAULT_WINDOW  # the connection's, towards the peer
        self._conn_unacked = 0
        self._headers: tuple[int, int, bytearray] | None = None  # (sid, flags, block) until END_HEADERS
        self._out: list[bytes] = []
        self._paused = False
        self._pending_bytes = 0
        self.going_away = False
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only the same interface
        self.transport = cast(asyncio.Transport, transport)
        lim = self.limits
        settings = b"".join(struct.pack(">HI", k, v) for k, v in (
            (S_MAX_CONCURRENT_STREAMS, lim.max_streams), (S_INITIAL_WINDOW_SIZE, lim.stream_window),
            (S_MAX_FRAME_SIZE, lim.max_frame), (S_MAX_HEADER_LIST, lim.max_header_bytes)))
        self.transport.write(frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", lim.connection_window - DEFAULT_WINDOW)))

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            self._parse()
        except ProtocolViolation as exc:
            self._fail(exc.code, exc.reason)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        streams, self.streams = self.streams, {}
        for sid in streams:
            self.app.reset(sid)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        for sid in list(self.streams):
            self._drain(sid)
        self._flush()

    # -- inbound ---------------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = self._buf
        if not self._preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    raise ProtocolViolation(PROTOCOL_ERROR, "bad_preface")
                return
            if buf[:len(PREFACE)] != PREFACE:
                raise ProtocolViolation(PROTOCOL_ERROR, "bad_preface")
            del buf[:len(PREFACE)]
            self._preface = True
        pos = 0
        while len(buf) - pos >= 9 and self.transport is not None:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if length > self.limits.max_frame:
                raise ProtocolViolation(FRAME_SIZE_ERROR, "frame_too_large")
            if len(buf) - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[pos + 9:pos + 9 + length])
            pos += 9 + length
            self._frame(kind, flags, sid, payload)
        del buf[:pos]

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self._headers is not None and (kind != CONTINUATION or sid != self._headers[0]):
            raise ProtocolViolation(PROTOCOL_ERROR, "continuation_expected")
        if kind == DATA:
            self._on_data(flags, sid, payload)
        elif kind == HEADERS:
            self._on_headers(flags, sid, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, sid, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif kind == PING:
            if sid or len(payload) != 8:
                raise ProtocolViolation(FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "bad_ping")
            if not flags & ACK:
                self._out.append(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if len(payload) != 4 or not sid:
                raise ProtocolViolation(FRAME_SIZE_ERROR if sid else PROTOCOL_ERROR, "bad_rst_stream")
            if self.streams.pop(sid, None) is not None:
                self.app.reset(sid)
        elif kind == GOAWAY:
            self.going_away = True
            self._close_if_idle()
        elif kind == PUSH_PROMISE:
            raise ProtocolViolation(PROTOCOL_ERROR, "push_promise")
        elif kind == PRIORITY and (not sid or len(payload) != 5):
            raise ProtocolViolation(PROTOCOL_ERROR, "bad_priority")
        # PRIORITY otherwise, and unknown frame types, are ignored (RFC 9113 §5.5)

    def _unpad(self, flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ProtocolViolation(PROTOCOL_ERROR, "bad_padding")
        return payload[1:len(payload) - payload[0]]

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        self._conn_unacked += len(payload)
        if self._conn_unacked > self.limits.connection_window:
            raise ProtocolViolation(FLOW_CONTROL_ERROR, "connection_window_exceeded")
        stream = self.streams.get(sid)
        if stream is None or stream.remote_ended:
            if not sid or sid > self._last_sid:
                raise ProtocolViolation(PROTOCOL_ERROR, "data_on_idle_stream")
            self._reopen(None, sid, len(payload))
            self._reset(sid, STREAM_CLOSED, "data_on_closed_stream")
            return
        stream.recv_unacked += len(payload)
        if stream.recv_unacked > self.limits.stream_window:
            self._reset(sid, FLOW_CONTROL_ERROR, "stream_window_exceeded")
            return
        end = bool(flags & END_STREAM)
        stream.remote_ended = end
        self.app.data(sid, self._unpad(flags, payload), end)
        self._reopen(self.streams.get(sid), sid, len(payload))
        self._forget_if_done(sid)

    def _reopen(self, stream: StreamState | None, sid: int, n: int) -> None:
        """Give back the windows of ``n`` bytes handed over, once half of a window is used."""
        if self._conn_unacked >= self.limits.connection_window // 2:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._conn_unacked)))
            self._conn_unacked = 0
        if stream is not None and not stream.remote_ended and stream.recv_unacked >= self.limits.stream_window // 2:
            self._out.append(frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", stream.recv_unacked)))
            stream.recv_unacked = 0

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid or not sid & 1:
            raise ProtocolViolation(PROTOCOL_ERROR, "bad_stream_id")
        block = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            block = block[5:]
        self._headers = (sid, flags, bytearray(block))
        if flags & END_HEADERS:
            self._end_headers()

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self._headers is None:
            raise ProtocolViolation(PROTOCOL_ERROR, "unexpected_continuation")
        self._headers[2].extend(payload)
        if len(self._headers[2]) > self.limits.max_header_bytes:
            raise ProtocolViolation(PROTOCOL_ERROR, "header_block_too_large")
        if flags & END_HEADERS:
            self._end_headers()

    def _end_headers(self) -> None:
        assert self._headers is not None
        (sid, flags, block), self._headers = self._headers, None
        if len(block) > self.limits.max_header_bytes:
            raise ProtocolViolation(PROTOCOL_ERROR, "header_block_too_large")
        try:
            headers = self.decoder.decode(bytes(block))
        except HpackError:
            raise ProtocolViolation(COMPRESSION_ERROR, "bad_header_block") from None
        end = bool(flags & END_STREAM)
        stream = self.streams.get(sid)
        if stream is not None:  # trailers: a gRPC client sends none, but they end the stream
            stream.remote_ended = True
            self.app.data(sid, b"", True)
            self._forget_if_done(sid)
            return
        if sid <= self._last_sid:
            raise ProtocolViolation(STREAM_CLOSED, "headers_on_closed_stream")
        self._last_sid = sid
        if self.going_away or len(self.streams) >= self.limits.max_streams:
            self._out.append(frame(RST_STREAM, 0, sid, struct.pack(">I", REFUSED_STREAM)))
            self.app.error("stream_refused")
            return
        self.streams[sid] = StreamState(self._peer_window, remote_ended=end)
        self.app.opened(self, sid, headers, end)
        self._forget_if_done(sid)

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise ProtocolViolation(PROTOCOL_ERROR, "settings_on_stream")
        if flags & ACK:
            if payload:
                raise ProtocolViolation(FRAME_SIZE_ERROR, "settings_ack_with_payload")
            return
        if len(payload) % 6:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "bad_settings")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolViolation(FLOW_CONTROL_ERROR, "bad_initial_window")
                delta, self._peer_window = value - self._peer_window, value
                for state in self.streams.values():
                    state.send_window += delta
            elif key == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= (1 << 24) - 1:
                    raise ProtocolViolation(PROTOCOL_ERROR, "bad_max_frame_size")
                self._peer_frame = value
        self._out.append(frame(SETTINGS, ACK, 0))
        for open_sid in list(self.streams):
            self._drain(open_sid)

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "bad_window_update")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not sid:
            if not increment or self._send_window + increment > MAX_WINDOW:
                raise ProtocolViolation(FLOW_CONTROL_ERROR if increment else PROTOCOL_ERROR, "bad_window_update")
            self._send_window += increment
            for open_sid in list(self.streams):
                self._drain(open_sid)
            return
        stream = self.streams.get(sid)
        if stream is None:
            return  # a stream we already closed
        if not increment or stream.send_window + increment > MAX_WINDOW:
            self._reset(sid, FLOW_CONTROL_ERROR if increment else PROTOCOL_ERROR, "bad_window_update")
            return
        stream.send_window += increment
        self._drain(sid)

    # -- outbound --------------------------------------------------------------------------------
    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        self._queue(sid, HEADERS, block, end_stream)

    def send_data(self, sid: int, data: bytes, end_stream: bool = False) -> None:
        self._queue(sid, DATA, data, end_stream)

    def _queue(self, sid: int, kind: int, payload: bytes, end: bool) -> None:
        stream = self.streams.get(sid)
        if stream is None or stream.local_ended:
            return
        stream.local_ended = end
        stream.pending.append((kind, payload, end))
        self._pending_bytes += len(payload)
        self._drain(sid)
        if self._pending_bytes > self.limits.max_pending_bytes:
            self._fail(INTERNAL_ERROR, "peer_not_reading")
        self._flush()

    def _drain(self, sid: int) -> None:
        """Send what waits on ``sid`` while the windows and the transport allow, in order."""
        stream = self.streams.get(sid)
        if stream is None:
            return
        while stream.pending and not self._paused:
            kind, payload, end = stream.pending[0]
            if kind == HEADERS:
                self._out.append(frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), sid, payload))
                stream.pending.popleft()
                self._pending_bytes -= len(payload)
                continue
            n = min(len(payload), stream.send_window, self._send_window, self._peer_frame)
            if n <= 0 and payload:
                return  # wait for a WINDOW_UPDATE
            last = n == len(payload)
            self._out.append(frame(DATA, END_STREAM if end and last else 0, sid, payload[:n]))
            stream.send_window -= n
            self._send_window -= n
            self._pending_bytes -= n
            if last:
                stream.pending.popleft()
            else:
                stream.pending[0] = (kind, payload[n:], end)
        self._forget_if_done(sid)

    def _forget_if_done(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is not None and stream.remote_ended and stream.local_ended and not stream.pending:
            del self.streams[sid]
            self._close_if_idle()

    def _reset(self, sid: int, code: int, reason: str) -> None:
        self._out.append(frame(RST_STREAM, 0, sid, struct.pack(">I", code)))
        self.app.error(reason)
        stream = self.streams.pop(sid, None)
        if stream is not None:
            self._pending_bytes -= sum(len(p) for _, p, _ in stream.pending)
            self.app.reset(sid)

    def reset(self, sid: int, code: int = CANCEL) -> None:
        """End ``sid`` from this side (the app gave up on it): RST_STREAM, no ``reset`` call back."""
        stream = self.streams.pop(sid, None)
        if stream is not None:
            self._pending_bytes -= sum(len(p) for _, p, _ in stream.pending)
            self._out.append(frame(RST_STREAM, 0, sid, struct.pack(">I", code)))
            self._flush()

    def _flush(self) -> None:
        if self._out and self.transport is not None:
            out, self._out = self._out, []
            if not self.transport.is_closing():  # a peer gone: what it would have read is dropped
                self.transport.write(b"".join(out))

    # -- ending ----------------------------------------------------------------------------------
    def goaway(self) -> None:
        """No new streams; those in flight finish; the connection closes once they have."""
        if self.transport is None or self.going_away:
            return
        self.going_away = True
        self._out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_sid, NO_ERROR)))
        self._flush()
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self.going_away and not self.streams and self.transport is not None:
            self._flush()
            self.transport.close()

    def _fail(self, code: int, reason: str) -> None:
        self.app.error(reason)
        if self.transport is not None:
            self._out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_sid, code)))
            self._flush()
            self.transport.close()
            self.transport = None
        self._buf.clear()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
