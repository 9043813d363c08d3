"""The precise index: exactly which blocks each engine replica holds, from its KV events.

Invariants:
- A *worker* is one (pod, dp_rank) and owns one bit (its slot). Per worker and medium, a ``_Table``
  maps ``engine hash -> key`` (``ORPHAN`` when keyless); copies beyond the first of a hash are
  counted in ``extra``: vLLM stores and removes each physical copy separately, and a hash goes
  away with its last copy.
- A block's key is kvindex's own chained key (``kvindex.keys``) computed from the event's token ids
  and its parent's key. A store whose parent is unknown or keyless, whose tokens are missing, or
  whose block size differs from the model's, is kept as an ORPHAN: a later BlockRemoved finds it,
  but it never matches a query.
- Inverted view per tier: ``key -> bitmask of workers holding it``; holdings beyond the first of
  a key by one worker in one tier are counted in ``_dups``. A lookup is one dict probe and a few
  integer operations per prompt block, whatever the number of pods: never O(pods × blocks).
  Tiers: "gpu" (what matches), "cpu", "disk" (reported cumulatively through the device tier).
- The index never sees bytes, and knows nothing about transport, seq numbers or HTTP.

Memory layout (no Python object per (block, pod) entry):
- A ``_Table`` is an open-addressing hash table in one ``array("Q")`` of (engine hash, key) slot
  pairs. Home slot: the top bits of ``hash * _MIX`` (Fibonacci hashing, ``size`` a power of two:
  sequential and strided hashes spread; ``hash % size``, even for a prime size, piles runs of
  sequential hashes into clusters hundreds of slots long). Linear probing that never wraps
  around (it runs on into spare slots past ``size``; the last slot is always empty, so every
  probe ends inside the array); backward-shift deletion (no tombstones); grown at 2/3 load (x4
  below 4096 slots, then x2), shrunk below 1/8. Slot hash 0 means empty, so an engine hash of 0
  and every keyless (ORPHAN) entry live in the table's ``side`` dict instead; a hash is in
  exactly one of the two places. 16 bytes per slot ≈ 25-50 bytes per entry, against ~130 for a
  dict entry with two fresh 64-bit ints. The hot loops of ``_store`` and ``_remove`` inline the
  table's probes (deletion is one method, ``_Table._delete``); ``_Table``'s own methods are the
  reference for them.
- The only per-block Python objects are in the inverted view: one key int and one dict slot per
  distinct (tier, key), whatever the number of holders. Masks of several holders are interned
  (``_masks``, a bounded cache): the same few holder sets recur across millions of keys. A lone
  holder's mask is its worker's ``bit`` object.
- ``_members`` caches mask -> [(pod, rank)] for match; it is dropped whenever a slot changes owner.
- The hot loops (``_store``'s common case, ``_remove``'s inline branch, ``_Table._resize``) run in
  C when ``kvindex._apply`` is built (a ``PreciseIndex(native=None)``, or ``KVINDEX_PURE_PYTHON=1``
  everywhere, runs the Python loops), and the device tier's walk in ``kvindex._walk``. The C loops work on these same
  objects and hand back every element they cannot take the simple way, which the Python code
  here then applies: the Python loops define the behaviour, tests hold the two states equal.
- ``frozen_copy`` still returns plain dicts (its contract), so it now materialises two int objects
  per entry instead of copying dicts.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate, compress, repeat, takewhile
from operator import and_, neg
from types import ModuleType

from kvindex import keys as K
from kvindex import native as _native
from kvindex.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvindex.index.protocol import Applied, Entry, PodMatch

TIERS = ("gpu", "cpu", "disk")
ORPHAN = -1

_tuple_new = tuple.__new__
_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: Fibonacci hashing, home = top bits of hash * _MIX
_M64 = (1 << 64) - 1
_MIN_BITS = 3
_PAD = 16  # slots past a table's size (probes run on into them), added 16 at a time
_MASKS_CAP = 1 << 16  # interned holder masks kept at most (then the cache starts over)
_MEMBERS_CAP = 1 << 10  # cached member lists (of shared (pod, rank) tuples)
_WALK = _native.load("kvindex._walk")  # the C twin of ``_walk`` for the device tier, when built
_APPLY = _native.load("kvindex._apply")  # the C loops (kvindex/_apply.c), or None: the Python ones


def _grown(bits: int) -> int:
    """A full table's next size: x4 while small (a few KB; fewer rebuilds while a worker fills),
    then x2."""
    return bits + 2 if bits < 12 else bits + 1


def tier_of(medium: str) -> str:
    if medium == GPU:
        return "gpu"
    if medium.startswith("CPU"):
        return "cpu"
    return "disk"


class _Table:
    """``engine hash -> key`` of one worker and medium, without a Python object per entry.

    Keyed entries with a non-zero hash live in ``tab``, an ``array("Q")`` of (hash, key) slot
    pairs (slot hash 0 = empty; both halves of a slot share a cache line). Home slot: the top
    ``bits`` bits of ``h * _MIX`` (mod 2^64); linear probing that never wraps around but runs on
    into slots past ``size``; the last slot always stays empty, so every probe ends inside the
    array (it is extended when an entry takes that slot). The rest (hash 0, ORPHAN values) is in
    ``side``. Behaves like the dict it replaces. ``native``: kvindex._apply (C rehash) or None."""

    __slots__ = ("tab", "size", "bits", "sh", "m", "used", "limit", "side", "native")

    def __init__(self, bits: int = _MIN_BITS, native: ModuleType | None = _APPLY) -> None:
        self.side: dict[int, int] = {}
        self.native = native
        self._alloc(bits)

    def _alloc(self, bits: int) -> None:
        size = 1 << bits
        self.tab = array("Q", bytes(16 * (size + _PAD)))
        self.size, self.bits, self.used, self.limit = size, bits, 0, size * 2 // 3
        # a hash's slot pair starts at ``hash * _MIX >> sh & m``: twice the top ``bits`` bits of
        # the low 64 bits of the product, in one shift and one mask
        self.sh, self.m = 63 - bits, 2 * size - 2

    def __len__(self) -> int:
        return self.used + len(self.side)

    def _extend(self) -> None:
        """An entry took the last slot: more slots past the end (the last one empty again)."""
        self.tab.frombytes(bytes(16 * _PAD))

    def _resize(self, bits: int) -> None:
        old, used = self.tab, self.used
        self._alloc(bits)
        if self.native is not None:
            i, rehash = 0, self.native.rehash
            while (i := rehash(old, self.tab, self.sh, self.m, i)) < len(old):
                self._extend()  # that entry takes the last slot, after more slots are added
        else:
            self._rehash(old)
        self.used = used

    def _rehash(self, old: array) -> None:
        """The entries of ``old`` into the fresh slot array, in slot order (the C twin's reference)."""
        tab, sh, m = self.tab, self.sh, self.m
        last = len(tab) - 2
        hs = old[0::2]
        for h, k in zip(compress(hs, hs), compress(old[1::2], hs)):
            j = h * _MIX >> sh & m
            while tab[j]:
                j += 2
            tab[j] = h
            tab[j + 1] = k
            if j == last:
                self._extend()
                tab = self.tab
                last = len(tab) - 2

    def get(self, h: int) -> int | None:
        if h:
            tab = self.tab
            j = h * _MIX >> self.sh & self.m
            x = tab[j]
            while x:
                if x == h:
                    return tab[j + 1]
                j += 2
                x = tab[j]
        return self.side.get(h) if self.side else None

    def insert(self, h: int, key: int) -> bool:
        """Add ``h -> key`` (a key, not ORPHAN) unless ``h`` is held; True if added."""
        side = self.side
        if side and h in side:
            return False
        if not 0 < h <= _M64 or not 0 <= key <= _M64:  # hash 0, or not u64s (any int is accepted)
            side[h] = key
            return True
        tab = self.tab
        j = h * _MIX >> self.sh & self.m
        x = tab[j]
        while x:
            if x == h:
                return False
            j += 2
            x = tab[j]
        tab[j] = h
        tab[j + 1] = key
        if j == len(tab) - 2:
            self._extend()
        self.used += 1
        if self.used > self.limit:
            self._resize(_grown(self.bits))
        return True

    def put(self, h: int, key: int) -> None:
        """``h -> key`` (key or ORPHAN), replacing what ``h`` had (dict assignment)."""
        self.pop(h)
        self.insert(h, key)  # ORPHAN (-1) is not a u64: the side dict

    def _delete(self, j: int) -> None:
        """Empty slot pair ``j`` by backward shift: later entries of its run whose home is at or
        before the hole move in (no tombstones; kvindex._apply's ``shift_out`` is its twin)."""
        tab, sh, m = self.tab, self.sh, self.m
        i = j
        j += 2
        x = tab[j]
        while x:
            if x * _MIX >> sh & m <= i:
                tab[i] = x
                tab[i + 1] = tab[j + 1]
                i = j
            j += 2
            x = tab[j]
        tab[i] = 0

    def pop(self, h: int) -> int | None:
        """Remove ``h``; its key (or ORPHAN), None if absent."""
        if h:
            tab, sh, m = self.tab, self.sh, self.m
            j = h * _MIX >> sh & m
            x = tab[j]
            while x:
                if x == h:
                    key = tab[j + 1]
                    self._delete(j)
                    self.used -= 1
                    if self.used < self.size >> 3 and self.bits > _MIN_BITS:
                        self._resize(max(_MIN_BITS, (self.used * 3).bit_length()))
                    return key
                j += 2
                x = tab[j]
        side = self.side
        return side.pop(h, None) if side else None

    def keys_(self) -> Iterator[int]:
        """Every key held (ORPHAN excluded)."""
        tab = self.tab
        yield from compress(tab[1::2], tab[0::2])
        for k in self.side.values():
            if k != ORPHAN:
                yield k

    def items(self) -> Iterator[tuple[int, int]]:
        tab = self.tab
        hs = tab[0::2]
        yield from zip(compress(hs, hs), compress(tab[1::2], hs))
        yield from self.side.items()

    def copy(self) -> _Table:
        """A point-in-time copy: C-level copies of the slot array and the side dict."""
        new = _Table.__new__(_Table)
        new.tab, new.side, new.native = self.tab[:], self.side.copy(), self.native
        new.size, new.bits, new.sh, new.m, new.used, new.limit = self.size, self.bits, self.sh, self.m, self.used, self.limit
        return new

    def to_dict(self) -> dict[int, int]:
        tab = self.tab
        hs = tab[0::2]
        out = dict(zip(compress(hs, hs), compress(tab[1::2], hs)))
        out.update(self.side)
        return out


class _Worker:
    __slots__ = ("pod", "rank", "ident", "slot", "bit", "media", "extra", "orphans")

    def __init__(self, pod: str, rank: int, slot: int, native: ModuleType | None = _APPLY) -> None:
        self.pod, self.rank, self.slot, self.bit = pod, rank, slot, 1 << slot
        self.ident = (pod, rank)  # shared by every cached member list it is in
        self.media: dict[str, _Table] = {GPU: _Table(native=native)}
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


class PreciseIndex:
    """In-memory precise index. Not thread-safe; one event loop owns it.

    ``native``: the C loops (``kvindex._apply``, the default when built) or None for the Python
    ones; either gives the same state (tests/test_native_apply.py)."""

    def __init__(self, native: ModuleType | None = _APPLY) -> None:
        self._native = native
        self._workers: dict[tuple[str, int], _Worker] = {}
        self._slots: list[_Worker | None] = []
        self._holders: dict[str, dict[int, int]] = {t: {} for t in TIERS}
        self._dups: dict[tuple[str, int, int], int] = {}  # (tier, key, slot): holdings beyond the first
        self._block_size: dict[str, int] = {}
        self._masks: dict[int, int] = {}  # interned masks of several holders
        self._members: dict[int, list[tuple[str, int]]] = {}  # mask -> (pod, rank) per set bit

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
            w = _Worker(pod, dp_rank, slot, self._native)
            if slot == len(self._slots):
                self._slots.append(w)
            else:
                self._slots[slot] = w
            self._workers[(pod, dp_rank)] = w
            self._members.clear()
        return w

    def _intern(self, mask: int) -> int:
        """One shared int object per distinct holder set (masks repeat across many keys)."""
        masks = self._masks
        got = masks.get(mask)
        if got is None:
            if len(masks) >= _MASKS_CAP:
                masks.clear()
            masks[mask] = got = mask
        return got

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
        t = w.media.get(medium)
        if t is None:
            t = w.media[medium] = _Table(native=self._native)
        tier = tier_of(medium)
        hashes = ev.block_hashes
        nkeys = len(keys)
        if t.used + len(hashes) > t.limit:  # room for them all first: no resize mid-loop
            t._resize(max(_grown(t.bits), ((t.used + len(hashes)) * 3 // 2).bit_length()))
        if len(w.media) == 1 and nkeys == len(hashes):  # every block has its key: the common case
            if self._native is not None:
                orphans = self._store_keyed_c(w, medium, tier, t, hashes, keys)
            else:
                orphans = self._store_keyed(w, medium, tier, t, hashes, keys)
        else:
            orphans = 0
            for i, h in enumerate(hashes):
                orphans += self._store_one(w, medium, tier, t, h, keys[i] if i < nkeys else w.key_of(h))
        done.stored_events += 1
        done.stored += len(hashes)
        done.orphans += orphans
        done.block_size_mismatch += mismatch

    def _store_keyed(self, w: _Worker, medium: str, tier: str, t: _Table, hashes: Sequence[int],
                     keys: list[int]) -> int:
        """``_store_one`` of each (hash, key) with ``_Table.insert`` and ``_hold`` inlined for the
        simple cases (the reference of kvindex._apply.store); returns the orphans added."""
        holders, masks, bit = self._holders[tier], self._masks, w.bit
        tab, sh, m, side = t.tab, t.sh, t.m, t.side
        last = len(tab) - 2
        added = orphans = 0
        try:  # used stays right if a bad hash raises mid-loop
            for h, key in zip(hashes, keys):
                if h and (not side or h not in side):
                    j = h * _MIX >> sh & m  # _Table.insert
                    x = tab[j]
                    while x:
                        if x == h:
                            break
                        j += 2
                        x = tab[j]
                    else:
                        try:
                            tab[j] = h
                        except OverflowError:  # not a u64 (events should not carry one): the slow path
                            pass
                        else:
                            tab[j + 1] = key
                            added += 1
                            if j == last:
                                t._extend()
                                tab = t.tab
                                last = len(tab) - 2
                            mask = holders.get(key, 0)
                            if not mask:
                                holders[key] = bit  # a lone holder shares its bit object
                            elif not mask & bit:
                                mask |= bit
                                holders[key] = masks.get(mask) or self._intern(mask)
                            else:
                                self._hold(tier, key, w)  # counts the duplicate
                            continue
                t.used += added
                added = 0
                orphans += self._store_one(w, medium, tier, t, h, key)
                tab, sh, m, side = t.tab, t.sh, t.m, t.side
                last = len(tab) - 2
        finally:
            t.used += added
        return orphans

    def _store_keyed_c(self, w: _Worker, medium: str, tier: str, t: _Table, hashes: Sequence[int],
                       keys: list[int]) -> int:
        """``_store_keyed`` in C: each element C leaves goes through ``_store_one``."""
        store, holders, masks, bit, n = self._native.store, self._holders[tier], self._masks, w.bit, len(hashes)  # type: ignore[union-attr]
        i = orphans = 0
        while (i := store(t, holders, masks, bit, hashes, keys, i, _MASKS_CAP)) < n:
            orphans += self._store_one(w, medium, tier, t, hashes[i], keys[i])
            i += 1
        return orphans

    def _store_one(self, w: _Worker, medium: str, tier: str, blocks: _Table, h: int, key: int | None) -> int:
        """One stored copy, any case (repeat copies, orphans, other media); returns 1 if keyless."""
        old = blocks.get(h)
        if old is None:
            blocks.put(h, ORPHAN if key is None else key)
            w.orphans += key is None
            if key is not None and len(w.media) > 1:
                self._adopt_elsewhere(w, h, key)
        else:
            copies = w.extra[(medium, h)] = w.extra.get((medium, h), 0) + 1
            if old == ORPHAN and key is not None:  # a keyless hash learns its key:
                blocks.put(h, key)  # index the copies it already had
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
            if blocks.side.get(h) == ORPHAN:  # keyless entries live in the side dict
                blocks.put(h, key)
                w.orphans -= 1
                for _ in range(1 + w.extra.get((medium, h), 0)):
                    self._hold(tier_of(medium), key, w)

    def _remove(self, w: _Worker, ev: BlockRemoved, done: Applied) -> None:
        medium, hashes = ev.medium, ev.block_hashes
        blocks = w.media.get(medium)
        if blocks is None:
            removed, unknown = 0, len(hashes)
        else:
            inline = not blocks.side  # no hash 0 nor keyless entries (and removals never add any)
            if inline and self._native is not None:
                removed, unknown, gone = self._remove_c(w, medium, blocks, hashes)
            else:
                removed, unknown, gone = self._remove_run(w, medium, blocks, hashes, inline)
            if gone and blocks.used < blocks.size >> 3 and blocks.bits > _MIN_BITS:
                blocks._resize(max(_MIN_BITS, (blocks.used * 3).bit_length()))  # once, after the loop
        done.removed_events += 1
        done.removed += removed
        done.unknown_removals += unknown

    def _remove_run(self, w: _Worker, medium: str, blocks: _Table, hashes: Sequence[int],
                    inline: bool) -> tuple[int, int, int]:
        """Remove one copy of each hash: (removed, unknown, gone). With ``inline``, ``_Table.pop``
        inlined (its probe, then ``_delete``) minus its shrinking (the caller's, once per event);
        ``gone`` counts its deletions, subtracted from ``used`` here (the reference of
        kvindex._apply.remove)."""
        removed = unknown = gone = 0
        tier = tier_of(medium)
        holders, masks, dups, extra, keep = self._holders[tier], self._masks, self._dups, w.extra, ~w.bit
        pop, tab, sh, m = blocks.pop, blocks.tab, blocks.sh, blocks.m
        try:  # used stays right if a bad hash raises mid-loop
            for h in hashes:
                if extra and (medium, h) in extra:  # a copy goes, the hash stays
                    key = blocks.get(h)
                    c = extra[(medium, h)]
                    if c == 1:
                        del extra[(medium, h)]
                    else:
                        extra[(medium, h)] = c - 1
                elif inline:  # _Table.pop, inlined
                    j = h * _MIX >> sh & m
                    x = tab[j]
                    while x:
                        if x == h:
                            break
                        j += 2
                        x = tab[j]
                    else:
                        unknown += 1
                        continue
                    key = tab[j + 1]
                    blocks._delete(j)
                    gone += 1
                else:
                    key = pop(h)
                    tab, sh, m = blocks.tab, blocks.sh, blocks.m  # pop may have resized the table
                    if key is None:
                        unknown += 1
                        continue
                    if key == ORPHAN:  # its last copy went
                        w.orphans -= 1
                removed += 1
                if key == ORPHAN:
                    pass
                elif dups:
                    self._release(tier, key, w)
                else:  # _release, inlined
                    mask = holders.get(key, 0) & keep
                    if mask:
                        holders[key] = masks.get(mask) or self._intern(mask)
                    else:
                        holders.pop(key, None)
        finally:
            blocks.used -= gone
        return removed, unknown, gone

    def _remove_c(self, w: _Worker, medium: str, blocks: _Table, hashes: Sequence[int]) -> tuple[int, int, int]:
        """``_remove_run(..., inline=True)`` in C: each element C leaves goes through the Python loop."""
        tier = tier_of(medium)
        remove, n = self._native.remove, len(hashes)  # type: ignore[union-attr]
        args = (blocks, self._holders[tier], self._masks, ~w.bit, self._dups, w.extra, medium, tier, w.slot)
        removed = unknown = gone = i = 0
        while True:
            i, g, u = remove(*args, hashes, i, _MASKS_CAP)
            removed, unknown, gone = removed + g, unknown + u, gone + g
            if i >= n:
                return removed, unknown, gone
            r, u, g = self._remove_run(w, medium, blocks, hashes[i : i + 1], True)
            removed, unknown, gone = removed + r, unknown + u, gone + g
            i += 1

    def _hold(self, tier: str, key: int, w: _Worker) -> None:
        holders = self._holders[tier]
        mask = holders.get(key, 0)
        if mask & w.bit:
            d = (tier, key, w.slot)
            self._dups[d] = self._dups.get(d, 0) + 1
        else:
            holders[key] = self._intern(mask | w.bit) if mask else w.bit  # a lone holder shares its bit

    def _release(self, tier: str, key: int, w: _Worker) -> None:
        dups = self._dups
        if dups:
            d = (tier, key, w.slot)
            n = dups.get(d)
            if n:
                if n == 1:
                    del dups[d]
                else:
                    dups[d] = n - 1
                return
        holders = self._holders[tier]
        mask = holders.get(key, 0) & ~w.bit
        if mask:
            holders[key] = self._intern(mask)
        else:
            holders.pop(key, None)

    # -- pods ----------------------------------------------------------------------------------
    def clear_pod(self, pod: str, dp_rank: int | None = None) -> None:
        """Forget every block of ``pod`` (all ranks, or one) — AllBlocksCleared, restart, removal."""
        for wid in [wid for wid in self._workers if wid[0] == pod and dp_rank in (None, wid[1])]:
            w = self._workers.pop(wid)
            keep = ~w.bit
            for medium, blocks in w.media.items():
                holders = self._holders[tier_of(medium)]
                for key in blocks.keys_():
                    mask = holders.get(key, 0) & keep
                    if mask:
                        holders[key] = self._intern(mask)
                    else:
                        holders.pop(key, None)
            if self._dups:
                for d in [d for d in self._dups if d[2] == w.slot]:
                    del self._dups[d]
            self._slots[w.slot] = None
            self._members.clear()

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

    def frozen_copy(self) -> list[tuple[str, int, str, _Table, dict[tuple[str, int], int]]]:
        """A point-in-time copy of every worker's maps: copies of the packed tables (memcpy, no
        object per entry), fast enough for the event loop; ``entries_of`` turns it into entries
        anywhere (e.g. in a thread). Each table behaves like a read-only ``hash -> key`` mapping."""
        return [(w.pod, w.rank, medium, blocks.copy(), w.extra.copy())
                for w in self._workers.values() for medium, blocks in w.media.items()]

    def load_entries(self, entries: Iterable[Entry]) -> int:
        """Add exported entries (to an index that does not hold them yet); returns how many."""
        n = 0
        for e in entries:
            w = self._worker(e.pod, e.dp_rank)
            blocks = w.media.get(e.medium)
            if blocks is None:
                blocks = w.media[e.medium] = _Table(native=self._native)
            blocks.put(e.hash, ORPHAN if e.key is None else e.key)
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
        gpu = _WALK.walk(keys, self._holders["gpu"], allowed) if _WALK else _walk(keys, self._holders["gpu"], None, allowed)
        if not self._holders["cpu"] and not self._holders["disk"]:
            return self._per_pod_gpu(gpu)
        cpu = _walk(keys, self._holders["gpu"], [self._holders["cpu"]], allowed)
        disk = _walk(keys, self._holders["gpu"], [self._holders["cpu"], self._holders["disk"]], allowed)
        return self._per_pod(_depths(gpu), _depths(cpu), _depths(disk))

    def _mask_of(self, pods: Iterable[str]) -> int:
        wanted = set(pods)
        mask = 0
        for (pod, _), w in self._workers.items():
            if pod in wanted:
                mask |= w.bit
        return mask

    def _members_of(self, mask: int) -> list[tuple[str, int]]:
        """(pod, rank) of each set bit of ``mask``, lowest slot first (cached)."""
        got = self._members.get(mask)
        if got is None:
            slots = self._slots
            got = [w.ident for w in map(slots.__getitem__, _bits(mask))]  # type: ignore[union-attr]
            if len(self._members) >= _MEMBERS_CAP:
                self._members.clear()
            self._members[mask] = got
        return got

    def _per_pod_gpu(self, groups: list[tuple[int, int]]) -> dict[str, PodMatch]:
        """Groups come deepest first, so a pod's first worker seen has its deepest match."""
        out: dict[str, PodMatch] = {}
        members, new, get = self._members_of, _tuple_new, out.get
        for g, mask in groups:
            for pod, rank in members(mask):
                prev = get(pod)
                if prev is None:
                    out[pod] = new(PodMatch, (g, g, g, {rank: g}))  # PodMatch(...) minus its Python __new__
                else:
                    prev.dp[rank] = g
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


def entries_of(copy: list[tuple[str, int, str, _Table, dict[tuple[str, int], int]]]) -> Iterator[Entry]:
    for pod, rank, medium, blocks, extra in copy:
        for h, key in blocks.items():
            yield Entry(pod, rank, medium, h, None if key == ORPHAN else key, 1 + extra.get((medium, h), 0))


def _walk(keys: Sequence[int], gpu: dict[int, int], others: list[dict[int, int]] | None,
          allowed: int) -> list[tuple[int, int]]:
    """(depth, mask of the worker slots whose longest held prefix is that deep), deepest first,
    for depths ≥ 1.

    ``acc[i]`` is the mask of slots holding the first i keys: one C-level pass. Each step only
    clears bits, so ``acc`` is non-increasing as integers and the places where it changes are
    found by bisection: the Python work is O(distinct depths × log n), not O(n)."""
    if others:
        masks: Iterable[int] = [_union(k, gpu, others) for k in keys]
    else:
        masks = map(gpu.get, keys, repeat(0))
    acc = list(takewhile(bool, accumulate(masks, and_, initial=allowed)))  # stops when nobody is left
    groups: list[tuple[int, int]] = []
    hi, seen = len(acc), 0
    while hi > 1:
        value = acc[hi - 1]
        groups.append((hi - 1, value & ~seen))
        seen = value
        hi = bisect_left(acc, -value, 0, hi, key=neg)
    return groups


def _depths(groups: list[tuple[int, int]]) -> dict[int, int]:
    """Slot -> depth, deepest first."""
    return {slot: d for d, mask in groups for slot in _bits(mask)}


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
