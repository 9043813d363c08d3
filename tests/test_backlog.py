"""After a backlog the memory its messages took goes back to the OS (``kvindex.ingest.backlog``).

The rule is driven as Subscribers report their bursts, with a trim that counts its calls; a real
Subscriber whose last burst was exactly full must count as caught up once nothing more waits;
then a running daemon is fed a backlog over real ZeroMQ and must apply all of it and trim once,
with glibc's own ``malloc_trim``."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvindex.config import Config
from kvindex.ingest.backlog import TRIM_AFTER_BYTES, BacklogRelease, trimmer
from kvindex.ingest.transport import DRAIN_BURST, Subscriber, parse_message
from kvindex.tools.engine_sim import encode_batch
from tests.conftest import engine_config, ipc_endpoint, wait_for

PAYLOAD = 8 << 10
FULL_BURSTS = TRIM_AFTER_BYTES // (DRAIN_BURST * PAYLOAD) + 1  # full bursts of PAYLOAD bytes: past the bound


def full(size: int = PAYLOAD) -> tuple[bool, int]:
    """A full burst (``DRAIN_BURST`` messages of ``size`` payload bytes) as a Subscriber reports it."""
    return True, DRAIN_BURST * size


PART = (False, 0)  # a burst with nothing queued after it: the subscriber caught up


QUIET = 0.02  # the release's quiet time in these tests


class Trims:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def release_of(trims: Trims | None) -> BacklogRelease:
    return BacklogRelease(trims, quiet_seconds=QUIET)


async def quiet() -> None:
    """Longer than the release's quiet time: a pending trim has run."""
    await asyncio.sleep(3 * QUIET)


async def test_trimmed_once_when_every_lane_caught_up_and_nothing_queued_since() -> None:
    trims = Trims()
    release = release_of(trims)
    for _ in range(FULL_BURSTS):
        release.handled("a", *full())
        release.handled("b", *full())
    release.handled("a", *PART)  # a caught up, b still behind
    await quiet()
    assert trims.calls == 0
    release.handled("b", *PART)
    assert trims.calls == 0  # not yet: messages may still be queueing
    await quiet()
    assert trims.calls == 1 and release.backlog_bytes == 0
    release.handled("a", *PART)
    release.handled("b", *PART)
    await quiet()
    assert trims.calls == 1  # nothing since: nothing to give back


async def test_steady_traffic_and_small_backlogs_never_trim() -> None:
    trims = Trims()
    release = release_of(trims)
    for _ in range(10 * FULL_BURSTS):
        release.handled("a", *PART)  # nothing ever queued: the lane keeps up
    assert release.backlog_bytes == 0
    release.handled("a", *full(size=16))  # a full burst of small messages: below the bound
    release.handled("a", *PART)
    await quiet()
    assert trims.calls == 0 and 0 < release.backlog_bytes < TRIM_AFTER_BYTES


async def test_lanes_that_catch_up_but_keep_queueing_trim_once_they_fall_quiet() -> None:
    """Many lanes under a burst: none is ever behind (no burst full), each finds a few batches
    queued at every wake-up. Their bytes count, but nothing is trimmed while they keep queueing
    (a trim then gives back memory the next messages take again): once, when they stop."""
    trims = Trims()
    wait = 0.25  # the quiet time here: far longer than a turn of this loop, even on a busy machine
    release = BacklogRelease(trims, quiet_seconds=wait)
    loop = asyncio.get_running_loop()
    until = loop.time() + 3 * wait
    while loop.time() < until:
        for lane in ("a", "b"):
            release.handled(lane, False, TRIM_AFTER_BYTES // 4)
        await asyncio.sleep(0.005)
    assert trims.calls == 0
    await asyncio.sleep(2 * wait)
    assert trims.calls == 1 and release.backlog_bytes == 0


async def test_a_stopped_lane_is_behind_no_more() -> None:
    trims = Trims()
    release = release_of(trims)
    for _ in range(FULL_BURSTS):
        release.handled("a", *full())
    release.handled("gone", *full())
    release.forget("gone")
    release.handled("a", *PART)
    await quiet()
    assert trims.calls == 1


async def test_a_closed_release_trims_nothing_more() -> None:
    trims = Trims()
    release = release_of(trims)
    for _ in range(FULL_BURSTS):
        release.handled("a", *full())
    release.handled("a", *PART)
    release.close()
    await quiet()
    assert trims.calls == 0


async def test_without_malloc_trim_it_only_counts() -> None:
    release = release_of(None)
    for _ in range(FULL_BURSTS):
        release.handled("a", *full())
    release.handled("a", *PART)
    await quiet()
    assert release.trims == 0 and release.backlog_bytes == 0


async def test_a_subscriber_whose_last_burst_was_full_is_caught_up(tmp_path: Path) -> None:
    """The engine falls quiet right after exactly ``DRAIN_BURST`` queued messages: the subscriber
    looks again, finds nothing, and reports itself caught up (it used to stay behind until its
    engine's next message, holding every lane's trim)."""
    trims = Trims()
    ctx = zmq.asyncio.Context()
    endpoint = ipc_endpoint(tmp_path, "pub")
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    sub = Subscriber(ctx, endpoint, bind=False, rcvhwm=0,
                     backlog=BacklogRelease(trims, after_bytes=1, quiet_seconds=QUIET))
    bursts = sub.bursts()
    try:
        probe = [b"kv@p@m", (0).to_bytes(8, "big"), b"probe"]
        first = asyncio.ensure_future(bursts.__anext__())
        while not first.done():  # the slow joiner: publish until one arrives
            await pub.send_multipart(probe)
            await asyncio.sleep(0.01)
        marker = [b"kv@p@m", (0).to_bytes(8, "big"), b"marker"]
        await pub.send_multipart(marker)  # read up to it: every late probe is behind us
        while (await asyncio.wait_for(bursts.__anext__(), 5))[-1] != parse_message(marker):
            pass
        await pub.send_multipart(marker)  # alone: asking for it reports the probes' burst handled
        assert await asyncio.wait_for(bursts.__anext__(), 5) == [parse_message(marker)]
        await quiet()  # whatever trim the probes' bytes armed has run: nothing is counted now
        base = trims.calls
        for seq in range(DRAIN_BURST):
            await pub.send_multipart([b"kv@p@m", (seq + 1).to_bytes(8, "big"), bytes(1024)])
        await asyncio.sleep(0.3)  # all queued in the SUB before it reads
        burst = await asyncio.wait_for(bursts.__anext__(), 5)
        assert len(burst) == DRAIN_BURST  # exactly full: the case under test
        after = asyncio.ensure_future(bursts.__anext__())  # handled; nothing more will come
        await wait_for(lambda: trims.calls == base + 1, 5, "caught up (and trimmed) with nothing left queued")
        assert not after.done()
        after.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await after
    finally:
        await bursts.aclose()
        sub.close()
        pub.close(linger=0)
        ctx.destroy(linger=0)


async def test_a_daemon_caught_up_after_a_backlog_trims_once(make_harness: Any, make_engine: Any,
                                                              tmp_path: Path) -> None:
    if trimmer() is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"))
    h = await make_harness(Config(engines=(engine_config(engine, block_size=16, model="m"),)))
    await h.wait_connected()
    tokens = list(range(16)) * 128

    def batch(i: int) -> bytes:  # 128 blocks of a chain of its own: ~3 KB
        return encode_batch([{"type": "BlockStored", "block_hashes": [i << 8 | b for b in range(128)],
                              "parent_block_hash": None, "token_ids": tokens, "block_size": 16, "lora_id": None,
                              "medium": "GPU"}], ts=1.0)

    count = TRIM_AFTER_BYTES // len(batch(1)) + 4 * DRAIN_BURST
    assert h.daemon.intake.backlog.trims == 0
    for seq in range(count):  # sent while the lane cannot run (the PUB never blocks): it finds them queued
        await engine.publish([b"kv@p@m", seq.to_bytes(8, "big"), batch(seq + 1)], live_only=True)
    await h.wait_seq("p", count - 1, timeout=60)
    await wait_for(lambda: h.daemon.intake.backlog.trims == 1, 5, "the trim once the lane caught up")
    st = h.stream("p")
    assert st.batches == count and st.gaps == 0
