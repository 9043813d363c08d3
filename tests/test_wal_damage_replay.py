"""A damaged write-ahead log record is a gap like any other (issue 37, item 8): kvindex, SIGKILLed
and restarted on its state dir with one bit flipped in one logged engine batch, asks the engine's
replay for it and everything after it, and its pod is synced and exactly the engine's truth.

Real parts: a ``kvindex serve`` subprocess, a simulated vLLM engine publishing over real ZeroMQ with
a replay endpoint (``FakeEngine``), the engine's own block cache as the truth (``SimulatedCache``)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import msgspec

from kvindex.persist import snapshot as snapshots
from kvindex.persist.records import HEAD, Batch, segments, segment_path
from kvindex.tools.fake_engine import FakeEngine
from tests.faultkit import free_port, http, pods, serve, stop, stream

POD = "sim-0"


def batch_offsets(path: Path) -> dict[int, tuple[int, int]]:
    """Each logged engine batch's (record start, body length), by seq."""
    data, pos, out = path.read_bytes(), 0, {}
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        rec = msgspec.msgpack.decode(data[pos + HEAD:pos + HEAD + n])
        if rec[0] == "b":
            out[Batch(*rec[1:]).seq] = (pos, n)
        pos += HEAD + n
    return out


def flip_one_bit(state_dir: Path, seq: int) -> Path:
    """Flip one bit inside the logged payload of batch ``seq``; the segment it is in."""
    for n in segments(state_dir):
        path = segment_path(state_dir, n)
        found = batch_offsets(path).get(seq)
        if found is not None:
            start, length = found
            data = bytearray(path.read_bytes())
            data[start + HEAD + length - 3] ^= 0x04  # a byte of the engine payload, the record's last bytes
            path.write_bytes(bytes(data))
            return path
    raise AssertionError(f"batch {seq} is not in the log")


def held(port: int) -> set[int]:
    status, raw = http(f"http://127.0.0.1:{port}/v1/state")
    assert status == 200
    return {e.hash for e in snapshots.decode(raw).all_entries() if e.pod == POD}


async def wait(cond: Any, timeout: float, what: str) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = await asyncio.to_thread(cond)
        if v:
            return v
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_flipped_bit_in_a_logged_batch_is_asked_of_the_engine_and_the_pod_is_exact(tmp_path: Path) -> None:
    frames, truth = stream(60, seed=37)
    before_kill, bad_seq = 40, 20
    pub, rep, port = free_port(), free_port(), free_port()
    state = tmp_path / "state"
    args = ("--engine", f"endpoint=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{rep}", "--state-dir", str(state),
            "--snapshot-seconds", "3600")  # only the startup snapshot: every batch is in the log
    log = tmp_path / "kvindex.log"
    async with FakeEngine(f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{rep}") as engine:
        daemon = await asyncio.to_thread(serve, port, *args, log=log)
        try:
            await engine.wait_subscribers(1)
            for f in frames[:before_kill]:
                await engine.publish(f)
            await wait(lambda: (pods(port).get(POD) or {}).get("last_seq") == before_kill - 1, 15, "the first batches")
            daemon.send_signal(signal.SIGKILL)
            await asyncio.to_thread(daemon.wait)
            for f in frames[before_kill:]:  # the engine goes on while kvindex is down
                await engine.publish(f, replay_only=True)
            flip_one_bit(state, bad_seq)
            daemon = await asyncio.to_thread(serve, port, *args, log=log)
            last = len(frames) - 1
            mine = await wait(lambda: (p := pods(port).get(POD)) and p.get("last_seq") == last and p, 15,
                              "the restored pod to catch up")
            assert mine["synced"] is True and mine["unsynced_reason"] is None, (mine, log.read_text()[-2000:])
            assert await asyncio.to_thread(held, port) == set(truth.held()), "phantom or missing blocks"
            assert "damaged" in log.read_text()
        finally:
            await asyncio.to_thread(stop, daemon)

