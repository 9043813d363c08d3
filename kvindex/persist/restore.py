"""State that outlives the process: snapshots, the write-ahead log, peers, recovery on start.

Invariants:
- Before any lane starts, ``restore()`` loads the local snapshot (or, with no local state, a
  peer's ``/v1/state``) and re-applies the write-ahead log through lanes that are not running yet,
  using the lanes' own decode-and-apply path: the state is exactly what it was at the last logged
  batch, even after SIGKILL. A corrupt, foreign or future snapshot is refused (kept aside) and
  kvindex starts empty rather than wrong.
- From then on everything that changes either index is logged (engine batches, resyncs,
  decisions, pod removals, registrations); ``snapshot()`` captures without awaiting (consistent
  with the log), starts a new log segment and drops the segments it covers.
- A write-ahead log failure (disk full, EIO) never reaches a lane or an HTTP handler: the log
  handles it (``WriteAheadLog.append``), the daemon counts it, and ``wal_degraded`` is true until
  the next snapshot covers what could not be logged.
- ``_capture`` copies the precise index's tables on the loop (``export_tables``: snapshot rows,
  one C pass per table); a thread encodes them: a big index never stalls the loop for a snapshot.
- Restored stream watermarks go to the lanes when the fleet adds them; each lane then asks its
  engine's replay endpoint for what followed. Until a lane takes them they are still part of the
  state: every snapshot (the startup one, written before any lane exists, included) carries
  them, so a snapshot never drops the log segments that held a stream's watermark without holding
  it itself (a SIGKILL soon after a restart would otherwise take every stream for new and replay
  the engine's history over the restored blocks).
- One daemon per state dir: ``lock()`` (``kvindex.persist.lock``) before anything in it is read;
  then the temp files of interrupted snapshot writes are removed (``write_atomic`` removes its own
  on a failure).
- ``lock()`` opens the state dir once (``kvindex.persist.statedir``: refused, exit 2, when it is a
  symlink, another user's or writable by others); the lock, the snapshot and its temp file, the
  refused snapshot's rename and every log segment are reached through that descriptor only.
- A failed snapshot (disk full, EIO), at start as later, is counted (``on_snapshot_error``) and
  logged, never raised (``try_snapshot``): the previous snapshot and the segments it does not
  cover stay, answers stay exact, the next snapshot retries. A snapshot write cancelled (SIGTERM)
  is waited for before the next one starts.
- Loading is linear and leaves the loop its turns: read and decoded in a thread (gc off), each
  table sized once, its rows loaded ``LOAD_CHUNK`` at a time in one C pass each. A state with a
  row not in the format is refused whole (kvindex starts empty, says why in one line). HTTP
  meanwhile answers 503 "loading"; a SIGTERM cancels the restore (nothing is written: the log and
  the final snapshot start only once the state is whole). A peer's state loads the same way, read
  within its bounds (``kvindex.persist.peer``: bytes, idle and total time); its rows are freed in
  a thread once loaded (``State.release``).
- A block size configured before the restore wins over the snapshot's (a contradiction is logged);
  restored workers hold the sizes their keys were made with (the snapshot's: ``load_tables(sizes=)``)
  while those are in force, and no other model's.
- Only with the memory store (``--store memory://``): ``index`` and ``approx`` are its own
  precise index and ``ApproxIndex``; logged batches are re-applied through the lanes, i.e.
  through the store, so its stream positions are rebuilt with them. With Redis the state lives
  in Redis and the configuration refuses ``--state-dir`` and ``--peer``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvindex.config import Config, EngineConfig
from kvindex.index.approx import ApproxIndex
from kvindex.index.rows import ROW, tables_of
from kvindex.index.memory import AnyPrecise
from kvindex.logs import BurstLog
from kvindex.persist import snapshot as snapshots
from kvindex.persist.journal import LaneJournal, finished, journal_on
from kvindex.persist.logreplay import LogReplay
from kvindex.persist.lock import StateDirLock, open_state_dir
from kvindex.persist.peer import PeerBounds, load_peer
from kvindex.persist.statedir import StateDir
from kvindex.persist.snapshot import State, StateError
from kvindex.persist.wal import (
    WriteAheadLog,
    fsync_and_close,
    read_from,
)
from kvindex.registrations import Registration, Registrations
from kvindex.views import FleetView, PodsView, RestorableLane

log = logging.getLogger("kvindex.persist.restore")
LOAD_CHUNK = 1 << 16  # entries loaded per turn of the event loop
_NO_LOG = 1 << 62  # a first log segment past any real one: replay nothing
_REFUSED = State(wal_from=_NO_LOG)  # marker: the local snapshot could not be used


class Recovery:
    """Snapshots and the write-ahead log of one daemon; inert without a state dir or a peer."""

    def __init__(self, config: Config, *, index: AnyPrecise, approx: ApproxIndex, fleet: FleetView,
                 pods: PodsView, registrations: Registrations,
                 make_lane: Callable[[EngineConfig], RestorableLane], token: str | None,
                 on_wal_error: Callable[[str], None] | None = None,
                 on_snapshot_error: Callable[[], None] | None = None,
                 on_peer_refused: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.index, self.approx, self.fleet, self.pods = index, approx, fleet, pods
        self.registrations = registrations
        self._make_lane = make_lane
        self._token = token
        self._on_wal_error = on_wal_error  # called per write-ahead log failure (the daemon counts them)
        self._on_snapshot_error = on_snapshot_error  # called per failed snapshot write (counted too)
        self._on_peer_refused = on_peer_refused  # called with the reason when a peer's state is refused
        self._dir: StateDir | None = None  # the state dir, opened once by lock(): every file is reached through it
        self._lock: StateDirLock | None = None
        self._wal_burst = BurstLog(logging.getLogger("kvindex.persist.wal"))
        self._snapshot_lock = asyncio.Lock()
        self.wal: WriteAheadLog | None = None
        self._restored_streams: dict[str, list[dict[str, Any]]] = {}
        self.restored_from: str | None = None  # "state-dir", "peer" or None (started empty)

    def lock(self) -> None:
        """Open the state dir (``StateDirUnusable``: refused) and take its lock (``StateDirBusy``: another
        daemon holds it); idempotent."""
        if self.config.state_dir is not None and self._lock is None:
            # StateDirUnusable (exit 2): a symlink, another user's, writable by others
            self._dir = open_state_dir(self.config.state_dir)
            self._lock = StateDirLock(self._dir)
        if self._lock is not None:
            self._lock.acquire()

    def loading_reason(self) -> str | None:
        """What HTTP answers (503) while ``restore()`` runs; None: nothing to restore from."""
        if self.config.state_dir is None and not self.config.peer:
            return None
        return "loading: restoring the saved state"

    @property
    def state_dir(self) -> Path | None:
        return self.config.state_dir

    @property
    def wal_degraded(self) -> bool:
        """A change the indexes hold is missing from the write-ahead log and no snapshot covers it
        yet (see ``WriteAheadLog.degraded``)."""
        return self.wal is not None and self.wal.degraded

    def _capture(self) -> State:
        """Everything a snapshot holds, copied now (no await: consistent with the log). The precise
        index is copied as its tables' snapshot rows (one C pass each, cheap on the event loop);
        ``snapshots.encode`` packs the rest in a thread."""
        # restored watermarks no lane has taken yet (a snapshot before the lanes exist, e.g. at start)
        # are part of the state: without them the next start would take every stream for new
        streams = {key: list(saved) for key, saved in self._restored_streams.items()}
        streams.update({key: [snapshots.stream_state(st) for st in lane.state.streams.values()]
                        for key, lane in self.fleet.lanes().items()})
        state = State(block_sizes=self.index.block_sizes(), approx=self.approx.export_state(), streams=streams,
                      registrations=[r.to_json() for r in self.registrations.by_key.values()], created=time.time())
        state.tables = self.index.export_tables()
        return state

    async def state_bytes(self) -> bytes:
        """The snapshot format, for ``GET /v1/state`` (peer recovery)."""
        return await asyncio.to_thread(snapshots.encode, self._capture())

    async def snapshot(self) -> None:
        """Write a snapshot, start a new log segment, drop the segments it covers."""
        if self._dir is None or self.wal is None:
            return
        async with self._snapshot_lock:
            wal = self.wal
            state = self._capture()
            state.wal_from = wal.rotate()
            data = await asyncio.to_thread(snapshots.encode, state)
            await finished(asyncio.to_thread(snapshots.write_atomic_in, self._dir, snapshots.SNAPSHOT_NAME, data))
            wal.drop_before(state.wal_from)
            wal.covered(state.wal_from)
            log.info("snapshot: %d precise entries, %d approximate entries, %d bytes", sum(len(t[3]) for t in state.tables) // ROW.size + len(state.entries),
                     self.approx.entries(), len(data))

    async def try_snapshot(self, when: str) -> bool:
        """``snapshot()``, a failure (disk full, EIO) counted and logged, never raised: the previous
        snapshot and the log segments it did not cover stay, so nothing is lost; the next one retries."""
        try:
            await self.snapshot()
            return True
        except Exception as exc:  # noqa: BLE001 (the daemon must outlive a failed snapshot)
            if self._on_snapshot_error is not None:
                self._on_snapshot_error()
            log.error("%s snapshot failed: %s: %s (the previous snapshot and the write-ahead log keep everything; "
                      "retrying at the next snapshot)", when, type(exc).__name__, exc)
            return False

    async def snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.snapshot_seconds)
            await self.try_snapshot("periodic")

    async def fsync_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            fd = self.wal.begin_sync() if self.wal is not None else None
            if fd is not None:
                try:
                    await asyncio.to_thread(fsync_and_close, fd)
                except OSError as exc:
                    if self.wal is not None:
                        self.wal.sync_failed(exc)

    def _load_local(self) -> State | None:
        d = self._dir
        assert d is not None
        path = d.path / snapshots.SNAPSHOT_NAME
        try:
            st = snapshots.read_in(d, snapshots.SNAPSHOT_NAME)
        except StateError as exc:
            aside = path.with_name(f"{path.name}.refused-{int(time.time())}")
            d.replace(path.name, aside.name)
            log.error("state: refusing snapshot %s: %s; starting EMPTY (the file is kept as %s, its write-ahead "
                      "log is not replayed)%s", path, exc, aside.name, "; trying the peer" if self.config.peer else "")
            return _REFUSED
        return st

    async def _install(self, st: State) -> bool:
        """Load a decoded state; a Dynamo peer's rows are packed first (off the loop): one that is not
        in the row format refuses the state before anything is loaded (False, logged)."""
        try:
            tables = [*st.tables, *await asyncio.to_thread(tables_of, st.entries)]
        except (ValueError, OverflowError, TypeError, struct.error) as exc:
            log.error("state: precise entries cannot be loaded (%s); starting EMPTY", exc)
            return False
        for model, n in st.block_sizes.items():  # a configured size (set before the restore) wins
            now = self.index.block_size(model)
            if now is None:
                self.index.set_block_size(model, n)
            elif now != n:
                log.warning("state: model %r was saved with block_size %d, configured %d: the configured size is "
                            "in force; the restored blocks (keyed with %d) hold nothing until an engine stores %d "
                            "again", model, n, now, n, n)
        self.index.reserve_tables(tables)  # every table sized once for all of its entries: the load is linear
        for pod, rank, medium, rows in tables:  # in parts: the loop gets turns (HTTP, SIGTERM)
            for i in range(0, len(rows), step := LOAD_CHUNK * ROW.size):
                self.index.load_tables([(pod, rank, medium, memoryview(rows)[i:i + step])], sizes=st.block_sizes)
                await asyncio.sleep(0)
        lineage = getattr(self.index, "lineage", None)  # kept with --dynamo-dump only
        if lineage is not None:
            for i, (parent, locals_, keys) in enumerate(st.lineage):  # a Dynamo peer's: our /dump places its blocks
                lineage.add(parent, locals_, keys)
                if i % LOAD_CHUNK == LOAD_CHUNK - 1:
                    await asyncio.sleep(0)  # the loop gets turns
        try:
            self.approx.load_state(st.approx)
        except ValueError as exc:
            log.error("state: approximate index not restored: %s", exc)
        for d in st.registrations:
            try:
                self.registrations.add(Registration.from_json(d))
            except ValueError as exc:
                log.error("state: %s", exc)
        self._restored_streams = {k: list(v) for k, v in st.streams.items()}
        return True

    def _engine_for(self, key: str) -> EngineConfig | None:
        for engine in self.config.engines:
            if key == engine.lane_key:
                return engine
        for reg in self.registrations.by_key.values():
            if reg.lane_key == key:
                return reg.engine
        return None

    async def _replay_log(self, first: int) -> int:
        """Re-apply the write-ahead log's records through lanes that are not running yet."""
        assert self._dir is not None
        replay = LogReplay(index=self.index, approx=self.approx, registrations=self.registrations,
                           restored_streams=self._restored_streams, engine_for=self._engine_for,
                           make_lane=self._make_lane)
        return await replay.run(self._dir, first)

    async def restore(self) -> None:
        """Local state first (snapshot + log); else the peer's; else empty. The garbage collector
        is off meanwhile: a big snapshot decodes to millions of (acyclic) rows, which every full
        collection would traverse again (a 5M-entry restore took twice as long with it on)."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            await self._restore()
        finally:
            if enabled:
                gc.enable()

    async def _restore(self) -> None:
        st: State | None = None
        refused = False
        if self.config.state_dir is not None:
            self.lock()  # StateDirBusy: another daemon has it (nothing was touched)
            assert self._dir is not None
            for name in snapshots.remove_stale_temps(self._dir, snapshots.SNAPSHOT_NAME):
                log.warning("state: removed %s, left by an interrupted snapshot write", name)
            st = await asyncio.to_thread(self._load_local)  # off the loop: HTTP answers "loading"
            refused = st is _REFUSED
            if refused:
                st = None
            elif st is not None:
                self.restored_from = "state-dir"
        local_log = (self._dir is not None and st is None and not refused
                     and any(True for _ in read_from(self._dir, 0)))
        if st is None and not local_log and self.config.peer:
            st = await load_peer(self.config.peer, self._token, PeerBounds.of(self.config), self._on_peer_refused)
            if st is not None:
                self.restored_from = "peer"
                st.wal_from = _NO_LOG  # the peer's log is not ours
        if st is not None:
            installed = await self._install(st)
            await asyncio.to_thread(st.release)  # a Dynamo peer's rows, freed off the loop
            st = st if installed else None
        if self.config.state_dir is not None:
            first = st.wal_from if st is not None else _NO_LOG if refused else 0
            if await self._replay_log(first) and self.restored_from is None:
                self.restored_from = "state-dir"
            assert self._dir is not None
            self.wal = WriteAheadLog(self._dir, fsync=self.config.fsync, on_error=self._on_wal_error,
                                     burst=self._wal_burst)
            self._journal_on()
            await self.try_snapshot("startup")
        if self.restored_from:
            log.info("state restored from %s: %d pods, %d approximate entries", self.restored_from,
                     len(self.index.pods()), self.approx.entries())

    def _journal_on(self) -> None:
        assert self.wal is not None
        journal_on(self.wal, self.approx, self.pods, self.registrations)

    def lane_added(self, key: str, lane: RestorableLane) -> None:
        saved = self._restored_streams.pop(key, None)
        if saved:
            lane.restore_streams(saved)
        if self.wal is not None:
            lane.journal = LaneJournal(self.wal)

    def close(self) -> None:
        """After the lanes stopped: what they applied after the last snapshot is in the log."""
        if self.wal is not None:
            self.wal.close()
            self.wal = None
        if self._lock is not None:
            self._lock.release()
        if self._dir is not None:
            self._dir.close()
            self._dir = None
            self._lock = None
