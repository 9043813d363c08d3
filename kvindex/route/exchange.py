"""One ext_proc stream: one HTTP request through Envoy, as kvindex's filter sees it.

Two roles, told apart by Envoy's own flag (``observability_mode``):
- the **picker** (Envoy waits for it): the request body is held until it is whole (Envoy's
  FULL_DUPLEX_STREAMED or BUFFERED mode), ``RoutePath.route`` chooses the engine, the answer
  sets ``x-gateway-destination-endpoint`` (header and ``envoy.lb`` metadata) and
  ``x-kvindex-request`` (the request's id), and the body goes back unchanged. If Envoy also sends
  the response phases (a GIE gateway's configuration) they are answered at once, bodies echoed,
  and the answer's usage recorded;
- the **observer** (Envoy does not wait: nothing is answered): it reads the request (or finds the
  picker's ``x-kvindex-request`` id on it), the upstream that served it and the answer's usage,
  and records it. It never alters or delays traffic.

Invariants:
- Answers go out in the order Envoy's protocol needs them (request headers, body chunks, trailers),
  a deferred one after what it waits for; an observer answers nothing.
- The picker never drops a request: a failure of kvindex's own (an exception, the store
  unreachable) answers "continue" without a destination, and Envoy routes it itself; only the
  caller's errors (a body that is not JSON, no model, over the size limit) and "no engine" get an
  immediate response, a one-line JSON reason.
- Memory: a request body is held up to ``max_body_bytes`` (past it: 413 when picking; not predicted
  when watching); an answer's body is never held beyond ``UsageReader``'s bound.
- Every task a stream starts is owned by the ``Tasks`` it is given (cancelled at shutdown); a
  stream reset forgets a request it created and never routed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvindex.route import extproc as X
from kvindex.route.grpc import INVALID_ARGUMENT, Call
from kvindex.route.protocol import REQUEST_ID
from kvindex.route.usage import UsageReader
from kvindex.route.verdicts import Refused, Routed, RoutePath
from kvindex.settings import OBSERVE, PICK

log = logging.getLogger("kvindex.route.exchange")


class Tasks:
    """The background tasks of every stream: owned here, cancelled and awaited by ``close``."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("request path task %s failed", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Exchange:
    def __init__(self, call: Call, path: RoutePath, tasks: Tasks, on_error: Callable[[str], None]) -> None:
        self._call, self._path, self._tasks, self._on_error = call, path, tasks, on_error
        self._observer: bool | None = None
        self._modes = X.Modes(X.FULL_DUPLEX_STREAMED, X.NONE)
        self._body = bytearray()
        self._too_large = False
        self._id: str | None = None
        self._routed = False  # the picker's answer went out (the request is Envoy's again)
        self._predicting: asyncio.Task[Any] | None = None
        self._deferred: list[bytes] = []  # answers waiting for the pick
        self._ended = False
        self._served: str | None = None
        self._status: int | None = None
        self._reader: UsageReader | None = None
        self._finishing = False  # the answer has passed: the decision is being recorded
        self._subset: tuple[str, ...] | None = None  # Envoy's subset hint, the latest given

    # -- grpc.Handler ----------------------------------------------------------------------------
    def message(self, data: bytes) -> None:
        try:
            msg = X.decode(data)
        except X.BadMessage as exc:
            self._on_error("bad_ext_proc_message")
            self._call.finish(INVALID_ARGUMENT, str(exc))
            return
        if self._observer is None:
            self._observer = msg.observability
            if msg.modes is not None:
                self._modes = msg.modes
        if msg.subset is not None:
            self._subset = msg.subset
        ev = msg.event
        if isinstance(ev, X.Headers):
            self._response_headers(ev) if ev.response else self._request_headers(ev)
        elif isinstance(ev, X.Body):
            self._response_body(ev) if ev.response else self._request_body(ev)
        elif not self._observer:
            self._send(X.continue_trailers(ev.response), wait=not ev.response)

    def end(self) -> None:
        self._ended = True
        if self._predicting is None or self._predicting.done():
            self._call.finish()

    def cancel(self) -> None:
        """The stream is gone: forget the request unless it went on (a picker's routed request is
        the observer's to record) or its answer has passed."""
        if self._predicting is not None:
            self._predicting.cancel()
        handed_on = self._routed and not self._observer
        if self._id is not None and not self._finishing and not handed_on:
            self._path.forget(self._id, "reset")

    # -- the request -----------------------------------------------------------------------------
    def _request_headers(self, ev: X.Headers) -> None:
        self._id = ev.headers.get(REQUEST_ID) if self._observer else None
        if self._observer:
            return
        mode = self._modes.request_body
        if ev.end_of_stream or mode not in (X.FULL_DUPLEX_STREAMED, X.BUFFERED):
            if not ev.end_of_stream and mode != X.NONE:
                self._on_error("body_mode_cannot_pick")
            self._routed = True
            self._send(X.headers_response(False))
        elif mode == X.BUFFERED:
            self._send(X.headers_response(False))

    def _request_body(self, ev: X.Body) -> None:
        if self._observer and self._id is not None:
            return  # the picker read it
        if not self._observer and self._routed:
            if self._modes.request_body == X.BUFFERED_PARTIAL or self._modes.request_body == X.STREAMED:
                self._send(X.continue_body(False))
            return
        if not self._too_large:
            self._body += ev.data
            if len(self._body) > self._path.max_body_bytes:
                self._too_large = True
                self._body = bytearray()
                if not self._observer:
                    self._refuse(Refused(413, f"request body over {self._path.max_body_bytes} bytes",
                                         "too_large"))
                    return
        if ev.end_of_stream and not self._too_large:
            body, self._body = bytes(self._body), bytearray()
            self._predicting = self._tasks.spawn(self._route(body), "route request")
        elif ev.end_of_stream and self._observer:
            self._path.count(OBSERVE, "too_large")

    async def _route(self, body: bytes) -> None:
        source = OBSERVE if self._observer else PICK
        try:
            result: Routed | Refused = await self._path.route(body, self._subset, source)
        except Exception:  # noqa: BLE001 -- kvindex's failure: Envoy routes it itself, never a dropped request
            log.exception("routing a request failed; Envoy routes it itself")
            self._on_error("route_failed")
            result = Routed("", None)
        if self._observer:
            if isinstance(result, Routed) and result.id:
                self._id = result.id
            return
        if isinstance(result, Refused):
            self._refuse(result)
        else:
            self._answer(result, body)
        if self._ended:
            self._call.finish()

    def _answer(self, routed: Routed, body: bytes) -> None:
        self._id = routed.id or None
        tag = [(REQUEST_ID, routed.id)] if routed.id else []
        first = [X.buffered_body_response(tag, routed.destination)] if self._modes.request_body == X.BUFFERED else \
            [X.headers_response(False, tag, routed.destination), *X.body_chunks(False, body)]
        self._routed = True
        for message in first + self._deferred:
            self._call.send(message)
        self._deferred.clear()

    def _refuse(self, refused: Refused) -> None:
        self._routed = True
        self._deferred.clear()
        self._call.send(X.immediate(refused.status, refused.body()))

    def _send(self, message: bytes, wait: bool = False) -> None:
        """Answer now, or after the pick when ``wait`` and it has not gone out yet."""
        if wait and not self._routed:
            self._deferred.append(message)
        else:
            self._call.send(message)

    # -- the answer ------------------------------------------------------------------------------
    def _response_headers(self, ev: X.Headers) -> None:
        try:
            self._status = int(ev.headers.get(":status", ""))
        except ValueError:
            self._status = None
        self._served = ev.served
        self._reader = UsageReader(ev.headers.get("content-type", ""))
        if not self._observer:
            self._send(X.headers_response(True))
        if ev.end_of_stream:
            self._finish()

    def _response_body(self, ev: X.Body) -> None:
        if self._reader is not None:
            self._reader.feed(ev.data)
        if not self._observer:
            mode = self._modes.response_body
            if mode == X.FULL_DUPLEX_STREAMED:
                self._send(X.streamed_body(True, ev.data, ev.end_of_stream))
            elif mode != X.BUFFERED or ev.end_of_stream:
                self._send(X.continue_body(True))
        if ev.end_of_stream:
            self._finish()

    def _finish(self) -> None:
        self._finishing = True
        reader, self._reader = self._reader, None
        usage = reader.end() if reader is not None else None
        if reader is not None and reader.problem is not None and reader.problem != "no_usage":
            self._on_error(reader.problem)
        self._tasks.spawn(self._record(usage), "record decision")

    async def _record(self, usage: Any) -> None:
        if self._predicting is not None and self._observer:
            await asyncio.shield(self._predicting)  # the observer's own prediction, made meanwhile
        if self._id is not None:
            await self._path.finish(self._id, self._served, self._status, usage)
