"""Numbers out of range (issue 13 class 7): every integer is range-checked where it enters, and
seq arithmetic is exact at the top of the u64 range (HTTP, the wire, the state dir, Redis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvindex.config import Config
from kvindex.events import MAX_SEQ
from tests.conftest import engine_config, ipc_endpoint, wait_for
from tests.faultkit import stream


async def test_register_refuses_numbers_out_of_range_and_snapshots_keep_working(make_harness: Any,
                                                                                  tmp_path: Path) -> None:
    h = await make_harness(Config(state_dir=tmp_path / "state"))
    base = {"instance_id": 7, "model_name": "m", "endpoint": "tcp://127.0.0.1:5999"}
    for field, value in (("dp_rank", 2**64), ("block_size", 2**64), ("block_size", 65537), ("dp_rank", -1),
                         ("instance_id", 2**64)):
        status, body = await h.post("/register", {"block_size": 16, **base, field: value})
        assert status == 400 and body["field"] == field, (field, value, status, body)
    status, _ = await h.post("/register", {**base, "block_size": 16, "dp_rank": 65535})
    assert status == 201
    await h.daemon.snapshot()  # a registration kvindex holds is always one a snapshot can write
    await h.daemon.stop()
    h2 = await make_harness(Config(state_dir=tmp_path / "state"))
    status, body = await h2.get("/workers")
    assert status == 200 and "7" in str(body)


async def test_the_last_seq_of_the_u64_range_survives_a_restart(make_harness: Any, make_engine: Any,
                                                                tmp_path: Path) -> None:
    """A stream at seq 2**64-2 (the last a batch can have: all ones ends a replay answer) restarts
    from --state-dir without asking its engine for seq 2**64; a frame claiming seq 2**64-1 is
    refused (bad_seq), counted, and the lane lives on."""
    state_dir = tmp_path / "state"
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    config = Config(engines=(engine_config(engine),), state_dir=state_dir, replay_timeout=0.5)
    h = await make_harness(config)
    await h.wait_connected()
    frames, cache = stream(4, start_seq=MAX_SEQ - 3)
    for f in frames:
        await engine.publish(f)
    await h.wait_seq("sim-0", MAX_SEQ)
    topic, _, payload = stream(5, start_seq=MAX_SEQ - 3)[0][4]
    await engine.publish((topic, (2**64 - 1).to_bytes(8, "big"), payload))
    counted = h.daemon.metrics.decode_errors.labels(config.engines[0].name, "bad_seq")
    await wait_for(lambda: counted._value.get() == 1, 5, "bad_seq counted")
    held = {e.hash for e in h.daemon.index.export_entries()}
    assert held == set(cache.held())
    before = (h.stream("sim-0").synced, h.stream("sim-0").stored)  # history_lost: seqs 0.. never came
    await h.daemon.stop()
    await engine.wait_subscribers(0)  # the first daemon's subscription gone: the next one is the second's

    h2 = await make_harness(config)
    await h2.wait_connected()
    assert h2.stream("sim-0").last_seq == MAX_SEQ and (h2.stream("sim-0").synced, h2.stream("sim-0").stored) == before
    engine.clear_buffer()  # the engine restarts: its replay history is gone, seq 0 of a new life
    again, truth = stream(6, seed=1)
    for f in again:
        await engine.publish(f)
    await h2.wait_seq("sim-0", 5, timeout=10)
    assert {e.hash for e in h2.daemon.index.export_entries()} == set(truth.held())
