"""Re-applying the write-ahead log at start, through lanes that are not running yet.

Invariants:
- Every record is re-applied as it was when logged, in order, through the lanes' own decode and
  apply (``RestorableLane.apply_logged`` / ``resync_logged``), decisions and removals straight into
  the memory indexes; a record whose lane is gone (its engine no longer configured or registered)
  is skipped and counted.
- Damage is a gap like any other. Where the reader skipped damaged bytes (``records.Damage``) the
  records there are gone, whatever they were. A stream whose next logged batch after damage does
  not follow its last one (its seq jumps, or its first logged batch is past the dialect's first
  seq) lost a batch to the disk, not to the engine: its log replay stops there (that batch and
  every later logged batch of the stream are not applied), its watermark stays at the last good
  batch, and at start its lane asks the engine's replay for everything after it
  (``EngineLane._catch_up``): exact again when the engine still has that history, unsynced with the
  reason when it does not — never force-applied past as history lost. A gap with no damage
  before it is the unsynced stretch the live lane saw and is re-applied as such. Without a replay
  endpoint no engine can be asked: the damaged stream is re-applied across the gap, unsynced.
- An operator's resync in the log (``Resync``) clears its pod and replays from the first seq: a
  stream stopped by damage resumes after it. Damage to a record that was not an engine batch (a
  decision, a pod removal, a registration) cannot be asked of an engine: that change is lost,
  and the warning says the bytes were skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adapters.dialects import DIALECTS
from kvindex.config import EngineConfig
from kvindex.index.approx import ApproxIndex
from kvindex.index.memory import AnyPrecise
from kvindex.persist.snapshot import stream_state
from kvindex.persist.statedir import StateDir
from kvindex.persist.records import (
    Batch,
    Damage,
    Decision,
    PodRemoved,
    Record,
    RegistrationChange,
    Resync,
    Unknown,
    read_marked,
)
from kvindex.registrations import Registration, Registrations
from kvindex.views import RestorableLane

log = logging.getLogger("kvindex.persist.restore")
StreamKey = tuple[str, str]  # (lane key, topic)


@dataclass(slots=True)
class DamageGuard:
    """Which streams' log replay stopped at damage (see the module docstring)."""

    damage: int = 0  # damaged stretches read so far
    seen: dict[StreamKey, int] = field(default_factory=dict)  # per stream: ``damage`` at its last logged batch
    stopped: dict[StreamKey, int] = field(default_factory=dict)  # per stream: the logged batches not applied

    def admits(self, lane: RestorableLane, rec: Batch) -> bool:
        """Whether ``rec`` is re-applied: False once its stream lost a batch to damage."""
        key = (rec.lane_key, rec.topic)
        if key in self.stopped:
            self.stopped[key] += 1
            return False
        after_damage = self.seen.get(key, 0) < self.damage
        self.seen[key] = self.damage
        if not after_damage or not lane.engine.replay:
            return True
        st = lane.state.streams.get(rec.topic)
        last = st.last_seq if st is not None else None
        expected = DIALECTS[lane.engine.dialect].first_seq if last is None else last + 1
        if rec.seq <= expected:  # it follows (or went back: the restart it was)
            return True
        self.stopped[key] = 1
        log.warning("write-ahead log: %s %s: logged batch %d follows %s across a damaged record: its log replay "
                    "stops there, the engine's replay is asked for what followed", rec.lane_key, rec.topic, rec.seq,
                    "nothing" if last is None else f"seq {last}")
        return False

    def resynced(self, lane: RestorableLane, lane_key: str, pod: str) -> None:
        """An operator's resync of ``pod`` in the log: its streams start over, damage behind them."""
        for topic, st in lane.state.streams.items():
            if st.pod == pod:
                self.stopped.pop((lane_key, topic), None)
                self.seen[(lane_key, topic)] = self.damage


class LogReplay:
    """One start's replay of the log (``Recovery.restore``)."""

    def __init__(self, *, index: AnyPrecise, approx: ApproxIndex, registrations: Registrations,
                 restored_streams: dict[str, list[dict[str, Any]]],
                 engine_for: Callable[[str], EngineConfig | None],
                 make_lane: Callable[[EngineConfig], RestorableLane]) -> None:
        self.index, self.approx, self.registrations = index, approx, registrations
        self._restored_streams = restored_streams  # the snapshot's watermarks, by lane key (updated here)
        self._engine_for = engine_for
        self._make_lane = make_lane
        self.lanes: dict[str, RestorableLane] = {}
        self.guard = DamageGuard()

    async def run(self, directory: StateDir, first: int) -> int:
        """Re-apply segments >= ``first``; the number of records re-applied."""
        n = skipped = unknown = 0
        for rec in read_marked(directory, first):
            applied = False
            if isinstance(rec, Damage):
                self.guard.damage += 1
                continue
            if isinstance(rec, Unknown):  # e.g. a newer release's record: the first is logged, all counted
                unknown += 1
                if unknown == 1:
                    log.warning("write-ahead log: skipping records this kvindex does not know, first: %s", rec.why)
            else:
                try:
                    applied = await self._record(rec)
                except (TypeError, ValueError, KeyError) as exc:
                    log.warning("write-ahead log: skipping a malformed record: %s", exc)
            n += applied
            skipped += not applied
        for key, lane in self.lanes.items():
            self._restored_streams[key] = [stream_state(st) for st in lane.state.streams.values()]
        held_back = sum(self.guard.stopped.values())
        if n or skipped:
            log.info("write-ahead log: re-applied %d records (%d skipped, %d of them unknown, %d batches after damage "
                     "left to the engines' replay)", n, skipped, unknown, held_back)
        return n

    async def _record(self, rec: Record) -> bool:
        """One record, re-applied as it was when logged; False: it could not be (its lane is gone,
        or damage stopped its stream)."""
        match rec:
            case Batch() | Resync():
                lane = self.lanes.get(rec.lane_key) or await self._lane(rec.lane_key)
                if lane is None:
                    return False
                if isinstance(rec, Batch):
                    if not self.guard.admits(lane, rec):
                        return False
                    await lane.apply_logged(rec.topic, rec.seq, rec.payload)
                else:
                    await lane.resync_logged(rec.pod)
                    self.guard.resynced(lane, rec.lane_key, rec.pod)
            case Decision():
                self.approx.record(rec.pod, rec.model, list(rec.hashes))
            case PodRemoved():
                self.index.clear_pod(rec.pod)
                self.approx.remove_pod(rec.pod)
            case RegistrationChange():
                self._registration(rec.change, Registration.from_json(rec.registration))
        return True

    async def _lane(self, key: str) -> RestorableLane | None:
        engine = self._engine_for(key)
        if engine is None:
            return None
        lane = self.lanes[key] = self._make_lane(engine)
        lane.key = key
        lane.restore_streams(self._restored_streams.get(key, []))
        await lane.install_restored()
        return lane

    def _registration(self, kind: str, reg: Registration) -> None:
        if kind == "add":
            self.registrations.add(reg)
        elif (reg.instance_id, reg.dp_rank) in self.registrations.by_key:
            self.registrations.remove(reg)
            self.index.clear_pod(reg.instance_id, reg.dp_rank)
            self._restored_streams.pop(reg.lane_key, None)
            self.lanes.pop(reg.lane_key, None)
