"""Block sizes belong to engine streams' lives, not to models forever (issue 13 class 4): a real
daemon follows an engine restarted with another block size, registrations never pin one, and
replicas of one Redis that configure different ones refuse to start."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from kvindex import keys as K
from kvindex.config import Config, ModelConfig
from kvindex.persist import snapshot as snapshots
from kvindex.tools.engine_sim import SimulatedCache, encode_batch
from kvindex.types import Entry
from tests.conftest import engine_config, ipc_endpoint, wait_for
from tests.faultkit import free_port, http, wait_http


def life(n: int, block_size: int, *, seed: int, start_seq: int = 0, pod: str = "sim-0",
         model: str = "m") -> tuple[list[tuple[bytes, bytes, bytes]], SimulatedCache, list[int]]:
    """``n`` batches of one engine life whose cache has ``block_size``; and its last prompt."""
    rng = random.Random(seed)
    cache = SimulatedCache(64, block_size, hash_seed=seed)
    prefixes = [[rng.randrange(1, 5000) for _ in range(block_size * rng.randrange(1, 3))] for _ in range(4)]
    topic, frames, prompt = f"kv@{pod}@{model}".encode(), [], []
    while len(frames) < n:
        prompt = rng.choice(prefixes) + [rng.randrange(1, 5000) for _ in range(block_size * 2 + 1)]
        events = cache.admit(prompt).events
        if events:
            frames.append((topic, (start_seq + len(frames)).to_bytes(8, "big"), encode_batch(events, time.time())))
    return frames, cache, prompt


def cached(prompt: list[int], bs: int) -> int:
    """The tokens an engine that just admitted ``prompt`` serves from cache (its last token's block never)."""
    return (len(prompt) - 1) // bs * bs


async def score(h: Any, prompt: list[int], pod: str = "sim-0", model: str = "m") -> int:
    status, body = await h.post("/query", {"model_name": model, "token_ids": prompt})
    assert status == 200, body
    return sum(body["scores"].get(pod, {}).values())


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_an_engine_restarted_with_another_block_size_is_followed(backend: str, make_harness: Any,
                                                                       make_engine: Any, tmp_path: Path,
                                                                       request: Any) -> None:
    store = request.getfixturevalue("redis_url") if backend == "redis" else "memory://"
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    h = await make_harness(Config(engines=(engine_config(engine),), store=store, replay_timeout=0.5))
    await h.wait_connected()
    first, _, prompt16 = life(12, 16, seed=1)
    for f in first:
        await engine.publish(f)
    await h.wait_seq("sim-0", 11)
    assert await score(h, prompt16) == cached(prompt16, 16)
    engine.clear_buffer()  # the engine restarts: a new life, its replay history starts over
    second, truth, prompt32 = life(12, 32, seed=2)
    for f in second:
        await engine.publish(f)
    await wait_for(lambda: h.stream("sim-0").restarts == 1 and h.stream("sim-0").last_seq == 11, 10, "second life")
    st = h.stream("sim-0")
    assert st.synced and st.restarts == 1
    _, pods = await h.get("/v1/pods")
    entry = next(p for p in pods["pods"] if p["pod"] == "sim-0")
    assert entry["synced"] and entry["blocks"]["orphans"] == 0, entry
    assert entry["blocks"]["gpu"] == len(truth.held())
    for _ in range(2):  # the second: a replica that remembered 16 has learnt 32 from its walk
        assert await score(h, prompt32) == cached(prompt32, 32)
    assert await score(h, prompt16) == 0


async def test_register_never_pins_and_refuses_a_contradiction(make_harness: Any, make_engine: Any,
                                                               tmp_path: Path) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    h = await make_harness(Config(replay_timeout=0.5))
    reg = {"instance_id": "x", "model_name": "m", "endpoint": "tcp://127.0.0.1:9", "block_size": 1}
    assert (await h.post("/register", reg))[0] == 201
    assert (await h.post("/unregister", {"instance_id": "x", "model_name": "m"}))[0] == 200
    sim = {"instance_id": "sim-0", "model_name": "m", "endpoint": engine.endpoint, "block_size": 16,
           "replay_endpoint": engine.replay_address}
    assert (await h.post("/register", sim))[0] == 201
    await h.wait_connected()
    frames, _, prompt = life(6, 16, seed=3)
    for f in frames:
        await engine.publish(f)
    await h.wait_seq("sim-0", 5)
    assert await score(h, prompt) == cached(prompt, 16)  # keyed by 16, not by the 1 the removed registration set
    status, body = await h.post("/register", {**reg, "instance_id": "y", "block_size": 32, "routing_group": "g2"})
    assert status == 409 and body["field"] == "block_size" and "16" in body["error"] and "\n" not in body["error"]
    assert await score(h, prompt) == cached(prompt, 16)


async def test_a_restored_daemon_learns_new_models_and_its_configured_sizes_win(make_harness: Any, make_engine: Any,
                                                                                 tmp_path: Path, caplog: Any) -> None:
    """Restored from a snapshot of model m at 16 while configured 32: the configured size is in force
    (the snapshot's overrode it). A model the snapshot had no size for is registered (it answered
    500: KeyError) and learns its engine's size (every store was an orphan, 0 hits); an engine of m
    storing 16 again is followed, and the restored blocks (keyed with 16) match again."""
    state = tmp_path / "state"
    state.mkdir()
    tokens = [random.Random(9).randrange(1, 5000) for _ in range(33)]
    key = K.prompt_keys(K.root_key("m"), tokens, 16)[0]
    snapshots.write_atomic(state / snapshots.SNAPSHOT_NAME, snapshots.encode(snapshots.State(
        block_sizes={"m": 16}, entries=[Entry("old", 0, "GPU", 1, key, 1)])))
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    other = await make_engine(ipc_endpoint(tmp_path, "pub2"), replay_endpoint=ipc_endpoint(tmp_path, "rep2"))
    with caplog.at_level(logging.WARNING, logger="kvindex.persist.restore"):
        h = await make_harness(Config(state_dir=state, models={"m": ModelConfig(block_size=32)}, replay_timeout=0.5))
    assert h.daemon.restored_from == "state-dir"
    assert await h.daemon.store.block_size("m") == 32
    assert any("saved with block_size 16, configured 32" in r.getMessage() for r in caplog.records)
    sim = {"instance_id": "sim-0", "model_name": "Y", "endpoint": engine.endpoint, "block_size": 16,
           "replay_endpoint": engine.replay_address}
    status, body = await h.post("/register", sim)
    assert status == 201, body
    await h.wait_connected()
    frames, _, prompt = life(6, 16, seed=3, model="Y")
    for f in frames:
        await engine.publish(f)
    await h.wait_seq("sim-0", 5)
    assert await score(h, prompt, model="Y") == cached(prompt, 16)
    assert (await h.daemon.store.blocks_held("sim-0"))["orphans"] == 0
    assert await score(h, tokens, "old") == 0  # keyed with 16, asked by 32
    reg = {"instance_id": "sim-1", "model_name": "m", "endpoint": other.endpoint, "block_size": 16,
           "replay_endpoint": other.replay_address}
    assert (await h.post("/register", reg))[0] == 201  # nobody holds 32
    await h.wait_connected()
    frames, _, prompt = life(3, 16, seed=4, pod="sim-1")
    for f in frames:
        await other.publish(f)
    await h.wait_seq("sim-1", 2)
    assert await h.daemon.store.block_size("m") == 16
    assert await score(h, tokens, "old") == 16  # the restored block holds its size again


def test_redis_replicas_configured_with_different_block_sizes_refuse(redis_url: str, tmp_path: Path) -> None:
    def serve(bs: int, port: int) -> subprocess.Popen:
        cfg = tmp_path / f"kvindex-{bs}.toml"
        cfg.write_text(f'[models.m]\nblock_size = {bs}\n')
        return subprocess.Popen([sys.executable, "-m", "kvindex", "serve", "--port", str(port), "--store", redis_url,
                                 "--config", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port = free_port()
    first = serve(16, port)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
        second = serve(32, free_port())
        try:
            _, err = second.communicate(timeout=30)
        finally:
            second.kill()
            second.communicate()
        errors = [line for line in err.splitlines() if line.startswith("kvindex: ")]
        assert second.returncode == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert "block_size 32" in errors[0] and "16" in errors[0], err
        assert first.poll() is None  # the first replica serves on, its configuration untouched
        assert http(f"http://127.0.0.1:{port}/readyz")[0] == 200
        client = redis.Redis.from_url(redis_url)
        assert client.get(next(k for k in client.scan_iter() if k.endswith(b":cbs"))) == b"16"
        client.close()
    finally:
        first.terminate()
        first.communicate(timeout=15)
