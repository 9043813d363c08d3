"""``Table``: one worker's ``engine hash -> key`` map for one medium, packed (no object per entry);
``Worker``: one worker's tables, copies and slot.

Job: the storage under ``kvindex.index.precise.PreciseIndex``. It behaves like the dict it
replaces (``get`` / ``insert`` / ``put`` / ``pop`` / ``items``); it knows nothing of holders,
copies or tiers (those rules live in ``PreciseIndex``; ``kvindex.index.reference`` states them).

Invariants:
- Keyed entries with a hash in (0, 2^64) and a key in [0, 2^64) live in ``tab``, an
  ``array("Q")`` of (hash, key) slot pairs; slot hash 0 means empty. Everything else (hash 0,
  ``ORPHAN`` keys, ints outside u64) lives in the ``side`` dict. A hash is in exactly one place.
- Home slot: the top ``bits`` bits of ``hash * MIX`` mod 2^64 (Fibonacci hashing; sequential and
  strided hashes spread, where ``hash % size`` piles runs of them into long clusters). As a slot
  pair index: ``hash * MIX >> sh & m``, with ``sh = 63 - bits`` and ``m = 2 * size - 2``.
- Linear probing that never wraps around: a run continues into spare slots past ``size`` and the
  array's last slot is always empty, so every probe ends inside the array (``extend`` adds
  ``PAD`` slots when an entry takes the last one). Backward-shift deletion, no tombstones.
- ``used`` is the number of entries in ``tab``; grown past ``limit`` (2/3 load: x4 below 4096
  slots, then x2), shrunk below 1/8 load (``shrink``, called by ``pop``; ``take`` leaves it to
  the caller, once per batch of removals).
- 16 bytes per slot, about 25-50 bytes per entry (a dict entry with two fresh ints: ~130).

The C contract (``kvindex/_apply.c`` reads and writes these attributes by name): ``tab`` (the
``array("Q")``), ``sh`` and ``m`` (the home slot formula above), ``side`` (must be an exact dict;
C hands back every hash found there) and ``used`` (C adds what it inserts and subtracts what it
deletes). C never takes the last slot (it hands that entry back so Python ``extend``s) and never
resizes. ``kvindex._apply.rehash(old, new, sh, m, start)`` is ``rehash``'s twin, used by ``resize``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from itertools import compress
from types import ModuleType

from kvindex import native as _native
from kvindex.events import GPU

ORPHAN = -1  # the key of a keyless entry (not a u64: always in the side dict)
MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: Fibonacci hashing
M64 = (1 << 64) - 1
MIN_BITS = 3
PAD = 16  # slots past a table's size (probes run on into them), added PAD at a time
APPLY = _native.load("kvindex._apply")  # the C loops (kvindex/_apply.c), or None: the Python ones


def grown(bits: int) -> int:
    """A full table's next size: x4 while small (fewer rebuilds while a worker fills), then x2."""
    return bits + 2 if bits < 12 else bits + 1


class Table:
    """``engine hash -> key`` of one worker and medium. ``native``: kvindex._apply or None."""

    __slots__ = ("tab", "size", "bits", "sh", "m", "used", "limit", "side", "native")

    def __init__(self, bits: int = MIN_BITS, native: ModuleType | None = APPLY) -> None:
        self.side: dict[int, int] = {}
        self.native = native
        self._alloc(bits)

    def _alloc(self, bits: int) -> None:
        size = 1 << bits
        self.tab = array("Q", bytes(16 * (size + PAD)))
        self.size, self.bits, self.used, self.limit = size, bits, 0, size * 2 // 3
        self.sh, self.m = 63 - bits, 2 * size - 2

    def __len__(self) -> int:
        return self.used + len(self.side)

    # -- layout --------------------------------------------------------------------------------
    def extend(self) -> None:
        """An entry took the last slot: PAD more slots past the end (the last one empty again)."""
        self.tab.frombytes(bytes(16 * PAD))

    def resize(self, bits: int) -> None:
        """Rebuild with 2^bits home slots (C rehash when built, else ``rehash``)."""
        old, used = self.tab, self.used
        self._alloc(bits)
        if self.native is not None:
            i, rehash = 0, self.native.rehash
            while (i := rehash(old, self.tab, self.sh, self.m, i)) < len(old):
                self.extend()  # that entry takes the last slot, after more slots are added
        else:
            self.rehash(old)
        self.used = used

    def rehash(self, old: array) -> None:
        """The entries of ``old`` into the fresh slot array, in slot order (the C twin's reference)."""
        tab, sh, m = self.tab, self.sh, self.m
        last = len(tab) - 2
        hs = old[0::2]
        for h, k in zip(compress(hs, hs), compress(old[1::2], hs)):
            j = h * MIX >> sh & m
            while tab[j]:
                j += 2
            tab[j] = h
            tab[j + 1] = k
            if j == last:
                self.extend()
                tab = self.tab
                last = len(tab) - 2

    def reserve(self, n: int) -> None:
        """Room for ``n`` more entries now, so that no insert of a batch resizes mid-loop."""
        if self.used + n > self.limit:
            self.resize(max(grown(self.bits), ((self.used + n) * 3 // 2).bit_length()))

    def shrink(self) -> None:
        """Below 1/8 load: rebuild smaller (after removals)."""
        if self.used < self.size >> 3 and self.bits > MIN_BITS:
            self.resize(max(MIN_BITS, (self.used * 3).bit_length()))

    # -- the dict ------------------------------------------------------------------------------
    def get(self, h: int) -> int | None:
        if h:
            tab = self.tab
            j = h * MIX >> self.sh & self.m
            x = tab[j]
            while x:
                if x == h:
                    return tab[j + 1]
                j += 2
                x = tab[j]
        return self.side.get(h) if self.side else None

    def insert(self, h: int, key: int) -> bool:
        """Add ``h -> key`` (a key or ORPHAN) unless ``h`` is held; True if added."""
        side = self.side
        if side and h in side:
            return False
        if not 0 < h <= M64 or not 0 <= key <= M64:  # hash 0, ORPHAN, or not u64s (any int is accepted)
            side[h] = key
            return True
        tab = self.tab
        j = h * MIX >> self.sh & self.m
        x = tab[j]
        while x:
            if x == h:
                return False
            j += 2
            x = tab[j]
        tab[j] = h
        tab[j + 1] = key
        if j == len(tab) - 2:
            self.extend()
        self.used += 1
        if self.used > self.limit:
            self.resize(grown(self.bits))
        return True

    def put(self, h: int, key: int) -> None:
        """``h -> key`` (key or ORPHAN), replacing what ``h`` had (dict assignment; no shrinking)."""
        self.take(h)
        self.insert(h, key)

    def take(self, h: int) -> int | None:
        """Remove ``h`` without shrinking; its key (or ORPHAN), None if absent."""
        if h:
            tab = self.tab
            j = h * MIX >> self.sh & self.m
            x = tab[j]
            while x:
                if x == h:
                    key = tab[j + 1]
                    self._delete(j)
                    self.used -= 1
                    return key
                j += 2
                x = tab[j]
        side = self.side
        return side.pop(h, None) if side else None

    def pop(self, h: int) -> int | None:
        """Remove ``h`` (shrinking when sparse); its key (or ORPHAN), None if absent."""
        key = self.take(h)
        if key is not None:
            self.shrink()
        return key

    def _delete(self, j: int) -> None:
        """Empty slot pair ``j`` by backward shift: later entries of its run whose home is at or
        before the hole move in (kvindex._apply's ``shift_out`` is its twin)."""
        tab, sh, m = self.tab, self.sh, self.m
        i = j
        j += 2
        x = tab[j]
        while x:
            if x * MIX >> sh & m <= i:
                tab[i] = x
                tab[i + 1] = tab[j + 1]
                i = j
            j += 2
            x = tab[j]
        tab[i] = 0

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

    def copy(self) -> Table:
        """A point-in-time copy: C-level copies of the slot array and the side dict."""
        new = Table.__new__(Table)
        new.tab, new.side, new.native = self.tab[:], self.side.copy(), self.native
        new.size, new.bits, new.sh, new.m, new.used, new.limit = self.size, self.bits, self.sh, self.m, self.used, self.limit
        return new

    def to_dict(self) -> dict[int, int]:
        return dict(self.items())


class Worker:
    """One (pod, dp_rank): a Table per medium (GPU first, then in first-store order), the copies
    of each hash beyond its first (``extra``), its keyless hashes (``orphans``) and its slot bit."""

    __slots__ = ("pod", "rank", "ident", "slot", "bit", "media", "extra", "orphans")

    def __init__(self, pod: str, rank: int, slot: int, native: ModuleType | None = APPLY) -> None:
        self.pod, self.rank, self.slot, self.bit = pod, rank, slot, 1 << slot
        self.ident = (pod, rank)  # shared by every cached member list it is in
        self.media: dict[str, Table] = {GPU: Table(native=native)}
        self.extra: dict[tuple[str, int], int] = {}
        self.orphans = 0

    def empty(self) -> bool:
        return not self.extra and not any(self.media.values())

    def key_of(self, h: int) -> int | None:
        """The key of engine hash ``h``: its GPU entry's if it has one, else the first medium's
        that holds it; None if unknown or keyless."""
        key = self.media[GPU].get(h)
        if key is None:
            for blocks in self.media.values():
                key = blocks.get(h)
                if key is not None:
                    break
        return None if key is None or key == ORPHAN else key
