"""A replay endpoint that misbehaves (endless 1 MiB frames, endless tiny frames, never the end
marker) on one engine, while a second engine publishes and HTTP is timed: other lanes and HTTP
keep their latency, kvindex's RSS stays bounded, and the misbehaving pod is unsynced with the
bound's name (issue 13, class 13). A real ``kvindex serve``, real sockets, real processes."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvindex.config import Config, ConfigError
from kvindex.ingest.transport import fetch_replay
from kvindex.sequence import Outcome
from tests.conftest import ROOT, ipc_endpoint
from tests.faultkit import (
    free_port,
    http,
    pods,
    replay,
    rss_kib,
    serve,
    stop,
    stream,
    wait_until,
    write_capture,
)

MAX_BYTES = 32 << 20


def tcp(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def replays(url: str, pod: str) -> dict[str, float]:
    """``kvindex_replays_total`` of ``pod`` by outcome."""
    text = http(url + "/metrics")[1].decode()
    return {m.group(1): float(m.group(3)) for m in re.finditer(
        r'kvindex_replays_total\{outcome="([^"]+)",pod="([^"]+)"\} (\S+)', text) if m.group(2) == pod}


@pytest.mark.parametrize("kind", ["huge", "tiny"])
def test_a_misbehaving_replay_holds_neither_the_loop_nor_memory(kind: str, tmp_path: Path) -> None:
    frames, truth = stream(1200, seed=12)
    capture = write_capture(tmp_path / "good.jsonl", frames, dt=0.004)  # ~5 s of publishing
    bad_pub, bad_rep, good_pub, good_rep, port = (free_port() for _ in range(5))
    url = f"http://127.0.0.1:{port}"
    daemon = serve(port, "--engine", f"endpoint={tcp(bad_pub)},replay={tcp(bad_rep)}",
                   "--engine", f"endpoint={tcp(good_pub)},replay={tcp(good_rep)}",
                   "--replay-max-bytes", str(MAX_BYTES), "--replay-timeout", "1", log=tmp_path / "kvindex.log")
    rss0 = rss_kib(daemon.pid)  # before the hostile engine is up
    hostile = subprocess.Popen([sys.executable, "-m", "tests.hostile_engine", tcp(bad_pub), tcp(bad_rep), kind],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    good = None
    try:
        wait_until(lambda: replays(url, "hostile"), 15, "the hostile engine's replay asked")
        good = replay(capture, good_pub, good_rep, "--speed", "1", "--linger", "1")
        latencies: list[float] = []
        rss: list[int] = []
        progress: list[tuple[float, int]] = []  # (time, the good pod's last seq) whenever it moved
        t0 = time.monotonic()
        while good.poll() is None and time.monotonic() - t0 < 30:
            t = time.monotonic()
            status, body = http(url + "/v1/pods", timeout=10)
            latencies.append(time.monotonic() - t)
            assert status == 200
            seq = {p["pod"]: p.get("last_seq") for p in body["pods"]}.get("sim-0")
            if seq is not None and (not progress or seq != progress[-1][1]):
                progress.append((time.monotonic(), seq))
            rss.append(rss_kib(daemon.pid))
            time.sleep(0.02)
        assert good.wait(timeout=30) == 0
        wait_until(lambda: pods(port)["sim-0"]["last_seq"] == 1199, 5, "the good engine's last batch")
        worst = max(latencies)
        stalls = [b[0] - a[0] for a, b in itertools.pairwise(progress)]
        growth_mib = (max(rss) - rss0) / 1024
        print(f"\n{kind}: {len(latencies)} HTTP requests, max {worst * 1000:.0f} ms, median "
              f"{sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms; the good pod's longest pause "
              f"{max(stalls) * 1000:.0f} ms; RSS {rss0 // 1024} MiB -> max {max(rss) // 1024} MiB "
              f"(+{growth_mib:.0f} MiB); hostile replays {replays(url, 'hostile')}")
        assert worst < 0.5, f"HTTP stalled {worst:.2f}s"
        assert max(stalls) < 0.5, f"the good lane stalled {max(stalls):.2f}s"
        assert growth_mib < 256, f"RSS grew {growth_mib:.0f} MiB"
        view = pods(port)
        assert view["sim-0"]["synced"] and {e for e in view} >= {"sim-0", "hostile"}
        bad = view["hostile"]
        assert not bad["synced"] and bad["unsynced_reason"] in ("replay_too_large", "replay_timeout"), bad
        cut = {r: n for r, n in replays(url, "hostile").items() if r.startswith("replay_")}
        assert cut and sum(cut.values()) >= 2, cut
        got = _held(url, "sim-0")
        assert got == set(truth.held())
    finally:
        for p in (hostile, good, daemon):
            if p is not None:
                stop(p)


def _held(url: str, pod: str) -> set[int]:
    """The engine hashes ``/dump`` lists for ``pod``: in Dynamo's tree (--dynamo-dump) or unplaced."""
    groups = list(http(url + "/dump")[1].values())
    return ({b["block_hash"] for g in groups for e in g["events"] if e["pod"] == pod
             for b in e["event"]["data"]["stored"]["blocks"]}
            | {u[2] for g in groups for u in g.get("kvindex_unplaced", ()) if u[0] == pod})


# -- the bounds, at the transport ------------------------------------------------------------------
def _flood(endpoint: str, payload: bytes, stop: threading.Event) -> None:
    """A ROUTER (its own thread and context) answering the first request with endless frames."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    try:
        if not sock.poll(5000):
            return
        ident, *_ = sock.recv_multipart()
        seq = 0
        while not stop.is_set():
            try:
                sock.send_multipart([ident, b"", b"kv@sim-0@m", seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
                seq += 1
            except zmq.Again:
                time.sleep(0.001)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize(("payload", "max_bytes", "cut"), [
    (b"x" * 4, 128 << 20, "replay_timeout"),  # endless tiny frames: the deadline ends it
    (b"x" * (256 << 10), 4 << 20, "replay_too_large"),  # endless big frames: the byte bound ends it
])
async def test_an_endless_answer_ends_at_its_bound_and_never_holds_the_loop(
        payload: bytes, max_bytes: int, cut: str, tmp_path: Path) -> None:
    endpoint = ipc_endpoint(tmp_path, "rep")
    stop = threading.Event()
    flood = threading.Thread(target=_flood, args=(endpoint, payload, stop), daemon=True)
    flood.start()
    ctx = zmq.asyncio.Context()
    gaps: list[float] = []
    loop = asyncio.get_running_loop()
    last = [loop.time()]  # the ticker's last turn

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.005)
            now = loop.time()
            gaps.append(now - last[0])
            last[0] = now

    ticker = asyncio.create_task(tick())
    try:
        t0 = time.monotonic()
        result = await fetch_replay(ctx, endpoint, 0, timeout=0.5, max_bytes=max_bytes)
        took = time.monotonic() - t0
        gaps.append(loop.time() - last[0])  # the interval still open (a quick answer may end before any tick)
        assert not result.complete and result.cut == cut and result.frames, (result.cut, len(result.frames))
        assert sum(len(f.payload) for f in result.frames) <= max_bytes
        assert took < 2.0, took
        assert max(gaps) < 0.1, f"the event loop was held {max(gaps):.3f}s"
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        stop.set()
        flood.join(5)
        ctx.destroy(linger=0)


def test_the_bounds_are_checked_where_they_enter() -> None:
    for bad in ({"replay_max_bytes": 0}, {"replay_max_bytes": 1.5}, {"replay_timeout": 0},
                {"replay_timeout": -1.0}, {"replay_timeout": True}):
        with pytest.raises(ConfigError):
            Config(**bad)  # type: ignore[arg-type]
    assert (Config().replay_timeout, Config().replay_max_bytes) == (2.0, 128 << 20)
    for flag, value in (("--replay-max-bytes", "0"), ("--replay-timeout", "0")):
        done = subprocess.run([sys.executable, "-m", "kvindex", "serve", "--port", "0", flag, value],
                              capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 2 and "replay_" in done.stderr, done.stderr


# -- a replay that waited for descriptors is synced again only if it recovered ---------------------
@pytest.mark.parametrize(("kept", "back_after", "want"), [
    (48, None, "replay_failed"),  # the wait runs out: the replay never ran
    (8, 0.2, "history_lost"),  # descriptors back, but the engine's history no longer reaches seq 30
    (48, 0.2, None),  # descriptors back, the range recovered: synced again
], ids=["wait-ran-out", "history-lost", "recovered"])
async def test_a_replay_that_waited_for_descriptors_ends_with_its_outcome(kept: int, back_after: float | None,
                                                                         want: str | None, tmp_path: Path) -> None:
    """A real ZeroMQ context with one socket slot, held: the replay's DEALER cannot be made (EMFILE),
    so it waits, the stream shown unsynced (``replay_waiting_for_file_descriptors``). When the wait
    ends the store holds the recovery's outcome: synced only if the range was recovered (before,
    any end of the wait wrote synced, also after ``replay_failed`` or ``history_lost``)."""
    from prometheus_client import CollectorRegistry

    from adapters.dialects import DIALECTS
    from kvindex.config import EngineConfig
    from kvindex.index.memory import MemoryPreciseStore
    from kvindex.ingest.replay import NO_DESCRIPTORS, Replay
    from kvindex.ingest.writer import StreamWriter
    from kvindex.logs import BurstLog
    from kvindex.metrics import Metrics
    from kvindex.sequence import Position
    from kvindex.tools.fake_engine import FakeEngine

    frames, _ = stream(48, seed=13)
    engine = FakeEngine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"), buffer_steps=kept)
    await engine.start()
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, 1)
    hold = ctx.socket(zmq.PUB)  # the only slot: no DEALER can be made
    store, metrics = MemoryPreciseStore(), Metrics(CollectorRegistry())
    config = EngineConfig(endpoint=engine.endpoint, replay=engine.replay_address)
    writer = StreamWriter(config, {}, decoder=DIALECTS[config.dialect].decoder(), first_seq=0, store=store,
                          metrics=metrics, burst=BurstLog(logging.getLogger("test")))
    shown: list[Position | None] = []

    async def waiting(st: Any, *how: Any) -> None:  # (reason, waiting): the writer's, recorded
        await writer.waiting(st, *how)
        shown.append(await store.position(st.ref))

    replay = Replay(ctx, engine.replay_address, 2.0, metrics, on_wait=waiting, descriptor_wait=1.5)  # room for a loaded CI
    try:
        for f in frames:
            await engine.publish(f)
        st = writer.stream(frames[0][0].decode())
        await store.set_position(st.ref, Position(29, 0))  # synced at seq 29, as restored
        st.last_seq = 29

        async def offer(st: Any, frame: Any) -> bool:
            batch = writer.decode(st.pod, frame)
            return batch is not None and (await writer.apply(st, frame.seq, batch, frame.payload, None)).outcome \
                is not Outcome.GAP

        async def give_back() -> None:
            if back_after is not None:
                await asyncio.sleep(back_after)
                hold.close(linger=0)

        releaser = asyncio.create_task(give_back())
        reason = await replay.recover(st, 30, None, offer)
        await releaser
        assert reason == want
        assert shown[0] is not None and shown[0].reason == NO_DESCRIPTORS and not shown[0].synced  # it waited
        pos = await store.position(st.ref)
        assert pos is not None and pos.synced is (want is None) and pos.reason == want, pos
    finally:
        hold.close(linger=0)
        ctx.term()
        await engine.close()
