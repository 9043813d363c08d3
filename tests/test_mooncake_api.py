"""Mooncake's dialect of the KV-indexer RFC on the compatibility routes, through a real daemon fed
by a fake engine replaying the ``small`` vLLM capture over ZeroMQ.

The bodies are the ones Mooncake's cache-aware proxy sends (msgpack, ``token_ids`` as a bin of
little-endian int32s, its ``hash_profile``); the answers must equal the Dynamo dialect's and the
native API's for the same prompts, and the engine's own ``cached_tokens`` (meta.json)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import msgpack

from kvindex.config import Config
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, ipc_endpoint, wait_for

BS = 32
MODEL = "tiny"
POD = "prefill-a"
MSGPACK = {"Content-Type": "application/msgpack"}
PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0", "index_projection": "low64_be"}


def requests_in_order() -> list[dict[str, Any]]:
    reqs = json.loads((FIXTURES / "small" / "meta.json").read_text())["requests"]
    return sorted(reqs, key=lambda r: r["t_sent"])


def blob(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


async def post_mp(h: Any, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """A msgpack request as the proxy sends it; a msgpack answer decoded (an error is JSON)."""
    async with h.session.post(h.url + path, data=msgpack.packb(body, use_bin_type=True),
                              headers={**MSGPACK, **(headers or {})}) as r:
        raw = await r.read()
        if r.content_type == "application/msgpack":
            return r.status, msgpack.unpackb(raw, raw=False, strict_map_key=False)
        return r.status, json.loads(raw)


def registration(endpoint: str, iid: str = POD, **kw: Any) -> dict[str, Any]:
    """The proxy's registration payload (its field set, in its order)."""
    return {"endpoint": endpoint, "type": "vLLM", "modelname": MODEL, "instance_id": iid, "block_size": BS,
            "dp_rank": 0, "tenant_id": "default", "lora_name": "", "hash_profile": PROFILE, **kw}


def mooncake_query(tokens: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "block_size": BS, "token_ids": blob(tokens), "tenant_id": "default", "lora_name": "", **kw}


async def test_mooncake_answers_equal_dynamo_and_native(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    h = await make_harness(Config())
    endpoint, replay = ipc_endpoint(tmp_path, "pub"), ipc_endpoint(tmp_path, "replay")
    status, got = await post_mp(h, "/register", registration(endpoint, replay_endpoint=replay))
    assert (status, got) == (200, {"status": "registered successfully", "instance_id": POD})
    # the proxy registers at every start: the same registration again is a success, not a 409
    status, got = await post_mp(h, "/register", registration(endpoint, replay_endpoint=replay))
    assert (status, got) == (200, {"status": "registered successfully", "instance_id": POD})
    # a different registration of the same (instance, rank) is a conflict, not a silent change
    status, err = await post_mp(h, "/register", registration(endpoint, replay_endpoint=replay, block_size=16))
    assert status == 409 and err["field"] == "instance_id", err
    status, ws = await h.get("/workers")
    assert [(w["instance_id"], w["model_name"], w["routing_group"], w["block_size"]) for w in ws] == \
        [(POD, MODEL, "default", BS)]
    engine = await make_engine(endpoint, replay_endpoint=replay)
    await h.wait_connected()

    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    pos = checked = hits = 0
    for r in requests_in_order():
        while pos < len(captured) and captured[pos].t < r["t_sent"]:
            await engine.publish(captured[pos].frames)
            await h.wait_seq(POD, int.from_bytes(captured[pos].frames[1], "big"))
            pos += 1
        tokens, cached = r["prompt_token_ids"], r["cached_tokens"]
        status, m = await post_mp(h, "/query", mooncake_query(tokens))
        assert status == 200, m
        assert set(m) == {"instances", "default"} and m["default"] == m["instances"], r["i"]
        status, d = await h.post("/query", {"token_ids": tokens, "model_name": MODEL})
        assert status == 200, d
        openai = {k: r[k] for k in ("prompt", "messages") if k in r}
        status, n = await h.post("/v1/score", {"model": MODEL, **openai, "token_ids": tokens, "pods": [POD]})
        assert status == 200, n
        dyn = d["instances"].get(POD, {})
        moon = m["instances"].get(POD, {})
        longest = moon.get("longest_matched", 0)
        assert longest == dyn.get("longest_matched", 0), r["i"]  # the Dynamo dialect's number
        if moon:
            assert moon["GPU"] == moon["gpu"] == dyn["gpu"] and moon["DP"] == moon["dp"] == dyn["dp"], r["i"]
            assert moon["CPU"] == dyn["cpu"] and moon["DISK"] == dyn["disk"], r["i"]
        if len(tokens) % BS:  # no block ends on the last token: every dialect counts the engine's cached_tokens
            assert longest == n["pods"][POD]["precise"]["tokens"] == cached, r["i"]
        # Mooncake's JSON form (token_ids as an array): the same answer, in JSON
        status, mj = await h.post("/query", {**mooncake_query(tokens), "token_ids": tokens})
        assert status == 200 and mj == m, r["i"]
        hits += longest > 0
        checked += 1
    assert checked == 20 and hits >= 5

    r = max(requests_in_order(), key=lambda r: r["cached_tokens"])
    tokens = r["prompt_token_ids"]
    status, m = await post_mp(h, "/query", mooncake_query(tokens))
    assert m["instances"][POD]["longest_matched"] >= 2 * BS
    # a context Mooncake would not have: another block size, another tenant, another instance, a salt
    for other in ({"block_size": 16}, {"tenant_id": "t2"}, {"instance_id": "prefill-b"}):
        status, q = await post_mp(h, "/query", mooncake_query(tokens, **other))
        assert status == 200 and q["instances"] == {}, other
    status, q = await post_mp(h, "/query", mooncake_query(tokens, tenant_id="t2"))
    assert set(q) == {"instances", "t2"}  # results keyed by the query's tenant
    status, q = await post_mp(h, "/query", mooncake_query(tokens, instance_id=POD))
    assert q["instances"] == m["instances"]
    status, q = await post_mp(h, "/query", mooncake_query(tokens, cache_salt="s"))
    assert q["instances"].get(POD, {}).get("longest_matched", 0) == 0  # the salt is the hash namespace
    status, q = await post_mp(h, "/query", mooncake_query(tokens, cache_salt=""))  # "" is "not set"
    assert q == m

    # /unregister by (instance_id, tenant_id, dp_rank), as the conductor takes it
    status, got = await post_mp(h, "/unregister", {"instance_id": POD, "tenant_id": "default", "dp_rank": 0})
    assert (status, got) == (200, {"status": "unregistered successfully", "removed_instances": [f"{POD}|default|0"]})
    status, err = await post_mp(h, "/unregister", {"instance_id": POD, "tenant_id": "default", "dp_rank": 0})
    assert status == 404 and err["field"] == "instance_id" and "\n" not in err["error"]
    status, ws = await h.get("/workers")
    assert ws == []
    status, q = await post_mp(h, "/query", mooncake_query(tokens))
    assert q["instances"] == {}


async def test_tenants_are_registration_scopes(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """Two instances holding the same blocks under two tenants: a query sees its tenant's only,
    keyed by that tenant; a Dynamo query with the tenant as routing group answers alike."""
    h = await make_harness(Config())
    tokens = list(range(1, 14))  # 13 tokens: 3 complete blocks of 4
    stored = {"type": "BlockStored", "block_hashes": [11, 12, 13], "parent_block_hash": None,
              "token_ids": tokens[:12], "block_size": 4}
    for iid, tenant, rank in (("a", "t1", 0), ("a", "t1", 1), ("b", "t2", 0)):
        ep = ipc_endpoint(tmp_path, f"{iid}{rank}")
        e = await make_engine(ep)
        status, got = await post_mp(h, "/register", {**registration(ep, iid, tenant_id=tenant, dp_rank=rank),
                                                     "block_size": 4})
        assert status == 200, got
        await h.wait_connected()
        ev = stored if rank == 0 else {**stored, "block_hashes": [21, 22], "token_ids": tokens[:8]}
        await e.publish([b"kv@x@tiny", (0).to_bytes(8, "big"), msgpack.packb([1.0, [ev], rank])])
    await wait_for(lambda: sum(lane.state.frames for lane in h.daemon.fleet.lanes().values()) == 3, 5.0, "applied")

    status, q = await post_mp(h, "/query", {"model": MODEL, "block_size": 4, "token_ids": blob(tokens), "tenant_id": "t1"})
    assert status == 200 and set(q) == {"instances", "t1"}
    a = q["t1"]["a"]
    assert a["DP"] == {"0": 12, "1": 8} and a["longest_matched"] == a["GPU"] == 12 and set(q["t1"]) == {"a"}
    status, d = await h.post("/query", {"token_ids": tokens, "model_name": MODEL, "routing_group": "t1"})
    assert d["instances"]["a"]["dp"] == a["dp"] and d["instances"]["a"]["longest_matched"] == 12
    status, q = await post_mp(h, "/query", {"model": MODEL, "block_size": 4, "token_ids": blob(tokens), "tenant_id": "t2"})
    assert set(q["t2"]) == {"b"} and q["t2"]["b"]["longest_matched"] == 12
    status, got = await post_mp(h, "/unregister", {"instance_id": "a", "tenant_id": "t1", "dp_rank": 1})
    assert got["removed_instances"] == ["a|t1|1"]
    status, q = await post_mp(h, "/query", {"model": MODEL, "block_size": 4, "token_ids": blob(tokens), "tenant_id": "t1"})
    assert q["t1"]["a"]["DP"] == {"0": 12}


REJECTED = [  # (path, body, status, field)
    ("/register", {k: v for k, v in registration("ipc:///tmp/x").items() if k != "modelname"}, 400, "modelname"),
    ("/register", registration("ipc:///tmp/x", type="Mooncake"), 400, "type"),
    ("/register", registration("ipc:///tmp/x", hash_profile={**PROFILE, "strategy": "sglang"}), 400,
     "hash_profile.strategy"),
    ("/register", registration("ipc:///tmp/x", hash_profile={**PROFILE, "index_projection": "high64"}), 400,
     "hash_profile.index_projection"),
    ("/register", registration("ipc:///tmp/x", hash_profile="vllm_v1"), 400, "hash_profile"),
    ("/register", {k: v for k, v in registration("ipc:///tmp/x").items() if k != "dp_rank"}, 400, "dp_rank"),
    ("/register", registration("ipc:///tmp/x", block_size=0), 400, "block_size"),
    ("/register", registration("ipc:///tmp/x", modelname="m" * 600), 400, "modelname"),
    ("/register", registration("ipc:///tmp/x", tenant_id="t" * 300), 400, "tenant_id"),
    ("/register", registration("ipc:///tmp/x", additionalsalt="w8a8"), 400, "additionalsalt"),
    ("/register", registration("ipc:///tmp/x", cache_group=1), 400, "cache_group"),
    ("/register", registration("not-an-address"), 400, "endpoint"),
    ("/query", mooncake_query([1, 2], token_ids=b"\x01\x00\x00\x00\x02"), 400, "token_ids"),
    ("/query", mooncake_query([1, -2]), 400, "token_ids"),
    ("/query", {k: v for k, v in mooncake_query([1, 2]).items() if k != "block_size"}, 400, "block_size"),
    ("/query", {k: v for k, v in mooncake_query([1, 2]).items() if k != "model"}, 400, "model"),
    ("/query", mooncake_query([1, 2], lora_name="l" * 300), 400, "lora_name"),
    ("/query_by_hash", {"model": MODEL, "block_size": BS, "seq_hashes": [1, 2]}, 400, "seq_hashes"),
    ("/query_by_hash", {"model": MODEL, "block_size": BS, "block_hash": [1, 2]}, 400, "block_hash"),
    ("/unregister", {"instance_id": POD, "tenant_id": "default"}, 400, "dp_rank"),
]


async def test_malformed_mooncake_bodies_answer_one_line_4xx(make_harness: Any) -> None:
    h = await make_harness(Config())
    for path, body, status_want, field in REJECTED:
        status, err = await post_mp(h, path, body)
        assert (status, err["field"]) == (status_want, field), (path, body, err)
        assert set(err) == {"error", "field"} and "\n" not in err["error"] and err["error"], err
    # a body that is not msgpack, and one nested past the depth limit
    async with h.session.post(h.url + "/register", data=b"\xc1\xc1", headers=MSGPACK) as r:
        assert r.status == 400 and (await r.json())["field"] == "body"
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    status, err = await post_mp(h, "/register", registration("ipc:///tmp/x", hash_profile=deep))
    assert status == 400 and err["field"] == "body"
    status, ws = await h.get("/workers")
    assert ws == []  # nothing refused left a registration behind
    assert h.daemon.fleet.lanes() == {}
    status, text = await h.get("/metrics")
    counted = sum(float(v) for ep, v in re.findall(r'kvindex_http_rejections_total\{endpoint="(/[a-z_]+)",[^}]*\} (\S+)',
                                                      text.decode()) if ep in ("/register", "/query", "/query_by_hash",
                                                                               "/unregister"))
    assert counted == len(REJECTED) + 2


async def test_mooncake_registration_needs_the_write_token(make_harness: Any, tmp_path: Path) -> None:
    h = await make_harness(Config(), token="s3cret")
    body = registration(ipc_endpoint(tmp_path, "w"))
    status, err = await post_mp(h, "/register", body)
    assert status == 401 and err["field"] == "Authorization"
    status, got = await post_mp(h, "/register", body, {"Authorization": "Bearer s3cret"})
    assert status == 200 and got["status"] == "registered successfully"
