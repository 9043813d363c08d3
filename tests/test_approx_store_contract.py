"""The approximate-index store contract, one suite run against both backends.

Every test taking ``make_store`` runs twice: on ``MemoryApproxStore(ApproxIndex(config))`` and on
``RedisApproxStore`` over the session's real redis-server (``redis_url``). Expectations are the
semantics of reference/approx-index.md (Kthena main and GIE v1.5.0), written out, plus every case
of fixtures/vectors/approx-vectors.json. Redis-only tests at the end: a differential run against
the memory backend, two clients sharing beliefs, and a real server stopped, killed and restarted.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvindex.approx.hashing import hash_request, render_request
from kvindex.index.approx import ApproxIndex
from kvindex.index.memory import MemoryApproxStore
from kvindex.index.protocol import StoreLost, StoreUnavailable
from kvindex.index.redis_approx import RedisApproxStore
from kvindex.index.redis_cluster import cluster_client
from kvindex.settings import GIE_V1_5, ApproxConfig, ApproxSettings
from kvindex.storeurl import is_cluster
from tests.redis_server import RedisServer

VECTORS = json.loads((Path(__file__).parent.parent / "fixtures" / "vectors" / "approx-vectors.json")
                     .read_text(encoding="utf-8"))
KTHENA = VECTORS["kthena"]
GIE = VECTORS["gie_v1_5_0_approx_prefix"]
MakeStore = Callable[..., Any]


def kthena_config(**table: Any) -> ApproxConfig:
    return ApproxConfig(ApproxSettings.from_toml(table))


def gie_config(**table: Any) -> ApproxConfig:
    return ApproxConfig(ApproxSettings.from_toml({"personality": GIE_V1_5, **table}))


@pytest.fixture(params=["memory", "redis", "cluster"])
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[MakeStore]:
    """``make(config, on_evict=None)`` -> an open store of this run's backend. Redis stores made in
    one test share one (emptied) server or 3-master cluster, as replicas do."""
    clients: list[Any] = []
    fixture = {"redis": "redis_url", "cluster": "redis_cluster_url"}.get(request.param)
    url = request.getfixturevalue(fixture) if fixture else None

    async def make(config: ApproxConfig, on_evict: Callable[[str], None] | None = None) -> Any:
        if url is None:
            return MemoryApproxStore(ApproxIndex(config, on_evict=on_evict))
        client = cluster_client(url, socket_timeout=5, connect_timeout=5) if is_cluster(url) else aioredis.from_url(url)
        clients.append(client)
        store = RedisApproxStore(client, config, on_evict=on_evict)
        await store.open()
        return store

    yield make
    for client in clients:
        await client.aclose()


# --- every case of the vectors ---------------------------------------------------------------


async def test_kthena_hash_cases(make_store: MakeStore) -> None:
    store = await make_store(ApproxConfig(ApproxSettings.from_toml(KTHENA["defaults"])))
    for case in KTHENA["hash_cases"]:
        body = case["request_body"]
        hashes = hash_request(store.config, body["model"], body)
        assert hashes == case["hashes"], case["name"]
        if case["rendered"] is not None:
            assert render_request(store.config.for_model(body["model"]), body) == case["rendered"]
        await store.record("pod", body["model"], hashes)
        assert await store.match(body["model"], hashes, ["pod", "other"]) == {"pod": len(hashes), "other": 0}
        assert all([await store.believes("pod", body["model"], h) for h in hashes])


async def test_gie_hash_cases(make_store: MakeStore) -> None:
    store = await make_store(ApproxConfig(ApproxSettings.defaults(GIE_V1_5)))
    for i, case in enumerate(GIE["hash_cases"]):
        body = case["request_body"]
        hashes = hash_request(store.config, body["model"], body)
        assert hashes == case["hashes_v1_5_0"], case["name"]
        await store.record(f"pod-{i}", body["model"], hashes)
        found = await store.match(body["model"], hashes, [f"pod-{i}", "other"])
        assert found == {f"pod-{i}": len(hashes), "other": 0}


@pytest.mark.parametrize("scenario", KTHENA["scoring_scenarios"], ids=lambda s: s["name"])
async def test_kthena_scoring_scenario(make_store: MakeStore, scenario: dict[str, Any]) -> None:
    evicted: list[str] = []
    store = await make_store(kthena_config(**scenario["config"]), evicted.append)
    for step in scenario["steps"]:
        model = step["request_body"]["model"]
        hashes = hash_request(store.config, model, step["request_body"])
        assert len(hashes) == step["num_hashes"]
        if step["op"] == "record":
            await store.record(step["pod"], model, hashes)
            assert await store.entries() == step["expect_entries_gauge_after"]
            assert dict(Counter(evicted)) == step["expect_evictions_total_after"]
            assert await store.evictions() == sum(step["expect_evictions_total_after"].values())
            assert all([await store.believes(step["pod"], model, h) for h in hashes])
            continue
        before = await store.export_state()
        for _ in range(2):  # queries change nothing
            matches = await store.match(model, hashes, step["candidates"])
            assert matches == {p: step["expect_match_lengths_topk"].get(p, 0) for p in step["candidates"]}
            assert await store.score(model, hashes, step["candidates"]) == step["expect_scores"]
            assert max(matches.values()) / len(hashes) == step["expect_match_ratio_observed"]
        assert await store.export_state() == before


# --- Kthena LRU ------------------------------------------------------------------------------


async def test_kthena_record_evicts_deepest_blocks_first(make_store: MakeStore) -> None:
    evicted: list[str] = []
    store = await make_store(kthena_config(maxHashCacheSize=3), evicted.append)
    await store.record("p", "m", [1, 2, 3, 4, 5])
    assert await store.entries("p") == 3 and await store.evictions() == 2 and evicted == ["m", "m"]
    assert [await store.believes("p", "m", h) for h in (1, 2, 3, 4, 5)] == [True, True, True, False, False]
    assert await store.match("m", [1, 2, 3, 4, 5], ["p"]) == {"p": 3}
    assert (await store.export_state())["kthena"]["p"] == {"capacity": 3, "keys": [[3, "m"], [2, "m"], [1, "m"]]}


async def test_kthena_refresh_moves_to_most_recent_without_eviction(make_store: MakeStore) -> None:
    store = await make_store(kthena_config(maxHashCacheSize=3))
    await store.record("p", "m", [1, 2, 3])  # oldest first: 3, 2, 1
    await store.record("p", "m", [3])  # refresh: 2, 1, 3
    assert await store.evictions() == 0 and await store.entries() == 3
    await store.match("m", [2], ["p"])  # lookups never touch recency
    await store.depth("m", [2], ["p"])
    await store.record("p", "m", [9])  # evicts 2
    assert await store.evictions() == 1
    assert [await store.believes("p", "m", h) for h in (1, 2, 3, 9)] == [True, False, True, True]
    assert (await store.export_state())["kthena"]["p"]["keys"] == [[1, "m"], [3, "m"], [9, "m"]]


async def test_kthena_lru_per_pod_shared_across_models(make_store: MakeStore) -> None:
    evicted: list[str] = []
    store = await make_store(kthena_config(maxHashCacheSize=2), evicted.append)
    await store.record("p", "a", [1])
    await store.record("p", "b", [1])  # same hash, other model: a distinct key
    await store.record("q", "a", [1, 2])
    assert await store.evictions() == 0 and await store.entries() == 4 and await store.entries("q") == 2
    await store.record("p", "b", [3])  # evicts (1, "a"): the evicted key's model is reported
    assert evicted == ["a"]
    assert not await store.believes("p", "a", 1)
    assert await store.believes("p", "b", 1) and await store.believes("q", "a", 1)
    assert await store.match("a", [1], ["p", "q"]) == {"p": 0, "q": 1}


async def test_kthena_capacity_fixed_at_first_record(make_store: MakeStore) -> None:
    config = ApproxConfig(ApproxSettings(max_hash_cache_size=2), {"big": ApproxSettings(max_hash_cache_size=10)})
    store = await make_store(config)
    await store.record("p", "m", [])  # even an empty record fixes the pod's capacity
    await store.record("p", "big", [1, 2, 3, 4])
    assert await store.entries("p") == 2 and await store.evictions() == 2
    await store.record("q", "big", [1, 2, 3, 4])
    await store.record("q", "m", [5, 6])
    assert await store.entries("q") == 6 and await store.evictions() == 2
    state = await store.export_state()
    assert {pod: s["capacity"] for pod, s in state["kthena"].items()} == {"p": 2, "q": 10}
    assert await store.pods() == ["p", "q"]


async def test_empty_record_gives_no_entries_and_zero_scores(make_store: MakeStore) -> None:
    store = await make_store(ApproxConfig())
    hashes = hash_request(store.config, "m", {"input": []})
    assert hashes == []
    await store.record("p", "m", hashes)
    assert await store.entries() == 0 and await store.pods() == []
    assert await store.score("m", hashes, ["p", "q"]) == {"p": 0, "q": 0}
    assert await store.export_state() == {"kthena": {"p": {"capacity": 50000, "keys": []}}, "gie": {}, "evictions": 0}


async def test_kthena_unknown_model_duplicates_and_new_pods(make_store: MakeStore) -> None:
    store = await make_store(ApproxConfig())
    await store.record("p", "m", [1, 2])
    assert await store.score("other", [1, 2], ["p"]) == {"p": 0}
    assert await store.score("m", [1, 2], ["p", "new", "p"]) == {"p": 100, "new": 0}
    assert await store.score("m", [], ["p"]) == {"p": 0}
    assert await store.match("m", [1, 2], []) == {}
    assert await store.score("m", [1, 2, 3], ["p"]) == {"p": 66}


@pytest.mark.parametrize("m,n,score", [(29, 50, 57), (29, 100, 28), (57, 100, 56), (58, 100, 57), (1, 3, 33)])
async def test_kthena_score_float64_truncation(make_store: MakeStore, m: int, n: int, score: int) -> None:
    store = await make_store(ApproxConfig())
    hashes = list(range(1, n + 1))
    await store.record("p", "m", hashes[:m])
    assert await store.score("m", hashes, ["p"]) == {"p": score}


async def test_u64_hashes_stay_exact(make_store: MakeStore) -> None:
    """Hashes beyond 2**53 differ in their last bits; a double would merge them."""
    store = await make_store(kthena_config(maxHashCacheSize=4))
    big = [2**64 - 1, 2**53, 2**53 + 1, 2**63 + 12345]
    await store.record("p", "m", big[:1] + big[1:2])
    assert [await store.believes("p", "m", h) for h in big] == [True, True, False, False]
    assert await store.match("m", [2**64 - 1, 2**53 + 1], ["p"]) == {"p": 1}
    await store.record("p", "m", big[2:])
    state = await store.export_state()
    assert state["kthena"]["p"]["keys"] == [[2**53, "m"], [2**64 - 1, "m"], [2**63 + 12345, "m"], [2**53 + 1, "m"]]


# --- top-k cut-off ---------------------------------------------------------------------------


async def test_kthena_tie_at_cut_off_goes_to_sorted_pod_names(make_store: MakeStore) -> None:
    store = await make_store(kthena_config(topKMatches=2))
    for pod in ("pod-c", "pod-a", "pod-b"):
        await store.record(pod, "m", [1, 2])
    await store.record("pod-d", "m", [1])
    assert await store.match("m", [1, 2], ["pod-d", "pod-c", "pod-b", "pod-a"]) == {
        "pod-d": 0, "pod-c": 0, "pod-b": 2, "pod-a": 2}
    assert await store.score("m", [1, 2], ["pod-c", "pod-a"]) == {"pod-c": 100, "pod-a": 100}
    assert await store.depth("m", [1, 2], ["pod-d", "pod-c", "pod-b", "pod-a"]) == {
        "pod-d": 1, "pod-c": 2, "pod-b": 2, "pod-a": 2}


# Code-point order (Python's str order). Byte-wise strcoll in a UTF-8 locale, UTF-16 order (the
# astral emoji before U+FF5E) or case-folding collations (pod-Z after pod-e) would all differ.
UNICODE_PODS_SORTED = ["Pod-A", "pod-Z", "pod-e", "pod-z", "pod-é", "pod-ω", "pod-日本", "pod-～", "pod-😀",
                       "Ωmega"]


async def test_kthena_ties_sorted_by_code_point_for_any_utf8_pod_name(make_store: MakeStore) -> None:
    assert sorted(UNICODE_PODS_SORTED) == UNICODE_PODS_SORTED
    pods = UNICODE_PODS_SORTED[::-1]
    for top_k in range(1, len(pods) + 1):
        store = await make_store(kthena_config(topKMatches=top_k))
        await store.record("pod-deep", "m", [1, 2, 3])
        for pod in pods:
            await store.record(pod, "m", [1, 2])
        found = await store.match("m", [1, 2, 3], ["pod-deep", *pods])
        winners = [p for p, n in found.items() if n]
        assert found["pod-deep"] == 3
        assert sorted(winners) == sorted(["pod-deep", *UNICODE_PODS_SORTED[: top_k - 1]])
        assert list(found) == ["pod-deep", *pods]  # answers in the candidates' order
        await store.remove_pod("pod-deep")
        for pod in pods:
            await store.remove_pod(pod)


async def test_depth_has_no_top_k_cut_off(make_store: MakeStore) -> None:
    store = await make_store(ApproxConfig())
    hashes = hash_request(store.config, "m", {"model": "m", "prompt": "y" * 500})
    pods = [f"p{i}" for i in range(8)]
    for i, p in enumerate(pods):
        await store.record(p, "m", hashes[: len(hashes) - i % 3])
    found = await store.match("m", hashes, pods)
    assert found == {"p0": 8, "p1": 7, "p2": 0, "p3": 8, "p4": 7, "p5": 0, "p6": 8, "p7": 0}
    assert await store.depth("m", hashes, pods) == {p: len(hashes) - i % 3 for i, p in enumerate(pods)}
    assert await store.depth("m", hashes, []) == {}


# --- GIE -------------------------------------------------------------------------------------


async def test_gie_forward_walk_and_float_scores(make_store: MakeStore) -> None:
    store = await make_store(gie_config())
    await store.record("a", "m", [1, 2, 3])
    await store.record("b", "m", [1, 2])
    await store.record("c", "m", [2])
    assert await store.match("m", [1, 2, 3, 4], ["a", "b", "c", "d"]) == {"a": 3, "b": 2, "c": 1, "d": 0}
    assert await store.score("m", [1, 2, 3, 4], ["a", "b", "d"]) == {"a": 0.75, "b": 0.5, "d": 0.0}
    assert await store.match("m", [9, 2, 3], ["a", "c"]) == {"a": 0, "c": 0}  # stops at the first miss
    assert await store.score("m", [], ["a"]) == {"a": 0}
    # every holder of a visited hash counts, candidates or not; the walk stops only when nobody holds
    assert await store.depth("m", [1, 2, 3], ["c"]) == {"c": 1}


async def test_gie_has_no_top_k_and_no_model_index(make_store: MakeStore) -> None:
    store = await make_store(gie_config())
    for pod in "abcdefg":
        await store.record(pod, "m1", [1, 2])
    assert await store.match("m2", [1, 2], list("abcdefg")) == dict.fromkeys("abcdefg", 2)
    assert await store.believes("a", "m2", 1)


async def test_gie_record_order_and_stale_quirk(make_store: MakeStore) -> None:
    evicted: list[str] = []
    store = await make_store(ApproxConfig(ApproxSettings(GIE_V1_5, 64, 256, 2, 5)), evicted.append)
    await store.record("p", "m", [1, 2, 3])  # LRU adds 1, 2, 3: 1 is evicted, then re-inserted in the map
    assert await store.entries("p") == 2 and evicted == ["m"]
    assert await store.believes("p", "m", 1)  # stale belief, as in GIE v1.5.0
    await store.record("p", "m", [4])  # evicts 2: first block first means oldest first
    assert [await store.believes("p", "m", h) for h in (1, 2, 3, 4)] == [True, False, True, True]
    assert await store.match("m", [1, 2, 3], ["p"]) == {"p": 1}
    assert (await store.export_state())["gie"] == {"p": {"capacity": 2, "keys": [3, 4], "stale": [1]}}
    assert evicted == ["m", "m"] and await store.evictions() == 2


async def test_gie_stale_beliefs_are_bounded(make_store: MakeStore) -> None:
    store = await make_store(ApproxConfig(ApproxSettings(GIE_V1_5, 64, 256, 2, 5)))
    await store.record("p", "m", [1, 2, 3, 4, 5, 6])  # 1..4 evicted by the same call; cap keeps 2 stale
    assert [await store.believes("p", "m", h) for h in range(1, 7)] == [False, False, True, True, True, True]
    await store.record("p", "m", [3])  # re-added to the LRU: no longer stale
    assert await store.entries("p") == 2 and await store.believes("p", "m", 3)
    assert (await store.export_state())["gie"]["p"] == {"capacity": 2, "keys": [6, 3], "stale": [4]}


async def test_gie_capacity_fixed_at_first_record(make_store: MakeStore) -> None:
    config = ApproxConfig(ApproxSettings(GIE_V1_5, 64, 256, 2, 5), {"big": ApproxSettings(GIE_V1_5, 64, 256, 9, 5)})
    evicted: list[str] = []
    store = await make_store(config, evicted.append)
    await store.record("p", "m", [1])
    await store.record("p", "big", [2, 3, 4])
    assert await store.entries("p") == 2 and evicted == ["big", "big"]  # GIE: the recorded model
    assert (await store.export_state())["gie"]["p"]["capacity"] == 2


async def test_gie_and_kthena_stores_are_separate(make_store: MakeStore) -> None:
    store = await make_store(ApproxConfig(ApproxSettings(), {"g": ApproxSettings.defaults(GIE_V1_5)}))
    await store.record("p", "k", [1, 2])
    await store.record("p", "g", [1, 2])
    assert await store.entries("p") == 4 and await store.entries() == 4 and await store.pods() == ["p"]
    assert await store.believes("p", "k", 1) and await store.believes("p", "g", 1)
    assert not await store.believes("p", "other-kthena-model", 1)
    assert await store.score("g", [1, 2], ["p"]) == {"p": 1.0}
    assert await store.score("k", [1, 2], ["p"]) == {"p": 100}


# --- removal, counts, state ------------------------------------------------------------------


async def test_remove_pod_drops_everything_without_counting_evictions(make_store: MakeStore) -> None:
    config = ApproxConfig(ApproxSettings(max_hash_cache_size=4), {"g": ApproxSettings(GIE_V1_5, 64, 256, 2, 5)})
    store = await make_store(config)
    await store.record("p", "m", [1, 2, 3, 4, 5])
    await store.record("p", "g", [7, 8, 9])
    await store.record("q", "m", [1, 2])
    assert await store.evictions() == 2 and await store.entries() == 8
    assert await store.entries("p") == 6 and await store.entries("q") == 2 and await store.entries("nobody") == 0
    assert await store.pods() == ["p", "q"]
    await store.remove_pod("p")
    assert await store.pods() == ["q"] and await store.entries("p") == 0 and await store.entries() == 2
    assert await store.evictions() == 2
    assert not await store.believes("p", "m", 1) and not await store.believes("p", "g", 7)
    assert await store.match("m", [1, 2], ["p", "q"]) == {"p": 0, "q": 2}
    await store.remove_pod("q")
    await store.remove_pod("never-seen")
    assert await store.pods() == [] and await store.entries() == 0
    assert await store.export_state() == {"kthena": {}, "gie": {}, "evictions": 2}


def reference_state() -> dict[str, Any]:
    """A state built by the memory index (the shape both backends must accept)."""
    config = ApproxConfig(ApproxSettings(max_hash_cache_size=3), {"g": ApproxSettings(GIE_V1_5, 64, 256, 2, 5)})
    index = ApproxIndex(config)
    index.record("p", "m", [1, 2, 3, 4])
    index.record("p", "n", [2**64 - 1])
    index.record("pod-é", "m", [1, 2])
    index.record("p", "g", [5, 6, 7, 8])
    index.record("q", "g", [5])
    return index.export_state()


async def test_export_load_round_trip(make_store: MakeStore) -> None:
    config = ApproxConfig(ApproxSettings(max_hash_cache_size=3), {"g": ApproxSettings(GIE_V1_5, 64, 256, 2, 5)})
    evicted: list[str] = []
    store = await make_store(config, evicted.append)
    state = reference_state()
    await store.record("old", "m", [42])
    assert await store.load_state(state) == 3 + 2 + 2 + 1
    assert await store.export_state() == state
    assert await store.pods() == ["p", "pod-é", "q"] and await store.evictions() == state["evictions"]
    assert not await store.believes("old", "m", 42)
    assert await store.believes("p", "g", 5) and await store.believes("p", "n", 2**64 - 1)  # 5: stale
    await store.record("p", "m", [9])  # the loaded LRU order decides what is evicted: (2, m)
    assert evicted == ["m"] and not await store.believes("p", "m", 2)
    assert await store.match("m", [1, 2, 3], ["p", "pod-é"]) == {"p": 1, "pod-é": 2}
    exported = await store.export_state()
    assert await store.load_state(json.loads(json.dumps(exported))) == await store.entries()
    assert await store.export_state() == exported


async def test_loaded_lru_above_capacity_shrinks_one_key_per_new_key(make_store: MakeStore) -> None:
    """A loaded state may hold more keys than the capacity: refreshes evict nothing, each new key
    evicts exactly the oldest one (as ``_LRU.add`` does), in both personalities."""
    config = ApproxConfig(ApproxSettings(), {"g": ApproxSettings.defaults(GIE_V1_5)})
    evicted: list[str] = []
    store = await make_store(config, evicted.append)
    await store.load_state({"kthena": {"p": {"capacity": 2, "keys": [[1, "m"], [2, "m"], [3, "m"], [4, "m"]]}},
                            "gie": {"p": {"capacity": 2, "keys": [1, 2, 3, 4], "stale": []}}})
    await store.record("p", "m", [2])
    await store.record("p", "g", [2])
    assert evicted == [] and await store.entries("p") == 8
    await store.record("p", "m", [9])
    await store.record("p", "g", [9])
    assert evicted == ["m", "g"] and await store.entries("p") == 8
    state = await store.export_state()
    assert state["kthena"]["p"]["keys"] == [[3, "m"], [4, "m"], [2, "m"], [9, "m"]]
    assert state["gie"]["p"] == {"capacity": 2, "keys": [3, 4, 2, 9], "stale": []}
    assert not await store.believes("p", "m", 1) and not await store.believes("p", "g", 1)


BAD_STATES = [
    ("not_a_mapping", ["kthena"]),
    ("missing_capacity", {"kthena": {"p": {"keys": []}}}),
    ("key_not_a_pair", {"kthena": {"p": {"capacity": 2, "keys": [[1]]}}}),
    ("hash_not_a_number", {"kthena": {"p": {"capacity": 2, "keys": [["x", "m"]]}}}),
    ("gie_missing_stale", {"gie": {"p": {"capacity": 2, "keys": [1]}}}),
    ("gie_not_a_mapping", {"gie": 5}),
    ("bad_evictions", {"evictions": "many"}),
]


@pytest.mark.parametrize("state", [pytest.param(s, id=i) for i, s in BAD_STATES])
async def test_load_refuses_a_bad_shape_and_changes_nothing(make_store: MakeStore, state: Any) -> None:
    store = await make_store(ApproxConfig())
    await store.record("p", "m", [1, 2])
    before = await store.export_state()
    with pytest.raises(ValueError, match="not an approximate index state"):
        await store.load_state(state)
    assert await store.export_state() == before and await store.entries() == 2


# --- Redis only: the same answers as memory, shared beliefs, failures --------------------------


def _random_ops(rng: random.Random, n: int) -> list[tuple[Any, ...]]:
    pods = ["a", "b", "c", "é", "日", "Z", "😀", *(f"p{i}" for i in range(17))]  # > 16: both lookup paths
    models = ["k1", "k2", "g1"]
    ops: list[tuple[Any, ...]] = []
    for _ in range(n):
        kind = rng.random()
        hashes = [rng.randrange(12) + (2**63 if rng.random() < 0.3 else 0) for _ in range(rng.randrange(7))]
        if kind < 0.6:
            ops.append(("record", rng.choice(pods), rng.choice(models), hashes))
        elif kind < 0.95:
            ops.append(("query", rng.choice(models), hashes, rng.sample(pods, rng.randrange(1, len(pods) + 1))))
        else:
            ops.append(("remove", rng.choice(pods)))
    return ops


async def test_redis_answers_equal_memory_on_random_operations(redis_url: str) -> None:
    config = ApproxConfig(ApproxSettings(max_hash_cache_size=6, top_k_matches=2),
                          {"k2": ApproxSettings(max_hash_cache_size=3, top_k_matches=1),
                           "g1": ApproxSettings(GIE_V1_5, 64, 256, 3, 5)})
    client = aioredis.from_url(redis_url)
    try:
        for seed in range(4):
            mem_ev: list[str] = []
            red_ev: list[str] = []
            memory = MemoryApproxStore(ApproxIndex(config, on_evict=mem_ev.append))
            red = RedisApproxStore(client, config, on_evict=red_ev.append, prefix=f"diff{seed}")
            await red.open()
            for op in _random_ops(random.Random(seed), 300):
                await _same_answer(memory, red, op)
            assert red_ev == mem_ev
            assert await red.export_state() == await memory.export_state()
            assert await red.entries() == await memory.entries() and await red.pods() == await memory.pods()
    finally:
        await client.aclose()


async def _same_answer(memory: MemoryApproxStore, red: RedisApproxStore, op: tuple[Any, ...]) -> None:
    if op[0] == "record":
        await memory.record(*op[1:])
        await red.record(*op[1:])
        assert await red.entries(op[1]) == await memory.entries(op[1])
        assert await red.evictions() == await memory.evictions()
    elif op[0] == "query":
        model, hashes, pods = op[1:]
        assert await red.match(model, hashes, pods) == await memory.match(model, hashes, pods)
        assert await red.depth(model, hashes, pods) == await memory.depth(model, hashes, pods)
        assert await red.score(model, hashes, pods) == await memory.score(model, hashes, pods)
    else:
        await memory.remove_pod(op[1])
        await red.remove_pod(op[1])


async def test_two_clients_share_beliefs(redis_url: str) -> None:
    config = kthena_config(maxHashCacheSize=2)
    one, two = aioredis.from_url(redis_url), aioredis.from_url(redis_url, decode_responses=True)
    try:
        seen_one: list[str] = []
        seen_two: list[str] = []
        a = RedisApproxStore(one, config, on_evict=seen_one.append)
        b = RedisApproxStore(two, config, on_evict=seen_two.append)
        await a.open()
        await b.open()
        assert a.generation == b.generation
        assert await b.score("m", [1, 2], ["p", "q"]) == {"p": 0, "q": 0}
        await a.record("p", "m", [1, 2])
        assert await b.score("m", [1, 2], ["p", "q"]) == {"p": 100, "q": 0}
        await b.record("p", "m", [3])  # b's record evicts what a recorded; b is told, a is not
        assert seen_two == ["m"] and seen_one == []
        assert await a.evictions() == 1 and await a.match("m", [1, 2], ["p"]) == {"p": 1}
        assert await a.export_state() == await b.export_state()
        await b.remove_pod("p")
        assert await a.pods() == [] and await a.entries() == 0
    finally:
        await one.aclose()
        await two.aclose()


async def test_store_unavailable_then_lost_after_restart(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    client = aioredis.from_url(server.url, socket_connect_timeout=2, socket_timeout=2)
    try:
        store = RedisApproxStore(client, ApproxConfig())
        await store.open()
        await store.record("p", "m", [1, 2])
        server.stop()
        for call in (store.record("p", "m", [3]), store.score("m", [1, 2], ["p"]), store.entries(), store.open()):
            with pytest.raises(StoreUnavailable) as info:
                await call
            assert not isinstance(info.value, StoreLost) and "\n" not in str(info.value)
            assert str(info.value).startswith("redis approx store unreachable: ")
        server.start()  # a new, empty server: what the store held is gone
        for call in (store.score("m", [1, 2], ["p"]), store.record("p", "m", [3]), store.pods()):
            with pytest.raises(StoreLost):
                await call
        assert await client.dbsize() == 0  # the refused record wrote nothing
        await store.open()  # a new generation: an empty index, usable again
        assert await store.score("m", [1, 2], ["p"]) == {"p": 0}
        await store.record("p", "m", [1, 2])
        assert await store.entries() == 2
        await client.delete("{kvi:approx}:gen")  # the generation vanished (e.g. flushed)
        with pytest.raises(StoreLost):
            await store.entries()
    finally:
        await client.aclose()
        server.stop()


async def test_timeout_is_store_unavailable(tmp_path: Path) -> None:
    """A server that stops answering (SIGSTOP) gives StoreUnavailable, then works again."""
    server = RedisServer(tmp_path / "redis").start()
    client = aioredis.from_url(server.url, socket_timeout=0.3, retry=Retry(NoBackoff(), 0))
    try:
        store = RedisApproxStore(client, ApproxConfig())
        await store.open()
        await store.record("p", "m", [1, 2])
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(StoreUnavailable, match="^redis approx store unreachable: .*[Tt]imeout") as info:
                await store.score("m", [1, 2], ["p"])
            assert not isinstance(info.value, StoreLost) and "\n" not in str(info.value)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert await store.score("m", [1, 2], ["p"]) == {"p": 100}
    finally:
        await client.aclose()
        server.stop()


def test_every_lua_file_is_a_script_or_a_part_of_one() -> None:
    """The scripts are package data (kvindex/index/lua/*.lua): each file is used, each approximate
    script starts with its shebang line (Redis reads the flags there), the guard and then the prelude."""
    from importlib.resources import files

    from kvindex.index.redis_scripts import (
        APPROX,
        READ,
        WRITE,
        approx_scripts,
        lua,
        precise_script,
    )
    names = {p.name[:-4] for p in (files("kvindex.index") / "lua").iterdir() if p.name.endswith(".lua")}
    assert names == {"store_guard", "redis_precise", "approx_prelude"} | {part for _, parts in APPROX.values() for part in parts}
    scripts = approx_scripts()
    assert set(scripts) == set(APPROX)
    for name, src in scripts.items():
        shebang = APPROX[name][0]
        assert shebang in (READ, WRITE) and src.startswith(shebang + lua("store_guard") + lua("approx_prelude")), name
    assert "local op, base = ARGV[1], ARGV[3]" in precise_script()


async def test_unopened_store_refuses(redis_url: str) -> None:
    client = aioredis.from_url(redis_url)
    try:
        with pytest.raises(StoreUnavailable, match="open"):
            await RedisApproxStore(client, ApproxConfig()).record("p", "m", [1])
    finally:
        await client.aclose()


def test_benchmark_smoke_run_agrees_with_memory(tmp_path: Path) -> None:
    """benchmarks/redis_approx.py --smoke runs end to end; both backends gave the same answers."""
    out = tmp_path / "redis_approx.json"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "redis_approx.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=100, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    for res in doc["latency"].values():
        assert res["answers_equal"] is True and res["entries"] > 0
        ops = {"record_refresh", "record_new", "score", "depth", "record_plus_score_p50"}
        assert ops <= set(res["ratio_redis_vs_memory"])
    assert all(m["entries"] > 0 and m["used_memory_delta_bytes"] > 0 for m in doc["memory"].values())
