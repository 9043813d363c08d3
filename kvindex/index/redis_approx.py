"""The approximate index on Redis: one set of beliefs shared by every kvindex replica and router.

Job: ``ApproxStore`` on Redis: each operation one script (``lua/approx_*.lua``), its arguments and
its reply; the connection's failures as the contract's errors.

Semantics are exactly ``kvindex.index.approx.ApproxIndex`` (and so ``MemoryApproxStore``): both
personalities, Kthena's per-pod LRU of ``(hash, model)`` (deepest block first, refresh-only
re-adds, synchronous eviction, capacity fixed at the pod's first record) and GIE v1.5.0's per-pod
LRU of hashes (first block first, stale beliefs capped at the pod's capacity). Rendering and
hashing stay in this process (``render_request`` / ``hash_body``); only beliefs live in Redis.

Key layout, all under ONE hash tag ``T = {<prefix>:approx}``::

    T:gen                  the store's generation (random id, SET NX by the first opener)
    T:entries  T:evictions  counters: sum of LRU lengths; capacity evictions (store-wide)
    T:k:cap                HASH pod -> capacity of its Kthena LRU (present iff the LRU exists)
    T:k:lru:<pod>          ZSET "<hash> <model>", score = per-pod recency counter (oldest lowest)
    T:k:h:<hash>:<model>   HASH pod -> "" : the pods believed to hold the block (Kthena index)
    T:g:cap                HASH pod -> capacity of its GIE LRU (0: stale beliefs only, no LRU)
    T:g:lru:<pod>          ZSET of hashes, score = recency counter
    T:g:stale:<pod>        ZSET of stale hashes (GIE's quirk), score = insertion counter
    T:g:h:<hash>           HASH pod -> "" (GIE index, no model)

Holders are HASH fields rather than SET members: a small HASH is a listpack (compact) on every
Redis 7 and Valkey, a small SET of strings only from Redis 7.2 on.

Why one tag: a Kthena pod's LRU is shared by all models on that pod, so one record may evict
another model's key and touch that model's hash -> pods set; and a hash -> pods set spans pods.
No per-model or per-pod tag keeps a record's keys in one slot, so the whole approximate index
is one slot: correct on Redis Cluster (every script touches one slot; the scripts carry a
``#!lua`` shebang, so Redis refuses any cross-slot access instead of silently allowing it), but
the index is bounded by one node's memory and one node's CPU: it does not spread over shards.
benchmarks/redis_approx.py measures about 300 bytes per entry (190 when 4 pods share each
block) on Redis 7.0, so 64 pods x 50000 entries is about 1 GB on one node; past that, give each
router fleet its own prefix (a separate tag, so a separate slot).
On a cluster each script first checks that its node is a master seen at open (else ``StoreLost``)
and that its slot is not migrating (else ``StoreUnavailable``): ``kvindex.index.redis_cluster``.
Scripts declare only ``T:gen`` in KEYS and build the other names inside the same tag. Their
sources are ``kvindex/index/lua/approx_*.lua`` (assembled by ``redis_scripts.approx_scripts``).

Invariants:
- Every operation is ONE script (EVALSHA): ``record`` applies a whole request atomically and
  returns what it evicted; ``match``/``depth``/``score`` walk the prefix server-side in one round
  trip. Every script first checks ``T:gen`` against the generation read at ``open()``: missing or
  different -> ``StoreLost`` and nothing changed. Write scripts are flagged (``#!lua``): Redis
  refuses them up front when out of memory, and never stops one midway for memory, so a record
  never half-applies.
- u64 hashes travel as decimal strings and are never converted to Lua numbers (doubles); only
  counters and capacities are numbers.
- Holders tied at the Kthena top-k cut-off are ordered here, in Python (``sorted`` over ``str``:
  code-point order for any pod name), not by Lua, whose string ``<`` is ``strcoll``. The server
  returns each depth's newly matched candidates up to the depth where the cut-off falls.
- ``entries`` counts LRU keys (both personalities), ``T:entries`` is kept equal to that sum by
  every script. Connection or timeout errors -> ``StoreUnavailable`` with a one-line reason.
  A refused connection changed nothing; after a timeout the server may still run the script it
  received (a record then lands late; recording again only refreshes the same keys).
- The caller owns the Redis client; ``close()`` does not close it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis import exceptions as rx

from kvindex.index.approx import (
    ApproxIndex,
    score_matches,
)
from kvindex.index.protocol import StoreLost, StoreUnavailable
from kvindex.index.redis_cluster import cluster_url, is_cluster, master_guard
from kvindex.index.redis_scripts import approx_scripts
from kvindex.settings import GIE_V1_5, ApproxConfig

LOST_MARK = "KVI_LOST"
# a node unreachable, a cluster down, a slot not covered: unavailable (a script refused: ResponseError)
UNAVAILABLE = (rx.ConnectionError, rx.TimeoutError, OSError, rx.RedisClusterException, rx.ClusterError)

def _text(value: Any) -> str:
    """A reply element as text (the client may or may not decode responses)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _cut_off(levels: list[Any], top_k: int) -> dict[str, int]:
    """Kthena's top-k from the server's ``[depth, count, pods...]`` runs, deepest first: holders of
    one depth in sorted pod-name order (Python ``str`` order), stopping at ``top_k`` pods."""
    matches: dict[str, int] = {}
    i = 0
    while i < len(levels):
        depth, count = int(levels[i]), int(levels[i + 1])
        for pod in sorted(_text(p) for p in levels[i + 2 : i + 2 + count]):
            matches[pod] = depth
            if len(matches) >= top_k:
                return matches
        i += 2 + count
    return matches


def _hash_text(hashes: Iterable[int]) -> str:
    """Hashes as the scripts take them: decimal text, space-separated (never a Lua number)."""
    return " ".join([str(int(h)) for h in hashes])


def _load_blob(state: dict[str, Any]) -> bytes:
    """A normalised ``export_state()`` as the load script's msgpack argument (hashes as text)."""
    kthena = [[pod, int(saved["capacity"]), [str(x) for key in saved["keys"] for x in key]]
              for pod, saved in state["kthena"].items()]
    gie = [[pod, int(saved["capacity"]), [str(h) for h in saved["keys"]], [str(h) for h in saved["stale"]]]
           for pod, saved in state["gie"].items()]
    return msgpack.packb({"evictions": str(int(state["evictions"])), "kthena": kthena, "gie": gie})


def _parse_export(reply: list[Any]) -> dict[str, Any]:
    """The export script's reply in ``ApproxIndex.export_state()``'s shape."""
    kthena: dict[str, Any] = {}
    for pod, cap, members in reply[1]:
        keys = [_text(m).split(" ", 1) for m in members]
        kthena[_text(pod)] = {"capacity": int(cap), "keys": [[int(h), model] for h, model in keys]}
    gie: dict[str, Any] = {}
    for pod, cap, keys, stale in reply[2]:
        gie[_text(pod)] = {"capacity": int(cap), "keys": [int(h) for h in keys],
                           "stale": [int(h) for h in stale]}
    return {"kthena": kthena, "gie": gie, "evictions": int(reply[0])}


class RedisApproxStore:
    """``ApproxStore`` on Redis (see the module docstring for the layout and its invariants)."""

    name = "redis"

    def __init__(self, client: aioredis.Redis, config: ApproxConfig, *,
                 on_evict: Callable[[str], None] | None = None, prefix: str = "kvi") -> None:
        self._client = client
        self._config = config
        self._on_evict = on_evict
        self._gen_key = f"{{{prefix}:approx}}:gen"
        self._gen: str | None = None
        self._guard = ""  # on a cluster: "@ <replid>= ..." of every master at open (redis_cluster)
        self._sources = approx_scripts()
        self._scripts = {name: client.register_script(src) for name, src in self._sources.items()}

    @property
    def config(self) -> ApproxConfig:
        return self._config

    @property
    def generation(self) -> str | None:
        """The store generation read at ``open()`` (None before)."""
        return self._gen

    async def open(self) -> None:
        """Load the scripts; read the store's generation, creating it if the store is new."""
        fresh = uuid.uuid4().hex
        try:
            for src in self._sources.values():
                await self._client.script_load(src)
            old = await self._client.set(self._gen_key, fresh, nx=True, get=True)
            if is_cluster(self._client):  # every master's replication id (redis_cluster)
                self._guard = await master_guard(self._client, cluster_url(self._client), self._plain)
        except UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis approx store unreachable: {_one_line(exc)}") from None
        except rx.ResponseError as exc:
            raise StoreUnavailable(f"redis approx store refused open: {_one_line(exc)}") from None
        self._gen = fresh if old is None else _text(old)

    async def _run(self, script: str, *args: Any) -> Any:
        """Run one script with the generation guard; map Redis failures to the contract's errors."""
        if self._gen is None:
            raise StoreUnavailable("redis approx store: open() was not called")
        try:
            return await self._scripts[script](keys=[self._gen_key], args=[self._gen + self._guard, *args])
        except UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis approx store unreachable: {_one_line(exc)}") from None
        except rx.ResponseError as exc:
            if LOST_MARK in str(exc):
                raise StoreLost("redis approx store lost its state (generation vanished or changed)") from None
            raise StoreUnavailable(f"redis approx store refused {script}: {_one_line(exc)}") from None

    @staticmethod
    async def _plain(make: Callable[[], Any]) -> Any:
        """A call of open() whose failures open() maps (a refused CONFIG: ``... refused: ``)."""
        try:
            return await make()
        except rx.ResponseError as exc:
            raise StoreUnavailable(f"redis approx store: refused: {_one_line(exc)}") from None

    def _is_gie(self, model: str) -> bool:
        return self._config.for_model(model).personality == GIE_V1_5

    async def record(self, pod: str, model: str, hashes: Sequence[int]) -> None:
        """One atomic script; ``on_evict`` once per eviction it caused, after it returns."""
        settings = self._config.for_model(model)
        texts = _hash_text(hashes)
        if settings.personality == GIE_V1_5:
            count = await self._run("record_gie", pod, settings.max_hash_cache_size, texts)
            evicted = [model] * int(count)
        else:
            reply = await self._run("record_kthena", pod, model, settings.max_hash_cache_size, texts)
            evicted = [_text(m) for m in reply]
        if self._on_evict is not None:
            for evicted_model in evicted:
                self._on_evict(evicted_model)

    async def _walk(self, model: str, hashes: Sequence[int], candidates: list[str], top_k: int) -> dict[str, int]:
        """Matched blocks per candidate (0 for misses), candidates' order, one round trip."""
        if not hashes or not candidates:
            return dict.fromkeys(candidates, 0)
        texts, pods = _hash_text(hashes), msgpack.packb(candidates)
        if self._is_gie(model):
            counts = await self._run("match_gie", pods, texts)
            return {pod: int(c) for pod, c in zip(candidates, counts)}
        levels = await self._run("match_kthena", model, top_k, pods, texts)
        found = _cut_off(levels, top_k)
        return {pod: found.get(pod, 0) for pod in candidates}

    async def match(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        candidates = list(dict.fromkeys(pods))
        return await self._walk(model, hashes, candidates, self._config.for_model(model).top_k_matches)

    async def depth(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        candidates = list(dict.fromkeys(pods))
        return await self._walk(model, hashes, candidates, max(len(candidates), 1))

    async def score(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int | float]:
        matches = await self.match(model, hashes, pods)
        return score_matches(self._config.for_model(model), matches, len(hashes))

    async def believes(self, pod: str, model: str, hash: int) -> bool:
        kind = "g" if self._is_gie(model) else "k"
        return bool(await self._run("believes", kind, pod, model, str(int(hash))))

    async def remove_pod(self, pod: str) -> None:
        await self._run("remove_pod", pod)

    async def pods(self) -> list[str]:
        return sorted({_text(p) for p in await self._run("pods")})

    async def entries(self, pod: str | None = None) -> int:
        return int(await self._run("entries", *([pod] if pod is not None else [])))

    async def evictions(self) -> int:
        return int(await self._run("evictions"))

    async def export_state(self) -> dict[str, Any]:
        return _parse_export(await self._run("export"))

    async def load_state(self, state: dict[str, Any]) -> int:
        """Replace everything atomically. A bad shape raises ``ValueError`` before Redis is
        touched: the state is validated and normalised by loading it into an ``ApproxIndex``."""
        scratch = ApproxIndex(self._config)
        scratch.load_state(state)
        return int(await self._run("load", _load_blob(scratch.export_state())))

    async def close(self) -> None:
        """Forget the generation; the caller owns (and closes) the Redis client."""
        self._gen = None
