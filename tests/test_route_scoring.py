"""The request path's pure parts, against hand-computed answers: the scorers and their weighted
sum (llm-d's formulas), the engines' /metrics parsing, a response's usage (JSON and SSE), the
in-flight table's bounds and the decision log's."""

from __future__ import annotations

import random

import pytest

from kvindex.query.ledger import DecisionLog, Entry
from kvindex.route.inflight import InFlight
from kvindex.route.load import metric_values, parse_load
from kvindex.route.scorers import (
    Candidate,
    Load,
    PrefixParams,
    best,
    combine,
    kv_utilization,
    no_hit_lru,
    prefix_cache,
    prefix_view,
    queue,
    scores,
)
from kvindex.route.usage import Usage, UsageReader
from kvindex.settings import PRECISE_PROFILE


def cand(pod: str, precise: float | None = 0, approx: int = 0, waiting: float | None = None,
         usage: float | None = None, total: int = 10) -> Candidate:
    return Candidate(pod, precise, total, approx, 20, 16, Load(waiting, usage))


def test_prefix_scorer_floors_tier_weighted_blocks_and_falls_back_to_approx() -> None:
    cands = [cand("a", precise=4.8), cand("b", precise=None, approx=5), cand("c", precise=10)]
    got = prefix_cache(cands, PrefixParams())
    assert got == {"a": 0.4, "b": 0.25, "c": 1.0}  # int(4.8)=4 of 10; b unsynced: 5 of 20 approx blocks
    assert [prefix_view(c, "precise")[2] for c in cands] == ["precise", "approx", "precise"]
    assert prefix_cache(cands, PrefixParams(index="approx")) == {"a": 0.0, "b": 0.25, "c": 0.0}
    # matchLengthWeight 0.5, scale 64 tokens: c has 10 blocks x 16 tokens -> min(1, 160/64)^2 = 1
    mixed = prefix_cache([cand("a", precise=2)], PrefixParams("precise", 0.5, 64))
    assert mixed["a"] == pytest.approx(0.5 * 0.2 + 0.5 * (32 / 64) ** 2)


def test_queue_scorer_is_min_max_and_neutral_for_unknown_load() -> None:
    cands = [cand("a", waiting=0), cand("b", waiting=5), cand("c", waiting=10), cand("d", waiting=None)]
    assert queue(cands) == {"a": 1.0, "b": 0.5, "c": 0.0, "d": 0.5}
    assert queue([cand("a", waiting=3), cand("b", waiting=3)]) == {"a": 1.0, "b": 1.0}
    assert kv_utilization([cand("a", usage=0.25), cand("b")]) == {"a": 0.75, "b": 0.5}


def test_no_hit_lru_spreads_cold_requests_and_is_neutral_on_a_hit() -> None:
    cold = [cand("a"), cand("b"), cand("c")]
    assert no_hit_lru(cold, recent=[]) == {"a": 1.0, "b": 0.5, "c": 0.0}  # never picked, by name
    assert no_hit_lru(cold, recent=["a", "b"]) == {"c": 1.0, "b": 0.5, "a": 0.0}  # a picked last: last
    assert no_hit_lru([cand("a", precise=1), cand("b")], recent=[]) == {"a": 0.5, "b": 0.5}
    assert no_hit_lru([cand("only")], recent=["only"]) == {"only": 1.0}


def test_weighted_sum_and_the_picks_of_the_precise_profile() -> None:
    # a holds the prefix but is loaded; b is idle and cold; the profile prefix 2, kv 1, queue 1
    cands = [cand("a", precise=8, waiting=4, usage=0.9), cand("b", precise=0, waiting=0, usage=0.1)]
    per = scores(cands, PRECISE_PROFILE, PrefixParams())
    totals = combine(per, PRECISE_PROFILE, ["a", "b"])
    assert totals["a"] == pytest.approx(2 * 0.8 + 1 * 0.1 + 1 * 0.0)
    assert totals["b"] == pytest.approx(2 * 0.0 + 1 * 0.9 + 1 * 1.0)
    assert best(totals, random.Random(0)) == "b"  # 1.9 > 1.7: load wins here
    heavier = {"prefix-cache-scorer": 3.0, "queue-scorer": 1.0}
    assert best(combine(scores(cands, heavier, PrefixParams()), heavier, ["a", "b"]), random.Random(0)) == "a"


def test_ties_break_at_random_and_reproducibly_with_a_seed() -> None:
    totals = {"a": 1.0, "b": 1.0, "c": 0.5}
    picks = {best(totals, random.Random(seed)) for seed in range(50)}
    assert picks == {"a", "b"}
    assert [best(totals, random.Random(7)) for _ in range(3)] == [best(totals, random.Random(7))] * 3


def test_unknown_scorer_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown scorer"):
        scores([cand("a")], {"latency-scorer": 1.0}, PrefixParams())


PAGE = b"""# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting_total 99
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5 1700000000000
"""


def test_metrics_page_parsing() -> None:
    assert metric_values(PAGE, b"vllm:num_requests_waiting") == [3.0, 2.0]  # not the _total it prefixes
    assert parse_load(PAGE) == Load(waiting=5.0, kv_usage=0.5)
    sglang = b"sglang:num_queue_reqs{model=\"m\"} 7\nsglang:token_usage{model=\"m\"} 0.3\n"
    assert parse_load(sglang) == Load(7.0, 0.3)
    assert parse_load(b"up 1\n") is None
    assert parse_load(b"vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc 7\n") == Load(None, 1.0)
    assert parse_load(b"vllm:num_requests_waiting{a=\"}\"} x\n") is None


def test_usage_from_json_and_from_the_last_sse_chunk() -> None:
    r = UsageReader("application/json")
    for part in (b'{"usage": {"prompt_tokens": 40, "prompt_', b'tokens_details": {"cached_tokens": 32}}}'):
        r.feed(part)
    assert r.end() == Usage(40, 32)
    s = UsageReader("text/event-stream; charset=utf-8")
    stream = (b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [], "usage": {"prompt_tokens": 9, '
              b'"prompt_tokens_details": null}}\n\ndata: [DONE]\n\n')
    for i in range(0, len(stream), 7):
        s.feed(stream[i:i + 7])
    assert s.end() == Usage(9, None)  # the engine did not report cached tokens: None, never 0
    big = UsageReader("application/json", max_bytes=100)
    big.feed(b"x" * 101)
    assert big.end() is None and big.problem == "response_too_large"
    bad = UsageReader("application/json")
    bad.feed(b'{"usage": {"prompt_tokens": true, "prompt_tokens_details": {"cached_tokens": -1}}}')
    assert bad.end() == Usage(None, None)


def test_inflight_bounds_and_expiry() -> None:
    now = [0.0]
    dropped: list[str] = []
    f: InFlight[str] = InFlight(3, 100, ttl=10, on_drop=lambda why, value: dropped.append(why), clock=lambda: now[0])
    for i in range(4):
        assert f.add(f"k{i}", f"v{i}", 10)
    assert len(f) == 3 and "k0" not in f and dropped == ["evicted"]
    assert not f.add("huge", "v", 101) and dropped[-1] == "too_large"
    assert f.add("k9", "v9", 80) and len(f) == 3 and "k1" not in f and f.bytes == 100  # the oldest made room
    now[0] = 11
    assert f.add("k10", "v10", 10) and "k9" not in f and dropped[-1] == "expired"
    assert f.take("k10") == "v10" and f.take("k10") is None and f.bytes == 0


def test_decision_log_is_bounded_and_newest_first() -> None:
    log = DecisionLog(max_entries=3, max_bytes=1 << 20)
    for i in range(5):
        log.add(Entry(str(i), float(i), "pick", "m", "p", 10, 5, 4, 5, {"scores": {"p": 1.0}}))
    assert [e.id for e in log.latest(10)] == ["4", "3", "2"] and log.added == 5
    assert log.latest(1)[0].to_json()["predicted"] == {"precise": 5, "approx": 4}
    small = DecisionLog(max_entries=100, max_bytes=1000)
    for i in range(10):
        small.add(Entry(str(i), 0.0, "api", "m", "p", None, None, None, None))
    assert small.bytes <= 1000 and 0 < len(small) < 10
