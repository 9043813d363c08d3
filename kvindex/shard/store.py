"""The precise store of a sharded daemon (``--workers N``): the whole ``PreciseStore``, over workers.

Each worker process (``kvindex.shard.worker``) owns some engines' lanes and a memory precise index of
the pods they feed. The parent talks to each over one channel (``kvindex.shard.channel``) and
``ShardedPreciseStore`` implements every ``PreciseStore`` operation by forwarding it to the worker
that owns it, or by asking every worker and merging the answers.

Invariants:
- A query needs every worker's answer: a worker that cannot answer (deadline, dead, its error)
  raises ``StoreUnavailable`` naming it — a 503, never a partial answer.
- Reads merge to the single process's answer: a pod's ranks may sit on different workers (each
  lane is dealt to a worker on its own) and a pod's match is the longest over its ranks, so ``match`` merges
  tiers by max and ``dp`` by union; ``blocks_held`` sums; ``pods``, ``block_sizes`` and
  ``export_entries`` union; ``engine_hashes`` unions ranks; ``position`` is the one worker's
  that holds the stream. ``match`` sends the keys once per worker as one packed frame. A read of every worker
  writes all its requests before it awaits any answer, with no task per request; when one fails,
  the others' are forgotten (cancelled) at once, not left waiting for their deadline.
- A model's block size follows the engines' lives (an engine restarted with another block size
  changes it). Once the workers agreed on one, ``block_size`` answers it from memory and a query is
  one round trip per worker: ``match`` sends the size its keys were chunked by, a worker whose own
  size is another answers none, and ``match`` forgets the size and raises ``BlockSizeChanged`` (the
  query asks the workers again). An unknown size is asked every time; configured block sizes must
  agree (``StoreMisconfigured``). Each worker's size follows
  its own engines: when workers answer different sizes, ``block_size`` offers each to all of them
  (a worker whose engines hold no blocks of the model takes it); if none is taken by all, the
  engines of the model really run different sizes and ``block_size`` raises ``StoreUnavailable``
  saying so (503), never one worker's size for all. ``match(model=)`` sends the size the keys were
  chunked by; a worker whose size is another answers none, and ``match`` raises
  ``BlockSizeChanged`` (the query asks again).
- Writes that come from HTTP (``clear_pod``, ``set_block_size``) go to every worker (pods are few
  per worker and the ops are idempotent).
- The daemon's ingest writes happen in the workers, by their own lanes. Writes made through this
  store (``apply``, ``restart``, ``set_position``, ``load_entries``) go to the worker owning the
  pod (``owner_of(pod, N)``), which judges and applies them atomically, as every backend does.
  ``restart`` that moved the epoch on also clears the ranks on the other workers (a rank a lane
  there fed). Each worker learns an unconfigured model's block size from its own first
  ``BlockStored``: the sharded deployment has no fleet-wide "first block size wins"
  (``SHARED_FIRST_BLOCK_SIZE`` is False); configured block sizes (``set_block_size``) are everywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import TypeVar

from kvindex.events import KVEvent
from kvindex.index.protocol import (
    ApplyResult,
    BlockSizeChanged,
    StoreMisconfigured,
    StoreUnavailable,
)
from kvindex.sequence import Position, StreamRef
from kvindex.shard import channel as ch
from kvindex.shard.channel import owner_of, pack_keys
from kvindex.shard.client import ShardChannel
from kvindex.types import Entry, PodMatch, merged

R = TypeVar("R")


def merge_matches(parts: Iterable[dict[str, PodMatch]]) -> dict[str, PodMatch]:
    """Workers' answers into one: per pod the longest over its ranks (max per tier, dp union)."""
    out: dict[str, PodMatch] = {}
    for part in parts:
        for pod, m in part.items():
            out[pod] = merged(out.get(pod), m)
    return out


class ShardedPreciseStore:
    """``PreciseStore`` over the workers' channels (see the module docstring)."""

    name = "sharded"
    SHARED_FIRST_BLOCK_SIZE = False  # an unconfigured block size is learned per worker

    def __init__(self, channels: Sequence[ShardChannel]) -> None:
        self.channels = list(channels)
        self._configured: dict[str, int] = {}  # model -> the block size configuration gave it
        self._answered: dict[str, int] = {}  # model -> the block size block_size last answered (keys chunked by it)

    async def _all(self, req: ch.Request[R], *, extra: bytes | None = None) -> list[R]:
        """Every worker's answer, in worker order: each request written before any answer is
        awaited, no task per request (a query's round trip is the slowest worker's, not a sum)."""
        answers: list[asyncio.Future[R]] = []
        try:
            for c in self.channels:
                answers.append(c.send(req, extra=extra))
            return [await a for a in answers]
        finally:
            for a in answers:  # after a failure: the others forgotten, their outcome taken
                if not a.done():
                    a.cancel()
                elif not a.cancelled():
                    a.exception()

    def _owner(self, pod: str) -> ShardChannel:
        return self.channels[owner_of(pod, len(self.channels))]

    async def match(self, keys: Sequence[int], pods: Iterable[str] | None = None, *,
                    model: str | None = None) -> dict[str, PodMatch]:
        wanted = None if pods is None else tuple(pods)
        if wanted is not None and not wanted:
            return {}
        bs = None if model is None else self._answered.get(model)
        parts = await self._all(ch.Match(wanted, model, bs), extra=pack_keys(keys))
        if any(part is None for part in parts):  # a worker's size moved on (an engine's new life)
            self._answered.pop(model or "", None)
            raise BlockSizeChanged(model)
        return merge_matches(part for part in parts if part is not None)

    async def pods(self) -> list[str]:
        return sorted({p for part in await self._all(ch.Pods()) for p in part})

    async def blocks_held(self, pod: str) -> dict[str, int]:
        total: dict[str, int] = {}
        for part in await self._all(ch.BlocksHeld(pod)):
            for tier, n in part.items():
                total[tier] = total.get(tier, 0) + n
        return total

    async def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]:
        out: dict[int, dict[int, int | None]] = {}
        for part in await self._all(ch.EngineHashes(pod)):
            for rank, blocks in part.items():
                out.setdefault(rank, {}).update(blocks)
        return out

    async def position(self, stream: StreamRef) -> Position | None:
        for found in await self._all(ch.GetPosition(stream)):
            if found is not None:
                return found
        return None

    async def block_size(self, model: str) -> int | None:
        known = self._answered.get(model)  # ``match`` forgets it when a worker's size moved on
        return known if known is not None else await self._agreed_block_size(model)

    async def _agreed_block_size(self, model: str) -> int | None:
        """The workers' size of ``model``, asked of them; sizes that disagree are settled here."""
        known = sorted({bs for bs in await self._all(ch.BlockSize(model)) if bs is not None})
        if len(known) > 1:  # offered to all: workers whose engines hold none of the model's blocks take it
            for bs in known:
                if set(await self._all(ch.SetBlockSize(model, bs))) == {bs}:
                    known = [bs]
                    break
            else:
                raise StoreUnavailable(self._disagree(model, await self._all(ch.BlockSize(model))))
        if not known:
            self._answered.pop(model, None)
            return None
        self._answered[model] = known[0]
        return known[0]

    def _disagree(self, model: str, sizes: list[int | None]) -> str:
        each = ", ".join(f"{bs} on worker {c.index}" for c, bs in zip(self.channels, sizes, strict=True)
                         if bs is not None)
        return (f"model {model!r}: its engines on different workers hold blocks of different block sizes "
                f"({each}); its queries answer 503 until they agree")

    async def block_sizes(self) -> dict[str, int]:
        seen: dict[str, set[int]] = {}
        for part in await self._all(ch.BlockSizes()):
            for model, bs in part.items():
                seen.setdefault(model, set()).add(bs)
        sizes: dict[str, int] = {}
        for model, found in seen.items():
            agreed = found.pop() if len(found) == 1 else await self._agreed_block_size(model)
            if agreed is not None:
                sizes[model] = agreed
        return sizes

    async def set_block_size(self, model: str, block_size: int, *, configured: bool = False) -> int:
        if configured and self._configured.setdefault(model, block_size) != block_size:
            raise StoreMisconfigured(f"model {model!r} is configured with block_size {block_size} and "
                                     f"{self._configured[model]} ([models] and [[engines]] must agree)")
        self._answered.pop(model, None)
        sizes = await self._all(ch.SetBlockSize(model, block_size))
        return next((bs for bs in sizes if bs != block_size), block_size)

    async def clear_pod(self, pod: str, dp_rank: int | None = None) -> None:
        await self._all(ch.ClearPod(pod, dp_rank))

    # -- writes through the parent: the pod's owner judges and applies them ------------------------
    async def apply(self, stream: StreamRef, seq: int, epoch: int, dp_rank: int, events: Sequence[KVEvent],
                    *, force: str | None = None) -> ApplyResult:
        return await self._owner(stream.pod).request(
            ch.Apply(stream, seq, epoch, dp_rank, ch.events_to_wire(events), force))

    async def restart(self, stream: StreamRef, seen_epoch: int, ranks: Iterable[int] | None) -> Position:
        wanted = None if ranks is None else tuple(ranks)
        owner = self._owner(stream.pod)
        done = await owner.request(ch.Restart(stream, seen_epoch, wanted))
        if done.changed:
            others = [c for c in self.channels if c is not owner]
            clears = [ch.ClearPod(stream.pod)] if wanted is None else [ch.ClearPod(stream.pod, r) for r in wanted]
            await asyncio.gather(*(c.request(req) for c in others for req in clears))
        return done.position

    async def set_position(self, stream: StreamRef, position: Position) -> None:
        await self._owner(stream.pod).request(ch.SetPosition(stream, position))

    async def export_entries(self) -> list[Entry]:
        return [e for part in await self._all(ch.ExportEntries()) for e in part]

    async def load_entries(self, entries: Iterable[Entry]) -> int:
        by_owner: dict[int, list[Entry]] = {}
        for e in entries:
            by_owner.setdefault(owner_of(e.pod, len(self.channels)), []).append(e)
        counts = await asyncio.gather(*(self.channels[i].request(ch.LoadEntries(tuple(part)))
                                        for i, part in by_owner.items()))
        return sum(counts)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

