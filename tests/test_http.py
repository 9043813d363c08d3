"""kvindex's native HTTP API, through a real daemon (aiohttp server, ZeroMQ lanes, fake engines).

Expected values come from outside kvindex: the engine's own ``cached_tokens`` in the capture's
meta.json, byte arithmetic on the prompt (Kthena's 64-byte blocks), a hand-counted simulator
tokenization, and Prometheus' own text parser."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgpack
import prometheus_client
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from adapters.llmd_sim import SimTokenizer
from kvindex.config import Config, EngineConfig, ModelConfig
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, engine_config, independent_holdings, ipc_endpoint

POD = "127.0.0.1:8000"
BS = 32


def meta_requests() -> list[dict[str, Any]]:
    reqs = json.loads((FIXTURES / "small" / "meta.json").read_text())["requests"]
    return sorted(reqs, key=lambda r: r["t_sent"])


def held_in_capture(capture: str) -> int:
    """Block copies the engine holds at the end of a capture, straight from the frames."""
    return sum(sum(held.values()) for held in independent_holdings(load_capture(FIXTURES / capture / "events.jsonl")).values())


async def counter(h: Any, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    status, text = await h.get("/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        if fam.name == family:
            for s in fam.samples:
                if s.name == family + "_total":
                    out[tuple(sorted(s.labels.items()))] = s.value
    return out


async def raw(h: Any, method: str, path: str, **kw: Any) -> tuple[int, str, Any]:
    async with h.session.request(method, URL(h.url + path, encoded=True), **kw) as r:
        body = await r.read()
        return r.status, r.headers.get("Content-Type", ""), body


async def publish_capture(h: Any, engine: Any, pod: str, capture: str = "small") -> None:
    captured = load_capture(FIXTURES / capture / "events.jsonl")
    for c in captured:
        await engine.publish(c.frames)
    await h.wait_seq(pod, int.from_bytes(captured[-1].frames[1], "big"))


# -- health, readiness, metrics ------------------------------------------------------------------
async def test_healthz_readyz_and_metrics(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    endpoint = ipc_endpoint(tmp_path, "late")
    h = await make_harness(Config(engines=(EngineConfig(endpoint=endpoint),)))
    status, body = await h.get("/healthz")
    assert status == 200 and body == {"status": "ok"}

    status, body = await h.get("/readyz")  # nothing bound at the endpoint yet
    assert status == 503
    assert body["status"] != "ready"
    assert any("not connected" in r and endpoint in r for r in body["reasons"]), body

    await make_engine(endpoint)  # the engine comes up; the SUB socket reconnects by itself
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while True:
        status, body = await h.get("/readyz")
        if status == 200 or loop.time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert status == 200 and body == {"status": "ready"}, body

    status, ctype, body = await raw(h, "GET", "/metrics")
    assert status == 200 and ctype == prometheus_client.CONTENT_TYPE_LATEST
    names = {fam.name for fam in text_string_to_metric_families(body.decode())}
    assert {"kvindex_decode_errors", "kvindex_http_rejections", "kvindex_engine_connected"} <= names


async def test_readyz_names_an_unsynced_pod(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"))  # no replay endpoint: a gap cannot be filled
    h = await make_harness(Config(engines=(engine_config(engine),)))
    await h.wait_connected()
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    for c in captured[1:]:  # joined mid-stream: batch 0 is missing
        await engine.publish(c.frames)
    await h.wait_seq(POD, 17)
    status, body = await h.get("/readyz")
    assert status == 503 and any(POD in r and "unsynced" in r for r in body["reasons"]), body


# -- pods ------------------------------------------------------------------------------------------
POD_FIELDS = {"pod", "model", "endpoint", "connected", "last_seq", "gaps", "replays", "restarts", "blocks",
              "approx_entries", "synced"}


async def test_pods_list_get_and_delete_with_slash_in_pod_id(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    pod = "ns/vllm-0"
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine, pod=pod),)))
    await h.wait_connected()
    await publish_capture(h, engine, pod)
    expected_gpu = held_in_capture("small")

    status, body = await h.get("/v1/pods")
    assert status == 200 and set(body) == {"pods"} and isinstance(body["pods"], list)
    (view,) = body["pods"]
    assert POD_FIELDS <= set(view), POD_FIELDS - set(view)
    assert view["pod"] == pod and view["model"] == "tiny" and view["endpoint"] == engine.endpoint
    assert view["connected"] is True and view["synced"] is True
    assert (view["last_seq"], view["gaps"], view["replays"], view["restarts"]) == (17, 0, 0, 0)
    assert view["blocks"]["gpu"] == expected_gpu and view["approx_entries"] == 0

    for path in ("/v1/pods/ns/vllm-0", "/v1/pods/ns%2Fvllm-0", "/v1/pods/ns%2fvllm-0"):
        status, ctype, raw_body = await raw(h, "GET", path)
        assert status == 200, (path, raw_body)
        got = json.loads(raw_body)
        assert got.pop("last_event_age_seconds") >= view["last_event_age_seconds"], path  # seconds since: it grows
        assert got == {k: v for k, v in view.items() if k != "last_event_age_seconds"}, path
    status, ctype, raw_body = await raw(h, "GET", "/v1/pods/ns/nope")
    assert status == 404 and json.loads(raw_body)["field"] == "pod"

    status, ctype, raw_body = await raw(h, "DELETE", "/v1/pods/ns%2Fvllm-0")
    assert status == 200 and json.loads(raw_body) == {"removed": pod}
    assert h.daemon.index.engine_hashes(pod) == {}
    status, got = await h.get("/v1/pods/ns/vllm-0")  # its lane still runs; it holds nothing now
    assert status == 200 and got["blocks"]["gpu"] == 0
    status, ctype, raw_body = await raw(h, "DELETE", "/v1/pods/other/pod")
    assert status == 404 and json.loads(raw_body)["field"] == "pod"


# -- scoring ---------------------------------------------------------------------------------------
async def test_score_with_token_ids_matches_engine_cached_tokens(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),)))
    await h.wait_connected()
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    pos = 0
    for r in meta_requests():
        while pos < len(captured) and captured[pos].t < r["t_sent"]:
            await engine.publish(captured[pos].frames)
            await h.wait_seq(POD, int.from_bytes(captured[pos].frames[1], "big"))
            pos += 1
        openai = {k: r[k] for k in ("prompt", "messages") if k in r}
        body = {"model": "tiny", **openai, "token_ids": r["prompt_token_ids"], "pods": [POD]}
        status, s = await h.post("/v1/score", body)
        assert status == 200, s
        cached, n = r["cached_tokens"], r["prompt_tokens"]
        assert s["model"] == "tiny" and s["prompt_tokens"] == n
        assert set(s["pods"]) == {POD}
        p = s["pods"][POD]
        assert p["precise"] == {"blocks": cached // BS, "tokens": cached, "ratio": round(cached / n, 6),
                                "total_blocks": cached // BS, "total_tokens": cached,  # no offload tier here
                                "tier_blocks": {"device": cached // BS, "host": 0, "disk": 0},
                                "tier_score": float(cached // BS)}, r["i"]
        assert p["approx"] == {"blocks": 0, "score": 0}  # the router has recorded nothing
        assert p["drift"] == round(0 - cached / n, 6)

    # the router's belief: a decision for a 128-byte prompt (2 Kthena blocks of 64 bytes)
    p1 = "".join(chr(ord("a") + i % 26) for i in range(128))
    p2 = p1 + "z" * 100  # 228 bytes: 4 blocks, the first 2 shared with p1
    status, got = await h.post("/v1/decisions", {"pod": POD, "request": {"model": "tiny", "prompt": p1}})
    assert status == 200, got
    r = next(r for r in meta_requests() if r["cached_tokens"])
    await publish_capture(h, engine, POD)
    status, s = await h.post("/v1/score", {"model": "tiny", "prompt": p2, "token_ids": r["prompt_token_ids"]})
    assert status == 200, s
    p = s["pods"][POD]
    assert p["approx"] == {"blocks": 2, "score": int(2 / 4 * 100)}
    assert p["drift"] == round(2 / 4 - p["precise"]["ratio"], 6)
    assert p["precise"]["tokens"] == p["precise"]["blocks"] * BS


async def test_score_prompt_without_tokenizer_is_approx_only(make_harness: Any) -> None:
    h = await make_harness(Config())
    p1 = "x" * 64 * 3
    status, got = await h.post("/v1/decisions", {"pod": "pod-a", "request": {"model": "m", "prompt": p1}})
    assert status == 200, got
    status, s = await h.post("/v1/score", {"model": "m", "prompt": p1 + "tail"})  # 196 bytes: 4 blocks
    assert status == 200, s
    assert s["model"] == "m" and s["prompt_tokens"] is None
    assert s["pods"] == {"pod-a": {"approx": {"blocks": 3, "score": 75}, "drift": None, "precise": None}}
    status, s = await h.post("/v1/score", {"model": "m", "prompt": "y" * 70, "pods": ["pod-a", "pod-b"]})
    assert status == 200 and s["pods"] == {p: {"approx": {"blocks": 0, "score": 0}, "drift": None, "precise": None} for p in ("pod-a", "pod-b")}
    # lora_name / cache_salt matter only to the precise side: an approximate-only score never refuses them
    status, s = await h.post("/v1/score", {"model": "m", "prompt": p1 + "tail", "cache_salt": "", "lora_name": 3})
    assert status == 200 and s["pods"]["pod-a"]["approx"] == {"blocks": 3, "score": 75}, s
    status, s = await h.post("/v1/score", {"model": "m", "prompt": p1, "token_ids": [1, 2, 3], "cache_salt": ""})
    assert status == 400 and s == {"error": "cache_salt must be a non-empty string", "field": "cache_salt"}, s


def fnv1a32(s: str) -> int:
    h = 0x811C9DC5
    for b in s.encode():
        h = ((h ^ b) * 0x01000193) % (1 << 32)
    return h


async def test_score_prompt_with_llmd_sim_tokenizer(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    sim_bs = 4
    # hand-counted: "Hello" ", " "world" "! " "foo" "-" "bar " -> 7 tokens per repetition
    unit = ["Hello", ", ", "world", "! ", "foo", "-", "bar "]
    prompt = "Hello, world! foo-bar " * 5
    ids = [fnv1a32(t) for t in unit] * 5
    assert SimTokenizer().tokenize_prompt(prompt) == ids  # the adapter agrees with the hand count
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"))
    cfg = Config(engines=(engine_config(engine),), models={"sim": ModelConfig(tokenizer="llmd-sim")})
    h = await make_harness(cfg)
    await h.wait_connected()
    n_blocks = len(ids) // sim_bs  # 35 tokens -> 8 full blocks held by the engine
    ev = {"type": "BlockStored", "block_hashes": list(range(100, 100 + n_blocks)), "parent_block_hash": None,
          "token_ids": ids[: n_blocks * sim_bs], "block_size": sim_bs}
    await engine.publish([b"kv@sim-0@sim", (0).to_bytes(8, "big"), msgpack.packb([1.0, [ev], 0])])
    await h.wait_seq("sim-0", 0)

    status, s = await h.post("/v1/score", {"model": "sim", "prompt": prompt})
    assert status == 200, s
    assert s["prompt_tokens"] == len(ids) == 35
    cached = (len(ids) - 1) // sim_bs  # the last token's block is never a hit
    assert s["pods"]["sim-0"]["precise"] == {"blocks": cached, "tokens": cached * sim_bs,
                                             "ratio": round(cached * sim_bs / len(ids), 6),
                                             "total_blocks": cached, "total_tokens": cached * sim_bs,
                                             "tier_blocks": {"device": cached, "host": 0, "disk": 0},
                                             "tier_score": float(cached)}
    assert s["pods"]["sim-0"]["approx"] == {"blocks": 0, "score": 0}

    # chat: rendered "### user: Hi\n" -> "#" "#" "# " "user" ": " "Hi\n"
    status, s = await h.post("/v1/score", {"model": "sim", "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and s["prompt_tokens"] == 6
    # another model has no tokenizer: approx side only
    status, s = await h.post("/v1/score", {"model": "tiny", "prompt": prompt})
    assert status == 200 and s["prompt_tokens"] is None
    assert all(p["precise"] is None for p in s["pods"].values())
    # the tokenizer refuses a body it cannot tokenize: a 4xx naming the field
    status, s = await h.post("/v1/score", {"model": "sim", "input": "responses-api input"})
    assert 400 <= status < 500 and s["field"] == "request", s


# -- refusals --------------------------------------------------------------------------------------
async def test_a_prompt_that_tokenizes_past_the_limit_is_the_callers_413(make_harness: Any) -> None:
    """The caller's prompt over max_token_ids once tokenized: 413 naming the limit, not a 503
    saying the tokenizer is unavailable (it answered; the prompt is too long)."""
    h = await make_harness(Config(max_token_ids=8, models={"m": ModelConfig(tokenizer="llmd-sim")}))
    status, answer = await h.post("/v1/score", {"model": "m", "prompt": "one two three four five six seven eight nine"})
    assert status == 413 and answer["field"] == "request" and "limit is 8" in answer["error"], answer
    status, answer = await h.post("/v1/score", {"model": "m", "prompt": "one two three"})
    assert status == 200, answer


async def test_bad_bodies_get_4xx_naming_the_field_and_are_counted(make_harness: Any) -> None:
    h = await make_harness(Config(max_token_ids=8, max_body_bytes=2048))
    before = await counter(h, "kvindex_http_rejections")
    json_ct = {"Content-Type": "application/json"}
    cases: list[tuple[str, str, dict[str, Any], int, str | None, str]] = [
        # (method, path, request kwargs, status, field, reason)
        ("POST", "/v1/score", {"data": b"{not json", "headers": json_ct}, 400, "body", "malformed"),
        ("POST", "/v1/score", {"data": b"", "headers": json_ct}, 400, "body", "malformed"),
        # "Expecting ':' delimiter" once passed for the integer digit limit's error ("limit"): a 500
        ("POST", "/v1/score", {"data": b'{"model"', "headers": json_ct}, 400, "body", "malformed"),
        ("POST", "/v1/score", {"data": b'{"model": "m", "token_ids": [1, 2] "x": 1}', "headers": json_ct}, 400, "body", "malformed"),
        ("POST", "/v1/score", {"json": [1, 2]}, 400, "body", "malformed"),
        ("POST", "/v1/score", {"json": "a string"}, 400, "body", "malformed"),
        ("POST", "/v1/score", {"json": {"token_ids": [1]}}, 400, "model", "missing_field"),
        ("POST", "/v1/score", {"json": {"model": 5, "token_ids": [1]}}, 400, "model", "bad_field"),
        ("POST", "/v1/score", {"json": {"model": "m", "token_ids": "1 2 3"}}, 400, "token_ids", "bad_request"),
        ("POST", "/v1/score", {"json": {"model": "m", "token_ids": [1, -2]}}, 400, "token_ids", "bad_request"),
        ("POST", "/v1/score", {"json": {"model": "m", "token_ids": [1.5]}}, 400, "token_ids", "bad_request"),
        ("POST", "/v1/score", {"json": {"model": "m", "token_ids": [1 << 32]}}, 400, "token_ids", "bad_request"),
        ("POST", "/v1/score", {"json": {"model": "m", "token_ids": list(range(9))}}, 413, "token_ids", "too_large"),
        ("POST", "/v1/score", {"json": {"model": "m", "token_ids": [1], "pods": "pod-a"}}, 400, "pods", "bad_field"),
        ("POST", "/v1/score", {"json": {"model": "m", "token_ids": [1], "pods": [1]}}, 400, "pods", "bad_field"),
        ("POST", "/v1/score", {"json": {"model": "m"}}, 400, "request", "missing_field"),
        ("POST", "/v1/score", {"json": {"model": "m", "prompt": 5}}, 400, "request", "unrenderable"),
        ("POST", "/v1/score", {"json": {"model": "m", "prompt": "x" * 4000}}, 413, "body", "too_large"),
        ("GET", "/v1/score", {}, 405, None, "bad_method"),
        ("PUT", "/v1/pods", {}, 405, None, "bad_method"),
        ("GET", "/v2/nothing", {}, 404, None, "no_route"),
    ]
    for method, path, kw, status, field, reason in cases:
        s, ctype, body = await raw(h, method, path, **kw)
        assert s == status, (method, path, kw, s, body)
        assert ctype.startswith("application/json"), (path, ctype)
        err = json.loads(body)
        assert set(err) == {"error", "field"} and isinstance(err["error"], str) and err["error"], err
        assert "\n" not in err["error"]
        assert err["field"] == field, (kw, err)
    after = await counter(h, "kvindex_http_rejections")
    grown = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert sum(grown.values()) == len(cases)
    by_reason: dict[str, float] = {}
    for labels, n in grown.items():
        by_reason[dict(labels)["reason"]] = by_reason.get(dict(labels)["reason"], 0) + n
    expected: dict[str, float] = {}
    for *_, reason in cases:
        expected[reason] = expected.get(reason, 0) + 1
    assert by_reason == expected
    assert all(dict(k)["endpoint"] == "/v1/score" for k in grown if dict(k)["reason"] not in ("bad_method", "no_route"))
    status, _ = await h.get("/healthz")
    assert status == 200


async def test_bearer_token_guards_mutating_endpoints(make_harness: Any) -> None:
    h = await make_harness(Config(), token="s3cret")
    before = await counter(h, "kvindex_http_rejections")
    for method, path, body in (("DELETE", "/v1/pods/x", None), ("DELETE", "/v1/pods/ns%2Fx", None),
                               ("POST", "/register", {}), ("POST", "/unregister", {}),
                               ("POST", "/v1/pods/x/resync", {})):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cretX"}, {"Authorization": "Bearer "}):
            status, _, raw_body = await raw(h, method, path, json=body, headers=headers)
            assert status == 401, (method, path, headers)
            assert json.loads(raw_body)["field"] == "Authorization"
        status, _, raw_body = await raw(h, method, path, json=body, headers={"Authorization": "Bearer s3cret"})
        assert status != 401 and 400 <= status < 500, (method, path, status)  # past the token: unknown pod / bad body
    after = await counter(h, "kvindex_http_rejections")
    unauthorized = sum(v - before.get(k, 0) for k, v in after.items() if dict(k)["reason"] == "unauthorized")
    assert unauthorized == 5 * 5
    # reading needs no token
    for path in ("/healthz", "/v1/pods", "/metrics", "/workers"):
        status, _ = await h.get(path)
        assert status == 200, path
    status, _ = await h.post("/v1/score", {"model": "m", "token_ids": [1, 2]})
    assert status == 200


async def test_a_body_over_the_cap_is_413_before_it_is_sent_when_declared_and_once_past_it_when_chunked(
        make_harness: Any) -> None:
    h = await make_harness(Config(max_body_bytes=2048, body_timeout=30))
    before = await counter(h, "kvindex_http_rejections")
    json_ct = {"Content-Type": "application/json"}
    # a declared length over the cap: refused at once, nothing of the body sent (not a 408 after 30 s)
    reader, writer = await asyncio.open_connection("127.0.0.1", h.daemon.port)
    writer.write(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 413"), head
    writer.close()
    await writer.wait_closed()
    # no length declared (chunked): refused once the chunks received pass the cap
    big = json.dumps({"model": "m", "prompt": "x" * 3000}).encode()

    async def chunks() -> Any:
        yield big[:1000]
        yield big[1000:]
    s, _, body = await raw(h, "POST", "/v1/score", data=chunks(), headers=json_ct)
    assert s == 413 and json.loads(body) == {"error": "body exceeds 2048 bytes", "field": "body"}, (s, body)
    # a body of exactly the cap, in chunks: read whole and answered on its merits
    start = b'{"model": "m", "token_ids": [1], "pad": "'
    at_cap = start + b"x" * (2048 - len(start) - 2) + b'"}'
    assert len(at_cap) == 2048

    async def at_cap_chunks() -> Any:
        yield at_cap[:700]
        yield at_cap[700:]
    s, _, body = await raw(h, "POST", "/v1/score", data=at_cap_chunks(), headers=json_ct)
    assert s == 200 and json.loads(body)["model"] == "m", (s, body)
    after = await counter(h, "kvindex_http_rejections")
    key = (("endpoint", "/v1/score"), ("reason", "too_large"))
    assert after.get(key, 0) - before.get(key, 0) == 2
