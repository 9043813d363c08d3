"""The precise index: exactly which blocks each engine replica holds, from its KV events.

Invariants:
- A *worker* is one (pod, dp_rank) and owns one bit. Per worker and medium, ``engine hash -> key``
  (``ORPHAN`` when keyless); copies beyond the first of a hash are counted in ``extra``: vLLM stores
  and removes each physical copy separately, and a hash goes away with its last copy.
- A block's key is kvindex's own chained key (``kvindex.keys``) computed from the event's token ids
  and its parent's key. A store whose parent is unknown or keyless, whose tokens are missing, or
  whose block size differs from the model's, is kept as an ORPHAN: a later BlockRemoved finds it,
  but it never matches a query.
- Inverted view per tier: ``key -> bitmask of workers holding it``. A lookup is one dict probe and
  a few integer operations per prompt block, whatever the number of pods: never O(pods × blocks).
  Tiers: "gpu" (what matches), "cpu", "disk" (reported cumulatively through the device tier).
- The index never sees bytes, and knows nothing about transport, seq numbers or HTTP.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat, takewhile
from operator import and_, neg
from typing import NamedTuple

from kvindex import keys as K
from kvindex.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

TIERS = ("gpu", "cpu", "disk")
ORPHAN = -1


def tier_of(medium: str) -> str:
    if medium == GPU:
        return "gpu"
    if medium.startswith("CPU"):
        return "cpu"
    return "disk"


class _Worker:
    __slots__ = ("pod", "rank", "slot", "bit", "media", "extra", "orphans")

    def __init__(self, pod: str, rank: int, slot: int) -> None:
        self.pod, self.rank, self.slot, self.bit = pod, rank, slot, 1 << slot
        self.media: dict[str, dict[int, int]] = {GPU: {}}
        self.extra: dict[tuple[str, int], int] = {}
        self.orphans = 0

    def empty(self) -> bool:
        return not self.extra and not any(self.media.values())

    def key_of(self, h: int) -> int | None:
        """The key of engine hash ``h`` in any medium; None if unknown or keyless."""
        key = self.media[GPU].get(h)
        if key is None:
            for blocks in self.media.values():
                key = blocks.get(h)
                if key is not None:
                    break
        return None if key is None or key == ORPHAN else key


@dataclass(slots=True)
class Applied:
    """What a batch of events did (counts), filled in as it is applied."""

    stored: int = 0  # block copies
    removed: int = 0
    orphans: int = 0  # stores kept without a key
    unknown_removals: int = 0
    block_size_mismatch: int = 0  # BlockStored events whose block size differs from the model's
    stored_events: int = 0
    removed_events: int = 0
    cleared: int = 0  # AllBlocksCleared events


class Entry(NamedTuple):
    """One held engine hash, as exported and loaded (snapshots, peer recovery)."""

    pod: str
    dp_rank: int
    medium: str
    hash: int
    key: int | None
    copies: int


class PodMatch(NamedTuple):
    """Longest matched prefix of one pod, in blocks. ``dp`` per rank; tiers cumulative."""

    gpu: int
    cpu: int
    disk: int
    dp: dict[int, int]


class PreciseIndex:
    """In-memory precise index. Not thread-safe; one event loop owns it."""

    def __init__(self) -> None:
        self._workers: dict[tuple[str, int], _Worker] = {}
        self._slots: list[_Worker | None] = []
        self._holders: dict[str, dict[int, int]] = {t: {} for t in TIERS}
        self._dups: dict[tuple[str, int, int], int] = {}  # (tier, key, slot): holdings beyond the first
        self._block_size: dict[str, int] = {}

    # -- configuration -------------------------------------------------------------------------
    def set_block_size(self, model: str, block_size: int) -> None:
        self._block_size[model] = block_size

    def block_size(self, model: str) -> int | None:
        return self._block_size.get(model)

    # -- events --------------------------------------------------------------------------------
    def apply(self, pod: str, model: str, dp_rank: int, event: KVEvent) -> Applied:
        return self.apply_batch(pod, model, dp_rank, (event,))

    def apply_batch(self, pod: str, model: str, dp_rank: int, events: Iterable[KVEvent]) -> Applied:
        """Apply one engine batch in order; one worker lookup, one result for the batch."""
        done = Applied()
        w = self._workers.get((pod, dp_rank))
        for ev in events:
            t = type(ev)
            if t is BlockRemoved:
                if w is None:  # nothing held: every removal is of an unknown hash
                    done.removed_events += 1
                    done.unknown_removals += len(ev.block_hashes)  # type: ignore[union-attr]
                else:
                    self._remove(w, ev, done)  # type: ignore[arg-type]
            elif t is BlockStored:
                self._store(w or (w := self._worker(pod, dp_rank)), model, ev, done)  # type: ignore[arg-type]
            elif t is AllBlocksCleared:  # one rank's cache (each dp rank publishes its own stream)
                self.clear_pod(pod, dp_rank)
                done.cleared += 1
                w = None
            else:
                raise TypeError(f"not a KV event: {t.__name__}")
        if w is not None and w.empty():
            self.clear_pod(pod, dp_rank)  # frees its slot: an empty worker costs nothing
        return done

    def _worker(self, pod: str, dp_rank: int) -> _Worker:
        w = self._workers.get((pod, dp_rank))
        if w is None:
            slot = next((i for i, s in enumerate(self._slots) if s is None), len(self._slots))
            w = _Worker(pod, dp_rank, slot)
            if slot == len(self._slots):
                self._slots.append(w)
            else:
                self._slots[slot] = w
            self._workers[(pod, dp_rank)] = w
        return w

    def _event_keys(self, w: _Worker, model: str, ev: BlockStored) -> tuple[list[int], bool]:
        """Keys for the event's blocks (shorter than its hashes where tokens run out)."""
        bs = ev.block_size
        mismatch = self._block_size.setdefault(model, bs) != bs
        if mismatch:
            return [], True
        if ev.parent_hash is None:
            parent: int | None = K.root_key(model, ev.lora_name, ev.cache_salt)
        else:
            parent = w.key_of(ev.parent_hash)
        if parent is None:
            return [], False
        return K.prompt_keys(parent, ev.token_ids, bs, limit=len(ev.block_hashes)), False

    def _store(self, w: _Worker, model: str, ev: BlockStored, done: Applied) -> None:
        keys, mismatch = self._event_keys(w, model, ev)
        medium = ev.medium
        blocks = w.media.get(medium)
        if blocks is None:
            blocks = w.media[medium] = {}
        tier = tier_of(medium)
        holders, bit, single = self._holders[tier], w.bit, len(w.media) == 1
        hashes = ev.block_hashes
        orphans = 0
        for i, h in enumerate(hashes):
            key = keys[i] if i < len(keys) else w.key_of(h)
            if key is not None and single and h not in blocks:  # the common case, inlined
                blocks[h] = key
                mask = holders.get(key, 0)
                if not mask:
                    holders[key] = bit  # a lone holder shares its bit object
                elif not mask & bit:
                    holders[key] = mask | bit
                else:
                    self._hold(tier, key, w)  # counts the duplicate
            else:
                orphans += self._store_one(w, medium, tier, blocks, h, key)
        done.stored_events += 1
        done.stored += len(hashes)
        done.orphans += orphans
        done.block_size_mismatch += mismatch

    def _store_one(self, w: _Worker, medium: str, tier: str, blocks: dict[int, int], h: int, key: int | None) -> int:
        """One stored copy, any case (repeat copies, orphans, other media); returns 1 if keyless."""
        old = blocks.get(h)
        if old is None:
            blocks[h] = ORPHAN if key is None else key
            w.orphans += key is None
            if key is not None and len(w.media) > 1:
                self._adopt_elsewhere(w, h, key)
        else:
            copies = w.extra[(medium, h)] = w.extra.get((medium, h), 0) + 1
            if old == ORPHAN and key is not None:  # a keyless hash learns its key:
                blocks[h] = key  # index the copies it already had
                w.orphans -= 1
                for _ in range(copies):
                    self._hold(tier, key, w)
            else:
                key = None if old == ORPHAN else old
        if key is None:
            return 1
        self._hold(tier, key, w)
        return 0

    def _adopt_elsewhere(self, w: _Worker, h: int, key: int) -> None:
        """Keyless copies of ``h`` in other media (offload events carry no tokens) get its key."""
        for medium, blocks in w.media.items():
            if blocks.get(h) == ORPHAN:
                blocks[h] = key
                w.orphans -= 1
                for _ in range(1 + w.extra.get((medium, h), 0)):
                    self._hold(tier_of(medium), key, w)

    def _remove(self, w: _Worker, ev: BlockRemoved, done: Applied) -> None:
        removed = unknown = 0
        blocks = w.media.get(ev.medium)
        tier = tier_of(ev.medium)
        for h in ev.block_hashes:
            key = blocks.get(h) if blocks is not None else None
            if key is None:
                unknown += 1
                continue
            removed += 1
            n = w.extra.get((ev.medium, h), 0)
            if n:
                if n == 1:
                    del w.extra[(ev.medium, h)]
                else:
                    w.extra[(ev.medium, h)] = n - 1
            else:
                del blocks[h]  # type: ignore[union-attr]
                w.orphans -= key == ORPHAN
            if key != ORPHAN:
                self._release(tier, key, w)
        done.removed_events += 1
        done.removed += removed
        done.unknown_removals += unknown

    def _hold(self, tier: str, key: int, w: _Worker) -> None:
        holders = self._holders[tier]
        mask = holders.get(key, 0)
        if mask & w.bit:
            d = (tier, key, w.slot)
            self._dups[d] = self._dups.get(d, 0) + 1
        else:
            holders[key] = mask | w.bit if mask else w.bit  # a lone holder shares its bit object

    def _release(self, tier: str, key: int, w: _Worker) -> None:
        d = (tier, key, w.slot)
        n = self._dups.get(d)
        if n:
            if n == 1:
                del self._dups[d]
            else:
                self._dups[d] = n - 1
            return
        holders = self._holders[tier]
        mask = holders.get(key, 0) & ~w.bit
        if mask:
            holders[key] = mask
        else:
            holders.pop(key, None)

    # -- pods ----------------------------------------------------------------------------------
    def clear_pod(self, pod: str, dp_rank: int | None = None) -> None:
        """Forget every block of ``pod`` (all ranks, or one) — AllBlocksCleared, restart, removal."""
        for wid in [wid for wid in self._workers if wid[0] == pod and dp_rank in (None, wid[1])]:
            w = self._workers.pop(wid)
            for medium, blocks in w.media.items():
                holders, tier = self._holders[tier_of(medium)], tier_of(medium)
                for key in blocks.values():
                    if key == ORPHAN:
                        continue
                    mask = holders.get(key, 0) & ~w.bit
                    if mask:
                        holders[key] = mask
                    else:
                        holders.pop(key, None)
                    self._dups.pop((tier, key, w.slot), None)
            self._slots[w.slot] = None

    def pods(self) -> list[str]:
        return sorted({pod for pod, _ in self._workers})

    def blocks_held(self, pod: str) -> dict[str, int]:
        """Copies held per tier, plus ``orphans`` (keyless hashes) for ``pod``."""
        out = {t: 0 for t in TIERS} | {"orphans": 0}
        for (p, _), w in self._workers.items():
            if p != pod:
                continue
            for medium, blocks in w.media.items():
                out[tier_of(medium)] += len(blocks)
            for (medium, _), n in w.extra.items():
                out[tier_of(medium)] += n
            out["orphans"] += w.orphans
        return out

    def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]:
        """Per dp_rank: engine hash -> key (None for orphans), all media. For tests and /dump."""
        out: dict[int, dict[int, int | None]] = {}
        for (p, rank), w in self._workers.items():
            if p == pod:
                merged = out.setdefault(rank, {})
                for blocks in w.media.values():
                    merged.update({h: None if k == ORPHAN else k for h, k in blocks.items()})
        return out

    # -- state out and in (snapshots, peers) ----------------------------------------------------
    def block_sizes(self) -> dict[str, int]:
        return dict(self._block_size)

    def export_entries(self) -> Iterator[Entry]:
        """Every held engine hash: (pod, dp_rank, medium, hash, key or None, copies)."""
        return entries_of(self.frozen_copy())

    def frozen_copy(self) -> list[tuple[str, int, str, dict[int, int], dict[tuple[str, int], int]]]:
        """A point-in-time copy of every worker's maps: C-level dict copies, fast enough for the
        event loop; ``entries_of`` turns it into entries anywhere (e.g. in a thread)."""
        return [(w.pod, w.rank, medium, blocks.copy(), w.extra.copy())
                for w in self._workers.values() for medium, blocks in w.media.items()]

    def load_entries(self, entries: Iterable[Entry]) -> int:
        """Add exported entries (to an index that does not hold them yet); returns how many."""
        n = 0
        for e in entries:
            w = self._worker(e.pod, e.dp_rank)
            blocks = w.media.setdefault(e.medium, {})
            blocks[e.hash] = ORPHAN if e.key is None else e.key
            if e.copies > 1:
                w.extra[(e.medium, e.hash)] = e.copies - 1
            if e.key is None:
                w.orphans += 1
            else:
                for _ in range(e.copies):
                    self._hold(tier_of(e.medium), e.key, w)
            n += 1
        return n

    # -- queries -------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], pods: Iterable[str] | None = None) -> dict[str, PodMatch]:
        """Longest prefix of ``keys`` held by each pod (only pods with a match ≥ 1 are listed)."""
        allowed = (1 << len(self._slots)) - 1 if pods is None else self._mask_of(pods)
        if not allowed:
            return {}
        gpu = _walk(keys, self._holders["gpu"], None, allowed)
        if not self._holders["cpu"] and not self._holders["disk"]:
            return self._per_pod_gpu(gpu)
        cpu = _walk(keys, self._holders["gpu"], [self._holders["cpu"]], allowed)
        disk = _walk(keys, self._holders["gpu"], [self._holders["cpu"], self._holders["disk"]], allowed)
        return self._per_pod(gpu, cpu, disk)

    def _mask_of(self, pods: Iterable[str]) -> int:
        wanted = set(pods)
        mask = 0
        for (pod, _), w in self._workers.items():
            if pod in wanted:
                mask |= w.bit
        return mask

    def _per_pod_gpu(self, gpu: dict[int, int]) -> dict[str, PodMatch]:
        out: dict[str, PodMatch] = {}
        for slot, g in gpu.items():
            w = self._slots[slot]
            prev = out.get(w.pod)  # type: ignore[union-attr]
            if prev is None:
                out[w.pod] = PodMatch(g, g, g, {w.rank: g})  # type: ignore[union-attr]
            else:
                prev.dp[w.rank] = g  # type: ignore[union-attr]
                if g > prev.gpu:
                    out[w.pod] = PodMatch(g, g, g, prev.dp)  # type: ignore[union-attr]
        return out

    def _per_pod(self, gpu: dict[int, int], cpu: dict[int, int], disk: dict[int, int]) -> dict[str, PodMatch]:
        out: dict[str, PodMatch] = {}
        for slot, d in disk.items():
            w = self._slots[slot]
            assert w is not None
            g, c = gpu.get(slot, 0), cpu.get(slot, 0)
            prev = out.get(w.pod)
            if prev is None:
                out[w.pod] = PodMatch(g, c, d, {w.rank: g})
            else:
                prev.dp[w.rank] = g
                out[w.pod] = PodMatch(max(prev.gpu, g), max(prev.cpu, c), max(prev.disk, d), prev.dp)
        return out


def entries_of(copy: list[tuple[str, int, str, dict[int, int], dict[tuple[str, int], int]]]) -> Iterator[Entry]:
    for pod, rank, medium, blocks, extra in copy:
        for h, key in blocks.items():
            yield Entry(pod, rank, medium, h, None if key == ORPHAN else key, 1 + extra.get((medium, h), 0))


def _walk(keys: Sequence[int], gpu: dict[int, int], others: list[dict[int, int]] | None, allowed: int) -> dict[int, int]:
    """Depth (in blocks) of the longest prefix each worker slot holds, for slots with depth ≥ 1.

    ``acc[i]`` is the mask of slots holding the first i keys: one C-level pass. Each step only
    clears bits, so ``acc`` is non-increasing as integers and the places where it changes are
    found by bisection: the Python work is O(distinct depths × log n), not O(n)."""
    if others:
        masks: Iterable[int] = [_union(k, gpu, others) for k in keys]
    else:
        masks = map(gpu.get, keys, repeat(0))
    acc = list(takewhile(bool, accumulate(masks, and_, initial=allowed)))  # stops when nobody is left
    depth: dict[int, int] = {}
    hi, seen = len(acc), 0
    while hi > 1:
        value = acc[hi - 1]
        for slot in _bits(value & ~seen):
            depth[slot] = hi - 1
        seen = value
        hi = bisect_left(acc, -value, 0, hi, key=neg)
    return depth


def _union(key: int, gpu: dict[int, int], others: list[dict[int, int]]) -> int:
    held = gpu.get(key, 0)
    for t in others:
        held |= t.get(key, 0)
    return held


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
