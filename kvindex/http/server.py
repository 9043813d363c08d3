"""The HTTP listener: aiohttp's server behind a connection cap, with idle/header and body timeouts.

Invariants:
- At most ``max_connections`` HTTP connections are open at once. A connection beyond the cap is
  accepted and at once answered ``503`` ``{"error": "too many connections ..."}`` and closed
  (counted in ``kvindex_http_connections_refused_total``): it never holds a descriptor, and the
  connections within the cap (``/healthz`` among them) keep being served.
- The default cap leaves descriptors for everything else (``connection_cap``): the engines'
  ZeroMQ sockets (SUB, replay DEALER), the store, the state files. At start the soft
  ``RLIMIT_NOFILE`` is raised to the hard limit where allowed
  (``kvindex.ingest.transport.raise_nofile``).
- A connection that sends no complete request header within ``idle_timeout`` seconds of opening
  (or of its last answer) is closed (aiohttp's keep-alive timer runs from the connection's
  start); a body not received whole within ``body_timeout`` seconds is answered 408 and the
  connection closed after at most ``LINGER_SECONDS`` more (``read_body_within``, run by the
  request middleware before the handler: every handler then reads the body already received,
  ``body_bytes``); a body cut short by the client is a 400 ``body_incomplete``; a body over
  ``max_body_bytes`` is a 413 (a declared ``Content-Length`` over it: before anything is read).
  aiohttp's own log of malformed requests is one line per (message, exception type) per 10 s.
- With a ``FrontDoor`` (``kvindex.http.fastpath``) every connection meets it first; the
  connections it holds count against ``max_connections`` beside aiohttp's, and ``close`` closes
  them (the ones it handed to aiohttp are aiohttp's: the runner's cleanup).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Protocol, cast

from aiohttp import StreamReader, web

from kvindex.http.errors import ApiError
from kvindex.logs import burst_logger
from kvindex.metrics import Metrics

log = logging.getLogger("kvindex.http")

MAX_DEFAULT_CONNECTIONS = 4096  # the derived cap never exceeds this
RESERVED_FDS = 256  # descriptors kept for everything but HTTP (at most a quarter of the limit)
FDS_PER_ENGINE = 8  # an engine's SUB and replay sockets, with ZeroMQ's own descriptors
_REFUSAL = b'{"error": "too many connections: try again later", "field": "connection"}'
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL))


def connection_cap(nofile: int, engines: int) -> int:
    """The default connection cap for ``nofile`` descriptors and ``engines`` configured engines."""
    reserve = min(RESERVED_FDS, nofile // 4) + FDS_PER_ENGINE * engines
    return max(8, min(MAX_DEFAULT_CONNECTIONS, nofile - reserve))


class _Refuse(asyncio.Protocol):
    """A connection beyond the cap: the 503, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).write(_REFUSED)
        transport.close()


class FrontDoor(Protocol):
    """What meets a connection before aiohttp (``kvindex.http.fastpath.FastPath``): it hands the
    connection to ``server`` (aiohttp's protocol factory) whenever it does not answer it itself."""

    def protocol(self, server: web.Server) -> asyncio.Protocol: ...

    def open(self) -> int: ...  # connections held, not yet handed to aiohttp

    async def close(self) -> None: ...


class HttpServer:
    """``runner``'s application on ``host:port`` with at most ``max_connections`` connections,
    each met first by ``front`` when there is one (the fast path)."""

    def __init__(self, runner: web.AppRunner, max_connections: int, metrics: Metrics,
                 front: FrontDoor | None = None) -> None:
        self._runner = runner
        self.max_connections = max_connections
        self._metrics = metrics
        self._front = front
        self._server: asyncio.Server | None = None

    def _protocol(self) -> asyncio.Protocol:
        server = self._runner.server
        assert server is not None
        front = self._front
        if len(server.connections) + (front.open() if front is not None else 0) >= self.max_connections:
            self._metrics.http_connections_refused.inc()
            return _Refuse()
        return front.protocol(server) if front is not None else server()

    async def start(self, host: str, port: int) -> int:
        """Listen; the port listened on."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, host, port, reuse_address=True, backlog=512)
        sock: socket.socket = self._server.sockets[0]
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        """Stop accepting (the runner's cleanup then closes the open connections)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()  # the listening sockets close now; wait_closed would wait for every connection
        if self._front is not None:
            await self._front.close()  # its connections (the ones handed to aiohttp: the runner's cleanup)


LINGER_SECONDS = 2.0  # after an answer sent before its body arrived whole: read on this long, then close


def runner_options(idle_timeout: float) -> dict[str, Any]:
    """aiohttp's options for the runner: the idle/header timeout, the lingering read after an early
    answer (a 408, a 413) kept short, no access log, and its own log of malformed requests
    (a bad request line, header or chunk) rate-limited, one line each (``burst_logger``)."""
    return {"access_log": None, "handle_signals": False, "keepalive_timeout": idle_timeout,
            "lingering_time": LINGER_SECONDS, "logger": burst_logger("kvindex.http.server", log)}


BODY = web.RequestKey("kvindex_body", bytes)  # the body read by ``read_body_within``, for ``body_bytes``


async def read_body_within(request: web.Request, timeout: float, cap: int) -> None:
    """Read a request's body whole (kept under ``BODY``, read by ``body_bytes``), within ``timeout``
    seconds and at most ``cap`` bytes; past the time, the 408 ``body_timeout`` refusal and the
    connection is closed after the answer; past the cap (a declared ``Content-Length`` before
    anything is read), the 413 ``too_large``. A body already whole needs no timer."""
    if not request.body_exists:
        return
    if (declared := request.content_length) is not None and declared > cap:
        raise too_large(cap)
    stream = request.content
    try:
        if stream.is_eof():
            request[BODY] = await read_capped(stream, cap)
            return
        async with asyncio.timeout(timeout):
            request[BODY] = await read_capped(stream, cap)
    except TimeoutError:
        raise ApiError(f"request body not received within {timeout:g} s", field="body", status=408,
                       reason="body_timeout") from None
    except ConnectionError:  # the client went away mid-body: nobody to answer, but counted
        raise body_incomplete() from None


async def read_capped(stream: StreamReader, cap: int) -> bytes:
    """The stream's bytes to its end, at most ``cap`` of them: the chunks as received, joined once
    (one chunk is returned as it is), not grown in a buffer and copied again as ``request.read()`` does."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await stream.readany():
        size += len(chunk)
        if size > cap:
            raise too_large(cap)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def body_incomplete() -> ApiError:
    return ApiError("request body incomplete: the connection closed", field="body", reason="body_incomplete")


def too_large(cap: int) -> ApiError:
    return ApiError(f"body exceeds {cap} bytes", field="body", status=413, reason="too_large")


async def body_bytes(request: web.Request) -> bytes:
    """The request's body: what ``read_body_within`` read, else (a request it did not see) read now."""
    body = request.get(BODY)
    return body if body is not None else await request.read()
