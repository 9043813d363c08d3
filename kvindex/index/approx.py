"""The approximate index: what a router believes each pod caches, fed by its routing decisions.

It stores and matches block hashes; rendering and hashing a request (per personality) are
``kvindex.approx.hashing``'s job, never this module's.

Two personalities, each with its own store (a pod may appear in both):

``kthena`` (default) — Kthena main's prefix-cache plugin:
- Store: ``model -> hash -> pods`` plus one LRU per pod keyed ``(hash, model)`` with capacity
  ``maxHashCacheSize`` shared by all models on that pod.
- Record inserts the deepest block first; re-adding a key only refreshes it; a new key beyond
  capacity evicts the pod's oldest key synchronously (pod leaves that hash's set; empty sets go).
- Match walks from the deepest hash down, candidates only, and stops at ``topKMatches`` pods.
  Score is ``int((m / n) * 100)`` (float64 then truncation, as Go computes it).

``gie-v1.5`` — GIE v1.5.0's approx-prefix-cache-producer (byte mode):
- Store: ``hash -> pods`` (no per-model index) plus one LRU of hashes per pod.
- Record adds first block first to the LRU, then adds the pod to every hash's set, so hashes the
  same call evicted come back as stale beliefs (GIE's quirk, kept on purpose).
- Match walks forward and stops at the first hash nobody holds; every holder of each visited
  hash gets +1. Score is ``m / n`` as a float in [0, 1].

Invariants:
- Memory is bounded by the LRU capacities: a Kthena index entry exists iff its key is in the
  pod's LRU; GIE stale beliefs are capped per pod at the pod's capacity (beyond that the oldest
  stale belief is dropped — the one place this differs from GIE, which keeps them forever).
- Each pod's LRU capacity is fixed when the pod is first recorded, from the settings of the
  model being recorded (identical to upstream when one setting applies to all models).
- Lookups never change LRU recency. Removing a pod counts no eviction.
- No module state: everything lives in an ``ApproxIndex`` instance built from ``ApproxConfig``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from kvindex.settings import GIE_V1_5, ApproxConfig, ApproxSettings

K = TypeVar("K", bound=Hashable)


# --- scoring ---------------------------------------------------------------------------------


def score_matches(settings: ApproxSettings, matches: Mapping[str, int], n: int) -> dict[str, int | float]:
    """Scores from matched blocks out of ``n``: Kthena ``int((m / n) * 100)`` in 0..100 (float64
    then truncated, e.g. 29/50 -> 57); GIE ``m / n`` in [0, 1]. No hashes: every pod scores 0."""
    if n == 0:
        return {pod: 0 for pod in matches}
    if settings.personality == GIE_V1_5:
        return {pod: m / n for pod, m in matches.items()}
    return {pod: int((m / n) * 100) for pod, m in matches.items()}


# --- LRU -------------------------------------------------------------------------------------


class _LRU(Generic[K]):
    """Keys in recency order (oldest first). ``add`` returns the key it evicted, if any."""

    __slots__ = ("capacity", "_keys")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[K, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[K]:
        return iter(self._keys)

    def add(self, key: K) -> K | None:
        """Existing key: refresh only. New key: insert; evict the oldest beyond capacity."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return None
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            return self._keys.popitem(last=False)[0]
        return None

    def discard(self, key: K) -> None:
        self._keys.pop(key, None)


def _lru_for(lrus: dict[str, _LRU[K]], pod: str, capacity: int) -> _LRU[K]:
    """The pod's LRU; created with ``capacity`` on the pod's first record (then fixed)."""
    lru = lrus.get(pod)
    if lru is None:
        lru = lrus[pod] = _LRU(capacity)
    return lru


def _drop_holder(index: dict[int, set[str]], key: int, pod: str) -> None:
    """Remove ``pod`` from ``index[key]``, deleting the set when it empties."""
    holders = index.get(key)
    if holders is not None:
        holders.discard(pod)
        if not holders:
            del index[key]


# --- Kthena store ----------------------------------------------------------------------------


class _KthenaStore:
    """``model -> hash -> pods`` plus per-pod LRUs of ``(hash, model)``; an entry iff in an LRU."""

    def __init__(self, on_evict: Callable[[str], None]) -> None:
        self._index: dict[str, dict[int, set[str]]] = {}
        self._lrus: dict[str, _LRU[tuple[int, str]]] = {}
        self._on_evict = on_evict

    def record(self, pod: str, model: str, hashes: Sequence[int], settings: ApproxSettings) -> None:
        lru = _lru_for(self._lrus, pod, settings.max_hash_cache_size)
        for h in reversed(hashes):
            self._index.setdefault(model, {}).setdefault(h, set()).add(pod)
            evicted = lru.add((h, model))
            if evicted is not None:
                self._forget(pod, evicted)
                self._on_evict(evicted[1])

    def _forget(self, pod: str, key: tuple[int, str]) -> None:
        by_hash = self._index.get(key[1])
        if by_hash is not None:
            _drop_holder(by_hash, key[0], pod)
            if not by_hash:
                del self._index[key[1]]

    def match(
        self, model: str, hashes: Sequence[int], candidates: set[str], top_k: int
    ) -> dict[str, int]:
        """Deepest-first lookup, candidates only, stopping once ``top_k`` pods matched.

        Holders of one hash are visited in sorted pod-name order, so ties at the cut-off go to
        the smallest names (Kthena visits them in Go map order, i.e. randomly).
        """
        by_hash = self._index.get(model)
        matches: dict[str, int] = {}
        if not by_hash:
            return matches
        for i in range(len(hashes) - 1, -1, -1):
            for pod in sorted(by_hash.get(hashes[i], ())):
                if pod in candidates and pod not in matches:
                    matches[pod] = i + 1
                    if len(matches) >= top_k:
                        return matches
        return matches

    def believes(self, pod: str, model: str, h: int) -> bool:
        return pod in self._index.get(model, {}).get(h, ())

    def remove_pod(self, pod: str) -> None:
        for key in list(self._lrus.pop(pod, ())):
            self._forget(pod, key)

    def entries(self, pod: str | None) -> int:
        if pod is not None:
            return len(self._lrus.get(pod, ()))
        return sum(len(lru) for lru in self._lrus.values())

    def pods(self) -> set[str]:
        return {pod for pod, lru in self._lrus.items() if len(lru)}


# --- GIE v1.5.0 store ------------------------------------------------------------------------


class _GieStore:
    """``hash -> pods`` plus per-pod LRUs of hashes, and per-pod stale beliefs (GIE's quirk)."""

    def __init__(self, on_evict: Callable[[str], None]) -> None:
        self._index: dict[int, set[str]] = {}
        self._lrus: dict[str, _LRU[int]] = {}
        self._stale: dict[str, OrderedDict[int, None]] = {}
        self._on_evict = on_evict

    def record(self, pod: str, model: str, hashes: Sequence[int], settings: ApproxSettings) -> None:
        """First block first into the LRU (evicting), then the pod joins every hash's set."""
        lru = _lru_for(self._lrus, pod, settings.max_hash_cache_size)
        stale = self._stale.get(pod) or self._stale.setdefault(pod, OrderedDict())
        for h in hashes:
            stale.pop(h, None)
            evicted = lru.add(h)
            if evicted is not None:
                _drop_holder(self._index, evicted, pod)
                self._on_evict(model)
        for h in hashes:
            self._index.setdefault(h, set()).add(pod)
            if h not in lru:
                self._remember_stale(pod, stale, h, lru.capacity)
        if not stale:
            del self._stale[pod]

    def _remember_stale(self, pod: str, stale: OrderedDict[int, None], h: int, cap: int) -> None:
        """Keep a stale belief (GIE keeps them forever); beyond ``cap`` drop the oldest."""
        stale[h] = None
        stale.move_to_end(h)
        if len(stale) > cap:
            _drop_holder(self._index, stale.popitem(last=False)[0], pod)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Forward walk; stop at the first hash no pod holds; +1 per visited hash per holder."""
        counts: dict[str, int] = {}
        for h in hashes:
            holders = self._index.get(h)
            if not holders:
                break
            for pod in holders:
                counts[pod] = counts.get(pod, 0) + 1
        return counts

    def believes(self, pod: str, h: int) -> bool:
        return pod in self._index.get(h, ())

    def remove_pod(self, pod: str) -> None:
        keys = list(self._lrus.pop(pod, ())) + list(self._stale.pop(pod, ()))
        for h in keys:
            _drop_holder(self._index, h, pod)

    def entries(self, pod: str | None) -> int:
        if pod is not None:
            return len(self._lrus.get(pod, ()))
        return sum(len(lru) for lru in self._lrus.values())

    def pods(self) -> set[str]:
        return {pod for pod, lru in self._lrus.items() if len(lru)} | set(self._stale)


# --- the index -------------------------------------------------------------------------------


class ApproxIndex:
    """The router's beliefs, per pod, for every model; personality chosen per model by config.

    ``on_evict(model)`` is called once per capacity eviction (Kthena: the evicted key's model;
    GIE, whose LRU keys carry no model: the model being recorded). ``evictions`` is the total.
    Not thread-safe: use it from one event loop.
    """

    def __init__(self, config: ApproxConfig, on_evict: Callable[[str], None] | None = None) -> None:
        self._config = config
        self._user_on_evict = on_evict
        self.evictions = 0
        self.on_record: Callable[[str, str, Sequence[int]], None] | None = None  # the write-ahead log
        self._kthena = _KthenaStore(self._evicted)
        self._gie = _GieStore(self._evicted)

    @property
    def config(self) -> ApproxConfig:
        return self._config

    def _evicted(self, model: str) -> None:
        self.evictions += 1
        if self._user_on_evict is not None:
            self._user_on_evict(model)

    def _is_gie(self, model: str) -> bool:
        return self._config.for_model(model).personality == GIE_V1_5

    def record(self, pod: str, model: str, hashes: Sequence[int]) -> None:
        """Record that ``pod`` served a request with these block hashes (evicts synchronously)."""
        settings = self._config.for_model(model)
        store = self._gie if settings.personality == GIE_V1_5 else self._kthena
        store.record(pod, model, hashes, settings)
        if self.on_record is not None:
            self.on_record(pod, model, hashes)

    def match(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        """Matched blocks for every candidate pod (0 for misses), in the order given.

        Kthena: deepest-first lookup over candidates only; at most ``topKMatches`` pods get a
        non-zero length (the deepest ones); pods tied at the cut-off are taken in sorted
        pod-name order (upstream order is Go map order, i.e. random). GIE: forward walk.
        """
        candidates = list(dict.fromkeys(pods))
        if self._is_gie(model):
            found = self._gie.match(hashes)
        else:
            top_k = self._config.for_model(model).top_k_matches
            found = self._kthena.match(model, hashes, set(candidates), top_k)
        return {pod: found.get(pod, 0) for pod in candidates}

    def depth(self, model: str, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        """Each pod's matched blocks with no top-k cut-off: what the index believes of every pod
        (the drift audit's question), not what the router's lookup returns."""
        candidates = list(dict.fromkeys(pods))
        if self._is_gie(model):
            return self.match(model, hashes, candidates)
        found = self._kthena.match(model, hashes, set(candidates), max(len(candidates), 1))
        return {pod: found.get(pod, 0) for pod in candidates}

    def score(
        self, model: str, hashes: Sequence[int], pods: Iterable[str]
    ) -> dict[str, int | float]:
        """Kthena: ``int((m / n) * 100)`` in 0..100 (float64 then truncated, e.g. 29/50 -> 57).

        GIE: ``m / n`` as a float in [0, 1]. No hashes: every pod scores 0.
        """
        return score_matches(self._config.for_model(model), self.match(model, hashes, pods), len(hashes))

    def believes(self, pod: str, model: str, hash: int) -> bool:
        if self._is_gie(model):
            return self._gie.believes(pod, hash)
        return self._kthena.believes(pod, model, hash)

    def remove_pod(self, pod: str) -> None:
        """Forget ``pod`` in both stores (deleted or NotReady). Counts no eviction."""
        self._kthena.remove_pod(pod)
        self._gie.remove_pod(pod)

    def pods(self) -> list[str]:
        """Pods holding any belief, sorted."""
        return sorted(self._kthena.pods() | self._gie.pods())

    def entries(self, pod: str | None = None) -> int:
        """Sum of LRU lengths (Kthena's entries gauge), both personalities; one pod if given."""
        return self._kthena.entries(pod) + self._gie.entries(pod)

    def export_state(self) -> dict[str, Any]:
        """Everything the index holds: per personality, each pod's LRU in recency order (oldest
        first) with its capacity, GIE's stale beliefs, and the eviction counter."""
        return {"kthena": _export_kthena(self._kthena), "gie": _export_gie(self._gie), "evictions": self.evictions}

    def load_state(self, state: Mapping[str, Any]) -> int:
        """Replace the index's contents with an ``export_state()``; returns the entries loaded.
        Raises ``ValueError`` (nothing changed) when ``state`` is not that shape."""
        try:
            kthena, gie = _KthenaStore(self._evicted), _GieStore(self._evicted)
            _load_kthena(kthena, state.get("kthena") or {})
            _load_gie(gie, state.get("gie") or {})
            evictions = int(state.get("evictions", 0))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an approximate index state: {exc!r}") from None
        self._kthena, self._gie, self.evictions = kthena, gie, evictions
        return self.entries()


# --- state out and in (snapshots, peers) ------------------------------------------------------
# Shape (plain lists and dicts, msgpack/JSON friendly), every LRU oldest first:
# {"kthena": {pod: {"capacity": c, "keys": [[hash, model], ...]}},
#  "gie": {pod: {"capacity": c, "keys": [hash, ...], "stale": [hash, ...]}}, "evictions": n}


def _export_kthena(store: _KthenaStore) -> dict[str, Any]:
    return {pod: {"capacity": lru.capacity, "keys": [[h, m] for h, m in lru]} for pod, lru in store._lrus.items()}


def _export_gie(store: _GieStore) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pod in set(store._lrus) | set(store._stale):
        lru = store._lrus.get(pod)
        out[pod] = {"capacity": lru.capacity if lru is not None else 0, "keys": list(lru or ()),
                    "stale": list(store._stale.get(pod, ()))}
    return out


def _load_kthena(store: _KthenaStore, pods: Mapping[str, Any]) -> None:
    for pod, saved in pods.items():
        lru: _LRU[tuple[int, str]] = _LRU(int(saved["capacity"]))
        for h, model in saved["keys"]:
            lru._keys[(int(h), str(model))] = None
            store._index.setdefault(str(model), {}).setdefault(int(h), set()).add(str(pod))
        store._lrus[str(pod)] = lru


def _load_gie(store: _GieStore, pods: Mapping[str, Any]) -> None:
    for pod, saved in pods.items():
        pod = str(pod)
        if saved["capacity"]:
            lru: _LRU[int] = _LRU(int(saved["capacity"]))
            for h in saved["keys"]:
                lru._keys[int(h)] = None
                store._index.setdefault(int(h), set()).add(pod)
            store._lrus[pod] = lru
        if saved["stale"]:
            stale: OrderedDict[int, None] = OrderedDict()
            for h in saved["stale"]:
                stale[int(h)] = None
                store._index.setdefault(int(h), set()).add(pod)
            store._stale[pod] = stale

