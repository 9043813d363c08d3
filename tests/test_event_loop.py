"""The event loop stays responsive while kvindex does big work: snapshots of a large precise index
(``GET /v1/state``, the snapshot timer) and drift re-checks of a full sample. A ticker task in the
daemon's own loop measures it; real daemon, real HTTP."""

from __future__ import annotations

import asyncio
import time
from array import array
from pathlib import Path
from typing import Any

from kvindex.config import Config
from kvindex.query.drift import Decision, DriftAudit
from kvindex.index.approx import ApproxIndex
from kvindex.index.memory import MemoryApproxStore, MemoryPreciseStore
from kvindex.index.precise import PreciseIndex
from kvindex.persist import snapshot as snapshots
from kvindex.settings import ApproxConfig, ApproxSettings, DriftSettings
from kvindex.types import Entry


class Ticker:
    """Counts its turns on the loop and the longest time it waited for one."""

    def __init__(self, busy: Any = None) -> None:
        self.turns = 0
        self.busy_turns = 0  # turns taken while ``busy()`` was true
        self.max_gap = 0.0
        self._busy = busy
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last)
            last = now
            self.turns += 1
            if self._busy is not None and self._busy():
                self.busy_turns += 1

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


# -- snapshots ---------------------------------------------------------------------------------
async def test_snapshot_and_state_endpoint_do_not_block_the_loop(make_harness: Any, tmp_path: Path) -> None:
    h = await make_harness(Config(state_dir=tmp_path / "state", snapshot_seconds=3600))
    n = 300_000
    h.daemon.index.load_entries(Entry(f"pod-{i % 16}", 0, "GPU", i * 7919 + 1, i * 104729 + 3, 1) for i in range(n))
    entries = list(h.daemon.index.export_entries())
    assert len(entries) == n
    # the loop keeps turning while the snapshot is built (counted turns, not timings: the machine
    # may be loaded); done on the loop, as it once was, the whole build is zero turns
    async with Ticker() as t:
        await h.daemon.snapshot()
    assert t.turns >= 5, t.turns
    async with Ticker() as t:
        status, raw = await h.get("/v1/state")
    assert status == 200 and t.turns >= 5, t.turns
    assert sorted(snapshots.decode(raw).all_entries()) == sorted(entries)
    on_disk = snapshots.read_file(tmp_path / "state" / snapshots.SNAPSHOT_NAME)
    assert sorted(on_disk.all_entries()) == sorted(entries)


# -- drift re-checks ---------------------------------------------------------------------------
def _fill(precise: PreciseIndex, approx: ApproxIndex, audit: DriftAudit, n: int, pods: int, t0: float) -> None:
    """``n`` decisions over ``pods`` pods; every pod holds some prefixes (precise) and the router
    believes others (approximate): stale and unseen ones both occur."""
    precise.set_block_size("m", 16)
    for i in range(n):
        keys = [1_000_000 * (i % 40) + k for k in range(8)]
        hashes = [2_000_000 * (i % 40) + k for k in range(8)]
        pod = f"pod-{i % pods}"
        if i % 3:  # the engine holds it (on this pod or the next)
            holder = pod if i % 2 else f"pod-{(i + 1) % pods}"
            precise.load_entries(Entry(holder, 0, "GPU", (i << 8) + k, key, 1) for k, key in enumerate(keys))
        approx.record(pod, "m", hashes)
        audit.add(Decision(t=t0 + i, pod=pod, model="m", hashes=array("Q", hashes), keys=array("Q", keys),
                           block_size=16, prompt_tokens=8 * 16 + 1, approx=1.0, precise=0.5, actual=None))


def _audit(clock: Any) -> tuple[PreciseIndex, ApproxIndex, DriftAudit]:
    precise = PreciseIndex()
    approx = ApproxIndex(ApproxConfig(ApproxSettings(), {}))
    return precise, approx, DriftAudit(MemoryPreciseStore(precise), MemoryApproxStore(approx),
                                       DriftSettings(sample_size=4096), clock=clock)


async def test_recheck_async_yields_and_equals_recheck() -> None:
    now = [1000.0]
    p1, a1, sync = _audit(lambda: now[0])
    p2, a2, asyn = _audit(lambda: now[0])
    _fill(p1, a1, sync, 512, 8, 0.0)
    _fill(p2, a2, asyn, 512, 8, 0.0)
    async with Ticker() as t:
        snap_async = await asyn.recheck_async()
    assert t.turns >= 512 // 32 - 1
    snap_sync = await sync.recheck()
    assert snap_async.pods == snap_sync.pods and asyn.pods == sync.pods
    assert any(s.stale for s in sync.pods.values()) and any(s.unseen for s in sync.pods.values())
    assert [(d.stale_now, d.stale_at) for d in asyn.decisions()] == [(d.stale_now, d.stale_at) for d in sync.decisions()]
    assert asyn.summary(1e9) == sync.summary(1e9)


async def test_recheck_async_leaves_out_a_pod_forgotten_meanwhile() -> None:
    p, a, audit = _audit(time.time)
    _fill(p, a, audit, 256, 4, time.time())
    task = asyncio.create_task(audit.recheck_async(every=8))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    audit.forget_pod("pod-1")
    await task
    assert "pod-1" not in audit.pods and "pod-1" not in audit.history[-1].pods
    assert sum(s.sampled for s in audit.pods.values()) == len(audit.decisions())


async def test_drift_endpoint_and_timer_recheck_without_blocking(make_harness: Any) -> None:
    for settings, via_http in ((DriftSettings(recheck_seconds=3600), True), (DriftSettings(recheck_seconds=0.05), False)):
        h = await make_harness(Config(drift=settings))
        audit = h.daemon.drift
        _fill(h.daemon.index, h.daemon.approx, audit, 1024, 16, time.time())
        before = audit.rechecks
        async with Ticker(busy=lambda: bool(audit._watchers)) as t:  # turns taken while a re-check runs
            if via_http:
                status, body = await h.get("/v1/drift?recheck=1")
                assert status == 200 and body["rechecks"] == before + 1
            else:
                rechecks = audit.rechecks
                while audit.rechecks < rechecks + 2:
                    await asyncio.sleep(0.01)
        assert t.busy_turns >= 1024 // 32 // 2, (via_http, t.busy_turns)
        assert sum(s.sampled for s in audit.pods.values()) == 1024


# -- the collector's pace ------------------------------------------------------------------------
def test_every_process_entry_paces_the_collector_for_a_server() -> None:
    """``loops.run`` (``kvindex``'s entry and each ingest worker's) collects the youngest generation
    every GC_YOUNG_THRESHOLD allocations, not Python's 700: see kvindex.loops for the stalls that
    avoids."""
    import gc

    from kvindex import loops

    async def threshold() -> tuple[int, int, int]:
        return gc.get_threshold()

    before = gc.get_threshold()
    try:
        assert loops.run(threshold(), "asyncio") == (loops.GC_YOUNG_THRESHOLD, before[1], before[2])
    finally:
        gc.set_threshold(*before)
