"""The daemon on a shared Redis store (``--store redis://``), fed by fake engines replaying the
real vLLM captures: answers against the engine's own ``cached_tokens``, two replicas on one
Redis, the store stopped and restarted mid-stream (compared with a memory daemon fed the same
frames), and startup with an unreachable store. Real redis-server processes, real ZeroMQ, real
HTTP; nothing mocked."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvindex.config import Config
from kvindex.tools.capture import Captured, load_capture
from tests.conftest import (
    FIXTURES,
    ROOT,
    engine_config,
    independent_holdings,
    ipc_endpoint,
    wait_for,
)
from tests.redis_server import RedisServer
from tests.test_precise_fixtures import predictable, requests_in_order

POD = "127.0.0.1:8000"


def seq_of(c: Captured) -> int:
    return int.from_bytes(c.frames[1], "big")


async def engine_and_daemons(make_engine: Any, make_harness: Any, tmp_path: Path, stores: list[str],
                             **config: Any) -> tuple[Any, list[Any]]:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    daemons = [await make_harness(Config(engines=(engine_config(engine),), store=url, **config)) for url in stores]
    for h in daemons:
        await h.wait_connected()
    return engine, daemons


async def precise_answer(h: Any, r: dict[str, Any]) -> tuple[int, Any]:
    """(status, tokens) of /v1/score for the request's pod, and /query agreeing with it."""
    pod = r["server"].split("//")[1]
    status, s = await h.post("/v1/score", {"model": "tiny", "token_ids": r["prompt_token_ids"], "pods": [pod]})
    if status != 200:
        return status, s
    status_q, q = await h.post("/query", {"token_ids": r["prompt_token_ids"], "model_name": "tiny"})
    assert status_q == 200, q
    tokens = s["pods"][pod]["precise"]["tokens"]
    ids, bs = r["prompt_token_ids"], 32
    # /query counts the block holding the last token (Dynamo's rule), /v1/score does not (the engine's)
    whole = (tokens, tokens + bs) if len(ids) % bs == 0 and tokens == len(ids) - bs else (tokens,)
    assert q["instances"].get(pod, {}).get("longest_matched", 0) in whole
    return status, tokens


async def publish_until(engine: Any, daemons: list[Any], captured: list[Captured], pos: int, t: float) -> int:
    while pos < len(captured) and captured[pos].t < t:
        await engine.publish(captured[pos].frames)
        for h in daemons:
            await h.wait_seq(captured[pos].frames[0].decode().split("@")[1], seq_of(captured[pos]))
        pos += 1
    return pos


async def test_answers_equal_engine_cached_tokens_on_redis(make_harness: Any, make_engine: Any, tmp_path: Path,
                                                           redis_server: Any) -> None:
    for capture, requests in (("small", requests_in_order("small")), ("reset_restart", predictable("reset_restart"))):
        redis_server.flush()
        redis_url = redis_server.url
        captured = load_capture(FIXTURES / capture / "events.jsonl")
        engine, (h,) = await engine_and_daemons(make_engine, make_harness, tmp_path / capture, [redis_url])
        wanted = {r["i"] for r in requests}
        pos = checked = 0
        for r in requests_in_order(capture):
            pos = await publish_until(engine, [h], captured, pos, r["t_sent"])
            if r["i"] in wanted:
                assert await precise_answer(h, r) == (200, r["cached_tokens"]), (capture, r["i"])
                checked += 1
        assert checked == len(requests) >= 20
        status, pods = await h.get("/v1/pods")
        assert status == 200 and pods["pods"][0]["synced"] is True
        await h.daemon.stop()


async def test_two_replicas_on_one_redis_apply_every_batch_once(make_harness: Any, make_engine: Any, tmp_path: Path,
                                                                redis_url: str) -> None:
    capture = "reset_restart"
    captured = load_capture(FIXTURES / capture / "events.jsonl")
    engine, (a, b) = await engine_and_daemons(make_engine, make_harness, tmp_path, [redis_url, redis_url])
    wanted = {r["i"] for r in predictable(capture)}
    pos = checked = 0
    for r in requests_in_order(capture):
        pos = await publish_until(engine, [a, b], captured, pos, r["t_sent"])
        if r["i"] in wanted:
            assert await precise_answer(a, r) == await precise_answer(b, r) == (200, r["cached_tokens"]), r["i"]
            checked += 1
    pos = await publish_until(engine, [a, b], captured, pos, float("inf"))
    assert checked == len(wanted) >= 20 and pos == len(captured)
    sa, sb = a.stream(POD), b.stream(POD)
    assert sa.batches + sb.batches == len(captured)  # every batch applied exactly once
    assert sa.skipped + sb.skipped == len(captured)  # ... and skipped by the other replica
    assert sa.restarts == sb.restarts == 1  # both saw the engine restart ...
    position = await a.daemon.store.position(sa.ref)
    assert position is not None and position.epoch == 1 == sa.epoch == sb.epoch  # ... it was cleared once
    expected = independent_holdings(captured)[POD]
    for h in (a, b):
        status, pods = await h.get("/v1/pods")
        assert status == 200 and pods["pods"][0]["blocks"]["gpu"] == sum(expected.values())
        status, metrics = await h.get("/metrics")
        assert b"kvindex_store_up 1.0" in metrics
    _, ma = await a.get("/metrics")
    _, mb = await b.get("/metrics")
    assert b'kvindex_batches_skipped_total{outcome="duplicate",pod="127.0.0.1:8000"}' in ma + mb


async def compare_while(redis: Any, memory: Any, requests: list[dict[str, Any]]) -> list[int]:
    """Every redis answer is a 503 (with the ApiError shape) or exactly the memory daemon's."""
    statuses = []
    for r in requests:
        status, got = await precise_answer(redis, r)
        statuses.append(status)
        if status == 200:
            assert (status, got) == await precise_answer(memory, r), r["i"]
        else:
            assert status == 503 and set(got) == {"error", "field"} and got["field"] is None, got
            assert got["error"].startswith(("store unavailable: ", "store resynchronising")), got
    return statuses


async def test_store_stopped_then_restarted_empty_resyncs_through_replay(make_harness: Any, make_engine: Any,
                                                                          tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        await stopped_then_restarted(make_harness, make_engine, tmp_path, server, keep_data=False)
    finally:
        server.stop()


async def test_store_stopped_then_back_with_its_data_applies_the_buffer(make_harness: Any, make_engine: Any,
                                                                         tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        await stopped_then_restarted(make_harness, make_engine, tmp_path, server, keep_data=True)
    finally:
        server.stop()


async def stopped_then_restarted(make_harness: Any, make_engine: Any, tmp_path: Path, server: RedisServer,
                                 *, keep_data: bool) -> None:
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    requests = requests_in_order("small")
    engine, (redis, memory) = await engine_and_daemons(make_engine, make_harness, tmp_path, [server.url, "memory://"])
    half = len(captured) // 2
    await publish_until(engine, [redis, memory], captured, 0, captured[half].t)
    assert set(await compare_while(redis, memory, requests)) == {200}

    server.stop(signal.SIGTERM if keep_data else signal.SIGKILL)
    for c in captured[half:]:
        await engine.publish(c.frames)
    await memory.wait_seq(POD, seq_of(captured[-1]))
    await wait_for(lambda: redis.stream(POD).held == len(captured) - half, 5.0, "the batches buffered")
    assert set(await compare_while(redis, memory, requests)) == {503}
    status, score = await redis.post("/v1/score", {"model": "tiny", "token_ids": [1, 2, 3]})
    assert status == 503 and score["error"].startswith("store unavailable: redis at "), score
    status, ready = await redis.get("/readyz")
    assert status == 503 and any(r.startswith("store unavailable: ") for r in ready["reasons"]), ready
    decision = {"pod": POD, "request": {"model": "tiny", "prompt": "hello"}, "token_ids": [1, 2, 3]}
    for method, path, body in (("GET", "/v1/pods", None), ("POST", "/query", {"token_ids": [1, 2], "model_name": "x"}),
                               ("POST", "/v1/decisions", decision),
                               ("DELETE", f"/v1/pods/{POD}", None), ("GET", "/dump", None)):
        async with redis.session.request(method, redis.url + path, json=body) as resp:
            got = await resp.json()
        assert resp.status == 503 and got["error"].startswith("store unavailable: "), (path, got)
    status, metrics = await redis.get("/metrics")
    assert status == 200 and b"kvindex_store_up 0.0" in metrics and b'kvindex_store_errors_total{op="apply"}' in metrics

    server.start()
    resynced = await wait_until_answering(redis, memory, requests)
    assert redis.stream(POD).held == 0 and redis.daemon.guard.losses == (0 if keep_data else 1)
    assert resynced == len(requests)
    expected = independent_holdings(captured)[POD]
    status, pods = await redis.get("/v1/pods")
    assert status == 200 and pods["pods"][0]["blocks"]["gpu"] == sum(expected.values())
    assert pods["pods"][0]["synced"] is True
    status, ready = await redis.get("/readyz")
    assert status == 200, ready


async def wait_until_answering(redis: Any, memory: Any, requests: list[dict[str, Any]], timeout: float = 15.0) -> int:
    """Compare answers (503 or exact) until every one is a 200; returns how many there are."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        statuses = await compare_while(redis, memory, requests)
        if set(statuses) == {200}:
            return len(statuses)
        assert loop.time() < deadline, statuses
        await asyncio.sleep(0.05)


async def test_buffer_overflow_drops_then_resyncs_through_replay(make_harness: Any, make_engine: Any,
                                                                 tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        captured = load_capture(FIXTURES / "small" / "events.jsonl")
        requests = requests_in_order("small")
        engine, (redis, memory) = await engine_and_daemons(make_engine, make_harness, tmp_path,
                                                           [server.url, "memory://"], store_buffer=3)
        half = len(captured) // 2
        await publish_until(engine, [redis, memory], captured, 0, captured[half].t)
        server.stop(signal.SIGTERM)
        for c in captured[half:]:
            await engine.publish(c.frames)
        await memory.wait_seq(POD, seq_of(captured[-1]))
        await wait_for(lambda: redis.stream(POD).needs_resync == "store_unavailable", 5.0, "the buffer dropped")
        status, metrics = await redis.get("/metrics")
        assert b'kvindex_batches_skipped_total{outcome="dropped",pod="127.0.0.1:8000"}' in metrics
        server.start()
        assert await wait_until_answering(redis, memory, requests) == len(requests)
        status, pods = await redis.get("/v1/pods")
        assert pods["pods"][0]["synced"] is True and redis.daemon.guard.losses == 0
    finally:
        server.stop()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvindex", "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_startup_with_an_unreachable_store_exits_2() -> None:
    done = run_cli("--store", "redis://127.0.0.1:1/0")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvindex: store redis://127.0.0.1:1/0 cannot be reached: "), done.stderr


def test_store_url_and_its_refusals_at_config_time(tmp_path: Path) -> None:
    for args, message in ((["--store", "mongodb://x"], "expected memory:// or redis://"),
                          (["--store", "redis://127.0.0.1:6379/zero"], "the database must be a number"),
                          (["--store", "redis://127.0.0.1:6379/0", "--state-dir", str(tmp_path)], "the state lives in Redis"),
                          (["--store", "unix:///tmp/r.sock?db=0", "--peer", "http://127.0.0.1:1"], "the state lives in Redis"),
                          (["--store-buffer", "0"], "store_buffer must be a positive integer")):
        done = run_cli(*args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    toml = tmp_path / "k.toml"
    toml.write_text('[server]\nstore = "redis://127.0.0.1:1/3"\n[state]\ndir = "/tmp/x"\n')
    done = run_cli("--config", str(toml))
    assert done.returncode == 2 and "the state lives in Redis" in done.stderr, done.stderr
    help_text = subprocess.run([sys.executable, "-m", "kvindex", "serve", "--help"], capture_output=True, text=True,
                               cwd=ROOT).stdout
    assert "--store URL" in help_text and "memory://" in help_text and "--store-buffer" in help_text
