"""The pod directory: one view per pod, joined from the engine lanes and both stores
(``kvindex.views.PodsView``, over any ``FleetView``).

Invariants: it owns no state of its own beyond what it reads at call time. Whether a stream is
synced comes from the store's position (so every replica sharing a store reports the same),
joined with this replica's own state: its connection, and a resync it still owes (after the store
was unreachable past the buffer bound, or lost) or what its inbox says (lagging behind the engine,
batches dropped over its byte budget or lost with a connection: ``LaneState.receiving_problem``). The store reads of a view are gathered, not
awaited one by one. Removing a pod removes it from both stores and the drift sample (the engine
lane, if any, keeps running and may add blocks again). A configured (or registered) engine that has
not published yet is listed too, under its pod (else its endpoint), with ``connected`` and
``last_event_age_seconds: null`` (never); once it publishes, its streams' rows replace it.
``last_event_age_seconds`` is the seconds since this process last received a batch of the stream.
An orphaned pod (``Orphans``: blocks restored from a snapshot or a peer, and no configured or
registered engine publishes for it, e.g. its engine was removed from the configuration) is listed
unsynced (``ORPHANED``): nothing keeps its blocks up to date. Its blocks are answered for
``orphan_grace_seconds`` after the start (an engine may register again, a replica recovered from a
peer may be asked at once), then left out of every answer. Its blocks stay until removed
(``DELETE /v1/pods/{pod}``); once an engine publishes for it (a lane names it) it is an engine's
pod again. Only this process's own store has orphans: a replica of a
shared store that subscribes to no engine answers for the pods other replicas keep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kvindex.metrics import Metrics
from kvindex.query.drift import DriftAudit
from kvindex.index.protocol import ApproxStore, PreciseStore
from kvindex.sequence import Position
from kvindex.types import TIERS
from kvindex.views import FleetView, LaneView, StreamView


ORPHANED = ("no configured or registered engine publishes for this pod: its blocks (from a snapshot, a peer "
            "or a removed engine) are not kept up to date")


def published_pods(fleet: FleetView) -> set[str]:
    """The pods a configured or registered engine publishes for: each lane's (its pod, else its
    endpoint, as the directory lists it) and its streams'."""
    lanes = fleet.lanes().values()
    return {lane.engine.pod or lane.engine.endpoint for lane in lanes} | \
        {st.pod for lane in lanes for st in lane.state.streams.values()}


class Orphans:
    """Pods whose blocks came from saved state (a snapshot, the log, a peer) and that no engine
    publishes for: listed unsynced, and left out of answers once ``grace`` seconds have passed
    since ``settle`` (the module docstring).

    Settled once, after the restore and the lanes' start (``settle``); from then on a pod only
    leaves the set: an engine that publishes for it, or its removal. An orphan can arise only
    there: a running kvindex drops an engine's pod with its lane (``/unregister``). ``excluded``
    costs nothing while there is no orphan (the usual case: no state dir, or every engine still
    configured)."""

    def __init__(self, fleet: FleetView, grace: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fleet, self._grace, self._clock = fleet, grace, clock
        self._pods: set[str] = set()
        self._excluded_from = 0.0  # clock time from which orphans are left out of answers

    async def settle(self, store: PreciseStore) -> None:
        pods = [p for p in await store.pods() if any((await store.blocks_held(p)).values())]
        self._pods = set(pods) - published_pods(self._fleet)
        self._excluded_from = self._clock() + self._grace

    def excluded(self, pods: Iterable[str]) -> set[str]:
        """The orphans among ``pods`` that answers leave out: none during the grace period."""
        if not self._pods or self._clock() < self._excluded_from:
            return set()
        return self.among(pods)

    def among(self, pods: Iterable[str]) -> set[str]:
        """The orphans among ``pods``."""
        if not self._pods:
            return set()
        found = self._pods.intersection(pods)
        if found:  # an engine may publish for it by now (a /register naming it)
            self._pods -= published_pods(self._fleet)
            found &= self._pods
        return found

    def forget(self, pod: str) -> None:
        self._pods.discard(pod)


class PodDirectory:
    def __init__(self, fleet: FleetView, store: PreciseStore, approx: ApproxStore, drift: DriftAudit,
                 orphans: Orphans | None = None) -> None:
        self._orphans = orphans if orphans is not None else Orphans(fleet)
        self._drift = drift
        self._fleet = fleet
        self._store = store
        self._approx = approx
        self.on_remove: Callable[[str], object] | None = None  # the write-ahead log

    def _streams(self) -> list[tuple[str, LaneView, StreamView]]:
        return [(key, lane, st) for key, lane in self._fleet.lanes().items() for st in lane.state.streams.values()]

    async def _positions(self, streams: list[tuple[str, LaneView, StreamView]]) -> list[tuple[bool, str | None]]:
        """(synced, reason) per stream: the store's position, unless this replica owes a resync."""
        positions = await asyncio.gather(*(self._store.position(st.ref) for _, _, st in streams))
        return [_sync_state(lane, st, pos) for (_, lane, st), pos in zip(streams, positions)]

    async def views(self) -> list[dict[str, Any]]:
        views: dict[str, dict[str, Any]] = {}
        streams = self._streams()
        now = time.monotonic()
        for (key, lane, st), (synced, reason) in zip(streams, await self._positions(streams)):
            views[st.pod] = {
                **self._engine_view(key, lane), "model": st.model, "topic": st.topic, "pod": st.pod,
                "last_seq": st.last_seq, "batches": st.batches, "gaps": st.gaps, "replays": st.replays,
                "restarts": st.restarts, "synced": synced, "unsynced_reason": reason,
                "last_event_age_seconds": None if st.last_event is None else round(max(0.0, now - st.last_event), 3),
            }
        for key, lane in self._fleet.lanes().items():
            if not lane.state.streams:  # configured, never published: listed, its age null (never)
                view = self._engine_view(key, lane)
                views.setdefault(view["pod"], view)
        for pod in (set(await self._store.pods()) | set(await self._approx.pods())) - set(views):
            views[pod] = {"pod": pod, "model": None, "endpoint": None, "connected": False, "synced": True}
        for pod in self._orphans.among(views):  # blocks no engine stream keeps up to date
            views[pod].update(synced=False, unsynced_reason=ORPHANED)
        pods = sorted(views)
        blocks = await asyncio.gather(*(self._store.blocks_held(p) for p in pods))
        entries = await asyncio.gather(*(self._approx.entries(p) for p in pods))
        for pod, held, n in zip(pods, blocks, entries):
            views[pod]["blocks"] = held
            views[pod]["approx_entries"] = n
        return [views[p] for p in pods]

    def _engine_view(self, key: str, lane: LaneView) -> dict[str, Any]:
        """What a lane says of its engine before any stream: connected, and never an event."""
        failure = self._fleet.lane_task_failed(key)
        return {"pod": lane.engine.pod or lane.engine.endpoint, "model": lane.engine.model,
                "endpoint": lane.engine.endpoint, "replay_endpoint": lane.engine.replay, "topic": None,
                "connected": lane.state.connected_peers > 0 and failure is None, "listener_error": failure,
                "last_seq": None, "batches": 0, "gaps": 0, "replays": 0, "restarts": 0, "synced": True,
                "unsynced_reason": None, "last_event_age_seconds": None}

    async def readiness_problems(self) -> list[str]:
        problems = []
        for key, lane in self._fleet.lanes().items():
            failure = self._fleet.lane_task_failed(key)
            if failure is not None:
                problems.append(f"engine {lane.engine.name}: listener failed: {failure}")
            elif lane.state.connected_peers == 0:
                problems.append(f"engine {lane.engine.name}: not connected ({lane.engine.endpoint})")
        streams = self._streams()
        for (_, _, st), (synced, reason) in zip(streams, await self._positions(streams)):
            if not synced:
                problems.append(f"pod {st.pod}: unsynced ({reason})")
        return problems

    async def remove(self, pod: str) -> bool:
        self._orphans.forget(pod)
        return await remove_pod(pod, self._store, self._approx, self._drift, self.on_remove)


def pod_census(fleet: FleetView, store: PreciseStore, approx: ApproxStore) -> Callable[[set[str]], Awaitable[tuple[set[str], int]]]:
    """The decisions' census (``kvindex.query.decisions.Census``): of ``pods``, those no engine lane or
    stream and neither index knows; and how many pods only the approximate index knows (pods known
    only from decisions). Engines' pods cost no store call."""
    async def census(pods: set[str]) -> tuple[set[str], int]:
        lanes = fleet.lanes().values()
        engines = {lane.engine.pod for lane in lanes} | {st.pod for lane in lanes for st in lane.state.streams.values()}
        if pods <= engines:
            return set(), 0
        precise, held = set(await store.pods()), set(await approx.pods())
        return pods - engines - precise - held, len(held - precise - engines)
    return census


async def remove_pod(pod: str, store: PreciseStore, approx: ApproxStore, drift: DriftAudit,
                     on_remove: Callable[[str], object] | None) -> bool:
    """Forget ``pod`` in both stores and the drift sample; True if either store knew it."""
    known = pod in await store.pods() or pod in await approx.pods()
    await store.clear_pod(pod)
    await approx.remove_pod(pod)
    drift.forget_pod(pod)
    if on_remove is not None:
        on_remove(pod)
    return known


def _sync_state(lane: LaneView, st: StreamView, pos: Position | None) -> tuple[bool, str | None]:
    """A loss this replica saw first (batches dropped or lost with the connection), then a resync
    it owes, then the stream's own reason; lagging only where nothing else says unsynced (a lane
    held by a failing replay lags too: the replay's outcome is the cause worth naming)."""
    receiving = lane.state.receiving_problem()
    if receiving is not None and not receiving.startswith("lagging"):
        return False, receiving
    if st.needs_resync is not None:
        return False, st.needs_resync
    synced, reason = (st.synced, st.unsynced_reason) if pos is None else (pos.synced, pos.reason)
    if synced and receiving is not None:
        return False, receiving
    return synced, reason


Gauge = tuple[str, str, list[str], list[tuple[list[str], float]]]  # name, help, labels, samples


def state_gauges(views: list[dict[str, Any]], approx_entries: int, metrics: Metrics, drift_audit: DriftAudit,
                 wal_degraded: bool) -> Iterable[Gauge]:
    """Per-pod gauges: a pod no engine, registration or (up to a few) decision made known is
    summed under "other" (``Metrics.pods``), so what requests name cannot grow /metrics."""
    fold = metrics.pods.fold
    for v in views:  # an engine's pods (a stream, or blocks in the precise index, e.g. restored ones)
        if v.get("endpoint") or any(v["blocks"].values()):
            metrics.pods.admit(v["pod"])
    yield ("kvindex_blocks_held", "Block copies held per pod and tier (precise index)", ["pod", "tier"],
           fold(([v["pod"], t], v["blocks"][t]) for v in views for t in TIERS))
    yield ("kvindex_orphan_blocks_held", "Keyless (orphan) engine hashes held per pod", ["pod"],
           fold(([v["pod"]], v["blocks"]["orphans"]) for v in views))
    yield ("kvindex_pod_synced", "1 when the pod's event stream is complete, 0 when unsynced", ["pod"],
           fold(([v["pod"]], 1.0 if v.get("synced", True) else 0.0) for v in views))
    yield ("kvindex_engine_connected", "1 when the engine's publisher is connected", ["pod"],
           fold(([v["pod"]], 1.0 if v.get("connected") else 0.0) for v in views if v.get("endpoint")))
    drift = drift_audit.pods
    yield ("kvindex_drift_stale", "Sampled decisions whose prefix the router believes but the engine evicted",
           ["pod"], fold(([p], d.stale) for p, d in drift.items()))
    yield ("kvindex_drift_unseen", "Sampled requests whose prefix the pod holds but the router never recorded there",
           ["pod"], fold(([p], d.unseen) for p, d in drift.items()))
    yield ("kvindex_drift_sampled", "Decisions in the drift sample", ["pod"],
           fold(([p], d.sampled) for p, d in drift.items()))
    yield ("kvindex_wal_degraded", "1 while a change is missing from the write-ahead log (a failed append) "
           "and no snapshot covers it yet", [], [([], 1.0 if wal_degraded else 0.0)])
    yield ("kvindex_approx_entries", "Approximate index entries, summed over pods (Kthena's prefix_cache_entries)",
           [], [([], float(approx_entries))])
