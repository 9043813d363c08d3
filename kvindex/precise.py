"""The precise index: exactly which blocks each engine replica holds, from its KV events.

Invariants:
- A *worker* is one (pod, dp_rank). Per worker, ``engine hash -> _Block(key, copies per medium)``:
  vLLM stores and removes each physical copy of a hash separately, so copies are refcounted, and
  the entry goes away only when its last copy (in any medium) is removed.
- A block's ``key`` is kvindex's own chained key (``kvindex.keys``) computed from the event's
  token ids and its parent's key. A store whose parent is unknown (or keyless), whose tokens are
  missing, or whose block size differs from the model's, is kept keyless (an *orphan*): a later
  BlockRemoved still finds it, but it never matches a query.
- Inverted view per tier: ``key -> {worker: copies}``, so a lookup costs O(prefix depth × holders
  still matching), never O(pods × blocks). Tiers: "gpu" (what matches), "cpu", "disk" (reported
  cumulatively through the device tier, like the Dynamo indexer's fields).
- The index never sees bytes, and knows nothing about transport, seq numbers or HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvindex import keys as K
from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

TIERS = ("gpu", "cpu", "disk")


def tier_of(medium: str) -> str:
    if medium == "GPU":
        return "gpu"
    if medium.startswith("CPU"):
        return "cpu"
    return "disk"


class _Block:
    __slots__ = ("key", "copies")

    def __init__(self, key: int | None) -> None:
        self.key = key
        self.copies: dict[str, int] = {}


@dataclass(slots=True)
class _Worker:
    pod: str
    dp_rank: int
    blocks: dict[int, _Block] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Applied:
    """What one event did: blocks stored/removed, orphans kept, removals of unknown hashes."""

    stored: int = 0
    removed: int = 0
    orphans: int = 0
    unknown_removals: int = 0
    block_size_mismatch: bool = False
    cleared: bool = False


@dataclass(frozen=True, slots=True)
class PodMatch:
    """Longest matched prefix of one pod, in blocks. ``dp`` per rank; tiers cumulative."""

    gpu: int
    cpu: int
    disk: int
    dp: dict[int, int]


class PreciseIndex:
    """In-memory precise index. Not thread-safe; one event loop owns it."""

    def __init__(self) -> None:
        self._workers: dict[tuple[str, int], _Worker] = {}
        self._holders: dict[str, dict[int, dict[tuple[str, int], int]]] = {t: {} for t in TIERS}
        self._block_size: dict[str, int] = {}

    # -- configuration -------------------------------------------------------------------------
    def set_block_size(self, model: str, block_size: int) -> None:
        self._block_size[model] = block_size

    def block_size(self, model: str) -> int | None:
        return self._block_size.get(model)

    # -- events --------------------------------------------------------------------------------
    def apply(self, pod: str, model: str, dp_rank: int, event: KVEvent) -> Applied:
        if isinstance(event, BlockStored):
            return self._store(self._worker(pod, dp_rank), model, event)
        if isinstance(event, BlockRemoved):
            return self._remove(self._worker(pod, dp_rank), event)
        if isinstance(event, AllBlocksCleared):
            self.clear_pod(pod)
            return Applied(cleared=True)
        raise TypeError(f"not a KV event: {type(event).__name__}")

    def _worker(self, pod: str, dp_rank: int) -> _Worker:
        w = self._workers.get((pod, dp_rank))
        if w is None:
            w = self._workers[(pod, dp_rank)] = _Worker(pod, dp_rank)
        return w

    def _store(self, w: _Worker, model: str, ev: BlockStored) -> Applied:
        bs = ev.block_size
        model_bs = self._block_size.setdefault(model, bs)
        mismatch = bs != model_bs
        tier = tier_of(ev.medium)
        if ev.parent_hash is None:
            parent_key: int | None = K.root_key(model, ev.lora_name, ev.cache_salt)
        else:
            parent = w.blocks.get(ev.parent_hash)
            parent_key = parent.key if parent is not None else None
        tokens = ev.token_ids
        orphans = 0
        for i, h in enumerate(ev.block_hashes):
            block = w.blocks.get(h)
            key = block.key if block is not None else None
            if key is None and parent_key is not None and not mismatch and len(tokens) >= (i + 1) * bs:
                key = K.chain(parent_key, K.local_hash(tokens[i * bs : (i + 1) * bs]))
            if block is None:
                block = w.blocks[h] = _Block(key)
            elif block.key is None and key is not None:
                self._adopt_key(w, block, key)
            if key is None:
                orphans += 1
            block.copies[ev.medium] = block.copies.get(ev.medium, 0) + 1
            if key is not None:
                self._hold(tier, key, (w.pod, w.dp_rank), +1)
            parent_key = key
        return Applied(stored=len(ev.block_hashes), orphans=orphans, block_size_mismatch=mismatch)

    def _adopt_key(self, w: _Worker, block: _Block, key: int) -> None:
        """A keyless block learns its key (a later store carried its tokens): index its copies."""
        block.key = key
        for medium, n in block.copies.items():
            self._hold(tier_of(medium), key, (w.pod, w.dp_rank), n)

    def _remove(self, w: _Worker, ev: BlockRemoved) -> Applied:
        removed = unknown = 0
        for h in ev.block_hashes:
            block = w.blocks.get(h)
            n = block.copies.get(ev.medium, 0) if block is not None else 0
            if block is None or n == 0:
                unknown += 1
                continue
            removed += 1
            if n == 1:
                del block.copies[ev.medium]
            else:
                block.copies[ev.medium] = n - 1
            if block.key is not None:
                self._hold(tier_of(ev.medium), block.key, (w.pod, w.dp_rank), -1)
            if not block.copies:
                del w.blocks[h]
        return Applied(removed=removed, unknown_removals=unknown)

    def _hold(self, tier: str, key: int, worker: tuple[str, int], delta: int) -> None:
        holders = self._holders[tier]
        per_key = holders.get(key)
        if per_key is None:
            per_key = holders[key] = {}
        n = per_key.get(worker, 0) + delta
        if n > 0:
            per_key[worker] = n
        else:
            per_key.pop(worker, None)
            if not per_key:
                del holders[key]

    # -- pods ----------------------------------------------------------------------------------
    def clear_pod(self, pod: str) -> None:
        """Forget every block of every rank of ``pod`` (AllBlocksCleared, restart, removal)."""
        for wid in [wid for wid in self._workers if wid[0] == pod]:
            w = self._workers.pop(wid)
            for block in w.blocks.values():
                if block.key is None:
                    continue
                for medium, n in block.copies.items():
                    self._hold(tier_of(medium), block.key, wid, -n)

    def pods(self) -> list[str]:
        return sorted({pod for pod, _ in self._workers})

    def blocks_held(self, pod: str) -> dict[str, int]:
        """Copies held per tier, plus ``orphans`` (keyless hashes) for ``pod``."""
        out = {t: 0 for t in TIERS} | {"orphans": 0}
        for (p, _), w in self._workers.items():
            if p != pod:
                continue
            for block in w.blocks.values():
                for medium, n in block.copies.items():
                    out[tier_of(medium)] += n
                out["orphans"] += block.key is None
        return out

    def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]:
        """Per dp_rank: engine hash -> key (None for orphans). For tests and /dump."""
        return {
            rank: {h: b.key for h, b in w.blocks.items()}
            for (p, rank), w in self._workers.items()
            if p == pod
        }

    # -- queries -------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], pods: Iterable[str] | None = None) -> dict[str, PodMatch]:
        """Longest prefix of ``keys`` held by each pod (only pods with a match ≥ 1 are listed)."""
        allowed = set(pods) if pods is not None else None
        gpu = self._walk(keys, [self._holders["gpu"]], allowed)
        if not gpu and not self._holders["cpu"] and not self._holders["disk"]:
            return {}
        cpu = self._walk(keys, [self._holders["gpu"], self._holders["cpu"]], allowed)
        disk = self._walk(keys, [self._holders[t] for t in TIERS], allowed)
        return _per_pod(gpu, cpu, disk)

    @staticmethod
    def _walk(
        keys: Sequence[int],
        tiers: list[dict[int, dict[tuple[str, int], int]]],
        allowed: set[str] | None,
    ) -> dict[tuple[str, int], int]:
        depth: dict[tuple[str, int], int] = {}
        if not keys:
            return depth
        active = _holders_of(keys[0], tiers)
        if allowed is not None:
            active = {w for w in active if w[0] in allowed}
        for i in range(1, len(keys)):
            if not active:
                break
            here = _holders_of(keys[i], tiers)
            nxt = active & here
            for w in active - nxt:
                depth[w] = i
            active = nxt
        for w in active:
            depth[w] = len(keys) if active else 0
        return depth


def _holders_of(key: int, tiers: list[dict[int, dict[tuple[str, int], int]]]) -> set[tuple[str, int]]:
    if len(tiers) == 1:
        h = tiers[0].get(key)
        return set(h) if h else set()
    out: set[tuple[str, int]] = set()
    for t in tiers:
        h = t.get(key)
        if h:
            out.update(h)
    return out


def _per_pod(
    gpu: dict[tuple[str, int], int],
    cpu: dict[tuple[str, int], int],
    disk: dict[tuple[str, int], int],
) -> dict[str, PodMatch]:
    out: dict[str, PodMatch] = {}
    for pod in {w[0] for w in disk}:
        dp = {rank: n for (p, rank), n in gpu.items() if p == pod}
        out[pod] = PodMatch(
            gpu=max(dp.values(), default=0),
            cpu=max((n for (p, _), n in cpu.items() if p == pod), default=0),
            disk=max((n for (p, _), n in disk.items() if p == pod), default=0),
            dp=dp,
        )
    return out
