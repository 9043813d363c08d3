"""The memory backends: async views of ``PreciseIndex`` and ``ApproxIndex`` in this process.

``MemoryPreciseStore`` wraps any ``LocalPreciseIndex``: the fast ``PreciseIndex`` (the default)
or the readable ``kvindex.index.reference.ReferenceIndex`` (the contract suite runs both).

Invariants: the embedded default. Nothing here ever raises ``StoreUnavailable``; each coroutine
runs to completion without awaiting, so an apply is atomic with respect to the event loop. Stream
positions live beside the index and follow ``judge`` / ``next_position`` exactly as the Redis
backend's scripts do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, Union

from kvindex import native
from kvindex.events import KVEvent
from kvindex.index.approx import ApproxIndex
from kvindex.index.precise import CORE, PreciseIndex
from kvindex.index.protocol import ApplyResult, StoreMisconfigured
from kvindex.index.reference import ReferenceIndex
from kvindex.sequence import Outcome, Position, StreamRef, judge, next_position
from kvindex.settings import ApproxConfig
from kvindex.types import Applied, Entry, PodMatch


AnyPrecise = Union[PreciseIndex, ReferenceIndex]
_APPLIED = Outcome.APPLIED  # a module global for the per-batch path (through the class: ~150 ns on 3.11)


def new_precise_index(*, lineage: bool = False) -> AnyPrecise:
    """The fast index when its native core is built, else the readable reference (the same
    answers; each match reads every entry: for machines without a C compiler, not for load).
    ``lineage``: where each key came from, for ``/dump`` (``--dynamo-dump``)."""
    return PreciseIndex(lineage=lineage) if CORE is not None else ReferenceIndex(lineage=lineage)


def core_missing() -> str | None:
    """Why the precise index is the slow one, for the startup log; None when the core is built."""
    if CORE is not None:
        return None
    return ("precise index: the native core (kvindex.index._core) is not built, so the readable reference index "
            "serves: the same answers, but each query reads every entry and a snapshot packs its rows in Python "
            f"on the event loop. To build it: {native.fix(['kvindex.index._core'])}")


class LocalPreciseIndex(Protocol):
    """A precise index in this process, synchronous (``PreciseIndex``, ``ReferenceIndex``)."""

    def apply_batch(self, pod: str, model: str, dp_rank: int, events: Iterable[KVEvent]) -> Applied: ...
    def clear_pod(self, pod: str, dp_rank: int | None = None) -> None: ...
    def set_block_size(self, model: str, block_size: int) -> int: ...
    def block_size(self, model: str) -> int | None: ...
    def block_sizes(self) -> dict[str, int]: ...
    def pods(self) -> list[str]: ...
    def blocks_held(self, pod: str) -> dict[str, int]: ...
    def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]: ...
    def match(self, keys: Sequence[int], pods: Iterable[str] | None = None) -> dict[str, PodMatch]: ...
    def hash_match(self, hashes: Sequence[int]) -> dict[str, PodMatch]: ...
    def hash_tiers(self, hashes: Sequence[int]) -> dict[str, dict[str, list[int]]]: ...
    def export_entries(self) -> Iterable[Entry]: ...
    def load_entries(self, entries: Iterable[Entry]) -> int: ...


class MemoryPreciseStore:
    name = "memory"

    def __init__(self, index: LocalPreciseIndex | None = None) -> None:
        self.index: LocalPreciseIndex = index if index is not None else new_precise_index()
        self._positions: dict[str, Position] = {}
        self._configured: dict[str, int] = {}  # model -> the block size configuration gave it

    async def apply(self, stream: StreamRef, seq: int, epoch: int, dp_rank: int, events: Sequence[KVEvent],
                    *, force: str | None = None) -> ApplyResult:
        sid = stream.id
        pos = self._positions.get(sid)
        outcome = judge(pos, seq, epoch, force)
        if outcome is not _APPLIED:
            return ApplyResult(outcome, pos or Position(epoch=epoch))
        done = self.index.apply_batch(stream.pod, stream.model, dp_rank, events)
        after = self._positions[sid] = next_position(pos, seq, epoch, force, done.cleared > 0)
        return ApplyResult(outcome, after, done)

    async def restart(self, stream: StreamRef, seen_epoch: int, ranks: Iterable[int] | None) -> Position:
        pos = self._positions.get(stream.id) or Position()
        if pos.epoch != seen_epoch:
            return pos
        if ranks is None:
            self.index.clear_pod(stream.pod)
        else:
            for rank in ranks:
                self.index.clear_pod(stream.pod, rank)
        after = self._positions[stream.id] = Position(None, seen_epoch + 1, True, None)
        return after

    async def position(self, stream: StreamRef) -> Position | None:
        return self._positions.get(stream.id)

    async def set_position(self, stream: StreamRef, position: Position) -> None:
        self._positions[stream.id] = position

    async def clear_pod(self, pod: str, dp_rank: int | None = None) -> None:
        self.index.clear_pod(pod, dp_rank)

    async def set_block_size(self, model: str, block_size: int, *, configured: bool = False) -> int:
        if configured and self._configured.setdefault(model, block_size) != block_size:
            raise StoreMisconfigured(f"model {model!r} is configured with block_size {block_size} and "
                                     f"{self._configured[model]} ([models] and [[engines]] must agree)")
        return self.index.set_block_size(model, block_size)

    async def block_size(self, model: str) -> int | None:
        return self.index.block_size(model)

    async def block_sizes(self) -> dict[str, int]:
        return self.index.block_sizes()

    async def pods(self) -> list[str]:
        return self.index.pods()

    async def blocks_held(self, pod: str) -> dict[str, int]:
        return self.index.blocks_held(pod)

    async def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]:
        return self.index.engine_hashes(pod)

    def lineage(self) -> Any:
        """Where each held key came from (``kvindex.index.lineage``), for ``/dump``; None if not kept."""
        return getattr(self.index, "lineage", None)

    async def match(self, keys: Sequence[int], pods: Iterable[str] | None = None, *,
                    model: str | None = None) -> dict[str, PodMatch]:
        return self.index.match(keys, pods)  # keys are global here: ``model`` is only a slot hint

    async def hash_match(self, hashes: Sequence[int]) -> dict[str, PodMatch]:
        """``match`` by engine block hashes, through each worker's own entries (not in the store
        contract: only this store reads its workers' hash tables in one step)."""
        return self.index.hash_match(hashes)

    async def hash_tiers(self, hashes: Sequence[int]) -> dict[str, dict[str, list[int]]]:
        return self.index.hash_tiers(hashes)

    async def export_entries(self) -> list[Entry]:
        return list(self.index.export_entries())

    async def load_entries(self, entries: Iterable[Entry]) -> int:
        return self.index.load_entries(entries)

    async def close(self) -> None:
        return None


class MemoryApproxStore:
    name = "memory"

    def __init__(self, index: ApproxIndex) -> None:
        self.index = index

    @property
    def config(self) -> ApproxConfig:
        return self.index.config

    async def record(self, pod: str, model: str, hashes: Sequence[int]) -> None:
        self.index.record(pod, model, hashes)

    async def match(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        return self.index.match(model, hashes, pods)

    async def depth(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        return self.index.depth(model, hashes, pods)

    async def score(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int | float]:
        return self.index.score(model, hashes, pods)

    async def believes(self, pod: str, model: str, hash: int) -> bool:
        return self.index.believes(pod, model, hash)

    async def remove_pod(self, pod: str) -> None:
        self.index.remove_pod(pod)

    async def pods(self) -> list[str]:
        return self.index.pods()

    async def entries(self, pod: str | None = None) -> int:
        return self.index.entries(pod)

    async def evictions(self) -> int:
        return self.index.evictions

    async def export_state(self) -> dict[str, Any]:
        return self.index.export_state()

    async def load_state(self, state: dict[str, Any]) -> int:
        return self.index.load_state(state)

    async def close(self) -> None:
        return None
