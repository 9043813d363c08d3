"""The precise store of a sharded daemon (``--workers N``): the read side, fanned out to workers.

Each worker process (``kvindex.shard.worker``) owns some engines' lanes and a memory precise index of
the pods they feed. The parent talks to each over one ZeroMQ DEALER socket (``ShardChannel``,
ipc://, request ids, msgpack frames) and ``ShardedPreciseStore`` implements the ``PreciseStore``
read side over them.

Invariants:
- Every request has a deadline (``timeout``): no answer in time, a worker known dead, or a
  worker's error raises ``StoreUnavailable`` with a one-line reason naming the worker. A query
  needs every worker's answer: a missing shard is a 503, never a partial answer.
- ``match`` sends the keys once per worker as one frame of packed u64 (``pack_keys``) and
  merges: a pod's ranks may sit on different workers (lanes are assigned by lane key), and a
  pod's match is the longest over its ranks, so tiers merge by max and ``dp`` by union — the
  answer equals the single process's exactly. ``blocks_held`` sums, ``pods`` and
  ``block_sizes`` union, ``engine_hashes`` unions ranks, ``position`` is the owner's. A model's
  block size, once known, is kept here (it is fixed per model: keys are chunked by it), so a
  query is one round trip per worker.
- Writes that come from HTTP (``clear_pod``, ``set_block_size``) go to every worker (pods are
  few per worker and the ops are idempotent). Ingest writes (``apply``, ``restart``,
  ``set_position``, state export/load) happen in the workers only: here they raise
  ``StoreUnavailable``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvindex.events import KVEvent
from kvindex.index.protocol import ApplyResult, Entry, PodMatch, StoreUnavailable
from kvindex.sequence import Position, StreamRef
from kvindex.shard.worker import pack_keys

REQUEST_TIMEOUT = 5.0  # seconds a worker may take to answer one request


class ShardChannel:
    """Request/reply to one worker over a DEALER socket; replies are matched by request id."""

    def __init__(self, ctx: zmq.asyncio.Context, index: int, endpoint: str, timeout: float = REQUEST_TIMEOUT) -> None:
        self.index = index
        self.endpoint = endpoint
        self.timeout = timeout
        self.dead: str | None = None  # why this worker cannot answer (set by the supervisor)
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._waiting: dict[bytes, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read(), name=f"worker {self.index} replies")

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            fut = self._waiting.pop(frames[0], None) if len(frames) == 2 else None
            if fut is None or fut.done():
                continue  # an answer after its deadline
            reply = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
            if "error" in reply:
                fut.set_exception(StoreUnavailable(f"worker {self.index}: {reply['error']}"))
            else:
                fut.set_result(reply["ok"])

    async def request(self, op: str, *args: Any, extra: bytes | None = None, timeout: float | None = None) -> Any:
        if self.dead is not None:
            raise StoreUnavailable(f"worker {self.index} {self.dead}")
        rid = next(self._ids).to_bytes(8, "little")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._waiting[rid] = fut
        limit = timeout if timeout is not None else self.timeout
        timer = loop.call_later(limit, _expire, fut, f"worker {self.index}: no answer to {op} within {limit:g} s")
        frames = [rid, msgpack.packb([op, list(args)])] + ([extra] if extra is not None else [])
        try:
            # not awaited: a send that cannot complete (a dead peer's queue full) must not outlast the deadline
            sent = self._sock.send_multipart(frames, copy=False)
            sent.add_done_callback(lambda done: _send_done(done, fut, self.index))
            return await fut
        finally:
            timer.cancel()
            self._waiting.pop(rid, None)

    def fail(self, reason: str) -> None:
        """The worker is gone: every pending and later request fails at once with ``reason``."""
        self.dead = reason
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(StoreUnavailable(f"worker {self.index} {reason}"))
        self._waiting.clear()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        self._sock.close(linger=0)


def _send_done(sent: asyncio.Future[Any], fut: asyncio.Future[Any], index: int) -> None:
    if sent.cancelled() or sent.exception() is None or fut.done():
        return
    fut.set_exception(StoreUnavailable(f"worker {index}: sending failed: {sent.exception()}"))


def _expire(fut: asyncio.Future[Any], reason: str) -> None:
    if not fut.done():
        fut.set_exception(StoreUnavailable(reason))


def merge_matches(parts: Iterable[dict[str, list[Any]]]) -> dict[str, PodMatch]:
    """Workers' answers into one: per pod the longest over its ranks (max per tier, dp union)."""
    out: dict[str, PodMatch] = {}
    for part in parts:
        for pod, (gpu, cpu, disk, dp) in part.items():
            prev = out.get(pod)
            if prev is None:
                out[pod] = PodMatch(gpu, cpu, disk, dp)
            else:
                out[pod] = PodMatch(max(prev.gpu, gpu), max(prev.cpu, cpu), max(prev.disk, disk), {**prev.dp, **dp})
    return out


class ShardedPreciseStore:
    """``PreciseStore`` over the workers' channels (see the module docstring)."""

    name = "sharded"

    def __init__(self, channels: Sequence[ShardChannel]) -> None:
        self.channels = list(channels)
        self._block_sizes: dict[str, int] = {}  # known ones: fixed per model (keys are chunked by it)

    async def _all(self, op: str, *args: Any, extra: bytes | None = None) -> list[Any]:
        return list(await asyncio.gather(*(c.request(op, *args, extra=extra) for c in self.channels)))

    async def match(self, keys: Sequence[int], pods: Iterable[str] | None = None, *,
                    model: str | None = None) -> dict[str, PodMatch]:
        wanted = None if pods is None else list(pods)
        if wanted is not None and not wanted:
            return {}
        return merge_matches(await self._all("match", wanted, model, extra=pack_keys(keys)))

    async def pods(self) -> list[str]:
        return sorted({p for part in await self._all("pods") for p in part})

    async def blocks_held(self, pod: str) -> dict[str, int]:
        total: dict[str, int] = {}
        for part in await self._all("blocks_held", pod):
            for tier, n in part.items():
                total[tier] = total.get(tier, 0) + n
        return total

    async def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]:
        out: dict[int, dict[int, int | None]] = {}
        for part in await self._all("engine_hashes", pod):
            for rank, blocks in part.items():
                out.setdefault(rank, {}).update(blocks)
        return out

    async def position(self, stream: StreamRef) -> Position | None:
        for found in await self._all("position", [stream.id, stream.pod, stream.model]):
            if found is not None:
                return Position(*found)
        return None

    async def block_size(self, model: str) -> int | None:
        known = self._block_sizes.get(model)
        if known is not None:
            self._usable()  # a dead worker is a 503 here too, as on every other path
            return known
        return (await self.block_sizes()).get(model)

    async def block_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for part in await self._all("block_sizes"):
            sizes.update(part)
        self._block_sizes.update(sizes)
        return sizes

    async def set_block_size(self, model: str, block_size: int) -> None:
        await self._all("set_block_size", model, block_size)
        self._block_sizes[model] = block_size

    def _usable(self) -> None:
        for ch in self.channels:
            if ch.dead is not None:
                raise StoreUnavailable(f"worker {ch.index} {ch.dead}")

    async def clear_pod(self, pod: str, dp_rank: int | None = None) -> None:
        await self._all("clear_pod", pod, dp_rank)

    # -- ingest happens in the workers -----------------------------------------------------------
    async def apply(self, stream: StreamRef, seq: int, epoch: int, dp_rank: int, events: Sequence[KVEvent],
                    *, force: str | None = None) -> ApplyResult:
        raise StoreUnavailable("the sharded store is read-only in the parent: the workers apply")

    async def restart(self, stream: StreamRef, seen_epoch: int, ranks: Iterable[int] | None) -> Position:
        raise StoreUnavailable("the sharded store is read-only in the parent: the workers apply")

    async def set_position(self, stream: StreamRef, position: Position) -> None:
        raise StoreUnavailable("the sharded store is read-only in the parent: the workers apply")

    async def export_entries(self) -> list[Entry]:
        raise StoreUnavailable("state export is not available with --workers")

    async def load_entries(self, entries: Iterable[Entry]) -> int:
        raise StoreUnavailable("state load is not available with --workers")

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
