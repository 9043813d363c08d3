"""The precise index on Redis: one store shared by every kvindex replica.

Semantics are ``kvindex.index.precise.PreciseIndex``'s, reproduced exactly: a batch is replayed
client-side on a small *overlay* (a ``PreciseIndex`` holding only the worker's entries the batch
can see), so keys, orphans, copies and media follow the very same code; the store receives the
resulting differences and applies them in one server-side script. The common batch (GPU stores
that all get keys, of hashes not held yet, and removals, on a worker holding GPU blocks only, none
keyless or copied among those the batch names) is planned without the overlay (``plan_fast``): the
same plan, at a fraction of the cost; anything else falls back to the replay.

Invariants:
- Every key of one model carries the hash tag ``{<model id>}``, so each script touches one slot
  (Redis Cluster). Global keys: ``<prefix>:gen`` (the store's generation), ``<prefix>:mid`` (HASH
  model -> its small id, allocated from ``<prefix>:mid:n`` by the first client needing it),
  ``<prefix>:pods`` (HASH pod -> model, for load_entries).
- Layout under ``B = <prefix>:{<model id>}:``: ``gen`` (copy of the generation), ``bs`` (block
  size), ``off`` (set once a cpu/disk copy was held), ``s:<stream id>`` HASH q(last seq) e(epoch)
  y(synced) r(reason); workers: ``W`` HASH "rank|pod" -> slot (``N``: its inverse), ``slots`` bitmap of slots in use (the
  lowest free slot is reused, as PreciseIndex reuses bits), ``v`` HASH "rank|pod" -> version (bumped
  by every write to the worker, never deleted: a recreated worker is a new version), ``w:<slot>``
  HASH n(name) M(media in first-store order, "\\n"-joined) o(orphans) c(entries);
  ``b:<slot>:<i>:<bucket>`` HASH engine hash -> key or "o" of the i-th medium, in 128 buckets by the
  hash's low 7 bits (listpack hashes up to Redis's default hash-max-listpack-entries, 512: ~25 bytes
  per entry, listpack up to ~65k hashes per worker and medium; few buckets: a batch's hashes share
  them, and each bucket touched costs the scripts one call), ``k:<slot>:<i>`` bitmap of the
  buckets that may be in use (a superset: an emptied bucket keeps its bit until the worker goes),
  ``x:<slot>`` HASH "<i>:<hash>" -> copies beyond the first; holders per tier t in g|c|d:
  ``t:<key>`` bitmap of the slots holding the key (PreciseIndex's ``_holders`` bitmask), and per
  worker ``D:<slot>`` HASH holder key name -> its copies beyond the first (``_dups``). Engine hashes
  and keys are 8 big-endian bytes (binary strings: compact, and Lua never turns them into
  numbers); a batch's bulk arguments (hashes per bucket, entries per bucket, holder changes) travel
  msgpack-encoded and are unpacked in C (``cmsgpack``): the scripts do no per-entry parsing, and a
  batch costs about one Redis call per bucket touched plus a few (one MGET / MSET / DEL for all its
  holder bitmaps); seqs and epochs are decimal strings that Lua compares as numbers (exact below
  2^53).
- ``apply`` = at most two round trips: a read script (position, block size, worker version and the
  entries of every hash the batch names), then, unless the read already shows the batch is not to
  be applied, the apply script. It re-judges the position (``judge``/``next_position`` of base.py),
  re-checks the worker version and block size it was computed from (else the client recomputes),
  and writes everything or nothing: the scripts validate before their first write. A batch of
  clears only (nothing to read) is one round trip. A call that timed out may still have been
  applied; offering it again is safe (DUPLICATE).
- Every script checks the model slot's generation copy against the one read at ``open()``; a
  mismatch (Redis restarted empty, or another generation) raises ``StoreLost``. Connection and
  timeout errors raise ``StoreUnavailable("redis at <url>: <reason>")``.
- ``match`` takes an optional keyword ``model``: with it, one round trip (the prefix walk over the
  holder bitmaps for all candidate workers runs server-side); without it, every model is walked
  (two round trips), since a key does not say which model's slot holds it.
- A pod's streams share the pod's model: ``restart`` clears the pod's ranks in its stream's model;
  ``clear_pod``, ``pods``, ``blocks_held``, ``engine_hashes`` and ``export_entries`` visit every model.
- ``load_entries`` needs each pod's model: it is the model of the pod's streams applied or
  positioned through this store (``<prefix>:pods``); an entry of an unknown pod is refused.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import msgpack
import redis.asyncio as aioredis
import redis.exceptions as rex

from kvindex import keys as K
from kvindex.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvindex.index.precise import ORPHAN, WorkerReplay, tier_of
from kvindex.index.protocol import (
    Applied,
    ApplyResult,
    Entry,
    PodMatch,
    StoreLost,
    StoreUnavailable,
)
from kvindex.index.redis_scripts import precise_script
from kvindex.sequence import Outcome, Position, StreamRef, judge

RETRIES = 16  # optimistic recomputations of one batch when another writer changed its worker
_TIER_CHAR = {"gpu": "g", "cpu": "c", "disk": "d"}
_packb = msgpack.Packer(use_bin_type=False).pack  # the scripts' cmsgpack reads str, not bin
BUCKET_MASK = 127  # a hash's bucket: its low 7 bits (bucket_of in the script)
_DIGITS = tuple(str(b).encode() for b in range(BUCKET_MASK + 1))  # a bucket's number as its key names it
UNCHANGED = (1 << 32) - 1  # extra copies not changed

def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def _position(q: Any, e: Any, y: Any, r: Any) -> Position | None:
    if e is None:
        return None
    return Position(None if q is None else int(q), int(e), _text(y) == "1", _text(r))


def _u64(v: int) -> bytes:
    """An engine hash or key as the store holds it: 8 bytes, big-endian (never a Lua number)."""
    return v.to_bytes(8, "big")


def _key_or_orphan(v: bytes) -> int:
    return ORPHAN if v == b"o" else int.from_bytes(v, "big")


def model_base(prefix: str, model_id: int) -> str:
    """The key prefix of one model: its short id is the hash tag (short key names: each distinct
    block key costs one top-level key per tier, and a long model name in it would cost more)."""
    return f"{prefix}:{{{model_id}}}:"


def client_url(client: aioredis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


@dataclass(frozen=True, slots=True)
class _WorkerView:
    """What the read script saw of one worker: the basis of one batch's computation."""

    position: Position | None
    block_size: int | None
    version: str
    media: tuple[str, ...]
    orphans: int
    entries: dict[tuple[str, int], tuple[int, int]]  # (medium, hash) -> (key or ORPHAN, extra copies)


@dataclass(frozen=True, slots=True)
class _Plan:
    """A batch's effect on one worker, as the apply script takes it."""

    done: Applied
    reset: bool
    media: tuple[str, ...]
    orphans: int
    changes: list[tuple[int, int, int | None, int]]  # (medium index, hash, key / ORPHAN / None: gone, extra)
    holders: dict[tuple[str, int], int]  # (tier char, key) -> change of the copies held (non-zero)
    counted: int  # change of the number of entries (medium, hash) held
    new_block_size: int | None


def _view_of(reply: list[Any], hashes: list[int]) -> _WorkerView:
    pos = _position(*reply[1:5])
    bs = None if reply[5] is None else int(reply[5])
    media = tuple(_text(reply[7]).split("\n")) if reply[7] is not None else ()
    entries: dict[tuple[str, int], tuple[int, int]] = {}
    for i, medium in enumerate(media):
        if 9 + 2 * i >= len(reply):
            break
        values, extras = chain.from_iterable(reply[9 + 2 * i]), reply[10 + 2 * i]  # per bucket group
        for j, v in enumerate(values):
            if v is not None:
                x = extras[j] if extras else None
                entries[(medium, hashes[j])] = (_key_or_orphan(v), 0 if x is None else int(x))
    return _WorkerView(pos, bs, _text(reply[6]), media, int(reply[8] or 0), entries)


def _hashes_of(events: Sequence[KVEvent]) -> list[int]:
    """Every engine hash the batch can read or write (stored, removed, parents), once each."""
    seen: dict[int, None] = {}
    for ev in events:
        if type(ev) is BlockStored:
            if ev.parent_hash is not None:
                seen[ev.parent_hash] = None
            seen.update(dict.fromkeys(ev.block_hashes))
        elif type(ev) is BlockRemoved:
            seen.update(dict.fromkeys(ev.block_hashes))
    return list(seen)


def plan_batch(pod: str, model: str, rank: int, events: Sequence[KVEvent], view: _WorkerView, hashes: list[int]) -> _Plan:
    """The batch's plan: the fast path when it applies, else the full replay."""
    return plan_fast(model, events, view, hashes) or plan_replayed(pod, model, rank, events, view, hashes)


def plan_replayed(pod: str, model: str, rank: int, events: Sequence[KVEvent], view: _WorkerView,
                  hashes: list[int]) -> _Plan:
    """Replay the batch with PreciseIndex's own rules (``WorkerReplay``) and diff the worker (any batch)."""
    replay = WorkerReplay(pod, model, rank, view.block_size, view.media, view.entries, view.orphans)
    done = replay.run(events)
    if replay.reset:  # the store clears the worker first: everything the replay holds is new
        changes, holders, counted = _diff(replay, {}, replay.held())
    else:
        changes, holders, counted = _diff(replay, view.entries, [(m, h) for m in replay.media for h in hashes])
    new_bs = replay.block_size() if view.block_size is None else None
    return _Plan(done, replay.reset, replay.media, replay.orphans, changes, holders, counted, new_bs)


def _diff(replay: WorkerReplay, before: dict[tuple[str, int], tuple[int, int]],
          touched: list[tuple[str, int]]) -> tuple[list[tuple[int, int, int | None, int]], dict[tuple[str, int], int], int]:
    """The changed entries, the holder deltas (copies per tier and key) and the change of the
    number of entries, between ``before`` and the replayed worker over ``touched``."""
    changes: list[tuple[int, int, int | None, int]] = []
    deltas: dict[tuple[str, int], int] = {}
    index = {m: i for i, m in enumerate(replay.media, 1)}
    counted = 0
    for m, h in touched:
        old, now = before.get((m, h)), replay.entry(m, h)
        if old == now:
            continue
        new, new_x = now if now is not None else (None, 0)
        counted += (new is not None) - (old is not None)
        keep = old is not None and old[1] == new_x or old is None and new_x == 0
        changes.append((index[m], h, new, UNCHANGED if keep else new_x))
        t = _TIER_CHAR[tier_of(m)]
        if old is not None and old[0] != ORPHAN:
            deltas[(t, old[0])] = deltas.get((t, old[0]), 0) - 1 - old[1]
        if new is not None and new != ORPHAN:
            deltas[(t, new)] = deltas.get((t, new), 0) + 1 + new_x
    return changes, {k: d for k, d in deltas.items() if d}, counted


def plan_fast(model: str, events: Sequence[KVEvent], view: _WorkerView, hashes: list[int]) -> _Plan | None:
    """The common batch without the overlay: a worker holding GPU blocks only, none keyless or
    copied twice among those the batch names, and GPU stores that all get keys (parent held or
    none, tokens for every block, the model's block size) of hashes not held yet, and removals.
    Same result as ``plan_replayed``; None (use it) as soon as the batch leaves that case."""
    if view.media not in ((), (GPU,)):
        return None
    held: dict[int, int] = {}
    for (_, h), (key, extra) in view.entries.items():
        if extra or key == ORPHAN:
            return None
        held[h] = key
    now, deltas, done, bs = dict(held), {}, Applied(), view.block_size
    for ev in events:
        t = type(ev)
        if t is BlockStored:
            if ev.medium != GPU or (bs is not None and ev.block_size != bs):  # type: ignore[union-attr]
                return None
            bs = ev.block_size  # type: ignore[union-attr]
            if not _store_fast(model, ev, now, deltas):  # type: ignore[arg-type]
                return None
            done.stored_events += 1
            done.stored += len(ev.block_hashes)  # type: ignore[union-attr]
        elif t is BlockRemoved and ev.medium == GPU:  # type: ignore[union-attr]
            gone = [now.pop(h, None) for h in ev.block_hashes]  # type: ignore[union-attr]
            for key in gone:
                if key is not None:
                    deltas[key] = deltas.get(key, 0) - 1
            done.removed_events += 1
            done.unknown_removals += gone.count(None)
            done.removed += len(gone) - gone.count(None)
        else:
            return None
    changes, counted = [], 0
    for h in hashes:
        old, new = held.get(h), now.get(h)
        if old != new:
            counted += (new is not None) - (old is not None)
            changes.append((1, h, new, UNCHANGED))
    new_bs = bs if view.block_size is None else None
    return _Plan(done, False, (GPU,), view.orphans, changes, {("g", k): d for k, d in deltas.items() if d}, counted, new_bs)


def _store_fast(model: str, ev: BlockStored, now: dict[int, int], deltas: dict[int, int]) -> bool:
    """Store ``ev``'s blocks in ``now`` (hash -> key); False if one would be keyless or a copy."""
    if ev.parent_hash is None:
        parent: int | None = K.root_key(model, ev.lora_name, ev.cache_salt)
    else:
        parent = now.get(ev.parent_hash)
        if parent is None:
            return False
    hashes = ev.block_hashes
    keys = K.prompt_keys(parent, ev.token_ids, ev.block_size, limit=len(hashes))
    if len(keys) < len(hashes):
        return False
    for h, key in zip(hashes, keys):
        if h in now:
            return False
        now[h] = key
        deltas[key] = deltas.get(key, 0) + 1
    return True


def _pack_changes(changes: list[tuple[int, int, int | None, int]]) -> tuple[bytes, bytes, bytes]:
    """The apply script's entry sections (see write_entries): writes and deletions grouped per
    (medium, bucket), and the changed extra copies."""
    sets: dict[tuple[int, int], list[bytes]] = {}
    dels: dict[tuple[int, int], list[bytes]] = {}
    xdel: list[bytes] = []
    xset: list[bytes] = []
    for idx, h, key, extra in changes:
        group, hb = (idx, h & BUCKET_MASK), h.to_bytes(8, "big")
        if key is None:
            fields = dels.get(group)
            if fields is None:
                dels[group] = [hb]
            else:
                fields.append(hb)
        else:
            value = b"o" if key == ORPHAN else key.to_bytes(8, "big")
            fields = sets.get(group)
            if fields is None:
                sets[group] = [hb, value]
            else:
                fields += (hb, value)
        if extra != UNCHANGED:
            field = b"%d:%s" % (idx, hb)
            if extra:
                xset += (field, b"%d" % extra)
            else:
                xdel.append(field)
    return (_packb(_columns(sets, with_bucket=True)) if sets else b"",
            _packb(_columns(dels, with_bucket=False)) if dels else b"",
            _packb([xdel, xset]) if xdel or xset else b"")


def _columns(groups: dict[tuple[int, int], list[bytes]], *, with_bucket: bool) -> list[list[Any]]:
    """Groups as write_entries takes them: medium indexes, bucket digits, (buckets,) sizes, items."""
    keys = list(groups)
    out: list[list[Any]] = [[i for i, _ in keys], [_DIGITS[b] for _, b in keys]]
    if with_bucket:
        out.append([b for _, b in keys])
    out.append([len(f) for f in groups.values()])
    out.append([x for f in groups.values() for x in f])
    return out


def _read_groups(hashes: list[int]) -> tuple[bytes, list[int]]:
    """The read script's hashes grouped per bucket (msgpack, see read_worker), and the hashes in
    that order."""
    groups: dict[int, list[int]] = {}
    for h in hashes:
        group = groups.get(h & BUCKET_MASK)
        if group is None:
            groups[h & BUCKET_MASK] = [h]
        else:
            group.append(h)
    order = [h for hs in groups.values() for h in hs]
    return _packb([[_DIGITS[b] for b in groups], [len(hs) for hs in groups.values()],
                   [h.to_bytes(8, "big") for h in order]]), order


def _pack_holders(base: str, holders: dict[tuple[str, int], int]) -> bytes:
    """The holder changes as write_holders takes them (b"": none)."""
    if not holders:
        return b""
    prefixes = {t: f"{base}{t}:".encode() for t in "gcd"}
    names = [prefixes[t] + k.to_bytes(8, "big") for t, k in holders]
    offload = any(t != "g" and d > 0 for (t, _), d in holders.items())
    return _packb([names, list(holders.values()), 1 if offload else 0])


def _apply_args(base: str, seq: int, epoch: int, force: str | None, cleared: bool, name: str, view: _WorkerView,
                plan: _Plan) -> list[str | bytes]:
    """The apply script's arguments; a view of version "*" was not read (nothing to check)."""
    if view.version == "*":
        read_bs = "*"
    else:
        read_bs = "" if view.block_size is None else str(view.block_size)
    sets, dels, extras = _pack_changes(plan.changes)
    holders = _pack_holders(base, plan.holders)
    return [str(seq), str(epoch), "-" if force is None else "+" + force, "1" if cleared else "0", name,
            view.version, read_bs, "" if plan.new_block_size is None else str(plan.new_block_size),
            "1" if plan.reset else "0", "\n".join(plan.media), str(plan.orphans), sets, dels, extras, holders,
            str(plan.counted)]


class RedisPreciseStore:
    """``PreciseStore`` on one Redis (or one Redis Cluster slot per model)."""

    name = "redis"

    def __init__(self, client: aioredis.Redis, *, prefix: str = "kvi") -> None:
        if client.get_encoder().decode_responses:
            raise ValueError("RedisPreciseStore needs a client with decode_responses=False (it stores binary hashes)")
        self._client = client
        self._prefix = prefix
        self._url = client_url(client)
        self._source = precise_script()
        self._script = client.register_script(self._source)
        self._gen: str | None = None
        self._bases: dict[str, str] = {}  # model -> key prefix (ids never change within a generation)
        # model -> block size as last read or set here: a query's keys need it before its one round
        # trip; it changes only by configuration (set_block_size), never back to unknown
        self._block_sizes: dict[str, int] = {}
        self._ready_pods: set[tuple[str, str]] = set()

    # -- plumbing ------------------------------------------------------------------------------
    async def _call(self, make: Callable[[], Awaitable[Any]], *, idempotent: bool = True) -> Any:
        """Await ``make()``; a dropped connection is retried once when the call is idempotent (a
        pooled connection that died with its server fails first), then reported as unavailable.
        A connection that timed out is not retried: the server is there but not answering (a
        network cut), and a retry would only double the wait for the caller's 503."""
        for attempt in (0, 1):
            try:
                return await make()
            except rex.ConnectionError as exc:
                timed_out = isinstance(exc.__cause__, (rex.TimeoutError, TimeoutError))
                if attempt or not idempotent or timed_out:
                    raise self._unavailable(exc) from None
            except (rex.TimeoutError, TimeoutError, OSError) as exc:
                raise self._unavailable(exc) from None
            except rex.ResponseError as exc:
                raise StoreUnavailable(f"redis at {self._url}: refused: {exc}".splitlines()[0]) from None

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"redis at {self._url}: {type(exc).__name__}: {exc}".splitlines()[0])

    def _lost(self) -> StoreLost:
        return StoreLost(f"redis at {self._url}: the store's generation changed since open (its data was lost)")

    async def open(self) -> None:
        """Load the script and read (or create) the store's generation; again after StoreLost."""
        gen_key = f"{self._prefix}:gen"
        await self._call(lambda: self._client.set(gen_key, secrets.token_hex(8), nx=True))
        self._gen = _text(await self._call(lambda: self._client.get(gen_key)))
        await self._call(lambda: self._client.script_load(self._source))
        self._bases.clear()
        self._block_sizes.clear()
        self._ready_pods.clear()

    async def _ensure(self, model: str, pod: str | None = None) -> str:
        """The model's key prefix, its slot checked once per process; registers the pod's model."""
        if self._gen is None:
            raise StoreUnavailable(f"redis at {self._url}: store not opened")
        base = self._bases.get(model)
        if base is None:
            base = self._bases[model] = await self._register(model)
        if pod is not None and (pod, model) not in self._ready_pods:
            await self._call(lambda: self._client.hset(f"{self._prefix}:pods", pod, model))
            self._ready_pods.add((pod, model))
        return base

    async def _register(self, model: str) -> str:
        """The model's short id (``<prefix>:mid``; the first client to need one allocates it) and
        its slot's generation copy: set if absent, then the store's generation read after it, so
        a store that restarted in between is found lost."""
        mids, gen_key = f"{self._prefix}:mid", f"{self._prefix}:gen"
        if _text(await self._call(lambda: self._client.get(gen_key))) != self._gen:
            raise self._lost()
        mid = await self._call(lambda: self._client.hget(mids, model))
        if mid is None:
            fresh = await self._call(lambda: self._client.incr(mids + ":n"))
            await self._call(lambda: self._client.hsetnx(mids, model, fresh))
            mid = await self._call(lambda: self._client.hget(mids, model))
        base = model_base(self._prefix, int(mid))

        async def check() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.set(base + "gen", self._gen, nx=True, get=True)
            pipe.get(gen_key)
            return await pipe.execute()
        old, gen = await self._call(check)
        if _text(gen) != self._gen or _text(old) not in (None, self._gen):
            raise self._lost()
        return base

    async def _run(self, base: str, op: str, *args: Any, stream: str = "", idempotent: bool = True) -> list[Any]:
        keys, argv = [base + "gen", base + "s:" + stream], [op, self._gen, base, *args]
        reply = await self._call(lambda: self._script(keys=keys, args=argv), idempotent=idempotent)
        if reply and _text(reply[0]) == "lost":
            raise self._lost()
        return reply

    async def _models(self) -> list[str]:
        async def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.get(f"{self._prefix}:gen")
            pipe.hkeys(f"{self._prefix}:mid")
            return await pipe.execute()
        gen, models = await self._call(read)
        if self._gen is None or _text(gen) != self._gen:
            raise self._lost()
        return sorted(_text(m) for m in models)

    async def _each_model(self, op: str, *args: Any) -> list[tuple[str, list[Any]]]:
        """Run one op on every model's slot (pipelined): for pod-wide reads and clears."""
        models = await self._models()
        bases = [await self._ensure(m) for m in models]
        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for base in bases:
                await self._script(keys=[base + "gen", base + "s:"], args=[op, self._gen, base, *args], client=pipe)
            return await pipe.execute()
        replies = await self._call(run)
        if any(r and _text(r[0]) == "lost" for r in replies):
            raise self._lost()
        return list(zip(models, replies))

    # -- streams -------------------------------------------------------------------------------
    async def apply(self, stream: StreamRef, seq: int, epoch: int, dp_rank: int, events: Sequence[KVEvent],
                    *, force: str | None = None) -> ApplyResult:
        base = await self._ensure(stream.model, stream.pod)
        name = f"{dp_rank}|{stream.pod}"
        hashes = _hashes_of(events)
        cleared = any(type(ev) is AllBlocksCleared for ev in events)
        blind = not hashes and not any(type(ev) is BlockStored for ev in events)  # nothing to read
        for _ in range(RETRIES):
            if blind:  # clears only (or nothing): one round trip, computed on an empty worker
                view = _WorkerView(None, None, "*", (), 0, {})
            else:
                packed, order = _read_groups(hashes)
                view = _view_of(await self._run(base, "read", name, packed, stream=stream.id), order)
                outcome = judge(view.position, seq, epoch, force)
                if outcome is not Outcome.APPLIED:
                    return ApplyResult(outcome, view.position or Position(epoch=epoch))
            plan = plan_batch(stream.pod, stream.model, dp_rank, events, view, hashes)
            args = _apply_args(base, seq, epoch, force, cleared, name, view, plan)
            reply = await self._run(base, "apply", *args, stream=stream.id)
            status = _text(reply[0])
            if status == "retry":
                continue
            pos = _position(*reply[1:5])
            if status != "applied":
                return ApplyResult(Outcome(status), pos or Position(epoch=epoch))
            assert pos is not None
            return ApplyResult(Outcome.APPLIED, pos, plan.done)
        raise StoreUnavailable(f"redis at {self._url}: worker {name} kept changing under {RETRIES} attempts")

    async def restart(self, stream: StreamRef, seen_epoch: int, ranks: Iterable[int] | None) -> Position:
        base = await self._ensure(stream.model, stream.pod)
        spec = "*" if ranks is None else ",".join(str(r) for r in ranks)
        if spec == "":
            spec = ","  # no rank: nothing to clear
        reply = await self._run(base, "restart", stream.pod, str(seen_epoch), spec, stream=stream.id)
        return _position(*reply[1:5]) or Position()

    async def position(self, stream: StreamRef) -> Position | None:
        base = await self._ensure(stream.model)
        reply = await self._run(base, "pos", stream=stream.id)
        return _position(*reply[1:5])

    async def set_position(self, stream: StreamRef, position: Position) -> None:
        base = await self._ensure(stream.model, stream.pod)
        q = "" if position.last_seq is None else str(position.last_seq)
        await self._run(base, "setpos", q, str(position.epoch), "1" if position.synced else "0",
                        "-" if position.reason is None else "+" + position.reason, stream=stream.id)

    # -- models and pods -----------------------------------------------------------------------
    async def set_block_size(self, model: str, block_size: int) -> None:
        await self._run(await self._ensure(model), "setbs", str(block_size))
        self._block_sizes[model] = block_size

    async def block_size(self, model: str) -> int | None:
        """The model's block size; once known, from this client's memory (no round trip: a
        query's only round trip is its walk). Unknown sizes are read every time."""
        known = self._block_sizes.get(model)
        if known is not None:
            return known
        reply = await self._run(await self._ensure(model), "getbs")
        if reply[1] is None:
            return None
        bs = self._block_sizes[model] = int(reply[1])
        return bs

    async def block_sizes(self) -> dict[str, int]:
        out = {}
        for model, reply in await self._each_model("getbs"):
            if reply[1] is not None:
                out[model] = int(reply[1])
        return out

    async def clear_pod(self, pod: str, dp_rank: int | None = None) -> None:
        await self._each_model("clear", pod, "*" if dp_rank is None else str(dp_rank))

    async def _dump(self, pod: str) -> list[tuple[str, int, str, dict[int, int], dict[tuple[str, int], int], int]]:
        """(pod, rank, medium, hash -> key, (medium, hash) -> extra, orphans) per worker medium."""
        out = []
        for _, workers in await self._each_model("dump", pod):
            for item in workers:
                rank, _, wpod = _text(item[0]).partition("|")
                media = _text(item[1]).split("\n")
                extra: dict[tuple[str, int], int] = {}
                flat = item[-1]
                for i in range(0, len(flat), 2):
                    idx, _, h = flat[i].partition(b":")
                    extra[(media[int(idx) - 1], int.from_bytes(h, "big"))] = int(flat[i + 1])
                for j, medium in enumerate(media):
                    blocks = item[3 + j]
                    entries = {int.from_bytes(blocks[i], "big"): _key_or_orphan(blocks[i + 1])
                               for i in range(0, len(blocks), 2)}
                    out.append((wpod, int(rank), medium, entries, extra, int(item[2] or 0) if j == 0 else 0))
        return out

    async def pods(self) -> list[str]:
        return sorted({_text(n).partition("|")[2] for _, names in await self._each_model("names") for n in names})

    async def blocks_held(self, pod: str) -> dict[str, int]:
        out = {"gpu": 0, "cpu": 0, "disk": 0, "orphans": 0}
        for _, counts in await self._each_model("held", pod):
            for name, n in zip(("gpu", "cpu", "disk", "orphans"), counts):
                out[name] += int(n)
        return out

    async def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]:
        out: dict[int, dict[int, int | None]] = {}
        for _, rank, _, entries, _, _ in await self._dump(pod):
            out.setdefault(rank, {}).update({h: None if k == ORPHAN else k for h, k in entries.items()})
        return out

    # -- queries -------------------------------------------------------------------------------
    async def match(self, keys: Sequence[int], pods: Iterable[str] | None = None, *,
                    model: str | None = None) -> dict[str, PodMatch]:
        """Longest prefix of ``keys`` per pod. ``model`` names the slot to walk (one round trip);
        without it every model's slot is walked."""
        if not keys:
            return {}
        wanted = None if pods is None else sorted(set(pods))
        if wanted == []:
            return {}
        args = ["-1"] if wanted is None else [str(len(wanted)), *wanted]
        args.append(struct.pack(f">{len(keys)}Q", *keys))
        if model is not None:
            replies = [await self._run(await self._ensure(model), "match", *args)]
        else:
            replies = [r for _, r in await self._each_model("match", *args)]
        return _per_pod(replies)

    # -- state out and in ----------------------------------------------------------------------
    async def export_entries(self) -> list[Entry]:
        """Every held entry, one pod at a time (each pod's entries are one point in time; a script
        never blocks the store for the whole fleet)."""
        out = []
        dumps = [item for pod in await self.pods() for item in await self._dump(pod)]
        for pod, rank, medium, entries, extra, _ in dumps:
            for h, key in entries.items():
                out.append(Entry(pod, rank, medium, h, None if key == ORPHAN else key, 1 + extra.get((medium, h), 0)))
        return out

    async def load_entries(self, entries: Iterable[Entry]) -> int:
        entries = list(entries)
        if not entries:
            return 0
        models = await self._call(lambda: self._client.hmget(f"{self._prefix}:pods", sorted({e.pod for e in entries})))
        model_of = dict(zip(sorted({e.pod for e in entries}), (_text(m) for m in models)))
        unknown = sorted(p for p, m in model_of.items() if m is None)
        if unknown:
            raise ValueError(f"load_entries: no model known for pod(s) {', '.join(unknown)} (apply or set_position first)")
        by_model: dict[str, list[str | bytes]] = {}
        for e in entries:
            by_model.setdefault(model_of[e.pod], []).extend(
                [f"{e.dp_rank}|{e.pod}", e.medium, _u64(e.hash), b"o" if e.key is None else _u64(e.key), str(e.copies)])
        for model, args in by_model.items():
            await self._run(await self._ensure(model), "load", *args, idempotent=False)
        return len(entries)

    async def close(self) -> None:
        """Nothing to release: the client is the caller's (it may serve other stores too)."""
        return None


def _per_pod(replies: list[list[Any]]) -> dict[str, PodMatch]:
    """Per-worker depths (name, gpu, cpu, disk) into per-pod matches, as PreciseIndex._per_pod."""
    out: dict[str, PodMatch] = {}
    for flat in replies:
        for i in range(0, len(flat), 4):
            rank, _, pod = _text(flat[i]).partition("|")
            g, c, d = int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3])
            prev = out.get(pod)
            if prev is None:
                out[pod] = PodMatch(g, c, d, {int(rank): g})
            else:
                prev.dp[int(rank)] = g
                out[pod] = PodMatch(max(prev.gpu, g), max(prev.cpu, c), max(prev.disk, d), prev.dp)
    return out
