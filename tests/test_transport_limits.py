"""ZeroMQ limits: the message size cap on the SUB and replay sockets, the replay's one deadline and
its frame cap. Real pyzmq sockets on ipc endpoints; nothing of kvindex is mocked."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvindex.config import Config, ConfigError
from kvindex.events import Frame
from kvindex.ingest.transport import (
    MAX_MESSAGE_BYTES,
    ReplayError,
    Subscriber,
    fetch_replay,
    ingest_context,
)
from kvindex.tools.engine_sim import SimulatedCache, encode_batch
from tests.conftest import engine_config, ipc_endpoint, wait_for

TOPIC = b"kv@sim-0@m"


@pytest.fixture
async def ctx() -> Any:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)  # never hangs, even when a failed test left a socket open


async def _router(ctx: zmq.asyncio.Context, endpoint: str, answer: Any) -> None:
    """A replay endpoint: ``answer(send)`` is awaited per request."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    try:
        while True:
            ident, *_ = await sock.recv_multipart()
            await answer(lambda parts: sock.send_multipart([ident, b"", *parts]))
    finally:
        sock.close(linger=0)


def _frame(seq: int, payload: bytes) -> list[bytes]:
    return [TOPIC, seq.to_bytes(8, "big"), payload]


# -- message size --------------------------------------------------------------------------------
async def test_subscriber_refuses_messages_over_the_limit(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    endpoint = ipc_endpoint(tmp_path, "pub")
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    sub = Subscriber(ctx, endpoint, bind=False, rcvhwm=1000, max_message_bytes=4096)
    got: list[Frame] = []

    async def read() -> None:
        async for m in sub.messages():
            assert isinstance(m, Frame)
            got.append(m)

    events: list[int] = []

    async def watch() -> None:  # what the lane does with the monitor (and what makes it reconnect)
        assert sub.monitor is not None
        while True:
            events.append(parse_monitor_message(await sub.monitor.recv_multipart())["event"])

    reader, watcher = asyncio.create_task(read()), asyncio.create_task(watch())
    try:
        for seq in range(200):  # until the subscription is through (slow joiner)
            await pub.send_multipart(_frame(seq, b"small"))
            if got:
                break
            await asyncio.sleep(0.02)
        assert got
        await pub.send_multipart(_frame(1000, b"x" * 8192))
        for _ in range(100):  # libzmq drops the connection that sent it (the lane reports it)
            if zmq.EVENT_DISCONNECTED in events:
                break
            await asyncio.sleep(0.02)
        assert events.count(zmq.EVENT_DISCONNECTED) == 1
        assert all(len(f.payload) <= 4096 for f in got) and 1000 not in {f.seq for f in got}
    finally:
        reader.cancel()
        watcher.cancel()
        await asyncio.gather(reader, watcher, return_exceptions=True)
        sub.close()
        pub.close(linger=0)


async def test_limit_defaults(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    sub = Subscriber(ctx, ipc_endpoint(tmp_path, "a"), bind=True, rcvhwm=10)
    try:
        assert sub._sock.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES == 64 << 20
    finally:
        sub.close()
    other = zmq.asyncio.Context()
    other.setsockopt(zmq.MAXMSGSIZE, 12345)  # what the daemon does with Config.max_message_bytes
    sub = Subscriber(other, ipc_endpoint(tmp_path, "b"), bind=True, rcvhwm=10)
    try:
        assert sub._sock.getsockopt(zmq.MAXMSGSIZE) == 12345
    finally:
        sub.close()
        other.term()
    assert Config().max_message_bytes == 64 << 20
    with pytest.raises(ConfigError):
        Config(max_message_bytes=0)


async def test_replay_refuses_messages_over_the_limit(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    endpoint = ipc_endpoint(tmp_path, "rep")

    async def answer(send: Any) -> None:
        await send(_frame(5, b"y" * 8192))
        await send([b"", b"\xff" * 8, b""])

    router = asyncio.create_task(_router(ctx, endpoint, answer))
    try:
        with pytest.raises(ReplayError):
            await fetch_replay(ctx, endpoint, 5, timeout=0.5, max_message_bytes=4096)
        result = await fetch_replay(ctx, endpoint, 5, timeout=2.0)  # the default limit lets it through
        assert result.complete and [f.seq for f in result.frames] == [5]
    finally:
        router.cancel()
        await asyncio.gather(router, return_exceptions=True)


async def test_daemon_drops_an_oversized_batch_and_marks_the_pod_unsynced(
        make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """``Config.max_message_bytes`` reaches the lane's SUB and replay sockets: a batch over it is
    never applied (live or replayed); the pod says it is unsynced."""
    cache = SimulatedCache(4096, 4, hash_seed=1)
    payloads = [encode_batch(cache.admit([100 * i + t for t in range(9)]).events, time.time()) for i in range(6)]
    huge_events = cache.admit(list(range(50_000, 53_000))).events
    huge = encode_batch(huge_events, time.time())
    tail = [encode_batch(cache.admit([7000 + 10 * i + t for t in range(9)]).events, time.time()) for i in range(6)]
    assert max(map(len, payloads + tail)) < 2048 < 8192 < len(huge)
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    h = await make_harness(Config(engines=(engine_config(engine),), max_message_bytes=8192, replay_timeout=0.5))
    await h.wait_connected()
    seq = 0
    for p in payloads:
        await engine.publish([TOPIC, seq.to_bytes(8, "big"), p])
        seq += 1
    await h.wait_seq("sim-0", seq - 1)
    await engine.publish([TOPIC, seq.to_bytes(8, "big"), huge])
    huge_seq = seq
    # libzmq drops the connection that sent it: the engine is reported, and the batch never applied
    await wait_for(lambda: all(not lane.state.connected_peers for lane in h.daemon.fleet.lanes().values()),
                   10, "the oversized sender to be dropped")
    status, ready = await h.get("/readyz")
    assert status == 503 and any("not connected" in r for r in ready["reasons"])
    assert h.stream("sim-0").last_seq == huge_seq - 1
    stored = {hh for ev in huge_events if ev["type"] == "BlockStored" for hh in ev["block_hashes"]}
    assert stored and not stored & {e.hash for e in h.daemon.index.export_entries()}


# -- the replay's deadline and frame cap -----------------------------------------------------------
async def test_replay_has_one_deadline_for_the_whole_answer(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """An endpoint that trickles batches forever, each well within the timeout: the answer as a
    whole must still end at the deadline."""
    endpoint = ipc_endpoint(tmp_path, "rep")

    async def trickle(send: Any) -> None:
        seq = 0
        while True:
            await send(_frame(seq, b"batch"))
            seq += 1
            await asyncio.sleep(0.05)

    router = asyncio.create_task(_router(ctx, endpoint, trickle))
    try:
        t0 = time.monotonic()
        result = await asyncio.wait_for(fetch_replay(ctx, endpoint, 0, timeout=0.4), 5)
        took = time.monotonic() - t0
        assert not result.complete and 1 <= len(result.frames) <= 20 and took < 1.5, (took, len(result.frames))
        assert [f.seq for f in result.frames] == list(range(len(result.frames)))
    finally:
        router.cancel()
        await asyncio.gather(router, return_exceptions=True)


async def test_replay_stops_after_max_frames(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    endpoint = ipc_endpoint(tmp_path, "rep")

    async def flood(send: Any) -> None:
        for seq in range(100):
            await send(_frame(seq, b"batch"))
        await send([b"", b"\xff" * 8, b""])

    router = asyncio.create_task(_router(ctx, endpoint, flood))
    try:
        result = await fetch_replay(ctx, endpoint, 0, timeout=2.0, max_frames=10)
        assert not result.complete and [f.seq for f in result.frames] == list(range(10))
    finally:
        router.cancel()
        await asyncio.gather(router, return_exceptions=True)


async def test_the_ingest_context_holds_more_lanes_than_libzmqs_default(tmp_path: Path) -> None:
    """libzmq's default of 1,023 sockets per context is 341 lanes (a SUB and its monitor's two ends):
    the daemon's context takes as many as the process may open files, so 400 engines subscribe."""
    ctx = ingest_context(MAX_MESSAGE_BYTES)  # raises the soft open-file limit first
    plain = zmq.asyncio.Context()
    subs: list[Subscriber] = []
    try:
        assert plain.get(zmq.MAX_SOCKETS) == 1023 < ctx.get(zmq.MAX_SOCKETS)
        for i in range(400):
            subs.append(Subscriber(ctx, ipc_endpoint(tmp_path, f"e{i}"), bind=False, rcvhwm=1000))
        assert len(subs) == 400 and all(s.monitor is not None for s in subs)
    finally:
        for s in subs:
            s.close()
        plain.term()
        ctx.term()


def test_the_ingest_context_plans_no_more_sockets_than_files_it_may_open() -> None:
    """Sized by the open-file limit in force after raising it: where the soft limit cannot be
    raised (a low hard limit), libzmq must not plan for more sockets than that (EMFILE)."""
    import subprocess
    import sys
    code = ("import resource, zmq; from kvindex.ingest.transport import ingest_context;"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (1500, 1500));"
            "c = ingest_context(1 << 20); print(c.get(zmq.MAX_SOCKETS), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1500", "1500"], out
    code = code.replace("(1500, 1500)", "(1024, 3000)")  # a soft limit under the hard one: raised first
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["3000", "3000"], out
