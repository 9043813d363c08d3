"""The pod directory: one view per pod, joined from the engine lanes and both indexes.

Invariants: it owns no state of its own beyond what it reads at call time; removing a pod removes
it from both indexes and the drift sample (the engine lane, if any, keeps running and may add blocks again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvindex.approx import ApproxIndex
from kvindex.drift import DriftAudit
from kvindex.ingest import Fleet
from kvindex.precise import PreciseIndex


class PodDirectory:
    def __init__(self, fleet: Fleet, index: PreciseIndex, approx: ApproxIndex, drift: DriftAudit) -> None:
        self._drift = drift
        self._fleet = fleet
        self._index = index
        self._approx = approx
        self.on_remove: Callable[[str], None] | None = None  # the write-ahead log

    def views(self) -> list[dict[str, Any]]:
        views: dict[str, dict[str, Any]] = {}
        for key, lane in self._fleet.lanes().items():
            failure = self._fleet.lane_task_failed(key)
            for st in lane.state.streams.values():
                views[st.pod] = {
                    "pod": st.pod, "model": st.model, "endpoint": lane.engine.endpoint,
                    "replay_endpoint": lane.engine.replay, "topic": st.topic,
                    "connected": lane.state.connected_peers > 0 and failure is None,
                    "listener_error": failure,
                    "last_seq": st.last_seq, "batches": st.batches, "gaps": st.gaps, "replays": st.replays,
                    "restarts": st.restarts, "synced": st.synced, "unsynced_reason": st.unsynced_reason,
                    "last_event_age_seconds": None,
                }
        for pod in set(self._index.pods()) | set(self._approx.pods()):
            views.setdefault(pod, {"pod": pod, "model": None, "endpoint": None, "connected": False, "synced": True})
        for pod, view in views.items():
            view["blocks"] = self._index.blocks_held(pod)
            view["approx_entries"] = self._approx.entries(pod)
        return [views[p] for p in sorted(views)]

    def readiness_problems(self) -> list[str]:
        problems = []
        for key, lane in self._fleet.lanes().items():
            failure = self._fleet.lane_task_failed(key)
            if failure is not None:
                problems.append(f"engine {lane.engine.name}: listener failed: {failure}")
            elif lane.state.connected_peers == 0:
                problems.append(f"engine {lane.engine.name}: not connected ({lane.engine.endpoint})")
            for st in lane.state.streams.values():
                if not st.synced:
                    problems.append(f"pod {st.pod}: unsynced ({st.unsynced_reason})")
        return problems

    async def remove(self, pod: str) -> bool:
        known = pod in self._index.pods() or pod in self._approx.pods()
        self._index.clear_pod(pod)
        self._approx.remove_pod(pod)
        self._drift.forget_pod(pod)
        if self.on_remove is not None:
            self.on_remove(pod)
        return known
