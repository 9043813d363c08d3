"""The fast precise index: exactly which blocks each engine replica holds, from its KV events.

Job: ``PreciseIndex`` applies engine batches and answers prefix matches, fast and compact. Its
rules (how a store or a removal changes the index, copies, orphans, tiers, AllBlocksCleared) are
those of ``kvindex.index.reference.ReferenceIndex``, the readable oracle; tests hold the two equal
(tests/test_native_apply.py, tests/test_precise_index.py, tests/test_store_contract.py); never sees bytes.

Invariants of the layout:
- A *worker* is one (pod, dp_rank) and owns one bit (its slot). Per worker and medium a
  ``Table`` (kvindex.index.table) maps ``engine hash -> key`` (``ORPHAN`` when keyless); copies
  beyond the first of a hash are counted in the worker's ``extra``.
- The inverted view (``Holders``, kvindex.index.holders): per tier, key -> bitmask of the worker
  slots holding it, so a lookup is one dict probe and a few integer operations per prompt block,
  whatever the number of pods. ``_members`` caches mask -> [(pod, rank)] for match; it is
  dropped whenever a slot changes owner.
- An empty worker is freed at the end of the batch that emptied it (its slot is reused).

One rule, one fast path: each stored copy goes through ``_store_one``, each removed one through
``_remove_one``, on ``Table``'s own methods. With ``kvindex._apply`` built (the default;
``native=None`` or ``KVINDEX_PURE_PYTHON=1``: the Python alone) its C loops take the common case (one
medium, every block keyed, no re-announcement; removals from a table without a side dict) on these
objects and hand back each element they cannot take simply, which ``_store_one``/``_remove_one``
apply: the state is the Python's, byte for byte. Matches walk the masks (kvindex.index.walk).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from operator import itemgetter
from types import ModuleType

from kvindex import keys as K
from kvindex.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvindex.index import holders as H
from kvindex.index import walk
from kvindex.index.entries import Where, runs_by_table, table_sizes
from kvindex.index.lineage import Lineage
from kvindex.index.protocol import tier_of
from kvindex.index.table import APPLY, ORPHAN, Table, Worker
from kvindex.types import TIERS, Applied, Entry, EntryRow, PodMatch

_MEMBERS_CAP = 1 << 10  # cached member lists (of shared (pod, rank) tuples)
_HASH_OF, _KEY_OF, _COPIES_OF = itemgetter(3), itemgetter(4), itemgetter(5)


class PreciseIndex:
    """In-memory precise index. Not thread-safe; one event loop owns it.

    ``native``: the C loops (``kvindex._apply``, the default when built) or None for the Python
    ones; either gives the same state (tests/test_native_apply.py)."""

    def __init__(self, native: ModuleType | None = APPLY, *, lineage: bool = False) -> None:
        self._native = native
        self._workers: dict[tuple[str, int], Worker] = {}
        self._slots: list[Worker | None] = []
        self._inv = H.Holders(TIERS)  # the inverted view: tier -> key -> mask of the slots holding it
        self._block_size: dict[str, int] = {}
        self._model_of: dict[tuple[str, int], str] = {}  # worker -> the model it last stored blocks of
        self._loaded_with: dict[tuple[str, int], dict[str, int]] = {}  # loaded worker, model not known yet -> sizes
        self._members: dict[int, list[tuple[str, int]]] = {}  # mask -> (pod, rank) per set bit
        self.lineage = Lineage(lambda: self._inv.tiers.values()) if lineage else None  # Dynamo's /dump: costs time
        self._record = self.lineage.add if self.lineage is not None else None

    # -- configuration (block sizes follow the engines' lives: reference.py) --------------------
    def set_block_size(self, model: str, block_size: int) -> int:
        if model not in self._block_size or not self._held(model):  # no size: nothing held (tier copies)
            self._block_size[model] = block_size
        return self._block_size[model]

    def _held(self, model: str) -> bool:
        """Whether a worker holds blocks of ``model`` keyed with its size in force."""
        bs, of, loaded = self._block_size.get(model), self._model_of, self._loaded_with
        return any(not w.empty() and (of[wid] == model if wid in of else bs is not None and loaded.get(wid, {}).get(model) == bs)
                   for wid, w in self._workers.items())

    def block_size(self, model: str) -> int | None:
        return self._block_size.get(model)

    def block_sizes(self) -> dict[str, int]:
        return dict(self._block_size)

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

    def _worker(self, pod: str, dp_rank: int) -> Worker:
        w = self._workers.get((pod, dp_rank))
        if w is None:
            slot = next((i for i, s in enumerate(self._slots) if s is None), len(self._slots))
            w = Worker(pod, dp_rank, slot, self._native)
            if slot == len(self._slots):
                self._slots.append(w)
            else:
                self._slots[slot] = w
            self._workers[(pod, dp_rank)] = w
            self._members.clear()
        return w

    def _event_keys(self, w: Worker, model: str, ev: BlockStored) -> tuple[list[int], bool]:
        """Keys for the event's blocks (shorter than its hashes where tokens run out; none on a lower tier)."""
        bs, size, device = ev.block_size, self._block_size.get(model), ev.medium == GPU
        if device and size != bs and (size is None or not self._held(model)):
            self._block_size[model] = bs  # nobody holds the old size (or none): follow the engine
        self._model_of[w.ident] = model  # after the check: the store does not make its worker a holder
        self._loaded_with.pop(w.ident, None)
        if not device:
            return [], False  # a tier store: each hash takes the worker's key for it (reference.py)
        if self._block_size[model] != bs:
            return [], True
        parent = K.root_key(model, ev.lora_name, ev.cache_salt) if ev.parent_hash is None else w.key_of(ev.parent_hash)
        if parent is None:
            return [], False
        return K.recorded_keys(parent, ev.token_ids, bs, len(ev.block_hashes), self._record), False

    def _store(self, w: Worker, model: str, ev: BlockStored, done: Applied) -> None:
        keys, mismatch = self._event_keys(w, model, ev)
        medium, hashes, nkeys, tier = ev.medium, ev.block_hashes, len(keys), tier_of(ev.medium)
        t = w.media.get(medium)
        if t is None:
            t = w.media[medium] = Table(native=self._native)
        if t.used + len(hashes) > t.limit:
            t.reserve(len(hashes))  # room for them all first: no resize mid-loop
        again = ev.parent_hash is None and medium == GPU and None not in map(t.get, hashes)  # re-announced (GPU only)
        if self._native is not None and len(w.media) == 1 and nkeys == len(hashes) and not again:
            orphans = self._store_c(w, medium, tier, t, hashes, keys)  # the common case
        else:
            orphans = sum([self._store_one(w, medium, tier, t, h, keys[i] if i < nkeys else w.key_of(h), not again)
                           for i, h in enumerate(hashes)])
        done.stored_events += 1
        done.stored += 0 if again else len(hashes)
        done.reannounced += len(hashes) if again else 0
        done.orphans += orphans
        done.tier_unkeyed += orphans if medium != GPU else 0
        done.block_size_mismatch += mismatch

    def _store_c(self, w: Worker, medium: str, tier: str, t: Table, hashes: Sequence[int], keys: list[int]) -> int:
        """The store loop in C (new hashes, keys this worker does not hold yet in ``tier``); each
        element C leaves goes through ``_store_one``. Returns the orphans added."""
        store, holders, masks, bit, n = self._native.store, self._inv.tiers[tier], self._inv.masks, w.bit, len(hashes)  # type: ignore[union-attr]
        i = orphans = 0
        while (i := store(t, holders, masks, bit, hashes, keys, i, H.MASKS_CAP)) < n:
            orphans += self._store_one(w, medium, tier, t, hashes[i], keys[i])
            i += 1
        return orphans

    def _store_one(self, w: Worker, medium: str, tier: str, blocks: Table, h: int, key: int | None, copy: int = 1) -> int:
        """One stored copy of ``h``, any case (``copy`` 0: a re-announced hash); 1 if it is keyless."""
        if blocks.insert(h, ORPHAN if key is None else key):  # a new hash
            if key is None:
                w.orphans += 1
                return 1
            if len(w.media) > 1:
                self._adopt_elsewhere(w, h, key)
        else:  # one more copy (or none) of a held hash
            old = blocks.get(h)
            if copies := w.extra.get((medium, h), 0) + copy:
                w.extra[(medium, h)] = copies
            if old == ORPHAN and key is not None:  # a keyless hash learns its key:
                blocks.put(h, key)
                w.orphans -= 1
                for _ in range(copies):  # index the copies it already had (the last one below)
                    self._inv.hold(tier, key, w.bit, w.slot)
            elif old == ORPHAN:
                return 1
            elif not copy:
                return 0
            else:
                key = old  # a hash keeps the key it was first stored with
        self._inv.hold(tier, key, w.bit, w.slot)  # type: ignore[arg-type]
        return 0

    def _adopt_elsewhere(self, w: Worker, h: int, key: int) -> None:
        """Keyless copies of ``h`` in other media (offload events carry no tokens) get its key."""
        for medium, blocks in w.media.items():
            if blocks.side.get(h) == ORPHAN:  # keyless entries live in the side dict
                blocks.put(h, key)
                w.orphans -= 1
                for _ in range(1 + w.extra.get((medium, h), 0)):
                    self._inv.hold(tier_of(medium), key, w.bit, w.slot)

    def _remove(self, w: Worker, ev: BlockRemoved, done: Applied) -> None:
        medium, hashes = ev.medium, ev.block_hashes
        blocks = w.media.get(medium)
        if blocks is None:
            removed, unknown = 0, len(hashes)
        else:
            tier, before = tier_of(medium), blocks.used
            if self._native is not None and not blocks.side:  # removals never add side entries
                removed = self._remove_c(w, medium, tier, blocks, hashes)
            else:
                removed = sum([self._remove_one(w, medium, tier, blocks, h) for h in hashes])
            unknown = len(hashes) - removed
            if blocks.used < before and blocks.used < blocks.size >> 3:
                blocks.shrink()  # once, after the loop, if it deleted any
        done.removed_events += 1
        done.removed += removed
        done.unknown_removals += unknown

    def _remove_c(self, w: Worker, medium: str, tier: str, blocks: Table, hashes: Sequence[int]) -> int:
        """The removal loop in C (sole copies, no duplicate holdings); each element C leaves goes
        through ``_remove_one``. Returns the copies removed."""
        remove, n = self._native.remove, len(hashes)  # type: ignore[union-attr]
        inv = self._inv
        args = (blocks, inv.tiers[tier], inv.masks, ~w.bit, inv.dups, w.extra, medium, tier, w.slot)
        removed = i = 0
        while True:
            i, gone, _unknown = remove(*args, hashes, i, H.MASKS_CAP)
            removed += gone
            if i >= n:
                return removed
            removed += self._remove_one(w, medium, tier, blocks, hashes[i])
            i += 1

    def _remove_one(self, w: Worker, medium: str, tier: str, blocks: Table, h: int) -> int:
        """One removed copy of ``h``: 1, or 0 if the worker does not hold ``h`` in ``medium``."""
        extra = w.extra
        if extra and (medium, h) in extra:  # a copy goes, the hash stays
            key = blocks.get(h)
            c = extra[(medium, h)]
            if c == 1:
                del extra[(medium, h)]
            else:
                extra[(medium, h)] = c - 1
        else:
            key = blocks.take(h)
            if key is None:
                return 0
            if key == ORPHAN:  # its last copy went
                w.orphans -= 1
        if key != ORPHAN:
            self._inv.release(tier, key, w.bit, w.slot)  # type: ignore[arg-type]
        return 1

    # -- pods ----------------------------------------------------------------------------------
    def clear_pod(self, pod: str, dp_rank: int | None = None) -> None:
        """Forget every block of ``pod`` (all ranks, or one) — AllBlocksCleared, restart, removal."""
        for wid in [wid for wid in self._workers if wid[0] == pod and dp_rank in (None, wid[1])]:
            w = self._workers.pop(wid)
            self._model_of.pop(wid, None)
            self._loaded_with.pop(wid, None)
            self._inv.forget(w.bit, w.slot, [(tier_of(m), blocks.keys_()) for m, blocks in w.media.items()])
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
    def export_entries(self) -> Iterator[Entry]:
        """Every held engine hash: (pod, dp_rank, medium, hash, key or None, copies)."""
        return entries_of(self.frozen_copy())

    def frozen_copy(self) -> list[tuple[str, int, str, Table, dict[tuple[str, int], int]]]:
        """A point-in-time copy of every worker's maps: copies of the packed tables (memcpy, no
        object per entry), fast enough for the event loop; ``entries_of`` turns it into entries
        anywhere (e.g. in a thread). Each table behaves like a read-only ``hash -> key`` mapping."""
        return [(w.pod, w.rank, medium, blocks.copy(), w.extra.copy())
                for w in self._workers.values() for medium, blocks in w.media.items()]

    def load_entries(self, entries: Iterable[EntryRow], sizes: dict[str, int] | None = None) -> int:
        """Add exported entries (to an index that does not hold them yet); returns how many.
        ``sizes``: the block sizes their keys were made with (default: those in force; reference.py).
        Linear: each table is sized for all its entries first (an export comes in slot order: into
        a growing table they would pile up in one probe run), keyed single copies go through C."""
        rows = entries if isinstance(entries, list) else list(entries)
        made_with = dict(self._block_size if sizes is None else sizes)
        for where, parts in runs_by_table(rows).items():
            if where[:2] not in self._model_of:
                self._loaded_with.setdefault(where[:2], made_with)
            w, blocks = self._table(*where)
            blocks.reserve(sum(map(len, parts)))
            for part in parts:
                self._load_run(w, where[2], blocks, part)
        return len(rows)

    def reserve_entries(self, entries: Iterable[EntryRow]) -> None:
        """Size each table for the entries that later ``load_entries`` calls (of parts of
        ``entries``) will add to it, so that loading in parts is linear too."""
        self.reserve_tables(table_sizes(entries))

    def reserve_tables(self, sizes: Mapping[Where, int]) -> None:
        """Room in each (pod, dp_rank, medium) table for that many more entries."""
        for where, n in sizes.items():
            self._table(*where)[1].reserve(n)

    def _table(self, pod: str, rank: int, medium: str) -> tuple[Worker, Table]:
        w = self._worker(pod, rank)
        blocks = w.media.get(medium)
        if blocks is None:
            blocks = w.media[medium] = Table(native=self._native)
        return w, blocks

    def _load_run(self, w: Worker, medium: str, blocks: Table, run: list[EntryRow]) -> None:
        tier, i, n = tier_of(medium), 0, len(run)
        if self._native is not None:  # a copy of each (keyed) entry in C; the rest below
            store, holders, masks = self._native.store, self._inv.tiers[tier], self._inv.masks
            hashes, keys = list(map(_HASH_OF, run)), list(map(_KEY_OF, run))
            left: set[int] = set()  # the entries C left to Python (loaded whole below)
            while (i := store(blocks, holders, masks, w.bit, hashes, keys, i, H.MASKS_CAP)) < n:
                self._load_one(w, medium, tier, blocks, run[i], 0)
                left.add(i)
                i += 1
            copies = list(map(_COPIES_OF, run))
            if copies.count(1) != n:  # entries with more copies than the one C stored
                for j, c in enumerate(copies):
                    if c != 1 and j not in left:
                        self._load_one(w, medium, tier, blocks, run[j], 1)
            return
        for e in run:
            self._load_one(w, medium, tier, blocks, e, 0)

    def _load_one(self, w: Worker, medium: str, tier: str, blocks: Table, e: EntryRow, stored: int) -> None:
        """Entry ``e``, of which ``stored`` copies are in already (C stored its first one)."""
        h, key, copies = e[3], e[4], e[5]
        if not stored:
            blocks.put(h, ORPHAN if key is None else key)
            if key is None:
                w.orphans += 1
        if copies > 1:
            w.extra[(medium, h)] = copies - 1
        if key is not None:
            for _ in range(copies - stored):
                self._inv.hold(tier, key, w.bit, w.slot)

    # -- queries -------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], pods: Iterable[str] | None = None) -> dict[str, PodMatch]:
        """Longest prefix of ``keys`` held by each pod (only pods with a match ≥ 1 are listed)."""
        allowed = (1 << len(self._slots)) - 1 if pods is None else self._mask_of(pods)
        if not allowed:
            return {}
        return walk.match(keys, self._inv.tiers, allowed, self._members_of, self._slots)

    def _mask_of(self, pods: Iterable[str]) -> int:
        wanted = set(pods)  # each worker has its own bit: their sum is their union
        return sum(w.bit for (pod, _), w in self._workers.items() if pod in wanted)

    def _members_of(self, mask: int) -> list[tuple[str, int]]:
        """(pod, rank) of each set bit of ``mask``, lowest slot first (cached)."""
        got = self._members.get(mask)
        if got is None:
            slots = self._slots
            got = [w.ident for w in map(slots.__getitem__, walk.bits(mask))]  # type: ignore[union-attr]
            if len(self._members) >= _MEMBERS_CAP:
                self._members.clear()
            self._members[mask] = got
        return got


def entries_of(copy: list[tuple[str, int, str, Table, dict[tuple[str, int], int]]]) -> Iterator[Entry]:
    for pod, rank, medium, blocks, extra in copy:
        for h, key in blocks.items():
            yield Entry(pod, rank, medium, h, None if key == ORPHAN else key, 1 + extra.get((medium, h), 0))
