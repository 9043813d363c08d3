"""The precise index on Redis: one store shared by every kvindex replica.

Job: ``PreciseStore`` on one Redis (or one Redis Cluster slot per model): the connection, the
round trips and the replies. Semantics are ``kvindex.index.precise.PreciseIndex``'s, reproduced
exactly: a batch is planned client-side by ``redis_plan`` (the batch applied by a scratch
``PreciseIndex`` holding the worker's entries the batch can see, then diffed), and the store
receives the differences and applies them in one server-side script (``lua/redis_precise.lua``).
Key layout and encoding: ``redis_keys``.

Invariants:
- ``apply`` = at most two round trips: a read script (position, block size, worker version, the
  model's other workers and the entries of every hash the batch names), then, unless the read already shows the batch is not to
  be applied, the apply script. It re-judges the position (``judge``/``next_position`` of kvindex.sequence),
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
from typing import Any

import redis.asyncio as aioredis

from kvindex.events import AllBlocksCleared, BlockStored, KVEvent
from kvindex.index.protocol import (
    ApplyResult,
    BlockSizeChanged,
    StoreLost,
    StoreMisconfigured,
    StoreUnavailable,
)
from kvindex.index.redis_cluster import cluster_url, is_cluster, masters_unchanged, redis_call
from kvindex.index.redis_config import watch_evictions
from kvindex.index.redis_keys import (
    WorkerView,
    client_url,
    key_of,
    model_base,
    per_pod,
    position_of,
    read_groups,
    text,
    u64,
    value_of,
    view_of,
)
from kvindex.index.redis_plan import apply_args, hashes_of, plan_batch
from kvindex.index.redis_scripts import precise_script
from kvindex.sequence import Outcome, Position, StreamRef, judge
from kvindex.types import Entry, PodMatch

RETRIES = 16  # optimistic recomputations of one batch when another writer changed its worker


class RedisPreciseStore:
    """``PreciseStore`` on one Redis (or one Redis Cluster slot per model)."""

    name = "redis"

    def __init__(self, client: aioredis.Redis, *, prefix: str = "kvi") -> None:
        if client.get_encoder().decode_responses:
            raise ValueError("RedisPreciseStore needs a client with decode_responses=False (it stores binary hashes)")
        self._client = client
        self._prefix = prefix
        self._url = cluster_url(client) if is_cluster(client) else client_url(client)
        self._source = precise_script()
        self._script = client.register_script(self._source)
        self._gen: str | None = None
        self._watch = ""  # "|<evicted keys at open>" when the server's eviction policy is unknown
        self._bases: dict[str, str] = {}  # model -> key prefix (ids never change within a generation)
        # model -> block size as last read or set here: a query's keys need it before its one round
        # trip, whose reply says the slot's size (a change, an engine's new life: BlockSizeChanged)
        self._block_sizes: dict[str, int] = {}
        self._ready_pods: set[tuple[str, str]] = set()

    # -- plumbing ------------------------------------------------------------------------------
    async def _call(self, make: Callable[[], Awaitable[Any]], *, idempotent: bool = True) -> Any:
        return await redis_call(make, self._url, idempotent=idempotent)

    def _lost(self) -> StoreLost:
        return StoreLost(f"redis at {self._url}: the store's generation changed since open (its data was lost)")

    async def open(self) -> None:
        """Load the script and read (or create) the store's generation; again after StoreLost."""
        gen_key = f"{self._prefix}:gen"
        self._watch = await watch_evictions(self._client, self._url, self._call)
        await self._call(lambda: self._client.set(gen_key, secrets.token_hex(8), nx=True))
        self._gen = text(await self._call(lambda: self._client.get(gen_key)))
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

    async def _has_id(self, model: str) -> bool:
        """Read-only: a model name a query carries is neither stored in Redis nor remembered here."""
        if self._gen is None:
            raise StoreUnavailable(f"redis at {self._url}: store not opened")
        async def probe() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.get(f"{self._prefix}:gen")
            pipe.hexists(f"{self._prefix}:mid", model)
            return await pipe.execute()
        gen, exists = await self._call(probe)
        if text(gen) != self._gen:
            raise self._lost()
        return bool(exists)

    async def _register(self, model: str) -> str:
        """The model's short id (``<prefix>:mid``; the first client to need one allocates it) and
        its slot's generation copy: set if absent, then the store's generation read after it, so
        a store that restarted in between is found lost."""
        mids, gen_key = f"{self._prefix}:mid", f"{self._prefix}:gen"
        if text(await self._call(lambda: self._client.get(gen_key))) != self._gen:
            raise self._lost()
        mid = await self._call(lambda: self._client.hget(mids, model))
        if mid is None:
            fresh = await self._call(lambda: self._client.incr(mids + ":n"))
            await self._call(lambda: self._client.hsetnx(mids, model, fresh))
            mid = await self._call(lambda: self._client.hget(mids, model))
        base = model_base(self._prefix, int(mid))

        gen_now = self._gen
        assert gen_now is not None  # _ensure checked it

        async def check() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.set(base + "gen", gen_now, nx=True, get=True)
            pipe.get(gen_key)
            return await pipe.execute()
        old, gen = await self._call(check)
        if text(gen) != self._gen or text(old) not in (None, self._gen) or \
                not await masters_unchanged(self._client, self._watch, self._call):
            raise self._lost()
        return base

    async def _run(self, base: str, op: str, *args: Any, stream: str = "", idempotent: bool = True) -> list[Any]:
        keys, argv = [base + "gen", base + "s:" + stream], [op, f"{self._gen}{self._watch}", base, *args]
        return self._judged(await self._call(lambda: self._script(keys=keys, args=argv), idempotent=idempotent))

    def _judged(self, reply: list[Any]) -> list[Any]:
        """A script's reply, or the store's guard's verdict as the contract's error."""
        if reply and reply[0] in (b"lost", b"moving", "lost", "moving"):
            if text(reply[0]) == "lost":
                raise self._lost()
            raise StoreUnavailable(f"redis at {self._url}: a slot is migrating (try again when it has moved)")
        return reply

    async def _models(self) -> list[str]:
        """Every model's name, read in one transaction with the generation (and, when watching
        evictions, the server's count of them: a model list that lost a key is a loss)."""
        watching = self._watch.startswith("|")  # one Redis (a cluster's masters: masters_unchanged)

        async def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=watching)
            pipe.get(f"{self._prefix}:gen")
            pipe.hkeys(f"{self._prefix}:mid")
            if watching:
                pipe.info("stats")
            return await pipe.execute()
        gen, models, *stats = await self._call(read)
        if self._gen is None or text(gen) != self._gen or not await masters_unchanged(self._client, self._watch, self._call):
            raise self._lost()
        if stats and int(stats[0].get("evicted_keys", 0)) > int(self._watch[1:]):
            raise self._lost()
        return sorted(text(m) for m in models)

    async def _each_model(self, op: str, *args: Any) -> list[tuple[str, list[Any]]]:
        """Run one op on every model's slot (pipelined): for pod-wide reads and clears."""
        models = await self._models()
        gen = self._gen or ""  # _models checked it
        bases = [await self._ensure(m) for m in models]

        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for base in bases:
                await self._script(keys=[base + "gen", base + "s:"], args=[op, gen + self._watch, base, *args], client=pipe)
            return await pipe.execute()
        replies = [self._judged(r) for r in await self._call(run)]
        return list(zip(models, replies))

    # -- streams -------------------------------------------------------------------------------
    async def apply(self, stream: StreamRef, seq: int, epoch: int, dp_rank: int, events: Sequence[KVEvent],
                    *, force: str | None = None) -> ApplyResult:
        base = await self._ensure(stream.model, stream.pod)
        name = f"{dp_rank}|{stream.pod}"
        hashes = hashes_of(events)
        cleared = any(type(ev) is AllBlocksCleared for ev in events)
        blind = not hashes and not any(type(ev) is BlockStored for ev in events)  # nothing to read
        for _ in range(RETRIES):
            if blind:  # clears only (or nothing): one round trip, computed on an empty worker
                view = WorkerView(None, None, "*", (), 0, {})
            else:
                packed, order = read_groups(hashes)
                view = view_of(await self._run(base, "read", name, packed, stream=stream.id), order)
                outcome = judge(view.position, seq, epoch, force)
                if outcome is not Outcome.APPLIED:
                    return ApplyResult(outcome, view.position or Position(epoch=epoch))
            plan = plan_batch(stream.pod, stream.model, dp_rank, events, view, hashes)
            args = apply_args(base, seq, epoch, force, cleared, name, view, plan)
            reply = await self._run(base, "apply", *args, stream=stream.id)
            status = text(reply[0])
            if status == "retry":
                continue
            pos = position_of(*reply[1:5])
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
        return position_of(*reply[1:5]) or Position()

    async def position(self, stream: StreamRef) -> Position | None:
        base = await self._ensure(stream.model)
        reply = await self._run(base, "pos", stream=stream.id)
        return position_of(*reply[1:5])

    async def set_position(self, stream: StreamRef, position: Position) -> None:
        base = await self._ensure(stream.model, stream.pod)
        q = "" if position.last_seq is None else str(position.last_seq)
        await self._run(base, "setpos", q, str(position.epoch), "1" if position.synced else "0",
                        "-" if position.reason is None else "+" + position.reason, stream=stream.id)

    # -- models and pods -----------------------------------------------------------------------
    async def set_block_size(self, model: str, block_size: int, *, configured: bool = False) -> int:
        base = await self._ensure(model)
        reply = await self._run(base, "setbs", str(block_size), "1" if configured else "0")
        if text(reply[0]) == "conflict":
            raise StoreMisconfigured(
                f"redis at {self._url}: model {model!r} is configured with block_size {block_size} here but "
                f"{text(reply[1])} by another replica of this store: configure every replica alike (once they "
                f"agree, DEL {base}cbs)")
        bs = self._block_sizes[model] = int(reply[1])
        return bs

    async def block_size(self, model: str) -> int | None:
        """The model's block size; once known, from this client's memory (no round trip: a
        query's only round trip is its walk, whose reply says the size the keys needed:
        ``match`` raises ``BlockSizeChanged`` when it moved on). Unknown sizes are read every time."""
        known = self._block_sizes.get(model)
        if known is not None:
            return known
        if model not in self._bases and not await self._has_id(model):
            return None  # no engine or replica named the model: a query registers nothing
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

    async def _dump(self, pod: str) -> list[tuple[str, int, str, dict[int, int | None], dict[tuple[str, int], int], int]]:
        """(pod, rank, medium, hash -> key, (medium, hash) -> extra, orphans) per worker medium."""
        out = []
        for _, workers in await self._each_model("dump", pod):
            for item in workers:
                rank, _, wpod = text(item[0]).partition("|")
                media = text(item[1]).split("\n")
                extra: dict[tuple[str, int], int] = {}
                flat = item[-1]
                for i in range(0, len(flat), 2):
                    idx, _, h = flat[i].partition(b":")
                    extra[(media[int(idx) - 1], int.from_bytes(h, "big"))] = int(flat[i + 1])
                for j, medium in enumerate(media):
                    blocks = item[3 + j]
                    entries = {int.from_bytes(blocks[i], "big"): key_of(blocks[i + 1])
                               for i in range(0, len(blocks), 2)}
                    out.append((wpod, int(rank), medium, entries, extra, int(item[2] or 0) if j == 0 else 0))
        return out

    async def pods(self) -> list[str]:
        return sorted({text(n).partition("|")[2] for _, names in await self._each_model("names") for n in names})

    async def blocks_held(self, pod: str) -> dict[str, int]:
        out = {"gpu": 0, "cpu": 0, "disk": 0, "orphans": 0}
        for _, counts in await self._each_model("held", pod):
            for name, n in zip(("gpu", "cpu", "disk", "orphans"), counts):
                out[name] += int(n)
        return out

    async def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]:
        out: dict[int, dict[int, int | None]] = {}
        for _, rank, _, entries, _, _ in await self._dump(pod):
            out.setdefault(rank, {}).update(entries)
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
        args: list[str | bytes] = ["-1"] if wanted is None else [str(len(wanted)), *wanted]
        args.append(struct.pack(f">{len(keys)}Q", *keys))
        if model is None:
            return per_pod([r[1:] for _, r in await self._each_model("match", *args)])
        reply = await self._run(await self._ensure(model), "match", *args)
        now, used = None if reply[0] is None else int(reply[0]), self._block_sizes.get(model)
        if now != used:  # an engine restarted with another block size: keys made by the one told are wrong
            if now is None:
                self._block_sizes.pop(model, None)
            else:
                self._block_sizes[model] = now
            if used is not None:
                raise BlockSizeChanged(f"model {model!r}: block size {used} -> {now}")
        return per_pod([reply[1:]])

    # -- state out and in ----------------------------------------------------------------------
    async def export_entries(self) -> list[Entry]:
        """Every held entry, one pod at a time (each pod's entries are one point in time; a script
        never blocks the store for the whole fleet)."""
        out = []
        dumps = [item for pod in await self.pods() for item in await self._dump(pod)]
        for pod, rank, medium, entries, extra, _ in dumps:
            for h, key in entries.items():
                out.append(Entry(pod, rank, medium, h, key, 1 + extra.get((medium, h), 0)))
        return out

    async def load_entries(self, entries: Iterable[Entry]) -> int:
        entries = list(entries)
        if not entries:
            return 0
        models = await self._call(lambda: self._client.hmget(f"{self._prefix}:pods", sorted({e.pod for e in entries})))
        model_of = dict(zip(sorted({e.pod for e in entries}), (text(m) for m in models)))
        unknown = sorted(p for p, m in model_of.items() if m is None)
        if unknown:
            raise ValueError(f"load_entries: no model known for pod(s) {', '.join(unknown)} (apply or set_position first)")
        by_model: dict[str, list[str | bytes]] = {}
        for e in entries:
            by_model.setdefault(model_of[e.pod], []).extend(
                [f"{e.dp_rank}|{e.pod}", e.medium, u64(e.hash), value_of(e.key), str(e.copies)])
        for model, args in by_model.items():
            await self._run(await self._ensure(model), "load", *args, idempotent=False)
        return len(entries)

    async def close(self) -> None:
        """Nothing to release: the client is the caller's (it may serve other stores too)."""
        return None

