"""The routing policies (kvindex.route.policies) and the what-if summary (kvindex.query.whatif)
on hand-computed cases: ties, a cold request, a tier split, a loaded engine; and the shadows of a
router's decisions through the real app (POST /v1/score, then POST /v1/decisions, GET /v1/whatif)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvindex.config import Config

from kvindex.query.whatif import Shadow, WhatIf, summarize
from kvindex.route.policies import (
    APPROX,
    DYNAMO,
    KTHENA,
    LOAD,
    POLICIES,
    PRECISE,
    PROFILES,
    ROUND_ROBIN,
    Policies,
    dynamo_costs,
    profile_of,
)
from kvindex.route.scorers import Active, Candidate, Load
from kvindex.settings import PRECISE_PROFILE
from tests.conftest import engine_config, ipc_endpoint
from tests.test_http import POD, meta_requests, publish_capture


def cand(pod: str, gpu: int = 0, cpu: int = 0, approx: int = 0, total: int = 10, waiting: float | None = 0.0,
         usage: float | None = 0.5, active: Active = Active()) -> Candidate:
    """``gpu`` blocks on the device, ``cpu`` more on the host only."""
    return Candidate(pod, gpu + 0.8 * cpu, total, approx, total, 16, Load(waiting, usage), (gpu, cpu, 0), active)


def test_profiles_are_llm_d_s_and_the_live_settings_name_them() -> None:
    assert dict(PROFILES[PRECISE].weights) == dict(PRECISE_PROFILE) and PROFILES[PRECISE].index == "precise"
    assert dict(PROFILES[APPROX].weights) == {"prefix-cache-scorer": 3.0, "queue-scorer": 2.0,
                                              "kv-cache-utilization-scorer": 2.0}
    assert profile_of(PRECISE_PROFILE, "precise") == PRECISE and profile_of(PRECISE_PROFILE, "approx") is None


def test_ties_are_broken_by_the_seed_alone() -> None:
    cands = [cand("a"), cand("b"), cand("c")]
    p = Policies()
    for policy in (PRECISE, APPROX, LOAD, KTHENA, DYNAMO):
        picks = {p.pick(policy, cands, seed) for seed in range(40)}
        assert picks == {"a", "b", "c"}, policy  # a three-way tie: every pod, by seed
        assert len({p.pick(policy, cands, 7) for _ in range(5)}) == 1  # the same seed, the same pick


def test_a_cold_request_goes_round_robin_in_name_order_and_by_load() -> None:
    p = Policies()
    cands = [cand("b"), cand("a"), cand("c")]
    assert [p.pick(ROUND_ROBIN, cands, 0) for _ in range(4)] == ["a", "b", "c", "a"]
    busy = [cand("a", waiting=4), cand("b", waiting=0), cand("c", waiting=2)]
    # queue-scorer: a 0, b 1, c 0.5; kv-utilization equal -> b
    assert p.pick(PRECISE, busy, 1) == p.pick(LOAD, busy, 1) == p.pick(APPROX, busy, 1) == "b"


def test_a_tier_split_counts_host_blocks_at_0_8_and_dynamo_at_0_75() -> None:
    a = cand("a", gpu=4)  # 4 blocks on the GPU
    b = cand("b", gpu=2, cpu=4)  # 2 on the GPU, 4 more on the CPU: 2 + 0.8 * 4 = 5.2 -> 5 blocks
    p = Policies()
    # precise: prefix 2 * 4/10 = 0.8 against 2 * 5/10 = 1.0 (load equal)
    assert p.pick(PRECISE, [a, b], 0) == "b"
    # dynamo: credit 4 against 2 + 0.75 * 4 = 5; cost (10 - credit) + 10 decode blocks
    assert dynamo_costs([a, b]) == {"a": 16.0, "b": 15.0} and p.pick(DYNAMO, [a, b], 0) == "b"


def test_a_loaded_engine_against_its_prefix() -> None:
    hot = cand("hot", gpu=8, approx=8, waiting=10)
    cold = cand("cold", waiting=0)
    p = Policies()
    # precise: hot 2 * 0.8 + 0.5 + 0 = 2.1, cold 0 + 0.5 + 1 = 1.5 -> hot
    assert p.pick(PRECISE, [hot, cold], 0) == "hot"
    # approx: hot 3 * 0.8 + 2 * 0.5 + 0 = 3.4, cold 0 + 1 + 2 = 3.0 -> hot; load alone: cold
    assert p.pick(APPROX, [hot, cold], 0) == "hot" and p.pick(LOAD, [hot, cold], 0) == "cold"
    assert p.pick(KTHENA, [hot, cold], 0) == "hot"  # the prefix alone
    # dynamo with requests in flight on hot: (10 + 30 - 8) + (10 + 60) = 102 against 10 + 10 = 20
    busy = cand("hot", gpu=8, active=Active(30, 60))
    assert dynamo_costs([busy, cold]) == {"hot": 102.0, "cold": 20.0} and p.pick(DYNAMO, [busy, cold], 0) == "cold"


def test_every_policy_picks_a_candidate() -> None:
    p = Policies()
    cands = [cand("x", gpu=1), cand("y", approx=3, waiting=None, usage=None)]
    assert set(p.pick_all(cands, 3)) == set(POLICIES) and set(p.pick_all(cands, 3).values()) <= {"x", "y"}
    with pytest.raises(ValueError, match="unknown policy"):
        p.pick("nope", cands, 0)


def shadow(t: float, pod: str, predicted: int, picks: dict[str, tuple[str, int]], realized: int | None = None,
           prompt: int = 100) -> Shadow:
    return Shadow(t, "pick", PRECISE, pod, prompt, predicted, realized, picks)


def test_whatif_sums_are_ratios_of_sums_and_regret_is_against_the_best() -> None:
    a = shadow(1.0, "p1", 40, {PRECISE: ("p1", 40), ROUND_ROBIN: ("p2", 0), DYNAMO: ("p3", 60)}, realized=40)
    b = shadow(2.0, "p2", 0, {PRECISE: ("p2", 0), ROUND_ROBIN: ("p1", 10), DYNAMO: ("p2", 0)}, realized=None,
               prompt=300)
    out = summarize([a, b])
    assert out["decisions"] == 2 and out["prompt_tokens"] == 400
    assert out["policies"][PRECISE] == {"decisions": 2, "predicted_tokens": 40, "agreement": 1.0,
                                        "predicted_hit_rate": 0.1, "kind": "predicted"}
    assert out["policies"][ROUND_ROBIN]["agreement"] == 0.0 and out["policies"][DYNAMO]["agreement"] == 0.5
    assert out["regret"]["tokens"] == 20 + 10 and out["regret"]["fraction_of_prompt"] == 0.075
    assert out["actual"]["realized_tokens"] == 40 and out["actual"]["realized_hit_rate"] == 0.4  # only a reported


def test_whatif_window_and_byte_bound() -> None:
    now = [10.0]
    w = WhatIf(max_bytes=3 * shadow(0, "p", 0, {PRECISE: ("p", 0)}).size(), clock=lambda: now[0])
    for t in range(5):
        w.add(shadow(float(t), "p", 0, {PRECISE: ("p", 0)}))
    assert [s.t for s in w.latest(None)] == [2.0, 3.0, 4.0]  # the oldest went first
    assert [s.t for s in w.latest(7.5)] == [3.0, 4.0] and w.added == 5


async def test_a_routers_decisions_are_shadowed_from_its_last_score(make_harness: Any, make_engine: Any,
                                                                     tmp_path: Path) -> None:
    """POST /v1/score over two pods, then the router's decision for the one holding nothing:
    shadowed from what the score saw (the real app, a real engine's recorded events)."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),)))
    await h.wait_connected()
    await publish_capture(h, engine, POD)
    r = next(r for r in meta_requests() if r["cached_tokens"])
    body = {"model": "tiny", "prompt": r.get("prompt", "x"), "token_ids": r["prompt_token_ids"]}
    status, scored = await h.post("/v1/score", {**body, "pods": [POD, "elsewhere"]})
    assert status == 200, scored
    held = scored["pods"][POD]["precise"]["tokens"]
    assert held > 0 and scored["pods"]["elsewhere"]["precise"]["tokens"] == 0
    status, _ = await h.post("/v1/decisions", {"pod": "elsewhere", "request": body, "cached_tokens": 0,
                                               "prompt_tokens": r["prompt_tokens"]})
    assert status == 200
    status, w = await h.get("/v1/whatif")
    assert status == 200 and w["decisions"] == 1, w
    assert w["policies"][PRECISE] == {"decisions": 1, "predicted_tokens": held, "agreement": 0.0,
                                      "predicted_hit_rate": round(held / r["prompt_tokens"], 6), "kind": "predicted"}
    assert w["actual"]["predicted_tokens"] == 0 and w["actual"]["decided_by"] == {"router": 1}
    assert w["regret"]["tokens"] == held and w["actual"]["realized_tokens"] == 0
    status, bad = await h.get("/v1/whatif?window=-1")
    assert status == 400 and bad["field"] == "window"
    # a decision with no score before it is not shadowed (nothing to compare it with)
    other = next(x for x in meta_requests() if x["prompt_token_ids"] != r["prompt_token_ids"])
    status, _ = await h.post("/v1/decisions", {"pod": POD, "request": {"model": "tiny", "prompt": "y",
                                                                       "token_ids": other["prompt_token_ids"]}})
    assert status == 200 and (await h.get("/v1/whatif"))[1]["decisions"] == 1
