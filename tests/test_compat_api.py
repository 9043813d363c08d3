"""The Dynamo standalone-indexer compatible API (reference/peers.md §6), through a real daemon fed
by a fake engine replaying the ``small`` capture over ZeroMQ.

Truth comes from outside kvindex: the engine's own ``cached_tokens`` per request (meta.json) and
the engine hashes held at the end of the capture, computed from the raw frames."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from kvindex.config import Config
from kvindex.http.dynamo import frequencies
from kvindex.keys import local_hashes
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, independent_holdings, ipc_endpoint, wait_for

BS = 32
MODEL = "tiny"
IID = 7
POD = str(IID)
MSGPACK = {"Content-Type": "application/msgpack"}


def requests_in_order() -> list[dict[str, Any]]:
    reqs = json.loads((FIXTURES / "small" / "meta.json").read_text())["requests"]
    return sorted(reqs, key=lambda r: r["t_sent"])


def held_hashes_at_end() -> set[int]:
    return {h for held in independent_holdings(load_capture(FIXTURES / "small" / "events.jsonl")).values() for h in held}


async def post_msgpack(h: Any, path: str, body: Any) -> tuple[int, str, Any]:
    async with h.session.post(h.url + path, data=msgpack.packb(body), headers=MSGPACK) as r:
        raw = await r.read()
        return r.status, r.content_type, raw


async def workers(h: Any, **params: str) -> list[dict[str, Any]]:
    status, body = await h.get("/workers", params=params)
    assert status == 200, body
    return body


async def register(h: Any, tmp_path: Path, make_engine: Any) -> Any:
    """Register instance 7 before its engine is up (pending), then start the engine (active)."""
    endpoint, replay = ipc_endpoint(tmp_path, "pub"), ipc_endpoint(tmp_path, "replay")
    body = {"instance_id": IID, "endpoint": endpoint, "model_name": MODEL, "block_size": BS, "replay_endpoint": replay}
    status, got = await h.post("/register", body)
    assert status in (200, 201), got
    (w,) = await workers(h)
    assert w["listeners"]["0"]["status"] == "pending" and w["status"] == "pending"
    engine = await make_engine(endpoint, replay_endpoint=replay)
    await h.wait_connected()  # connected and subscribed: what the engine publishes now arrives
    return engine


async def test_compat_api_end_to_end(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    h = await make_harness(Config(dynamo_dump=True))  # /dump as Dynamo reads it
    status, text = await h.get("/health")
    assert status == 200 and text == b"OK"
    assert await workers(h) == []
    engine = await register(h, tmp_path, make_engine)

    (w,) = await workers(h)
    assert w == {"instance_id": w["instance_id"], "source": "zmq", "status": "active", "model_name": MODEL,
                 "routing_group": "default", "block_size": BS, "endpoints": {"0": engine.endpoint},
                 "listeners": {"0": {"endpoint": engine.endpoint, "status": "active"}}}
    assert str(w["instance_id"]) == POD
    assert await workers(h, model_name="other") == []
    assert len(await workers(h, model_name=MODEL, routing_group="default")) == 1

    # replay the capture up to each request; every answer equals the engine's cached_tokens
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    pos = checked = 0
    for r in requests_in_order():
        while pos < len(captured) and captured[pos].t < r["t_sent"]:
            await engine.publish(captured[pos].frames)
            await h.wait_seq(POD, int.from_bytes(captured[pos].frames[1], "big"))
            pos += 1
        tokens, cached = r["prompt_token_ids"], r["cached_tokens"]
        status, q = await h.post("/query", {"token_ids": tokens, "model_name": MODEL})
        assert status == 200, q
        assert set(q) >= {"scores", "instances", "frequencies"}
        if cached:
            assert q["scores"] == {POD: {"0": cached}}, r["i"]
            assert q["instances"] == {POD: {"longest_matched": cached, "gpu": cached, "dp": {"0": cached},
                                            "cpu": cached, "disk": cached}}, r["i"]
            assert q["frequencies"] == [1] * (cached // BS)
        else:
            assert q["scores"] == {} and q["frequencies"] == [], r["i"]
            assert q["instances"].get(POD, {}).get("longest_matched", 0) == 0

        # the same query in msgpack: a msgpack answer with the same content
        status, ctype, raw = await post_msgpack(h, "/query", {"token_ids": tokens, "model_name": MODEL})
        assert status == 200 and ctype == "application/msgpack"
        assert msgpack.unpackb(raw, raw=False, strict_map_key=False) == q

        # by local hashes of the cacheable prefix (all but the last token): the same answer
        lh = local_hashes(tokens[:-1], BS)
        status, qh = await h.post("/query_by_hash", {"block_hashes": lh, "model_name": MODEL})
        assert status == 200 and qh == q, r["i"]
        if len(tokens) % BS:  # not block-aligned: the last token is in a partial block anyway
            status, qh = await h.post("/query_by_hash", {"block_hashes": local_hashes(tokens, BS), "model_name": MODEL})
            assert status == 200 and qh == q, r["i"]
        # signed i64 spelling of the same hashes
        signed = [x - (1 << 64) if x >= 1 << 63 else x for x in lh]
        status, ctype, raw = await post_msgpack(h, "/query_by_hash", {"block_hashes": signed, "model_name": MODEL})
        assert status == 200 and msgpack.unpackb(raw, raw=False, strict_map_key=False) == q
        checked += 1
    assert checked == 20
    while pos < len(captured):
        await engine.publish(captured[pos].frames)
        pos += 1
    await h.wait_seq(POD, 17)

    # a block-aligned prompt: the compatible endpoints count the block holding its last token (as
    # Dynamo does); the native API does not (the engine never serves that block from cache)
    r = max(requests_in_order(), key=lambda r: r["cached_tokens"])
    status, q = await h.post("/query", {"token_ids": r["prompt_token_ids"], "model_name": MODEL})
    depth = q["instances"][POD]["longest_matched"] // BS
    assert depth >= 2
    aligned = r["prompt_token_ids"][: depth * BS]
    status, qa = await h.post("/query", {"token_ids": aligned, "model_name": MODEL})
    status, qh = await h.post("/query_by_hash", {"block_hashes": local_hashes(aligned, BS), "model_name": MODEL})
    assert qa["scores"] == qh["scores"] == {POD: {"0": depth * BS}}
    assert qa["frequencies"] == [1] * depth
    status, qt = await h.post("/query_tiered_by_hash", {"block_hashes": local_hashes(aligned, BS), "model_name": MODEL,
                                                        "routing_group": "default"})
    assert status == 200 and qt == {"block_size": BS, "tiered": {
        "device": {"scores": [[{"worker_id": IID, "dp_rank": 0}, depth]], "frequencies": [1] * depth}, "lower_tier": []}}
    status, s = await h.post("/v1/score", {"model": MODEL, "token_ids": aligned})
    assert status == 200 and s["pods"][POD]["precise"]["tokens"] == (depth - 1) * BS

    # refusals
    status, err = await h.post("/query_by_hash", {"block_hashes": [1], "model_name": MODEL, "cache_salt": "s"})
    assert status == 400 and err["field"] == "cache_salt"
    status, err = await h.post("/query_by_hash", {"block_hashes": ["1"], "model_name": MODEL})
    assert status == 400 and err["field"] == "block_hashes"
    status, err = await h.post("/query", {"token_ids": [-1], "model_name": MODEL})
    assert status == 400 and err["field"] == "token_ids"
    status, err = await h.post("/query", {"token_ids": [1, 2]})
    assert status == 400 and err["field"] == "model_name"
    status, err = await h.post("/register", {"instance_id": IID, "endpoint": engine.endpoint, "model_name": MODEL,
                                             "block_size": BS})
    assert status == 409 and err["field"] == "instance_id"
    status, err = await h.post("/register", {"instance_id": 8, "endpoint": ipc_endpoint(tmp_path, "e8"),
                                             "model_name": MODEL, "block_size": 16})
    assert status == 409 and err["field"] == "block_size"  # contradicts the live registration of 4
    status, err = await h.post("/register", {"instance_id": 8, "endpoint": "not-an-address", "model_name": MODEL,
                                             "block_size": BS})
    assert status == 400 and err["field"] == "endpoint"
    status, err = await h.post("/register", {"instance_id": -1, "endpoint": engine.endpoint, "model_name": MODEL,
                                             "block_size": BS})
    assert status == 400 and err["field"] == "instance_id"
    assert len(await workers(h)) == 1  # none of the refused registrations left a worker behind
    assert len(h.daemon.fleet.lanes()) == 1

    # /dump: every held block of instance 7, as Dynamo-style stored events
    status, dump = await h.get("/dump")
    assert status == 200 and set(dump) == {f"{MODEL}:default"}
    group = dump[f"{MODEL}:default"]
    assert group["block_size"] == BS
    dumped: set[int] = set()
    for ev in group["events"]:
        assert ev["worker_id"] == IID and ev["pod"] == POD and ev["event"]["dp_rank"] == 0
        assert ev["storage_tier"] == "device" and ev["residency_domain"] == "worker"
        stored = ev["event"]["data"]["stored"]
        assert set(stored) == {"parent_hash", "start_position", "blocks"}
        for b in stored["blocks"]:
            assert set(b) == {"block_hash", "tokens_hash", "mm_extra_info", "kvindex_key"} and isinstance(b["tokens_hash"], int)
            dumped.add(b["block_hash"])
    assert dumped == held_hashes_at_end()

    # /unregister removes the worker and the pod
    status, err = await h.post("/unregister", {"instance_id": 99, "model_name": MODEL})
    assert status == 404 and err["field"] == "instance_id"
    status, got = await h.post("/unregister", {"instance_id": IID, "model_name": MODEL})
    assert status == 200, got
    assert await workers(h) == []
    status, pods = await h.get("/v1/pods")
    assert POD not in {v["pod"] for v in pods["pods"]}
    assert h.daemon.index.engine_hashes(POD) == {}
    status, q = await h.post("/query", {"token_ids": r["prompt_token_ids"], "model_name": MODEL})
    assert status == 200 and q["scores"] == {} and q["instances"] == {}
    # and can register again, now with a fresh lane
    status, got = await h.post("/register", {"instance_id": IID, "endpoint": engine.endpoint, "model_name": MODEL,
                                             "block_size": BS})
    assert status in (200, 201), got
    status, text = await h.get("/health")
    assert status == 200 and text == b"OK"


async def test_routing_groups_and_dp_ranks(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    await _two_groups(make_harness, make_engine, tmp_path)


async def _two_groups(make_harness: Any, make_engine: Any, tmp_path: Path) -> tuple[Any, list[int]]:
    """Two ranks of one instance in one group, a second instance in another group; a query with a
    group only sees that group's instances; unregistering one rank keeps the other."""
    h = await make_harness(Config())
    eps = [ipc_endpoint(tmp_path, f"r{i}") for i in range(3)]
    engines = [await make_engine(ep) for ep in eps]
    regs = [{"instance_id": 1, "dp_rank": 0, "routing_group": "g1"}, {"instance_id": 1, "dp_rank": 1, "routing_group": "g1"},
            {"instance_id": 2, "dp_rank": 0, "routing_group": "g2"}]
    for ep, reg in zip(eps, regs):
        status, got = await h.post("/register", {**reg, "endpoint": ep, "model_name": MODEL, "block_size": 4})
        assert status in (200, 201), got
    await h.wait_connected()  # every rank's subscription reached its engine: none of the messages below is lost
    tokens = list(range(1, 14))  # 13 tokens: 3 cacheable blocks of 4
    stored = {"type": "BlockStored", "block_hashes": [11, 12, 13], "parent_block_hash": None,
              "token_ids": tokens[:12], "block_size": 4}
    for i, e in enumerate(engines):
        ev = stored if i != 1 else {**stored, "block_hashes": [21, 22], "token_ids": tokens[:8]}
        await e.publish([b"kv@x@tiny", (0).to_bytes(8, "big"), msgpack.packb([1.0, [ev], 0])])
    await wait_for(lambda: sum(lane.state.frames for lane in h.daemon.fleet.lanes().values()) == 3, 5.0, "applied")

    ws = {str(w["instance_id"]): w for w in await workers(h)}
    assert set(ws) == {"1", "2"} and set(ws["1"]["listeners"]) == {"0", "1"} and ws["1"]["routing_group"] == "g1"
    status, q = await h.post("/query", {"token_ids": tokens, "model_name": MODEL, "routing_group": "g1"})
    assert status == 200 and q["scores"] == {"1": {"0": 12, "1": 8}}
    assert q["instances"]["1"]["longest_matched"] == 12 and q["frequencies"] == [2, 2, 1]
    status, q = await h.post("/query", {"token_ids": tokens, "model_name": MODEL, "routing_group": "g2"})
    assert q["scores"] == {"2": {"0": 12}}
    status, q = await h.post("/query", {"token_ids": tokens, "model_name": MODEL})  # the "default" group:
    assert q["scores"] == {} and q["frequencies"] == []  # one index per (model, group), as in Dynamo
    status, got = await h.post("/unregister", {"instance_id": 1, "model_name": MODEL, "dp_rank": 0})
    assert status == 200, got
    ws = {str(w["instance_id"]): w for w in await workers(h)}
    assert set(ws["1"]["listeners"]) == {"1"}
    status, q = await h.post("/query", {"token_ids": tokens, "model_name": MODEL, "routing_group": "g2"})
    assert q["scores"] == {"2": {"0": 12}}  # the other instance is untouched
    return h, tokens


async def test_unregistering_one_rank_drops_its_blocks(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    h, tokens = await _two_groups(make_harness, make_engine, tmp_path)
    status, q = await h.post("/query", {"token_ids": tokens, "model_name": MODEL, "routing_group": "g1"})
    assert status == 200 and q["scores"] == {"1": {"1": 8}}, q


@given(st.lists(st.integers(0, 600), max_size=70))
def test_frequencies_equal_their_definition(depths: list[int]) -> None:
    """Dynamo's ``frequencies`` as it is defined (for each depth i+1, how many workers hold at least
    that many blocks) against the runs ``frequencies`` builds."""
    plain = [sum(1 for d in depths if d > i) for i in range(max(depths, default=0))]
    assert frequencies(depths) == plain
