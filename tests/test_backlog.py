"""After a backlog the memory its messages took goes back to the OS (``kvindex.ingest.backlog``).

The rule is driven as Subscribers report their bursts, with a trim that counts its calls; then a running daemon is fed a backlog over real ZeroMQ and must apply all of
it and trim once, with glibc's own ``malloc_trim``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvindex.config import Config
from kvindex.ingest.backlog import TRIM_AFTER_BYTES, BacklogRelease, trimmer
from kvindex.ingest.transport import DRAIN_BURST
from kvindex.tools.engine_sim import encode_batch
from tests.conftest import engine_config, ipc_endpoint, wait_for

PAYLOAD = 8 << 10
FULL_BURSTS = TRIM_AFTER_BYTES // (DRAIN_BURST * PAYLOAD) + 1  # full bursts of PAYLOAD bytes: past the bound


def full(size: int = PAYLOAD) -> tuple[bool, int]:
    """A full burst (``DRAIN_BURST`` messages of ``size`` payload bytes) as a Subscriber reports it."""
    return True, DRAIN_BURST * size


PART = (False, 0)  # a burst that is not full: the subscriber caught up


class Trims:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_trimmed_once_when_every_lane_caught_up() -> None:
    trims = Trims()
    release = BacklogRelease(trims)
    for _ in range(FULL_BURSTS):
        release.handled("a", *full())
        release.handled("b", *full())
    release.handled("a", *PART)  # a caught up, b still behind
    assert trims.calls == 0
    release.handled("b", *PART)
    assert trims.calls == 1 and release.backlog_bytes == 0
    release.handled("a", *PART)
    release.handled("b", *PART)
    assert trims.calls == 1  # nothing since: nothing to give back


def test_steady_traffic_and_small_backlogs_never_trim() -> None:
    trims = Trims()
    release = BacklogRelease(trims)
    for _ in range(10 * FULL_BURSTS):
        release.handled("a", *PART)  # never full: the lane keeps up
    assert trims.calls == 0 and release.backlog_bytes == 0
    release.handled("a", *full(size=16))  # a full burst of small messages: below the bound
    release.handled("a", *PART)
    assert trims.calls == 0 and 0 < release.backlog_bytes < TRIM_AFTER_BYTES


def test_a_stopped_lane_is_behind_no_more() -> None:
    trims = Trims()
    release = BacklogRelease(trims)
    for _ in range(FULL_BURSTS):
        release.handled("a", *full())
    release.handled("gone", *full())
    release.forget("gone")
    release.handled("a", *PART)
    assert trims.calls == 1


def test_without_malloc_trim_it_only_counts() -> None:
    release = BacklogRelease(None)
    for _ in range(FULL_BURSTS):
        release.handled("a", *full())
    release.handled("a", *PART)
    assert release.trims == 0 and release.backlog_bytes == 0


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
