"""The fast precise index: exactly which blocks each engine replica holds, from its KV events.

Job: ``PreciseIndex`` applies engine batches and answers prefix matches, fast and compact. Its
rules (how a store or a removal changes the index, copies, orphans, tiers, AllBlocksCleared) are
those of ``kvindex.index.reference.ReferenceIndex``, the readable oracle; tests hold the two equal
on every capture, generated and fuzzed workloads (tests/test_core.py, tests/test_precise_index.py,
tests/test_store_contract.py). It never sees bytes.

Invariants of the layout:
- Every entry lives in the native core (``kvindex.index._core.Core``, kvindex/index/_core.c):
  per worker and medium ``engine hash -> key``, per tier ``key -> holder set``, with no Python
  object per entry. This class keeps only what is per worker or per event: which (pod, dp_rank)
  owns which slot, the media names, block sizes and the keys an event's tokens make.
- A *worker* is one (pod, dp_rank) and owns one slot; an empty worker is freed at the end of the
  batch that emptied it (its slot is reused).
- Without a C compiler there is no core: ``kvindex.index.memory.new_precise_index`` then gives
  the reference itself.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from kvindex import keys as K
from kvindex import native
from kvindex.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvindex.index.rows import ROW, Table, tables_of, unpack_rows
from kvindex.index.lineage import Lineage
from kvindex.index.protocol import tier_of
from kvindex.types import TIERS, Applied, Entry, EntryRow, PodMatch, merged

CORE = native.load("kvindex.index._core")  # the native core, or None (no C compiler: the reference serves)
TIER_NO = {t: i for i, t in enumerate(TIERS)}


class PreciseIndex:
    """In-memory precise index over the native core. Not thread-safe; one event loop owns it."""

    def __init__(self, *, lineage: bool = False) -> None:
        if CORE is None:
            raise ImportError(f"kvindex.index._core is not built; {native.HINT}")
        self._core = CORE.Core()
        self._slot: dict[tuple[str, int], int] = {}  # worker -> its slot in the core
        self._ident: list[tuple[str, int] | None] = []  # slot -> worker
        self._media: dict[str, int] = {GPU: 0}  # medium name -> its id in the core (GPU is 0)
        self._medium_names: list[str] = [GPU]
        self._tier_no: list[int] = [TIER_NO["gpu"]]  # medium id -> its tier's number in the core
        self._block_size: dict[str, int] = {}
        self._model_of: dict[tuple[str, int], str] = {}  # worker -> the model it last stored blocks of
        self._loaded_with: dict[tuple[str, int], dict[str, int]] = {}  # loaded worker, model not known yet -> sizes
        self.lineage = Lineage(self._held_keys) if lineage else None  # Dynamo's /dump: costs time
        self._record = self.lineage.add if self.lineage is not None else None

    # -- configuration (block sizes follow the engines' lives: reference.py) --------------------
    def set_block_size(self, model: str, block_size: int) -> int:
        if model not in self._block_size or not self._held(model):  # no size: nothing held (tier copies)
            self._block_size[model] = block_size
        return self._block_size[model]

    def _held(self, model: str) -> bool:
        """Whether a worker holds blocks of ``model`` keyed with its size in force."""
        bs, of, loaded, empty = self._block_size.get(model), self._model_of, self._loaded_with, self._core.empty
        return any(not empty(slot) and (of[wid] == model if wid in of else bs is not None and loaded.get(wid, {}).get(model) == bs)
                   for wid, slot in self._slot.items())

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
        wid = (pod, dp_rank)
        slot = self._slot.get(wid)
        sizes = self._block_size
        evs = events if type(events) is tuple or type(events) is list else tuple(events)
        n = len(evs)  # one event: its own call costs less than a run's (a lineage records keys: Python's path)
        i, native_run = 0, n > 1 and self._record is None
        while i < n:
            ev = evs[i]
            t = type(ev)
            if native_run and (t is BlockStored or (t is BlockRemoved and slot is not None)) \
                    and (size := sizes.get(model)) is not None:
                if slot is None:
                    slot = self._worker(wid)
                i = self._device_run(wid, slot, model, evs, i, size, done)  # the common events, in C
                if i >= n:
                    break
                ev = evs[i]
                t = type(ev)
            i += 1
            if t is BlockRemoved:
                if slot is None:  # nothing held: every removal is of an unknown hash
                    done.unknown_removals += len(ev.block_hashes)  # type: ignore[union-attr]
                else:
                    gone = self._core.remove(slot, self._media.get(ev.medium, -1), ev.block_hashes)  # type: ignore[union-attr]
                    done.removed += gone
                    done.unknown_removals += len(ev.block_hashes) - gone  # type: ignore[union-attr]
                done.removed_events += 1
            elif t is BlockStored:
                if slot is None:
                    slot = self._worker(wid)
                if ev.medium == GPU and sizes.get(model) == ev.block_size:  # type: ignore[union-attr]
                    self._device_store(wid, slot, model, ev, done)  # type: ignore[arg-type]
                else:
                    self._store(wid, slot, model, ev, done)  # type: ignore[arg-type]
            elif t is AllBlocksCleared:  # one rank's cache (each dp rank publishes its own stream)
                self.clear_pod(pod, dp_rank)
                done.cleared += 1
                slot = None
            else:
                raise TypeError(f"not a KV event: {t.__name__}")
        if slot is not None and self._core.empty(slot):
            self.clear_pod(pod, dp_rank)  # frees its slot: an empty worker costs nothing
        return done

    def _worker(self, wid: tuple[str, int]) -> int:
        slot = self._slot.get(wid)
        if slot is None:
            slot = self._slot[wid] = self._core.new_worker()
            if slot == len(self._ident):
                self._ident.append(wid)
            else:
                self._ident[slot] = wid
        return slot

    def _medium(self, name: str) -> int:
        mid = self._media.get(name)
        if mid is None:
            mid = self._media[name] = len(self._medium_names)
            self._medium_names.append(name)
            self._tier_no.append(TIER_NO[tier_of(name)])
        return mid

    def _event_keys(self, wid: tuple[str, int], slot: int, model: str, ev: BlockStored) -> tuple[Sequence[int], bool]:
        """Keys for the event's blocks (shorter than its hashes where tokens run out; none on a lower tier)."""
        bs, size, device = ev.block_size, self._block_size.get(model), ev.medium == GPU
        if device and size != bs and (size is None or not self._held(model)):
            self._block_size[model] = bs  # nobody holds the old size (or none): follow the engine
        self._model_of[wid] = model  # after the check: the store does not make its worker a holder
        self._loaded_with.pop(wid, None)
        if not device:
            return [], False  # a tier store: each hash takes the worker's key for it (reference.py)
        if self._block_size[model] != bs:
            return [], True
        parent = (K.root_key(model, ev.lora_name, ev.cache_salt) if ev.parent_hash is None
                  else self._core.key_of(slot, ev.parent_hash))
        if parent is None:
            return [], False
        return K.recorded_keys(parent, ev.token_ids, bs, len(ev.block_hashes), self._record), False

    def _device_run(self, wid: tuple[str, int], slot: int, model: str, events: Sequence[KVEvent], start: int,
                    size: int, done: Applied) -> int:
        """``events[start:]`` applied in one native call while each is a device store at the model's
        size with no LoRA name or salt, or a device removal (``Core.apply_device``: what
        ``_device_store`` and the removal branch do, event by event); the index of the first other
        event (the caller's general path applies it), or len(events)."""
        stop, stored_events, stored, again, orphans, removed_events, removed, unknown = self._core.apply_device(
            slot, self._tier_no[0], events, start, size, K.root_key(model), BlockStored, BlockRemoved, GPU)
        if stored_events:
            self._model_of[wid] = model
            self._loaded_with.pop(wid, None)
        done.stored_events += stored_events
        done.stored += stored
        done.reannounced += again
        done.orphans += orphans
        done.removed_events += removed_events
        done.removed += removed
        done.unknown_removals += unknown
        return stop

    def _device_store(self, wid: tuple[str, int], slot: int, model: str, ev: BlockStored, done: Applied) -> None:
        """``_store`` of the common event, a device store at the model's block size, in one step:
        the same keys, the same core call, the same counts (tests hold it equal to ``_store``). Tokens
        not packed as u32s, or a lineage recording the keys: ``_store`` itself."""
        tokens = ev.token_ids
        if self._record is not None or type(tokens) is not array or tokens.typecode != "I":
            self._store(wid, slot, model, ev, done)  # keys made in Python
            return
        self._model_of[wid] = model
        if wid in self._loaded_with:
            del self._loaded_with[wid]
        hashes, ph, n = ev.block_hashes, ev.parent_hash, len(ev.block_hashes)
        root = K.root_key(model, ev.lora_name, ev.cache_salt) if ph is None else 0
        orphans, again = self._core.store_tokens(slot, self._tier_no[0], hashes, ph, root, tokens, ev.block_size)
        done.stored_events += 1
        if again:
            done.reannounced += n
        else:
            done.stored += n
        done.orphans += orphans

    def _store(self, wid: tuple[str, int], slot: int, model: str, ev: BlockStored, done: Applied) -> None:
        keys, mismatch = self._event_keys(wid, slot, model, ev)
        medium, n = ev.medium, len(ev.block_hashes)
        mid = self._medium(medium)
        orphans, again = self._core.store(slot, mid, self._tier_no[mid], ev.block_hashes, keys,
                                          ev.parent_hash is None and medium == GPU)  # parentless: maybe re-announced
        done.stored_events += 1
        done.stored += 0 if again else n
        done.reannounced += n if again else 0
        done.orphans += orphans
        done.tier_unkeyed += orphans if medium != GPU else 0
        done.block_size_mismatch += mismatch

    # -- pods ----------------------------------------------------------------------------------
    def clear_pod(self, pod: str, dp_rank: int | None = None) -> None:
        """Forget every block of ``pod`` (all ranks, or one) — AllBlocksCleared, restart, removal."""
        for wid in [wid for wid in self._slot if wid[0] == pod and dp_rank in (None, wid[1])]:
            slot = self._slot.pop(wid)
            self._model_of.pop(wid, None)
            self._loaded_with.pop(wid, None)
            self._core.free_worker(slot)
            self._ident[slot] = None
        while self._ident and self._ident[-1] is None:
            self._ident.pop()

    def pods(self) -> list[str]:
        return sorted({pod for pod, _ in self._slot})

    def blocks_held(self, pod: str) -> dict[str, int]:
        """Copies held per tier, plus ``orphans`` (keyless hashes) for ``pod``."""
        out = {t: 0 for t in TIERS} | {"orphans": 0}
        for (p, _), slot in self._slot.items():
            if p == pod:
                media, orphans = self._core.media(slot)
                for mid, _entries, copies in media:
                    out[tier_of(self._medium_names[mid])] += copies
                out["orphans"] += orphans
        return out

    def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]:
        """Per dp_rank: engine hash -> key (None for orphans), all media. For tests and /dump."""
        out: dict[int, dict[int, int | None]] = {}
        for p, rank, _medium, rows in self.export_tables():
            if p == pod:
                out.setdefault(rank, {}).update({h: key for h, key, _ in unpack_rows(rows)})
        return out

    def _held_keys(self) -> Iterator[set[int]]:
        """Per tier, the keys held (for the lineage's pruning; costs a pass over every entry)."""
        by_tier: dict[str, set[int]] = {t: set() for t in TIERS}
        for _, _, medium, rows in self.export_tables():
            by_tier[tier_of(medium)].update(key for _, key, _ in unpack_rows(rows) if key is not None)
        return iter(by_tier.values())

    # -- state out and in (snapshots, peers) ----------------------------------------------------
    def export_tables(self) -> list[Table]:
        """A point-in-time copy of every worker's media as snapshot rows (one C pass each, no
        object per entry): fast enough for the event loop; media in order, empty ones included."""
        out: list[Table] = []
        for (pod, rank), slot in self._slot.items():
            media, _ = self._core.media(slot)
            out += [(pod, rank, self._medium_names[mid], self._core.export(slot, mid)) for mid, _, _ in media]
        return out

    def export_entries(self) -> Iterator[Entry]:
        """Every held engine hash: (pod, dp_rank, medium, hash, key or None, copies)."""
        return entries_of(self.export_tables())

    def load_tables(self, tables: Iterable[Table], sizes: Mapping[str, int] | None = None) -> int:
        """Add exported tables (of workers this index does not hold yet) in one C pass each;
        ``sizes``: the block sizes their keys were made with (default: those in force). Returns
        the entries added."""
        made_with = dict(self._block_size if sizes is None else sizes)
        n = 0
        for pod, rank, medium, rows in tables:
            if not len(rows):
                continue  # an emptied medium: nothing to hold (the reference keeps no trace of it)
            wid = (pod, rank)
            if wid not in self._model_of:
                self._loaded_with.setdefault(wid, made_with)
            mid = self._medium(medium)
            n += self._core.load(self._worker(wid), mid, self._tier_no[mid], rows)
        return n

    def load_entries(self, entries: Iterable[EntryRow], sizes: Mapping[str, int] | None = None) -> int:
        """Add exported entries (to an index that does not hold them yet); returns how many."""
        return self.load_tables(tables_of(entries), sizes)

    def reserve_tables(self, tables: Iterable[Table]) -> None:
        """Room in each table's (pod, dp_rank, medium) for its rows, before they are loaded in
        parts (each ``load_tables`` call then adds without growing)."""
        for pod, rank, medium, rows in tables:
            if len(rows):
                mid = self._medium(medium)
                self._core.reserve(self._worker((pod, rank)), mid, self._tier_no[mid], len(rows) // ROW.size)

    def memory(self) -> dict[str, int]:
        """The core's sizes: bytes, entries, side entries, keys, interned holder sets, duplicates."""
        return self._core.stats()

    # -- queries -------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], pods: Iterable[str] | None = None) -> dict[str, PodMatch]:
        """Longest prefix of ``keys`` held by each pod (only pods with a match ≥ 1 are listed)."""
        allowed = (1 << len(self._ident)) - 1 if pods is None else self._mask_of(pods)
        if not allowed:
            return {}
        rows = self._core.match(keys, allowed)
        ident = self._ident
        out: dict[str, PodMatch] = {}
        if not self._core.tiered():  # rows come deepest first: a pod's first row is its deepest
            new = tuple.__new__
            for g, _, _, slot in rows:
                pod, rank = ident[slot]  # type: ignore[misc]
                prev = out.get(pod)
                if prev is None:
                    out[pod] = new(PodMatch, (g, g, g, {rank: g}))  # PodMatch(...) minus its Python __new__
                else:
                    prev.dp[rank] = g
            return out
        for g, c, d, slot in rows:
            pod, rank = ident[slot]  # type: ignore[misc]
            out[pod] = merged(out.get(pod), PodMatch(g, c, d, {rank: g}))
        return out

    def hash_match(self, hashes: Sequence[int]) -> dict[str, PodMatch]:
        """``match`` for a prompt given as engine block hashes (ReferenceIndex.hash_match): each
        worker's leading run of held hashes, keyed by its own entries, matched on that worker alone."""
        out: dict[str, PodMatch] = {}
        key_of, tiered = self._core.key_of, self._core.tiered()
        for (pod, rank), slot in self._slot.items():
            keys = []
            for h in hashes:
                key = key_of(slot, h)
                if key is None:
                    break
                keys.append(key)
            for g, c, d, _ in self._core.match(keys, 1 << slot) if keys else ():
                out[pod] = merged(out.get(pod), PodMatch(g, c, d, {rank: g}) if tiered else PodMatch(g, g, g, {rank: g}))
        return out

    def hash_tiers(self, hashes: Sequence[int]) -> dict[str, dict[str, list[int]]]:
        """Per pod, per tier, which of ``hashes`` it holds keyed there (request order, each once)."""
        out: dict[str, dict[str, list[int]]] = {}
        key_of, holders = self._core.key_of, self._core.holders
        for (pod, _), slot in self._slot.items():
            tiers = out.setdefault(pod, {})
            for h in dict.fromkeys(hashes):
                key = key_of(slot, h)
                for t, name in enumerate(TIERS):
                    if key is not None and slot in holders(t, key) and h not in tiers.get(name, ()):
                        tiers.setdefault(name, []).append(h)
        return {pod: tiers for pod, tiers in out.items() if tiers}

    def _mask_of(self, pods: Iterable[str]) -> int:
        wanted = set(pods)  # each worker has its own bit: their sum is their union
        return sum(1 << slot for (pod, _), slot in self._slot.items() if pod in wanted)


def entries_of(tables: Iterable[Table]) -> Iterator[Entry]:
    for pod, rank, medium, rows in tables:
        for h, key, copies in unpack_rows(rows):
            yield Entry(pod, rank, medium, h, key, copies)
