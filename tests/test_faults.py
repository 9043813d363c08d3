"""Faults an operator will meet, with real processes and sockets; each ends by comparing kvindex's
state with an uninterrupted run's (a second daemon on the same stream) or with the engine's own
truth (the simulated vLLM block cache behind the stream)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvindex.config import Config, EngineConfig
from kvindex.persist import snapshot as snapshots
from kvindex.tools.fake_engine import FakeEngine
from tests.conftest import engine_config, ipc_endpoint
from tests.faultkit import (
    cpu_seconds,
    dump,
    free_port,
    http,
    open_fds,
    pods,
    replay,
    rss_kib,
    serve,
    stop,
    stream,
    wait_until,
    write_capture,
)

MSGS = [{"role": "system", "content": "you are a fault injector " * 4}]


def engine_arg(pub: int, rep: int | None) -> str:
    spec = f"endpoint=tcp://127.0.0.1:{pub}"
    return spec + (f",replay=tcp://127.0.0.1:{rep}" if rep else "")


def decide(port: int, i: int) -> None:
    status, body = http(f"http://127.0.0.1:{port}/v1/decisions", "POST", {
        "pod": f"sim-{i % 2}", "request": {"model": "m", "messages": MSGS + [{"role": "user", "content": f"q{i} " * 30}]}})
    assert status == 200, body


def fd_kinds(pid: int) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            kinds[os.readlink(f"/proc/{pid}/fd/{fd}").split(":")[0].split("[")[0]] += 1
        except OSError:
            pass
    return dict(kinds)


def errors(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "Error" in line or "ERROR" in line][:10]


def seq_of(port: int, pod: str = "sim-0") -> int:
    return (pods(port).get(pod) or {}).get("last_seq") or 0


def state_of(port: int) -> snapshots.State:
    status, raw = http(f"http://127.0.0.1:{port}/v1/state")
    assert status == 200
    return snapshots.decode(raw)


def delivered_holdings(frames: list[tuple[bytes, bytes, bytes]], delivered: set[int]) -> set[int]:
    """Engine hashes held after applying only the delivered batches (plain msgpack, no kvindex)."""
    counts: Counter[int] = Counter()
    for i, (_, _, payload) in enumerate(frames):
        if i not in delivered:
            continue
        for ev in msgpack.unpackb(payload, raw=False)[1]:
            for h in ev.get("block_hashes", []):
                if ev["type"] == "BlockStored":
                    counts[h] += 1
                elif counts[h]:
                    counts[h] -= 1
    return set(+counts)


# -- kvindex itself killed ---------------------------------------------------------------------
def test_sigkill_mid_stream_restart_equals_uninterrupted_run(tmp_path: Path) -> None:
    frames, truth = stream(400, seed=3)
    capture = write_capture(tmp_path / "cap.jsonl", frames, dt=0.008)
    pub, rep, ref_port, port = free_port(), free_port(), free_port(), free_port()
    spec = engine_arg(pub, rep)
    state_dir = tmp_path / "state"
    ref = serve(ref_port, "--engine", spec)
    victim = serve(port, "--engine", spec, "--state-dir", str(state_dir), "--snapshot-seconds", "0.7",
                   log=tmp_path / "victim.log")
    engine = replay(capture, pub, rep, "--speed", "1", "--linger", "1.5", "--subscribers", "2")
    try:
        for i in range(6):
            decide(ref_port, i), decide(port, i)
        seq = wait_until(lambda: (s := seq_of(port)) > 150 and s, 10, "mid-stream")
        victim.kill()  # SIGKILL: no final snapshot, only what is on disk
        victim.wait()
        assert seq < 399, "the stream ended before the kill: make it longer"
        victim = serve(port, "--engine", spec, "--state-dir", str(state_dir), log=tmp_path / "victim.log")
        for i in range(6, 9):
            decide(ref_port, i), decide(port, i)
        assert engine.wait(timeout=30) == 0
        wait_until(lambda: pods(port)["sim-0"]["last_seq"] == 399 == pods(ref_port)["sim-0"]["last_seq"], 10, "end")
        mine, theirs = pods(port), pods(ref_port)
        assert mine["sim-0"]["blocks"] == theirs["sim-0"]["blocks"] and mine["sim-0"]["synced"]
        assert {p: v["approx_entries"] for p, v in mine.items()} == {p: v["approx_entries"] for p, v in theirs.items()}
        assert dump(port) == dump(ref_port)
        a, b = state_of(port), state_of(ref_port)
        assert set(a.all_entries()) == set(b.all_entries()) and a.approx == b.approx
        assert {e.hash for e in a.all_entries()} == set(truth.held())
        assert "restored at seq" in (tmp_path / "victim.log").read_text()
    finally:
        for p in (engine, ref, victim):
            stop(p)


# -- the engine killed and restarted -----------------------------------------------------------
def test_engine_killed_and_restarted_seq_reset_detected(tmp_path: Path) -> None:
    first, _ = stream(300, seed=4)
    second, truth = stream(40, seed=5)  # a new engine life: seq starts at 0 again, new cache
    pub, rep, port = free_port(), free_port(), free_port()
    daemon = serve(port, "--engine", engine_arg(pub, rep))
    engine = replay(write_capture(tmp_path / "a.jsonl", first, dt=0.01), pub, rep, "--speed", "1", "--linger", "1")
    try:
        wait_until(lambda: seq_of(port) > 50, 10, "first life")
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        before = pods(port)["sim-0"]["last_seq"]
        assert 50 < before < 299
        engine = replay(write_capture(tmp_path / "b.jsonl", second, dt=0.002), pub, rep, "--speed", "1",
                        "--linger", "1.5")
        assert engine.wait(timeout=30) == 0
        wait_until(lambda: pods(port)["sim-0"]["last_seq"] == 39, 10, "second life")
        view = pods(port)["sim-0"]
        assert view["restarts"] >= 1 and view["synced"]
        assert {h for (_, _, h, _) in set().union(*dump(port).values())} == set(truth.held())
    finally:
        stop(engine), stop(daemon)


# -- messages dropped --------------------------------------------------------------------------
async def test_dropped_messages_recovered_by_replay(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    frames, truth = stream(200, seed=6)
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    h = await make_harness(Config(engines=(engine_config(engine),)))
    ref = await make_harness(Config(engines=(engine_config(engine),)))
    await h.wait_connected()
    await ref.wait_connected()
    dropped = {i for i in range(200) if i % 9 == 4 or 100 <= i < 130}  # single drops and an HWM burst
    for i, f in enumerate(frames):
        await engine.publish(f, replay_only=i in dropped)
    await h.wait_seq("sim-0", 199)
    await ref.wait_seq("sim-0", 199)  # the reference must be done too before the two are compared
    st = h.stream("sim-0")
    assert st.synced and st.gaps >= 15 and st.replays >= st.gaps
    assert set(h.daemon.index.export_entries()) == {e for e in ref.daemon.index.export_entries()}
    assert {e.hash for e in h.daemon.index.export_entries()} == set(truth.held())


# -- the replay endpoint down or answering garbage ----------------------------------------------
async def _garbage_router(ctx: zmq.asyncio.Context, endpoint: str, kind: str) -> None:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    try:
        while True:
            ident, *_ = await sock.recv_multipart()
            if kind == "payload":  # well-framed batches whose payloads are not msgpack batches
                for seq in range(0, 200):
                    await sock.send_multipart([ident, b"", b"kv@sim-0@m", seq.to_bytes(8, "big"), b"\xc1\xff garbage"])
                await sock.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
            else:  # frames of no known shape
                await sock.send_multipart([ident, b"", b"x", b"y", b"z", b"w", b"v"])
    finally:
        sock.close(linger=0)


@pytest.mark.parametrize("replay_kind", ["down", "payload", "frames"])
async def test_replay_down_or_garbage_marks_unsynced_never_wrong(
        replay_kind: str, make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    frames, _ = stream(60, seed=7)
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"))
    rep = ipc_endpoint(tmp_path, "rep")
    ctx = zmq.asyncio.Context()
    router = None if replay_kind == "down" else asyncio.create_task(_garbage_router(ctx, rep, replay_kind))
    try:
        h = await make_harness(Config(engines=(EngineConfig(endpoint=engine.endpoint, replay=rep),), replay_timeout=0.3))
        await h.wait_connected()
        dropped = {10, 11, 30}
        for i, f in enumerate(frames):
            await engine.publish(f, replay_only=i in dropped)
        await h.wait_seq("sim-0", 59, timeout=10)
        st = h.stream("sim-0")
        assert not st.synced and st.unsynced_reason in ("replay_failed", "history_lost")
        status, ready = await h.get("/readyz")
        assert status == 503 and any("sim-0: unsynced" in r for r in ready["reasons"])
        delivered = set(range(60)) - dropped
        assert {e.hash for e in h.daemon.index.export_entries()} == delivered_holdings(frames, delivered)
    finally:
        if router is not None:
            router.cancel()
            await asyncio.gather(router, return_exceptions=True)
        ctx.term()


# -- an engine that vanishes -------------------------------------------------------------------
def test_vanished_engine_reported_no_busy_loop_no_growth(tmp_path: Path) -> None:
    refused, silent_pub, gone_pub, port = free_port(), free_port(), free_port(), free_port()
    daemon = serve(port, "--engine", engine_arg(refused, free_port()), "--engine", engine_arg(silent_pub, None),
                   "--engine", engine_arg(gone_pub, None))
    ctx = zmq.Context()
    silent, gone = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
    silent.bind(f"tcp://127.0.0.1:{silent_pub}")
    gone.bind(f"tcp://127.0.0.1:{gone_pub}")
    try:
        wait_until(lambda: sum("not connected" in r for r in http(f"http://127.0.0.1:{port}/readyz")[1]["reasons"]) == 1,
                   10, "two engines connected")
        gone.close(linger=0)  # vanishes without a word
        status, ready = wait_until(lambda: (r := http(f"http://127.0.0.1:{port}/readyz")) and
                                   sum("not connected" in x for x in r[1]["reasons"]) == 2 and r, 10, "reported")
        assert status == 503
        assert any(f":{refused}" in r for r in ready["reasons"]) and any(f":{gone_pub}" in r for r in ready["reasons"])
        time.sleep(0.5)  # what is measured: the idle daemon, once the disconnect is handled
        cpu0, fds0, rss0 = cpu_seconds(daemon.pid), open_fds(daemon.pid), rss_kib(daemon.pid)
        time.sleep(3.0)  # what is measured: CPU, fds and RSS over 3 s of idling
        cpu1, fds1, rss1 = cpu_seconds(daemon.pid), open_fds(daemon.pid), rss_kib(daemon.pid)
        assert cpu1 - cpu0 < 0.3, f"busy loop: {cpu1 - cpu0:.2f}s CPU in 3s while idle"
        assert fds1 <= fds0 + 2 and rss1 - rss0 < 2048, (fds0, fds1, rss0, rss1)
    finally:
        silent.close(linger=0)
        ctx.term()
        assert stop(daemon) == 0


# -- 64 engines coming and going ----------------------------------------------------------------
def test_64_engines_connecting_and_disconnecting(tmp_path: Path) -> None:
    # the full minute in CI; a shorter churn for a developer's quick run. Each engine
    # publishes 3 batches a cycle until its stream is used up (well within the first half): what
    # kvindex keeps per batch (a stream's recent digests) then stops growing, and the churn alone runs
    n, seconds = 64, 60.0 if os.environ.get("CI") else 12.0
    batches = 200 if os.environ.get("CI") else 30
    port = free_port()
    daemon = serve(port, log=tmp_path / "daemon.log")
    ports = [(ipc_endpoint(tmp_path, f"p{i}"), ipc_endpoint(tmp_path, f"r{i}")) for i in range(n)]
    url = f"http://127.0.0.1:{port}"

    def register(i: int) -> None:
        pub, rep = ports[i]
        status, body = http(url + "/register", "POST", {
            "instance_id": i, "model_name": "m", "block_size": 4,
            "endpoint": pub, "replay_endpoint": rep})
        assert status == 201, body

    streams = [stream(batches, pod=str(i), seed=100 + i)[0] for i in range(n)]
    sent = [0] * n

    async def cycle(ctx: zmq.asyncio.Context, k: int) -> None:
        engines = [FakeEngine(p, replay_endpoint=r, context=ctx) for p, r in ports]
        try:
            for e in engines:
                await e.start()
            # every lane's SUB socket reconnected and subscribed to its new engine
            await asyncio.gather(*(e.wait_subscribers(1) for e in engines))
            published = set()
            for i, e in enumerate(engines):
                for _ in range(3):
                    if sent[i] < len(streams[i]):
                        await e.publish(streams[i][sent[i]])
                        sent[i] += 1
                        published.add(i)
            await applied_all(k, published)  # before the engines go away again
        finally:
            for e in engines:
                await e.close()

    async def applied_all(k: int, published: set[int]) -> None:
        """kvindex received and applied what the engines published in cycle ``k`` (it may ask an
        engine's replay endpoint for it, served by this event loop: poll without blocking it long).
        Once an engine's stream is used up it publishes nothing more, and nothing is waited for."""
        want = {str(i): sent[i] - 1 for i in published}
        deadline = time.monotonic() + 15
        while lagging := {p: (v.get("last_seq"), want[p]) for p, v in pods(port).items()
                          if p in want and v.get("last_seq") != want[p]} or set(want) - set(pods(port)):
            assert time.monotonic() < deadline, f"cycle {k}: not applied (pod: (kvindex, engine)): {lagging}"
            await asyncio.sleep(0.02)

    async def churn() -> list[tuple[float, int, int]]:
        ctx = zmq.asyncio.Context()
        samples = []
        t0 = time.monotonic()
        k = 0
        try:
            while time.monotonic() - t0 < seconds:
                await cycle(ctx, k)
                for i in range(k % 4, n, 4):  # a quarter of the fleet unregisters and registers again
                    status, _ = http(url + "/unregister", "POST", {"instance_id": i, "model_name": "m"})
                    assert status == 200
                    register(i)
                k += 1
                used_up = all(sent[i] == len(streams[i]) for i in range(n))
                samples.append((time.monotonic() - t0, open_fds(daemon.pid), rss_kib(daemon.pid), used_up))
        finally:
            ctx.term()
        return samples

    try:
        for i in range(n):
            register(i)
        samples = asyncio.run(churn())
        assert len(samples) >= 6, samples
        warm = samples[1]
        try:  # the last cycle's sockets closed (a leak never does: the assertions below say what grew)
            wait_until(lambda: open_fds(daemon.pid) <= warm[1] + 8, 10, "the last cycle's sockets closed")
        except AssertionError:
            pass
        end = (0, open_fds(daemon.pid), rss_kib(daemon.pid))
        assert end[1] <= warm[1] + 8, f"fds grew: {samples} {fd_kinds(daemon.pid)} {errors(tmp_path / 'daemon.log')}"
        # a leak grows with every cycle, at the same pace to the end; the allocator's warm-up slows
        # down (measured over 240 s here: +2.2 MB in the first 47 s after the streams were used up,
        # +0.5 MB in the 170 s after). So: over the second half of the churn alone (the streams used
        # up: nothing new to hold), RSS grows little, and the whole run stays within a fixed bound.
        churn_only = [s for s in samples if s[3]]
        assert len(churn_only) >= 6, f"the streams were used up too late to watch the churn alone: {samples}"
        second_half = churn_only[len(churn_only) // 2]
        assert end[2] - second_half[2] < 2 * 1024 and end[2] - warm[2] < 16 * 1024, f"RSS grew: {samples}"
        status, workers = http(url + "/workers")
        assert status == 200 and len(workers) == n
        assert http(url + "/healthz")[0] == 200
    finally:
        assert stop(daemon) == 0
