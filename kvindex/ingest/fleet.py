"""The fleet: the set of engine lanes of this process, by key (``kvindex.views.FleetView``).

Invariants:
- The only place lane tasks live: ``add`` starts one (after ``on_add``: the journal and the
  restored streams go to the lane before it runs), ``remove`` and ``close`` cancel and await
  them. A lane whose task ended says why (``lane_task_failed``).
- A removed lane's pending counts are flushed (what it applied still counts).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the lanes are made by the caller's ``make_lane``
    from kvindex.config import EngineConfig
    from kvindex.ingest.lane import EngineLane

log = logging.getLogger("kvindex.ingest.lane")  # every line about a lane under the lane's name


class Fleet:
    """Owns the lanes: starts, stops and lists them. The only place lane tasks live."""

    def __init__(self, make_lane: Callable[[EngineConfig], EngineLane],
                 on_add: Callable[[str, EngineLane], None] | None = None) -> None:
        self._make_lane = make_lane
        self._on_add = on_add  # called before the lane's task starts (journal, restored streams)
        self._lanes: dict[str, tuple[EngineLane, asyncio.Task[None]]] = {}

    def add(self, key: str, engine: EngineConfig) -> EngineLane:
        if key in self._lanes:
            raise KeyError(key)
        lane = self._make_lane(engine)
        lane.key = key
        if self._on_add is not None:
            self._on_add(key, lane)
        task = asyncio.create_task(self._run(lane), name=f"lane {key}")
        self._lanes[key] = (lane, task)
        return lane

    @staticmethod
    async def _run(lane: EngineLane) -> None:
        try:
            await lane.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine %s: lane stopped", lane.engine.name)
            raise

    async def remove(self, key: str) -> EngineLane | None:
        entry = self._lanes.pop(key, None)
        if entry is None:
            return None
        lane, task = entry
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for st in lane.state.streams.values():  # what it applied still counts
            st.counters.flush()
        return lane

    def lanes(self) -> dict[str, EngineLane]:
        return {k: lane for k, (lane, _) in self._lanes.items()}

    def behind(self, model: str) -> bool:
        return any(lane.behind(model) for lane, _ in self._lanes.values())

    def store_lost(self) -> None:
        for lane, _ in self._lanes.values():
            lane.store_lost()

    def flush_metrics(self) -> None:
        """Every stream's pending counts into its metric children (before a scrape)."""
        for lane, _ in self._lanes.values():
            for st in lane.state.streams.values():
                st.counters.flush()

    def lane_task_failed(self, key: str) -> str | None:
        entry = self._lanes.get(key)
        if entry is None or not entry[1].done() or entry[1].cancelled():
            return None
        exc = entry[1].exception()
        return f"{type(exc).__name__}: {exc}" if exc else "stopped"

    async def resync(self, pod: str) -> bool:
        found = False
        for lane in self.lanes().values():
            found |= await lane.resync(pod)
        return found

    async def close(self) -> None:
        for key in list(self._lanes):
            await self.remove(key)
