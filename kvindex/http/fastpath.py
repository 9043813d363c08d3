"""The HTTP fast path: plain ``POST /query`` and ``POST /query_by_hash`` answered before aiohttp.

Every connection on kvindex's HTTP port first meets ``FastConnection`` (``FastPath.protocol``, the
listener's protocol factory, ``kvindex.http.server.HttpServer``). It reads requests into a buffer;
a request it recognises exactly is answered by the route's own function, the one the aiohttp
handler calls (``FastRoute.answer``: ``kvindex.http.dynamo.query_data`` / ``by_hash_data``), the JSON
encoded by ``kvindex.http.bodies.json_body`` as ``json_response`` does. Anything else hands the
connection, with every byte not yet answered, to aiohttp's own protocol for good (its
``RequestHandler``: ``connection_made``, ``set_protocol``, ``data_received``), which then answers
as it always has.

Invariants:
- Answered here only: ``POST <route> HTTP/1.1`` exactly (no query string), one ``Content-Length``
  of digits at most ``max_body_bytes``, ``Content-Type: application/json`` (no parameters), a
  ``Connection`` of ``keep-alive`` or ``close`` or none, one ``Host`` (HTTP/1.1's rule), header lines of plain visible ASCII
  (``_HEADERS``), none of ``Transfer-Encoding``, ``Expect``, ``Upgrade``, ``Content-Encoding``, the
  head within ``MAX_HEAD`` bytes, the state loaded (``Services.loading``), a route that needs no
  token (``needs_token``). Anything else, or anything malformed: handed to aiohttp, unanswered.
- An answer here is the aiohttp path's: status 200, the same body bytes, ``Content-Type:
  application/json``, ``Content-Length``, ``Date``, ``Server``, ``Connection: close`` (then the
  connection closes) when the request asked for it; the same ``kvindex_query_seconds``
  observation (made by the route function). A route function that raises answers nothing here:
  the connection goes to aiohttp with the request still unanswered in the buffer, so every refusal
  is aiohttp's own (status, one-line JSON, ``kvindex_http_rejections``, the log). The route
  functions only read, so the request read twice changes nothing but the time (a store that
  fails counts its ``kvindex_store_errors`` on both tries).
- Pipelined requests that arrive in one read with one aiohttp's parser refuses: aiohttp answers
  only its 400; here the ones before it are answered first (as aiohttp does when they arrive in
  reads of their own).
- Requests on a connection are answered in order, one at a time (pipelined ones wait in the
  buffer). On the memory store an answer runs at once where its bytes arrive, and goes on in a
  task only if it has to wait; otherwise every answer runs in a task (a Redis client's timeouts
  need one). The buffer is bounded: past ``MAX_HEAD + max_body_bytes`` bytes the transport stops
  reading until a request is answered; while the transport cannot write, nothing more is answered.
- Timers, as aiohttp's: no complete head within ``idle_timeout`` of the connection's start or its
  last answer: closed. A body not whole within ``BODY_PATIENCE`` (at most ``body_timeout``) of its
  head: handed to aiohttp (whose ``body_timeout`` runs from then: the 408 comes that much later).
  The client gone with a head here and its body incomplete: counted and logged as aiohttp counts
  it (400 ``body_incomplete``, ``note_refusal``).
- ``FastPath`` owns its connections and their answer tasks: ``close`` closes the one, cancels and
  awaits the other. A connection handed to aiohttp is aiohttp's (``web.Server.connections``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, cast

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.tcp_helpers import tcp_nodelay

from kvindex.http.app import READ, REFUSALS, SERVICES, Services, needs_token, note_refusal, route_scope
from kvindex.http.bodies import json_body
from kvindex.http.server import body_incomplete
from kvindex.storeurl import is_memory

MAX_HEAD = 8192  # a head longer than this (aiohttp's line limit is 8190): aiohttp's to judge
BODY_PATIENCE = 1.0  # seconds a body may take here before aiohttp is handed the connection
JSON = "application/json"
_LINE = rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*((?:[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?)?)[ \t]*\r\n"
_FIELD = re.compile(_LINE)  # one header line: its name and value (visible ASCII, spaces inside)
_HEADERS = re.compile(b"(?:%s)*" % _LINE)  # the whole header block, nothing else
_WATCHED = frozenset({b"content-length", b"content-type", b"connection", b"host"})  # one each at most
_REFUSED = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"content-encoding"})


Answer = Callable[[Services, bytes, str, float], Awaitable[Any]]  # (services, raw body, content type, t0) -> data


@dataclass(frozen=True, slots=True)
class FastRoute:
    """A route the fast path answers: its endpoint label and the function both paths call."""

    endpoint: str
    answer: Answer
    answered: Any  # its kvindex_http_fast_path_answers child


def scope_of(app: web.Application, path: str) -> str:
    """The scope of the aiohttp handler of ``POST path`` (``READ`` when there is none)."""
    for r in app.router.routes():
        if r.method == "POST" and r.resource is not None and r.resource.canonical == path:
            return route_scope(r.handler)
    return READ


@dataclass(frozen=True, slots=True)
class Head:
    """A request head the fast path answers: its route, the head's length, the body's, and
    whether the client asked to close after the answer."""

    route: FastRoute
    size: int
    length: int
    close: bool


def read_head(buf: bytes | bytearray, lines: Mapping[bytes, FastRoute], max_body: int) -> Head | None:
    """The head at the start of ``buf`` (complete: it ends in a blank line) if the fast path
    answers it (the module docstring's rules), else None."""
    end = buf.find(b"\r\n\r\n", 0, MAX_HEAD)
    if end < 0:
        return None
    eol = buf.find(b"\r\n", 0, end + 2)
    route = lines.get(bytes(buf[:eol]))
    if route is None:
        return None
    block = bytes(buf[eol + 2:end + 2])  # every header line, each ending in CRLF
    if _HEADERS.fullmatch(block) is None:
        return None
    seen: dict[bytes, bytes] = {}
    for name, value in _FIELD.findall(block):
        name = name.lower()
        if name in _WATCHED:
            if name in seen:
                return None
            seen[name] = value.lower()
        elif name in _REFUSED:
            return None
    length, connection = seen.get(b"content-length", b""), seen.get(b"connection", b"keep-alive")
    if (not length.isdigit() or len(length) > 18 or int(length) > max_body or b"host" not in seen
            or seen.get(b"content-type") != b"application/json" or connection not in (b"close", b"keep-alive")):
        return None
    return Head(route, end + 4, int(length), connection == b"close")


class FastPath:
    """The listener's front door (module docstring): ``protocol`` makes each connection's."""

    def __init__(self, app: web.Application, routes: Mapping[str, Answer]) -> None:
        """``routes``: path -> the function its aiohttp handler calls (``dynamo.fast_routes``)."""
        self.svc = app[SERVICES]
        self.refusals = app[REFUSALS]
        self.lines = {f"POST {path} HTTP/1.1".encode(): FastRoute(path, answer, self.svc.metrics.http_fast_answers.labels(path))
                      for path, answer in routes.items()
                      if not needs_token(self.svc, scope_of(app, path))}
        cfg = self.svc.config
        self.max_body = cfg.max_body_bytes
        self.buffer_cap = MAX_HEAD + cfg.max_body_bytes
        self.idle_timeout, self.body_patience = cfg.idle_timeout, min(BODY_PATIENCE, cfg.body_timeout)
        # answers run at once, outside a task, only on the memory store: a client's timeouts
        # (asyncio.timeout, the Redis client's) need a current task
        self.eager = is_memory(cfg.store)
        self.connections: set[FastConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._date = (0, b"")

    def protocol(self, server: web.Server) -> asyncio.Protocol:
        return FastConnection(self, server)

    def open(self) -> int:
        """Connections held here (not yet handed to aiohttp)."""
        return len(self.connections)

    def loading(self) -> bool:
        return self.svc.loading is not None and self.svc.loading() is not None

    def response_head(self, length: int, close: bool) -> bytes:
        """The answer's status line and headers, as aiohttp writes a ``json_response``'s."""
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nDate: %s\r\n"
                b"Server: %s\r\n%s\r\n" % (length, self._date[1], SERVER_SOFTWARE.encode(),
                                           b"Connection: close\r\n" if close else b""))

    def incomplete(self, head: Head) -> None:
        """The client went away before ``head``'s body arrived: counted and logged as aiohttp does."""
        err = body_incomplete()
        self.svc.metrics.http_rejections.labels(head.route.endpoint, err.reason_label).inc()
        note_refusal(self.refusals, "POST", head.route.endpoint, head.route.endpoint, err)

    async def close(self) -> None:
        """Close every connection still here; cancel and await the answers in flight."""
        for conn in list(self.connections):
            conn.close()
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class FastConnection(asyncio.Protocol):
    """One connection until it is closed or handed to aiohttp (module docstring)."""

    def __init__(self, door: FastPath, server: web.Server) -> None:
        self._door, self._server = door, server
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._head: Head | None = None  # the request at the buffer's start, its head read
        self._busy = False  # a request is being answered
        self._timer: asyncio.TimerHandle | None = None
        self._reading = True
        self._writable: asyncio.Future[None] | None = None  # while the transport's buffer is full
        self._done = False  # closed, or handed to aiohttp

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = t = cast(asyncio.Transport, transport)
        tcp_nodelay(t, True)
        self._door.connections.add(self)
        self._arm(self._door.idle_timeout, self._idle)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if not self._busy:
            self._next()
        if self._reading and not self._done and len(self._buf) > self._door.buffer_cap:
            self._reading = False
            self._transport_().pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head is not None and not self._busy:
            self._door.incomplete(self._head)
        self._finish()

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the requests ----------------------------------------------------------------------
    def _next(self) -> None:
        """The requests at the buffer's start, in order: each answered, waited for, or handed off.
        An answer runs at once, here; one that has to wait (a store call, a full transport) goes
        on in a task, which comes back here when it is done."""
        while not self._done and not self._busy:
            head = self._ready()
            if head is None:
                return
            self._busy = True
            if not self._door.eager:
                task = asyncio.get_running_loop().create_task(self._answer_then_next(head))
                self._door.tasks.add(task)
                task.add_done_callback(self._door.tasks.discard)
                return
            coro = self._answer(head)
            try:
                waiting = coro.send(None)
            except StopIteration:
                continue
            task = asyncio.get_running_loop().create_task(self._resume(coro, waiting))
            self._door.tasks.add(task)
            task.add_done_callback(self._door.tasks.discard)
            return

    async def _resume(self, coro: Coroutine[Any, Any, None], waiting: Any) -> None:
        await _GoOn(coro, waiting)
        self._next()

    async def _answer_then_next(self, head: Head) -> None:
        await self._answer(head)
        self._next()

    def _ready(self) -> Head | None:
        """The request at the buffer's start if it is whole and answered here; None: wait for
        more bytes, or handed to aiohttp."""
        buf = self._buf
        if self._head is None:
            if not buf:
                return None
            if buf.find(b"\r\n\r\n", 0, MAX_HEAD) < 0:  # no whole head yet: the idle timer runs on
                if len(buf) >= MAX_HEAD:
                    self._hand_off()
                return None
            head = read_head(buf, self._door.lines, self._door.max_body)
            if head is None or self._door.loading():
                self._hand_off()
                return None
            self._head = head
            self._cancel_timer()  # the idle timer: a head came
        head = self._head
        end = head.size + head.length
        if len(buf) < end:
            if self._timer is None:
                self._arm(self._door.body_patience, self._hand_off)
            return None
        self._cancel_timer()
        if head.close and len(buf) > end:  # bytes after a close: aiohttp's 400
            self._hand_off()
            return None
        return head

    async def _answer(self, head: Head) -> None:
        """Answer ``head``'s request (whole in the buffer), or hand it to aiohttp unanswered."""
        t0 = time.perf_counter()
        end = head.size + head.length
        try:
            data = await head.route.answer(self._door.svc, bytes(self._buf[head.size:end]), JSON, t0)
            body = json_body(data)
            if head.close and len(self._buf) > end:
                raise ValueError("bytes after Connection: close")  # aiohttp refuses them: its answer
        except Exception:  # noqa: BLE001 -- refused (or a bug): aiohttp answers it, as it always has
            self._busy = False
            self._hand_off()
            return
        self._head = None
        if self._done:
            return
        transport = self._transport_()
        transport.write(self._door.response_head(len(body), head.close) + body)
        head.route.answered.inc()
        del self._buf[:end]
        if head.close:
            self.close()
            return
        if self._writable is not None:
            await self._writable
            if self._done:
                return
        if not self._reading and len(self._buf) <= self._door.buffer_cap:
            self._reading = True
            transport.resume_reading()
        self._arm(self._door.idle_timeout, self._idle)  # (a head whole in the buffer cancels it)
        self._busy = False

    def _hand_off(self) -> None:
        """The connection, with every byte not answered, to aiohttp's own protocol for good."""
        if self._done or self._busy:
            return
        transport = self._transport_()
        self._finish()
        if not self._reading:
            transport.resume_reading()
        handler = self._server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        data, self._buf = bytes(self._buf), bytearray()
        if data:
            handler.data_received(data)

    # -- the rest --------------------------------------------------------------------------
    def close(self) -> None:
        if not self._done:
            transport = self._transport_()
            self._finish()
            transport.close()

    def _idle(self) -> None:
        """No whole head within ``idle_timeout``: closed, as aiohttp's keep-alive timer does."""
        self._timer = None
        if self._head is None and not self._busy:
            self.close()

    def _finish(self) -> None:
        self._done = True
        self._cancel_timer()
        self._door.connections.discard(self)
        self._head = None
        self.resume_writing()

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(seconds, then)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _transport_(self) -> asyncio.Transport:
        assert self._transport is not None
        return self._transport


class _GoOn:
    """Awaited, goes on with ``coro``, a coroutine already started that waits on ``waiting``."""

    __slots__ = ("coro", "waiting")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting: Any) -> None:
        self.coro, self.waiting = coro, waiting

    def __await__(self) -> Generator[Any, None, None]:
        try:
            yield self.waiting
        except BaseException:  # cancelled (the server closing): the answer is dropped
            self.coro.close()
            raise
        yield from self.coro.__await__()
