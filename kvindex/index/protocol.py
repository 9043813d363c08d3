"""The storage contracts: where the precise and the approximate index live.

Backends of ``PreciseStore``: ``memory`` (this process, the embedded default; over the fast
``PreciseIndex`` or, in tests, the readable ``ReferenceIndex``), ``redis`` (one store shared by every
kvindex replica) and ``sharded`` (``kvindex.shard.store``: the workers of ``--workers N``). Of
``ApproxStore``: ``memory`` and ``redis``. One contract suite per Protocol runs against all of them
(``tests/test_store_contract.py``, ``tests/test_approx_store_contract.py``). ``judge`` and
``next_position`` are ``kvindex.sequence``'s.

Invariants, for every backend:
- Every method touching state is a coroutine. A backend that cannot reach its store raises
  ``StoreUnavailable`` (with a one-line reason) and has changed nothing: a batch is applied
  entirely or not at all, so no caller ever sees half-applied state.
- ``PreciseStore.apply`` is atomic and idempotent per stream. Whether a batch applies is decided by
  ``judge`` against the stream's stored ``Position``, inside the same atomic step as the
  apply, so when several replicas offer the same batch exactly one applies it and the others get
  ``DUPLICATE``. ``next_position`` is the position after an applied batch.
- An engine restart (its seq went back) is announced with ``restart(stream, seen_epoch, ranks)``:
  only the first replica to announce it clears the ranks and moves the epoch on; the others find
  the epoch already moved and change nothing.
- ``StoreLost`` (a ``StoreUnavailable``) means the store lost what it held since this client
  opened it (a Redis restarted without its data, keys evicted): every stream must be
  resynchronised. Every read checks the store's generation in the same atomic step as the read:
  its answer is exact or ``StoreLost``, never a partial answer. ``StoreMisconfigured`` (also a
  ``StoreUnavailable``) is a store whose answers cannot be trusted as configured.
- Semantics of the index operations are those of ``kvindex.index.reference.ReferenceIndex`` (the
  readable oracle; ``kvindex.index.precise.PreciseIndex`` is its fast twin) and
  ``kvindex.index.approx.ApproxIndex``; the memory backends are thin async views of those classes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from kvindex.events import GPU, KVEvent
from kvindex.sequence import Outcome, Position, StreamRef
from kvindex.settings import ApproxConfig
from kvindex.types import Applied, Entry, PodMatch


class StoreUnavailable(RuntimeError):
    """The store cannot be reached or refused the operation; nothing was changed."""


class StoreLost(StoreUnavailable):
    """The store's state was lost since it was opened (e.g. Redis restarted empty)."""


class BlockSizeChanged(Exception):
    """``match(..., model=)`` found the model's block size moved on since ``block_size`` answered
    (an engine restarted with another): the keys were chunked by the old one; compute them again."""


class StoreMisconfigured(StoreUnavailable):
    """The store is set up so that its answers could not be trusted (a Redis that may evict
    kvindex's keys, replicas configured with different block sizes): at start kvindex exits 2."""


def tier_of(medium: str) -> str:
    """An engine medium's tier: "GPU" is gpu, "CPU*" cpu, anything else disk."""
    if medium == GPU:
        return "gpu"
    if medium.startswith("CPU"):
        return "cpu"
    return "disk"


class ApplyResult(msgspec.Struct, frozen=True):
    outcome: Outcome
    position: Position  # the stream's position after the call
    applied: Applied | None = None  # what the batch did, when it applied


class PreciseStore(Protocol):
    """The precise index behind an async, replica-safe interface (see ``PreciseIndex``)."""

    name: str  # "memory", "redis" or "sharded", for logs and /v1/pods

    async def apply(self, stream: StreamRef, seq: int, epoch: int, dp_rank: int, events: Sequence[KVEvent],
                    *, force: str | None = None) -> ApplyResult: ...

    async def restart(self, stream: StreamRef, seen_epoch: int, ranks: Iterable[int] | None) -> Position:
        """The engine restarted. If the stream is still at ``seen_epoch``: clear the pod's ``ranks``
        (all its ranks when None), epoch + 1, last_seq None, synced. Else change nothing. Returns
        the position after."""
        ...

    async def position(self, stream: StreamRef) -> Position | None: ...

    async def set_position(self, stream: StreamRef, position: Position) -> None:
        """Overwrite a stream's position (restored state, an operator's resync, unsynced marks)."""
        ...

    async def clear_pod(self, pod: str, dp_rank: int | None = None) -> None: ...

    async def set_block_size(self, model: str, block_size: int, *, configured: bool = False) -> int:
        """The block size to use for ``model`` while no engine holds blocks of another (see
        reference.py: block sizes follow the engines); answers the size in force. ``configured``:
        the operator's ([models], [[engines]]); two different ones are ``StoreMisconfigured``."""
        ...

    async def block_size(self, model: str) -> int | None: ...

    async def block_sizes(self) -> dict[str, int]: ...

    async def pods(self) -> list[str]: ...

    async def blocks_held(self, pod: str) -> dict[str, int]: ...

    async def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]: ...

    async def match(self, keys: Sequence[int], pods: Iterable[str] | None = None, *,
                    model: str | None = None) -> dict[str, PodMatch]:
        """``model`` (the model the keys were computed for) lets a sharded backend walk only that
        model's slot: one round trip on Redis. Without it the answer is the same, at more cost.
        With it, a store that cannot read the block size in the same step (Redis) raises
        ``BlockSizeChanged`` when the model's moved on since ``block_size`` answered."""
        ...

    async def export_entries(self) -> list[Entry]: ...

    async def load_entries(self, entries: Iterable[Entry]) -> int: ...

    async def close(self) -> None: ...


class ApproxStore(Protocol):
    """The approximate index behind an async interface (see ``ApproxIndex``): beliefs only,
    every read and write async. Requests are rendered and hashed before they reach a store
    (``kvindex.approx.hashing``), with the settings ``config`` gives per model."""

    name: str

    @property
    def config(self) -> ApproxConfig: ...

    async def record(self, pod: str, model: str, hashes: Sequence[int]) -> None: ...

    async def match(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int]: ...

    async def depth(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int]: ...

    async def score(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int | float]: ...

    async def believes(self, pod: str, model: str, hash: int) -> bool: ...

    async def remove_pod(self, pod: str) -> None: ...

    async def pods(self) -> list[str]: ...

    async def entries(self, pod: str | None = None) -> int: ...

    async def evictions(self) -> int: ...

    async def export_state(self) -> dict[str, Any]: ...

    async def load_state(self, state: dict[str, Any]) -> int: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class Stores:
    """Both stores of one daemon and the client they share (None for memory)."""

    url: str
    precise: PreciseStore
    approx: ApproxStore
    client: Any = None

    async def open(self) -> None:
        """Reach the store (Redis: load scripts, read or create its generation); StoreUnavailable."""
        for store in (self.precise, self.approx):
            opener = getattr(store, "open", None)
            if opener is not None:
                await opener()

    async def close(self) -> None:
        for store in (self.precise, self.approx):
            await store.close()
        if self.client is not None:
            client, self.client = self.client, None
            await client.aclose()
