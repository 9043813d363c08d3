"""An engine's lives, with real sockets: a batch delivered twice is not a restart, a restart while
kvindex was down is seen when it comes back, and a resync the engine's history cannot rebuild
leaves the pod unsynced (issue 13, classes 2, 3 and 6). Each compares kvindex with an
uninterrupted control fed the same batches, or with the simulated engine's own truth."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvindex.config import Config
from tests.conftest import engine_config, ipc_endpoint, wait_for
from tests.faultkit import stream


def held(h: Any) -> set[int]:
    return {e.hash for e in h.daemon.index.export_entries()}


async def metric(h: Any, line: str) -> float | None:
    """The value of the metric sample ``line`` (name and labels) in ``/metrics``, None if absent."""
    status, body = await h.get("/metrics")
    assert status == 200
    m = re.search(re.escape(line) + r" (\S+)", body.decode())
    return float(m.group(1)) if m else None


# -- class 2: a duplicate is not a restart ------------------------------------------------------
async def test_a_batch_delivered_twice_is_a_duplicate_not_a_restart(make_harness: Any, make_engine: Any,
                                                                    tmp_path: Path) -> None:
    """seq N twice, N - 1 after N, and a seq far behind (past the stream's CRC memory), with a
    replay history of 8 batches: the pod keeps its blocks and stays synced, exactly as a control
    fed no duplicates; the duplicates are counted."""
    frames, truth = stream(300, seed=21)
    dup = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"),
                            buffer_steps=8)
    clean = await make_engine(ipc_endpoint(tmp_path, "pub2"), replay_endpoint=ipc_endpoint(tmp_path, "rep2"),
                              buffer_steps=8)
    h = await make_harness(Config(engines=(engine_config(dup),)))
    ref = await make_harness(Config(engines=(engine_config(clean),)))
    await h.wait_connected()
    await ref.wait_connected()
    for i, f in enumerate(frames):
        await dup.publish(f)
        await clean.publish(f)
        if i == 149:  # the network delivers 149 again, then 148
            await dup.publish(frames[149], live_only=True)
            await dup.publish(frames[148], live_only=True)
    await dup.publish(frames[5], live_only=True)  # far behind: the replay is asked about seq 299
    await dup.publish(frames[299], live_only=True)
    await h.wait_seq("sim-0", 299)
    await ref.wait_seq("sim-0", 299)
    line = 'kvindex_batches_skipped_total{outcome="duplicate",pod="sim-0"}'
    await wait_for(lambda: h.stream("sim-0").skipped == 4, 10, "the four duplicates handled")
    st = h.stream("sim-0")
    assert st.restarts == 0 and st.synced and st.gaps == 0, (st.restarts, st.synced, st.unsynced_reason)
    assert held(h) == held(ref) == set(truth.held())
    assert set(h.daemon.index.export_entries()) == set(ref.daemon.index.export_entries())
    assert await metric(h, line) == 4.0 and not await metric(ref, line)
    status, ready = await h.get("/readyz")
    assert status == 200, ready


async def test_a_restart_is_still_a_restart(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """The other side of the rule: seq back to 0 with other bytes (a new life), both inside the
    stream's CRC memory (20 batches) and past it (300): the pod holds the new life only."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    h = await make_harness(Config(engines=(engine_config(engine),)))
    await h.wait_connected()
    for restarts, (n, seed) in enumerate(((20, 31), (300, 32), (30, 33))):
        engine.clear_buffer()  # a new life: its history starts again
        frames, truth = stream(n, seed=seed)
        for f in frames:
            await engine.publish(f)
        await h.wait_seq("sim-0", n - 1, timeout=10)
        want = set(truth.held())
        await wait_for(lambda w=want: held(h) == w, 5, "the new life's blocks")
        st = h.stream("sim-0")
        assert st.restarts == restarts and st.synced


# -- class 3: a restart kvindex could not see --------------------------------------------------
@pytest.mark.parametrize("new_life", [60, 10], ids=["past-the-watermark", "short-of-it"])
async def test_an_engine_restart_while_kvindex_was_down_is_detected(new_life: int, make_harness: Any,
                                                                   make_engine: Any, tmp_path: Path) -> None:
    """kvindex stops at seq 29 (its state saved); the engine restarts and publishes ``new_life``
    batches of a new life, past the old watermark or short of it. kvindex comes back: the replay
    holds other bytes at seq 29 (or nothing): the pod holds the new life only, synced."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    config = Config(engines=(engine_config(engine),), state_dir=tmp_path / "state")
    h = await make_harness(config)
    await h.wait_connected()
    first, _ = stream(30, seed=41)
    for f in first:
        await engine.publish(f)
    await h.wait_seq("sim-0", 29)
    await h.daemon.stop()  # its final snapshot holds the watermark and the CRC of batch 29
    engine.clear_buffer()  # the engine restarts while kvindex is down
    second, truth = stream(new_life, seed=42)
    for f in second:
        await engine.publish(f)  # nobody listening
    h2 = await make_harness(config)
    # the replay of the new life sets last_seq batch by batch; the pod is marked synced after its last
    await wait_for(lambda: (s := h2.stream("sim-0")) is not None and s.last_seq == new_life - 1 and s.synced, 10,
                   "the new life replayed and the pod synced")
    st = h2.stream("sim-0")
    assert st.restarts == 1 and st.synced, (st.restarts, st.unsynced_reason)
    assert held(h2) == set(truth.held())
    _, pods = await h2.get("/v1/pods")
    assert [p["synced"] for p in pods["pods"] if p["pod"] == "sim-0"] == [True]


async def test_the_same_life_after_kvindex_was_down_is_caught_up_not_cleared(make_harness: Any, make_engine: Any,
                                                                            tmp_path: Path) -> None:
    """The control: the engine did not restart, only went on publishing; the watermark batch is
    still the engine's, so nothing is cleared (the replay's answer for seq 29 agrees)."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    config = Config(engines=(engine_config(engine),), state_dir=tmp_path / "state")
    h = await make_harness(config)
    await h.wait_connected()
    frames, truth = stream(60, seed=43)
    for f in frames[:30]:
        await engine.publish(f)
    await h.wait_seq("sim-0", 29)
    await h.daemon.stop()
    for f in frames[30:]:
        await engine.publish(f)
    h2 = await make_harness(config)
    await wait_for(lambda: (s := h2.stream("sim-0")) is not None and s.last_seq == 59 and s.synced, 10, "catch-up")
    st = h2.stream("sim-0")
    assert st.restarts == 0 and st.synced and held(h2) == set(truth.held())


# -- class 6: a resync without the history ------------------------------------------------------
async def test_resync_without_the_history_leaves_the_pod_unsynced(make_harness: Any, make_engine: Any,
                                                                  tmp_path: Path) -> None:
    """The engine's replay holds only its last 8 batches: an operator's resync clears the pod and
    cannot rebuild it, so the pod is unsynced with the reason (in /v1/pods, /readyz and
    kvindex_pod_synced), also after the next live batch; never an empty pod called synced."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"),
                               buffer_steps=8)
    h = await make_harness(Config(engines=(engine_config(engine),)))
    await h.wait_connected()
    frames, _ = stream(21, seed=51)
    for f in frames[:20]:
        await engine.publish(f)
    await h.wait_seq("sim-0", 19)
    assert h.stream("sim-0").synced and held(h)
    status, _ = await h.post("/v1/pods/sim-0/resync", {})
    assert status == 200

    async def unsynced() -> None:
        status, pods = await h.get("/v1/pods")
        (view,) = [p for p in pods["pods"] if p["pod"] == "sim-0"]
        assert view["synced"] is False and view["unsynced_reason"] == "history_lost", view
        status, ready = await h.get("/readyz")
        assert status == 503 and "pod sim-0: unsynced (history_lost)" in ready["reasons"], ready
        assert await metric(h, 'kvindex_pod_synced{pod="sim-0"}') == 0.0

    await unsynced()
    await engine.publish(frames[20])  # the next live batch applies, but the history before it is gone
    await h.wait_seq("sim-0", 20)
    await unsynced()


async def test_resync_with_the_whole_history_rebuilds_the_pod_synced(make_harness: Any, make_engine: Any,
                                                                     tmp_path: Path) -> None:
    """The control: the replay reaches seq 0, so the resync rebuilds exactly what the engine holds."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    h = await make_harness(Config(engines=(engine_config(engine),)))
    await h.wait_connected()
    frames, truth = stream(20, seed=51)
    for f in frames:
        await engine.publish(f)
    await h.wait_seq("sim-0", 19)
    status, _ = await h.post("/v1/pods/sim-0/resync", {})
    assert status == 200 and h.stream("sim-0").synced and held(h) == set(truth.held())
    status, ready = await h.get("/readyz")
    assert status == 200, ready


async def test_a_failed_resync_is_still_unsynced_after_a_crash(make_harness: Any, make_engine: Any,
                                                               tmp_path: Path) -> None:
    """The write-ahead log holds the resync and the batches after it, not its outcome: re-applied
    at start, a resync followed by a batch past the first seq is the history it could not rebuild."""
    state_dir = tmp_path / "state"
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"),
                               buffer_steps=8)
    h = await make_harness(Config(engines=(engine_config(engine),), state_dir=state_dir))
    await h.wait_connected()
    frames, _ = stream(21, seed=52)
    for f in frames[:20]:
        await engine.publish(f)
    await h.wait_seq("sim-0", 19)
    await h.daemon.snapshot()  # what follows is in the write-ahead log only
    assert (await h.post("/v1/pods/sim-0/resync", {}))[0] == 200
    await engine.publish(frames[20])
    await h.wait_seq("sim-0", 20)
    assert not h.stream("sim-0").synced
    crashed = tmp_path / "crashed"  # a SIGKILL at this instant: the files as they are on disk
    shutil.copytree(state_dir, crashed)
    h2 = await make_harness(Config(engines=(engine_config(engine),), state_dir=crashed))
    await wait_for(lambda: (s := h2.stream("sim-0")) is not None and s.last_seq == 20, 10, "restored")
    _, pods = await h2.get("/v1/pods")
    (view,) = [p for p in pods["pods"] if p["pod"] == "sim-0"]
    assert view["synced"] is False and view["unsynced_reason"] == "history_lost", view
    assert held(h2) == held(h)


# -- a catch-up that cannot rebuild a restored pod says so at once --------------------------------
async def test_a_restored_pod_whose_catch_up_fails_is_unsynced_without_a_live_batch(make_harness: Any,
                                                                                   make_engine: Any,
                                                                                   tmp_path: Path) -> None:
    """kvindex stops at seq 29 (state saved); the engine goes on to seq 59 with a replay history of
    8 batches, then goes quiet. kvindex comes back: the catch-up from 30 finds 52..59 only, so the
    pod is unsynced (history_lost) in /v1/pods and /readyz at once, not only after the next live
    batch (an idle engine may never send one). Before, the restored "synced" stayed."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"),
                               buffer_steps=8)
    config = Config(engines=(engine_config(engine),), state_dir=tmp_path / "state")
    h = await make_harness(config)
    await h.wait_connected()
    frames, _ = stream(60, seed=44)
    for f in frames[:30]:
        await engine.publish(f)
    await h.wait_seq("sim-0", 29)
    await h.daemon.stop()
    for f in frames[30:]:
        await engine.publish(f)  # nobody listening; the engine's history keeps 52..59
    h2 = await make_harness(config)
    await wait_for(lambda: (s := h2.stream("sim-0")) is not None and s.replays >= 1 and not s.synced, 10,
                   "the catch-up's verdict")
    _, pods = await h2.get("/v1/pods")
    (view,) = [p for p in pods["pods"] if p["pod"] == "sim-0"]
    assert view["synced"] is False and view["unsynced_reason"] == "history_lost", view
    status, ready = await h2.get("/readyz")
    assert status == 503 and "pod sim-0: unsynced (history_lost)" in ready["reasons"], ready
    assert await metric(h2, 'kvindex_pod_synced{pod="sim-0"}') == 0.0


# -- an old duplicate the replay cannot place is not a restart ------------------------------------
async def test_an_old_batch_the_replay_cannot_place_is_rejected_not_a_restart(make_harness: Any, make_engine: Any,
                                                                             tmp_path: Path) -> None:
    """The lane has applied 0..299; the engine went on to 320 but the live socket lost 300..320,
    and its replay keeps only 313..320. Then 20 old batches (seqs 5..24, past the stream's CRC
    memory) arrive again. The replay answers, but it no longer reaches the watermark (299): it
    cannot tell a duplicate from a restart. Nothing is cleared on that guess: the batches are
    rejected (counted), the pod keeps exactly what it held and is unsynced (``life_unknown``), and
    the replay is asked about the watermark at most once a second, not once a batch. Before, the
    first of them cleared the pod as a restart."""
    frames, truth = stream(321, seed=23)
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"),
                               buffer_steps=8)
    h = await make_harness(Config(engines=(engine_config(engine),)))
    await h.wait_connected()
    for f in frames[:300]:
        await engine.publish(f)
    await h.wait_seq("sim-0", 299)
    before = held(h)
    for f in frames[300:]:
        await engine.publish(f, replay_only=True)  # published, lost on the way
    asked = engine.replays_served
    for f in frames[5:25]:
        await engine.publish(f, live_only=True)
    rejected = {"pod": "sim-0", "reason": "life_unknown"}
    await wait_for(lambda: h.daemon.registry.get_sample_value("kvindex_decode_errors_total", rejected) == 20.0
                   or h.stream("sim-0").restarts, 10, "the 20 old batches handled")
    st = h.stream("sim-0")
    assert st.restarts == 0 and st.last_seq == 299, (st.restarts, st.last_seq)
    assert held(h) == before and held(h) != set(truth.held())  # kept, not cleared (and it lacks 300..320)
    _, pods = await h.get("/v1/pods")
    (view,) = [p for p in pods["pods"] if p["pod"] == "sim-0"]
    assert view["synced"] is False and view["unsynced_reason"] == "life_unknown", view
    assert engine.replays_served - asked <= 5  # at most once a second (a slow machine: a few), not 20
    # the engine's replay holds the watermark batch again (these very bytes at 299): the next check
    # (a second on) places the old batches as duplicates, and the pod is synced again, untouched
    await engine.publish(frames[299], replay_only=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while not h.stream("sim-0").synced:
        assert loop.time() < deadline, "synced again once the replay places the watermark"
        await engine.publish(frames[5], live_only=True)
        await asyncio.sleep(0.1)
    st = h.stream("sim-0")
    assert st.restarts == 0 and st.last_seq == 299 and held(h) == before
    _, pods = await h.get("/v1/pods")
    assert [p["synced"] for p in pods["pods"] if p["pod"] == "sim-0"] == [True]


async def test_without_a_replay_endpoint_a_seq_far_back_is_a_restart(make_harness: Any, make_engine: Any,
                                                                     tmp_path: Path) -> None:
    """The other side: an engine with no replay endpoint gives no evidence but its seq, so a seq
    that goes back past the stream's CRC memory with a usable event is a restart, as it always was."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"))
    h = await make_harness(Config(engines=(engine_config(engine),)))
    await h.wait_connected()
    first, _ = stream(300, seed=24)
    for f in first:
        await engine.publish(f)
    await h.wait_seq("sim-0", 299)
    second, truth = stream(30, seed=25)
    for f in second:
        await engine.publish(f)
    await h.wait_seq("sim-0", 29)
    st = h.stream("sim-0")
    assert st.restarts == 1 and st.synced, (st.restarts, st.unsynced_reason)
    assert held(h) == set(truth.held())
