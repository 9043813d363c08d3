"""The precise index's rules, plainly: dicts and sets, no packing, no speed tricks (the oracle).

Job: ``ReferenceIndex`` has exactly ``PreciseIndex``'s public API and semantics and is the
definition both the fast index (kvindex.index.precise) and the Redis backend are tested against.
Read it to learn what the precise index does; read precise.py to learn how it does it fast.

The rules, once:
- A *worker* is one (pod, dp_rank): one engine cache (each dp rank publishes its own stream).
  Per medium ("GPU", "CPU...", anything else) it holds ``engine hash -> key``, and a count of
  the *copies* of each hash: vLLM stores and removes each physical copy separately, so a store
  of a held hash adds a copy and a removal takes one; the hash goes with its last copy.
- A *re-announcement* adds no copy: a GPU BlockStored with no parent hash all of whose hashes the
  worker already holds on GPU. vLLM (``kv_cache_report_mode: "full"``) re-publishes the
  prefix a request hit in that shape, for blocks it holds and will remove once; a new physical
  copy is published by the store of the block that gained the hash, whose parent is the hash
  before it. (A request that hit no block of a held prefix, e.g. a prompt of exactly one block,
  also stores parentless copies of held hashes: taken as a re-announcement, such a copy is one
  kvindex does not count, never one it invents.) Its keyless hashes learn its keys. Lower tiers
  always count copies: vLLM's offloading connector re-announces a shared hash once per chunk and
  asks consumers to reference-count stores and removals.
- A block's key is kvindex's chained key (kvindex.keys) from the event's token ids and its
  parent's key: the root key of (model, lora, salt) when the event has no parent hash, else the
  key the worker holds for the parent hash (its GPU entry's if it has one, else the first medium's
  holding it). Blocks past the tokens' end take the key the worker already holds for their hash.
- A store on a lower tier (any medium but GPU: vLLM's offloading connector copying device blocks
  out) never keys its blocks itself: each of its hashes takes the key the worker already holds
  for that hash (``key_of``: its device copy's, else another medium's), whatever tokens, parent or
  block size the event carries. A placeholder (block size 0, no tokens) carries nothing to key;
  a self-describing one carries tokens but no extra_keys, so its own key would be unsalted and
  LoRA-less: another identity's. A tier copy whose hash the worker holds keyed nowhere is kept
  keyless (an orphan, counted ``tier_unkeyed``), never matched, until a store of the hash with a
  key gives it one (below). Tier stores leave block sizes alone (the worker's model is the event's).
- A store whose key cannot be computed (unknown or keyless parent, tokens missing, a block size
  other than the model's) is an *orphan*: kept keyless, so a later removal finds it, but it never
  matches.
- Block sizes belong to engine streams' lives, not to models forever. A model's block size is
  *held* while a worker that stored blocks of the model holds any. A worker loaded by
  ``load_entries`` (a snapshot, a peer), whose model is not known until its next store, holds
  each model whose size in force is the one its entries were keyed with (``sizes``: by default
  the sizes in force when it was loaded) and no other. The holders are counted before the store
  that makes a worker one: a worker switching models does not hold the new one's size yet. A
  BlockStored whose block size differs from the model's, while the size is held by anyone, is an
  orphan (``block_size_mismatch``); when nobody holds it, or the model has no size yet, the model
  follows the engine: its block size becomes the event's (an engine restarted with another block
  size, after its restart cleared it). ``set_block_size`` (configuration, a registration) sets
  the size while nobody holds another one, and answers the size in force.
- A held hash keeps the key it was first stored with; a keyless one learns the key of a later
  store of it (in that medium). A new hash stored with a key gives that key to the keyless
  entries of the same hash in the worker's other media (offload events carry no tokens).
- AllBlocksCleared empties its rank (every medium); so does ``clear_pod``. A worker left holding
  nothing at the end of a batch is forgotten (``pods`` no longer lists it).
- Tiers: a medium's tier is gpu, cpu or disk (``tier_of``). A worker *holds* a key in a tier
  while any of its hashes in a medium of that tier has that key. A match walks the prompt's keys
  in order: a worker's depth in a tier is the longest prefix it holds in that tier or a faster one
  (gpu; gpu+cpu; gpu+cpu+disk). Per pod, each tier's deepest rank; ``dp`` lists the ranks matching
  >= 1 block in some tier, with their gpu depth; pods with no match are not listed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvindex import keys as K
from kvindex.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvindex.index.lineage import Lineage
from kvindex.index.protocol import tier_of
from kvindex.index.rows import Table, pack_rows, unpack_rows
from kvindex.types import TIERS, Applied, Entry, PodMatch, merged


@dataclass
class Worker:
    """What one (pod, dp_rank) holds: per medium, hash -> key (None: keyless), and copies."""

    media: dict[str, dict[int, int | None]] = field(default_factory=lambda: {GPU: {}})  # GPU first
    copies: dict[tuple[str, int], int] = field(default_factory=dict)  # (medium, hash) -> copies >= 1

    def key_of(self, h: int) -> int | None:
        """The key this worker holds for hash ``h``: GPU's entry if it has one, else the first
        medium's holding it; None if unknown or keyless."""
        if h in self.media[GPU]:
            return self.media[GPU][h]
        for held in self.media.values():
            if h in held:
                return held[h]
        return None

    def keys_in(self, tiers: Sequence[str]) -> set[int]:
        """Every key held in a medium of one of ``tiers``."""
        return {k for m, held in self.media.items() if tier_of(m) in tiers for k in held.values() if k is not None}


class ReferenceIndex:
    """The precise index, plainly. Same API and answers as ``PreciseIndex`` (whose
    ``export_tables`` / ``load_tables`` / ``reserve_tables`` are snapshot conveniences over
    ``export_entries`` / ``load_entries``, the contract)."""

    def __init__(self, *, lineage: bool = False) -> None:
        self.workers: dict[tuple[str, int], Worker] = {}
        self.lineage = Lineage(lambda: [w.keys_in(TIERS) for w in self.workers.values()]) if lineage else None
        self._block_size: dict[str, int] = {}
        self._model_of: dict[tuple[str, int], str] = {}  # worker -> the model it last stored blocks of
        self._loaded_with: dict[tuple[str, int], dict[str, int]] = {}  # loaded worker, model not known yet -> sizes

    # -- configuration -------------------------------------------------------------------------
    def set_block_size(self, model: str, block_size: int) -> int:
        if model not in self._block_size or not self._held(model):  # no size: nothing held (tier copies)
            self._block_size[model] = block_size
        return self._block_size[model]

    def _held(self, model: str) -> bool:
        """Whether a worker holds blocks of ``model`` keyed with its size in force."""
        return any(w.copies and self._holds(wid, model) for wid, w in self.workers.items())

    def _holds(self, wid: tuple[str, int], model: str) -> bool:
        if wid in self._model_of:
            return self._model_of[wid] == model
        bs = self._block_size.get(model)
        return bs is not None and self._loaded_with.get(wid, {}).get(model) == bs

    def block_size(self, model: str) -> int | None:
        return self._block_size.get(model)

    def block_sizes(self) -> dict[str, int]:
        return dict(self._block_size)

    # -- events --------------------------------------------------------------------------------
    def apply(self, pod: str, model: str, dp_rank: int, event: KVEvent) -> Applied:
        return self.apply_batch(pod, model, dp_rank, (event,))

    def apply_batch(self, pod: str, model: str, dp_rank: int, events: Iterable[KVEvent]) -> Applied:
        """Apply one engine batch of (pod, dp_rank) in order."""
        done = Applied()
        for ev in events:
            if isinstance(ev, BlockStored):
                self._store((pod, dp_rank), self.workers.setdefault((pod, dp_rank), Worker()), model, ev, done)
            elif isinstance(ev, BlockRemoved):
                self._remove(self.workers.get((pod, dp_rank)), ev, done)
            elif isinstance(ev, AllBlocksCleared):
                self.clear_pod(pod, dp_rank)
                done.cleared += 1
            else:
                raise TypeError(f"not a KV event: {type(ev).__name__}")
        w = self.workers.get((pod, dp_rank))
        if w is not None and not w.copies:
            del self.workers[(pod, dp_rank)]  # holds nothing: forgotten
            self._model_of.pop((pod, dp_rank), None)
            self._loaded_with.pop((pod, dp_rank), None)
        return done

    def _keys(self, w: Worker, model: str, ev: BlockStored) -> Sequence[int]:
        """The keys the event's tokens give its blocks (fewer than its hashes when they run out)."""
        parent = K.root_key(model, ev.lora_name, ev.cache_salt) if ev.parent_hash is None else w.key_of(ev.parent_hash)
        if parent is None or self._block_size[model] != ev.block_size:
            return []
        record = self.lineage.add if self.lineage is not None else None  # --dynamo-dump: where each key came from
        return K.recorded_keys(parent, ev.token_ids, ev.block_size, len(ev.block_hashes), record)

    def _store(self, wid: tuple[str, int], w: Worker, model: str, ev: BlockStored, done: Applied) -> None:
        size = self._block_size.get(model)
        if ev.medium == GPU and size != ev.block_size and (size is None or not self._held(model)):
            self._block_size[model] = ev.block_size  # nobody holds the old size (or none): follow the engine
        self._model_of[wid] = model  # after the check: the store does not make its worker a holder
        self._loaded_with.pop(wid, None)
        if ev.medium != GPU:
            self._store_tier(w, ev, done)
            return
        done.block_size_mismatch += self._block_size[model] != ev.block_size
        keys = self._keys(w, model, ev)
        held = w.media.setdefault(ev.medium, {})
        again = ev.parent_hash is None and all(h in held for h in ev.block_hashes)  # a re-announcement
        for i, h in enumerate(ev.block_hashes):
            key = keys[i] if i < len(keys) else w.key_of(h)
            done.orphans += self._store_copy(w, ev.medium, held, h, key, copies=0 if again else 1)
        done.stored_events += 1
        done.stored += 0 if again else len(ev.block_hashes)
        done.reannounced += len(ev.block_hashes) if again else 0

    def _store_tier(self, w: Worker, ev: BlockStored, done: Applied) -> None:
        """Lower-tier copies of device blocks: each hash keyed through the worker's copy of it."""
        held = w.media.setdefault(ev.medium, {})
        for h in ev.block_hashes:
            keyless = self._store_copy(w, ev.medium, held, h, w.key_of(h))
            done.orphans += keyless
            done.tier_unkeyed += keyless
        done.stored_events += 1
        done.stored += len(ev.block_hashes)

    def _store_copy(self, w: Worker, medium: str, held: dict[int, int | None], h: int, key: int | None,
                    copies: int = 1) -> int:
        """``copies`` (1, or 0: re-announced) more of ``h`` in ``medium``; 1 if it is keyless
        after the store, else 0."""
        if h in held:
            w.copies[(medium, h)] += copies
            if held[h] is None:
                held[h] = key  # a keyless hash learns its key (or stays keyless)
            return held[h] is None
        held[h] = key
        w.copies[(medium, h)] = 1
        if key is not None:
            for other in w.media.values():  # the keyless copies elsewhere adopt the key
                if h in other and other[h] is None:
                    other[h] = key
        return key is None

    def _remove(self, w: Worker | None, ev: BlockRemoved, done: Applied) -> None:
        held = None if w is None else w.media.get(ev.medium)
        for h in ev.block_hashes:
            if w is None or held is None or h not in held:
                done.unknown_removals += 1
                continue
            done.removed += 1
            w.copies[(ev.medium, h)] -= 1
            if not w.copies[(ev.medium, h)]:  # its last copy: the hash goes
                del w.copies[(ev.medium, h)]
                del held[h]
        done.removed_events += 1

    # -- pods ----------------------------------------------------------------------------------
    def clear_pod(self, pod: str, dp_rank: int | None = None) -> None:
        """Forget every block of ``pod`` (all ranks, or one)."""
        for wid in [wid for wid in self.workers if wid[0] == pod and dp_rank in (None, wid[1])]:
            del self.workers[wid]
            self._model_of.pop(wid, None)
            self._loaded_with.pop(wid, None)

    def pods(self) -> list[str]:
        return sorted({pod for pod, _ in self.workers})

    def blocks_held(self, pod: str) -> dict[str, int]:
        """Copies held per tier, plus ``orphans`` (keyless hashes) for ``pod``."""
        out = {t: 0 for t in TIERS} | {"orphans": 0}
        for (p, _), w in self.workers.items():
            if p == pod:
                for (medium, h), n in w.copies.items():
                    out[tier_of(medium)] += n
                    out["orphans"] += w.media[medium][h] is None
        return out

    def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]:
        """Per dp_rank: engine hash -> key (None for orphans), media merged in their first-store
        order (GPU first)."""
        out: dict[int, dict[int, int | None]] = {}
        for (p, rank), w in self.workers.items():
            if p == pod:
                merged = out.setdefault(rank, {})
                for held in w.media.values():
                    merged.update(held)
        return out

    # -- state out and in ----------------------------------------------------------------------
    def export_entries(self) -> Iterator[Entry]:
        """Every held engine hash: (pod, dp_rank, medium, hash, key or None, copies)."""
        entries = [Entry(pod, rank, medium, h, key, w.copies[(medium, h)])
                   for (pod, rank), w in self.workers.items() for medium, held in w.media.items() for h, key in held.items()]
        return iter(entries)

    def export_tables(self) -> list[Table]:
        """``export_entries`` per (pod, dp_rank, medium) as snapshot rows (kvindex.index.rows),
        media in order (GPU first, empty ones included)."""
        return [(pod, rank, medium, pack_rows([(h, key, w.copies[(medium, h)]) for h, key in held.items()]))
                for (pod, rank), w in self.workers.items() for medium, held in w.media.items()]

    def load_tables(self, tables: Iterable[Table], sizes: dict[str, int] | None = None) -> int:
        return self.load_entries([Entry(pod, rank, medium, h, key, copies) for pod, rank, medium, rows in tables
                                  for h, key, copies in unpack_rows(rows)], sizes)

    def reserve_tables(self, tables: Iterable[Table]) -> None:
        """Nothing to size: dicts grow."""

    def load_entries(self, entries: Iterable[Entry], sizes: dict[str, int] | None = None) -> int:
        """Add exported entries (to an index that does not hold them yet); returns how many.
        ``sizes``: the block sizes their keys were made with (default: the sizes in force)."""
        n = 0
        made_with = dict(self._block_size if sizes is None else sizes)
        for e in entries:
            wid = (e.pod, e.dp_rank)
            if wid not in self._model_of:
                self._loaded_with.setdefault(wid, made_with)
            w = self.workers.setdefault(wid, Worker())
            w.media.setdefault(e.medium, {})[e.hash] = e.key
            w.copies[(e.medium, e.hash)] = e.copies
            n += 1
        return n

    # -- queries -------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], pods: Iterable[str] | None = None) -> dict[str, PodMatch]:
        """Longest prefix of ``keys`` held by each pod (only pods with a match >= 1 are listed)."""
        wanted = None if pods is None else set(pods)
        out: dict[str, PodMatch] = {}
        for (pod, rank), w in self.workers.items():
            if wanted is not None and pod not in wanted:
                continue
            g, c, d = (_prefix(keys, w.keys_in(TIERS[:n])) for n in (1, 2, 3))
            if not d:
                continue
            prev = out.get(pod, PodMatch(0, 0, 0, {}))
            out[pod] = PodMatch(max(prev.gpu, g), max(prev.cpu, c), max(prev.disk, d), {**prev.dp, rank: g})
        return out

    def hash_match(self, hashes: Sequence[int]) -> dict[str, PodMatch]:
        """``match`` for a prompt given as engine block hashes: each worker's leading run of the hashes
        it holds keyed is turned into keys by its own entries, and matched on that worker alone."""
        out: dict[str, PodMatch] = {}
        for (pod, rank), w in self.workers.items():
            keys = _leading_keys(w, hashes)
            g, c, d = (_prefix(keys, w.keys_in(TIERS[:n])) for n in (1, 2, 3))
            if d:
                out[pod] = merged(out.get(pod), PodMatch(g, c, d, {rank: g}))
        return out

    def hash_tiers(self, hashes: Sequence[int]) -> dict[str, dict[str, list[int]]]:
        """Per pod, per tier, which of ``hashes`` it holds keyed there (request order, each once)."""
        out: dict[str, dict[str, list[int]]] = {}
        for (pod, _), w in self.workers.items():
            held = {t: w.keys_in((t,)) for t in TIERS}
            tiers = out.setdefault(pod, {})
            for h in dict.fromkeys(hashes):
                key = w.key_of(h)
                for t in TIERS:
                    if key is not None and key in held[t] and h not in tiers.get(t, ()):
                        tiers.setdefault(t, []).append(h)
        return {pod: tiers for pod, tiers in out.items() if tiers}


def _leading_keys(w: Worker, hashes: Sequence[int]) -> list[int]:
    """The keys ``w`` holds for ``hashes``, from the first, up to the first it holds no key for."""
    keys = []
    for h in hashes:
        key = w.key_of(h)
        if key is None:
            break
        keys.append(key)
    return keys


def _prefix(keys: Sequence[int], held: set[int]) -> int:
    """How many of ``keys``, from the first, are in ``held``."""
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n
