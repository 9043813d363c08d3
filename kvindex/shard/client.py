"""The parent's side of the channel to one worker: ``ShardChannel``, requests and their replies.

Invariants (the messages are ``kvindex.shard.channel``'s, framed by ``kvindex.shard.frames``):
- One Unix stream connection per channel; a reply is matched to its request by the request id
  (8 bytes, this channel's counter). An answer after its request's deadline is dropped.
- Every request has a deadline (``timeout``): no answer in time, a worker known dead (``fail``),
  a connection that ended (after ``on_lost`` had its say), a reply that does not decode, or the
  worker's ``Failed`` raises ``StoreUnavailable`` with a one-line reason naming the worker.
- Requests made before the worker listens (it is starting) wait within their deadline and are
  written, in order, once the connection is up. ``send`` writes a request at once and returns the
  future of its answer (``request`` awaits it): a request's bookkeeping (its deadline's timer, its
  entry among those waiting) goes when that future is done, whether answered, failed, expired or
  cancelled by its caller. Its one task (``start``: connect, then read
  replies) is cancelled and awaited by ``close``.
- What the worker has not read yet is bounded: with more than ``max_unsent_bytes`` of requests
  waiting in the connection's buffer (or made before it was up), a request is refused at once
  (``StoreUnavailable``, saying how much waits), not buffered: a worker that stopped reading
  costs the parent that much memory at most.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from kvindex.index.protocol import StoreUnavailable
from kvindex.shard.channel import REQUEST_TIMEOUT, Request, decode_reply, encode
from kvindex.shard.frames import BrokenFraming, framed, read_message

T = TypeVar("T")

CONNECT_RETRY_SECONDS = 0.01  # while the worker is starting (its socket not there yet)
MAX_UNSENT_BYTES = 64 << 20  # requests not read by the worker yet: past this, refused at once


class ShardChannel:
    """Request/reply to one worker over one Unix stream connection; replies are matched by request
    id. Requests made before the worker listens wait (within their deadline) and go out once the
    connection is up."""

    def __init__(self, index: int, path: str, timeout: float = REQUEST_TIMEOUT, *,
                 on_lost: Callable[[], Awaitable[None]] | None = None, max_unsent_bytes: int = MAX_UNSENT_BYTES) -> None:
        self.index = index
        self.max_unsent_bytes = max_unsent_bytes
        self.on_lost = on_lost  # awaited when the connection ends, before waiting requests fail
        self.path = path  # the worker's Unix socket
        self.timeout = timeout
        self.dead: str | None = None  # why this worker cannot answer (set by the supervisor)
        self.sent = 0  # requests sent so far (what a query costs in round trips)
        self._ids = itertools.count(1)
        self._waiting: dict[bytes, tuple[type[Request[Any]], asyncio.Future[Any]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._unsent: list[bytes] = []  # messages made before the connection was up
        self._closed: str | None = None  # the connection ended: why
        self._reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read(), name=f"worker {self.index} replies")

    async def _connect(self) -> asyncio.StreamReader:
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.path)
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(CONNECT_RETRY_SECONDS)
                continue
            self._writer.write(b"".join(self._unsent))
            self._unsent.clear()
            return reader

    async def _read(self) -> None:
        reader = await self._connect()
        try:
            while True:
                frames = await read_message(reader)
                waiting = self._waiting.pop(frames[0], None) if len(frames) == 2 else None
                if waiting is not None and not waiting[1].done():  # else an answer after its deadline
                    self._settle(*waiting, frames[1])
        except (asyncio.IncompleteReadError, BrokenFraming, ConnectionError) as exc:
            assert self._writer is not None
            self._writer.close()
            self._writer = None  # requests made meanwhile wait for the verdict (``on_lost``)
            if self.on_lost is not None:  # the supervisor: did the worker die? (then ``fail`` says how)
                await self.on_lost()
            self._close(f"its connection closed ({type(exc).__name__})")

    def _settle(self, kind: type[Request[Any]], fut: asyncio.Future[Any], reply: bytes) -> None:
        try:
            fut.set_result(decode_reply(kind, reply))
        except StoreUnavailable as exc:
            fut.set_exception(StoreUnavailable(f"worker {self.index}: {exc}"))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            fut.set_exception(StoreUnavailable(f"worker {self.index}: a malformed answer: {exc}"))

    def _close(self, reason: str) -> None:
        self._closed = reason
        self._unsent.clear()
        self._fail_waiting(f"worker {self.index}: {reason}")

    async def request(self, req: Request[T], *, extra: bytes | None = None, timeout: float | None = None) -> T:
        return await self.send(req, extra=extra, timeout=timeout)

    def send(self, req: Request[T], *, extra: bytes | None = None, timeout: float | None = None) -> asyncio.Future[T]:
        """Writes the request now (or queues it while the connection is not up) and returns the
        future of its answer: a caller asking several workers writes every request before it
        awaits any answer, with no task per request (``ShardedPreciseStore``). Cancelling the
        future forgets the request; its deadline, the reply and ``fail`` settle it, as ``request``'s."""
        if self.dead is not None:
            raise StoreUnavailable(f"worker {self.index} {self.dead}")
        if self._closed is not None:
            raise StoreUnavailable(f"worker {self.index}: {self._closed}")
        if (unsent := self._unsent_bytes()) > self.max_unsent_bytes:
            raise StoreUnavailable(f"worker {self.index}: not reading its channel "
                                   f"({unsent / (1 << 20):.0f} MB of requests unread)")
        rid = next(self._ids).to_bytes(8, "little")
        self.sent += 1
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._waiting[rid] = (type(req), fut)
        limit = timeout if timeout is not None else self.timeout
        op = type(req).__struct_config__.tag  # the operation ("match", ...)
        timer = loop.call_later(limit, _expire, fut, f"worker {self.index}: no answer to {op} within {limit:g} s")
        fut.add_done_callback(functools.partial(self._forget, rid, timer))
        message = framed([rid, encode(req)] + ([extra] if extra is not None else []))
        if self._writer is None or self._writer.is_closing():  # not up yet, or ending: the reader decides
            self._unsent.append(message)
        else:
            self._writer.write(message)
        return fut

    def _forget(self, rid: bytes, timer: asyncio.TimerHandle, fut: asyncio.Future[Any]) -> None:
        timer.cancel()
        if (waiting := self._waiting.get(rid)) is not None and waiting[1] is fut:
            del self._waiting[rid]

    def in_flight(self) -> list[str]:
        """The operations ("match", "pods", ...) of requests sent, or waiting to be, and not answered yet."""
        return [str(kind.__struct_config__.tag) for kind, _ in self._waiting.values()]

    def _unsent_bytes(self) -> int:
        """Bytes of requests written but not yet taken by the worker's side of the connection."""
        if self._writer is None:
            return sum(map(len, self._unsent))
        return self._writer.transport.get_write_buffer_size()

    def fail(self, reason: str) -> None:
        """The worker is gone: every pending and later request fails at once with ``reason``."""
        self.dead = reason
        self._fail_waiting(f"worker {self.index} {reason}")

    def _fail_waiting(self, message: str) -> None:
        for _, fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(StoreUnavailable(message))
        self._waiting.clear()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _expire(fut: asyncio.Future[Any], reason: str) -> None:
    if not fut.done():
        fut.set_exception(StoreUnavailable(reason))
