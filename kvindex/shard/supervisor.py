"""Sharded ingest, the parent's side (``kvindex serve --workers N``, N >= 2).

The parent keeps HTTP, the approximate index, drift and decisions; N worker processes
(``kvindex.shard.worker``) each own a partition of the engines and run their lanes, so decoding and
applying — the dominant ingest cost — run in parallel. This module starts and watches the
workers (``Shards``), stands in for the fleet (``ShardedFleet``) and the pod directory
(``ShardedPods``) over the channels, and merges the workers' metrics (``MergedRegistry``).

Invariants:
- Engines are dealt out evenly (``next_worker``): each lane, configured or registered at runtime
  (``POST /register``), goes to the worker running the fewest lanes then, and stays there until it
  is removed; configured engines go round the workers in configuration order.
- The workers are children of the parent and run the same kvindex code (its package directory
  leads their ``PYTHONPATH``): started by ``Shards.start`` (which waits until each
  answers), terminated and awaited by ``Shards.stop`` (killed after ``STOP_SECONDS``), and they
  exit on their own when the parent is gone.
- A worker that dies is not restarted (a fresh worker would hold nothing until its engines
  publish again: wrong answers). Its death is seen when its connection ends (``_lost``; the
  watch loop's poll is the fallback), and a worker that closes its connection but keeps running
  counts as dead after ``LOST_SECONDS``. It is logged, every request to it fails at once
  (``StoreUnavailable``: queries answer 503, never a partial answer), ``/readyz`` answers 503
  with the reason, and ``on_failure`` is called: the daemon then exits (code 1) after a grace
  period so its supervisor restarts the whole kvindex.
- Lane and stream status (``/v1/pods``, ``/readyz``) is fetched from the workers per request;
  ``/workers`` (a synchronous view) reads the lane status the watch loop refreshes every
  ``WATCH_SECONDS``. Worker metrics are fetched as Prometheus text before each scrape and
  merged into the parent's families (labelled samples only: the pods are the workers').
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

import kvindex
from kvindex.config import EngineConfig
from kvindex.query.drift import DriftAudit
from kvindex.index.protocol import ApproxStore, StoreUnavailable
from kvindex.pods import remove_pod
from kvindex.shard import channel as ch
from kvindex.shard.channel import LaneStatus, WorkerSettings, next_worker
from kvindex.shard.client import ShardChannel
from kvindex.shard.store import ShardedPreciseStore

log = logging.getLogger("kvindex.shard.supervisor")
R = TypeVar("R")
START_SECONDS = 20.0  # a worker must answer its first ping within this (imports, socket bind)
STOP_SECONDS = 5.0  # SIGTERM, then SIGKILL after this
WATCH_SECONDS = 0.5
LOST_SECONDS = 2.0  # a worker whose connection ended must have exited within this
RESYNC_SECONDS = 30.0  # a resync awaits the engine's replay


def _same_code_env() -> dict[str, str]:
    """The environment of a worker: this one, with this process's kvindex first on the path."""
    root = str(Path(kvindex.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _exit_reason(proc: asyncio.subprocess.Process) -> str:
    return f"(pid {proc.pid}) exited with code {proc.returncode}: its engines are not indexed until kvindex restarts"


class ShardFailed(RuntimeError):
    """A worker process died: the daemon stopped (its supervisor should restart kvindex)."""


class Shards:
    """The worker processes and their channels."""

    def __init__(self, count: int, settings: WorkerSettings, *,
                 on_failure: Callable[[str], None] | None = None, log_level: str | None = None) -> None:
        self.count = count
        self.settings = settings
        self.on_failure = on_failure
        self._log_level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self._dir = tempfile.mkdtemp(prefix="kvi-shards-")
        self.channels = [ShardChannel(i, f"{self._dir}/w{i}", on_lost=functools.partial(self._lost, i))
                         for i in range(count)]
        self.procs: list[asyncio.subprocess.Process] = []
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False
        self.lane_status: dict[str, LaneStatus] = {}  # lane key -> the worker's last report
        self.on_lora: Callable[[str, str, Iterable[str]], None] | None = None  # what the lanes' events named

    async def start(self) -> None:
        for chan in self.channels:
            self.procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvindex.shard.worker", "--channel", chan.path, "--index", str(chan.index),
                "--settings", self.settings.to_json(), "--log-level", self._log_level, env=_same_code_env()))
            chan.start()
        pids = await asyncio.gather(*(self._first_answer(chan, proc) for chan, proc in zip(self.channels, self.procs)))
        log.info("%d ingest workers running (pids %s)", self.count, ", ".join(map(str, pids)))
        self._watch = asyncio.create_task(self._watch_loop(), name="worker watch")

    @staticmethod
    async def _first_answer(chan: ShardChannel, proc: asyncio.subprocess.Process) -> int:
        """The worker's pid once it answers; ``StoreUnavailable`` if it exits or stays silent first."""
        ping = asyncio.ensure_future(chan.request(ch.Ping(), timeout=START_SECONDS))
        exited = asyncio.ensure_future(proc.wait())
        await asyncio.wait({ping, exited}, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        if not ping.done():
            ping.cancel()
            raise StoreUnavailable(f"worker {chan.index} exited with code {proc.returncode} before it answered")
        return ping.result()

    def problems(self) -> list[str]:
        return [f"worker {chan.index} {chan.dead}" for chan in self.channels if chan.dead is not None]

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            for chan, proc in zip(self.channels, self.procs):
                if proc.returncode is not None and chan.dead is None and not self._stopping:
                    self._failed(chan, _exit_reason(proc))
            await self._refresh_lanes()

    async def _lost(self, index: int) -> None:
        """Worker ``index``'s connection ended: it died (said at once, not at the next watch) or,
        still running after ``LOST_SECONDS``, it is as good as dead."""
        chan, proc = self.channels[index], self.procs[index]
        try:
            await asyncio.wait_for(proc.wait(), LOST_SECONDS)
            reason = _exit_reason(proc)
        except TimeoutError:
            reason = (f"(pid {proc.pid}) closed its channel while running: its engines are not indexed "
                      "until kvindex restarts")
        if chan.dead is None and not self._stopping:
            self._failed(chan, reason)

    def _failed(self, chan: ShardChannel, reason: str) -> None:
        chan.fail(reason)
        log.error("worker %d %s", chan.index, reason)
        if self.on_failure is not None:
            self.on_failure(f"worker {chan.index} {reason}")

    async def _refresh_lanes(self) -> None:
        live = [chan for chan in self.channels if chan.dead is None]
        answers = await asyncio.gather(*(c.request(ch.Lanes()) for c in live), return_exceptions=True)
        heard = self.on_lora
        for part in answers:
            if isinstance(part, dict):
                self.lane_status.update(part)
                for pod, model, name in (t for status in part.values() for t in status.lora):
                    if heard is not None:
                        heard(pod, model, (name,) if name else ())  # "": the stream's model, a base

    async def ask_all(self, req: ch.Request[R]) -> list[R | BaseException]:
        """``req`` to every worker; a worker that cannot answer gives its ``StoreUnavailable``."""
        return list(await asyncio.gather(*(c.request(req) for c in self.channels), return_exceptions=True))

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for proc in self.procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), STOP_SECONDS)
            except TimeoutError:
                log.error("worker pid %d did not stop within %g s: killing it", proc.pid, STOP_SECONDS)
                proc.kill()
                await proc.wait()
        for chan in self.channels:
            await chan.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@dataclass(slots=True)
class RemoteLane:
    """What the parent knows of a lane a worker runs (the shape ``/workers`` and ``behind`` read)."""

    engine: EngineConfig
    connected_peers: int = 0
    behind_models: tuple[str, ...] = ()
    streams: dict[str, Any] = field(default_factory=dict)  # the streams live in the worker

    @property
    def state(self) -> RemoteLane:
        return self

    def behind(self, model: str) -> bool:
        return model in self.behind_models

    def receiving_problem(self) -> str | None:  # judged in the worker (its pods' views say it)
        return None


class ShardedFleet:
    """The fleet's interface (``kvindex.views.FleetView``: ``add``, ``remove``, ``lanes``, ``resync``, ...)
    over the workers."""

    def __init__(self, shards: Shards) -> None:
        self._shards = shards
        self._engines: dict[str, EngineConfig] = {}
        self._worker: dict[str, int] = {}  # lane key -> the index of the worker running it
        self._adding: set[asyncio.Task[None]] = set()

    def add(self, key: str, engine: EngineConfig) -> RemoteLane:
        if key in self._engines:
            raise KeyError(key)
        self._engines[key] = engine
        lanes = [0] * self._shards.count
        for index in self._worker.values():
            lanes[index] += 1
        index = self._worker[key] = next_worker(lanes)
        task = asyncio.create_task(self._add(key, engine, self._shards.channels[index]), name=f"add lane {key}")
        self._adding.add(task)
        task.add_done_callback(self._adding.discard)
        return RemoteLane(engine)

    async def _add(self, key: str, engine: EngineConfig, chan: ShardChannel) -> None:
        try:
            await chan.request(ch.AddLane(key, engine))
        except StoreUnavailable as exc:
            log.error("engine %s: worker %d could not start its lane: %s", engine.name, chan.index, exc)

    async def added(self) -> None:
        """Until every lane added so far has been handed to its worker."""
        await asyncio.gather(*list(self._adding), return_exceptions=True)

    async def remove(self, key: str) -> RemoteLane | None:
        engine = self._engines.pop(key, None)
        if engine is None:
            return None
        chan = self._shards.channels[self._worker.pop(key)]  # with the engine, before any await: a new add is new
        await self.added()
        await chan.request(ch.RemoveLane(key))
        self._shards.lane_status.pop(key, None)
        return RemoteLane(engine)

    def lanes(self) -> dict[str, RemoteLane]:
        out = {}
        for key, engine in self._engines.items():
            status = self._shards.lane_status.get(key, LaneStatus())
            out[key] = RemoteLane(engine, status.connected, status.behind)
        return out

    def behind(self, model: str) -> bool:
        return any(lane.behind(model) for lane in self.lanes().values())

    def store_lost(self) -> None:
        """Nothing here: each worker's store is its own memory (never lost while it runs)."""

    def flush_metrics(self) -> None:
        """Nothing here: each worker flushes its own counts when asked for its metrics."""

    def lane_task_failed(self, key: str) -> str | None:
        if key not in self._engines:
            return None
        chan = self._shards.channels[self._worker[key]]
        if chan.dead is not None:
            return f"worker {chan.index} {chan.dead}"
        return self._shards.lane_status.get(key, LaneStatus()).failure

    async def resync(self, pod: str) -> bool:
        found = await asyncio.gather(*(c.request(ch.Resync(pod), timeout=RESYNC_SECONDS)
                                       for c in self._shards.channels))
        return any(found)

    async def close(self) -> None:
        for task in list(self._adding):
            task.cancel()
        await asyncio.gather(*list(self._adding), return_exceptions=True)
        self._engines.clear()
        self._worker.clear()


class ShardedPods:
    """The pod directory's interface (``kvindex.views.PodsView``: ``views``, ``readiness_problems``,
    ``remove``) over the workers."""

    def __init__(self, shards: Shards, store: ShardedPreciseStore, approx: ApproxStore, drift: DriftAudit) -> None:
        self._shards = shards
        self._store = store
        self._approx = approx
        self._drift = drift
        self.on_remove: Callable[[str], object] | None = None

    async def views(self) -> list[dict[str, Any]]:
        views: dict[str, dict[str, Any]] = {}
        for part in await asyncio.gather(*(c.request(ch.Views()) for c in self._shards.channels)):
            for view in part:
                _merge_view(views, view)
        approx_only = sorted(set(await self._approx.pods()) - set(views))
        held = await asyncio.gather(*(self._store.blocks_held(p) for p in approx_only))
        for pod, blocks in zip(approx_only, held):
            views[pod] = {"pod": pod, "model": None, "endpoint": None, "connected": False, "synced": True,
                          "blocks": blocks}
        pods = sorted(views)
        for pod, n in zip(pods, await asyncio.gather(*(self._approx.entries(p) for p in pods))):
            views[pod]["approx_entries"] = n
        return [views[p] for p in pods]

    async def readiness_problems(self) -> list[str]:
        problems = self._shards.problems()
        for chan, part in zip(self._shards.channels, await self._shards.ask_all(ch.Problems())):
            if isinstance(part, list):
                problems.extend(part)
            elif chan.dead is None:  # it lives but did not answer (its message names it)
                problems.append(str(part))
        return problems

    async def remove(self, pod: str) -> bool:
        return await remove_pod(pod, self._store, self._approx, self._drift, self.on_remove)


def _merge_view(views: dict[str, dict[str, Any]], view: dict[str, Any]) -> None:
    """A pod whose ranks sit on two workers: blocks add up, synced only if both are."""
    prev = views.get(view["pod"])
    if prev is None:
        views[view["pod"]] = view
        return
    prev["blocks"] = {t: prev["blocks"].get(t, 0) + n for t, n in view["blocks"].items()}
    prev["synced"] = prev.get("synced", True) and view.get("synced", True)
    prev["unsynced_reason"] = prev.get("unsynced_reason") or view.get("unsynced_reason")
    prev["connected"] = prev.get("connected", False) or view.get("connected", False)


class MergedRegistry(CollectorRegistry):
    """The parent's registry plus the workers' metrics (``remote``: Prometheus text per worker,
    set before each scrape). Same-named families merge; a worker's unlabelled samples are left
    out (process-wide gauges such as ``kvindex_store_up`` are the parent's)."""

    def __init__(self) -> None:
        super().__init__()
        self.remote: list[str] = []

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for family in super().collect():
            families[family.name] = family
        for text in self.remote:
            for family in text_string_to_metric_families(text):
                mine = families.get(family.name)
                if mine is None:
                    families[family.name] = family
                else:
                    mine.samples.extend(s for s in family.samples if s.labels)
        yield from families.values()
