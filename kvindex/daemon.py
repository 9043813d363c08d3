"""The composition root: the only module that knows every part and wires them together.

Invariants:
- Every part gets its dependencies passed in; metrics live in one registry created here (or
  passed in by a test); nothing is module-global.
- Every background task (engine lanes, the drift timer, the HTTP site, the snapshot and fsync
  timers) is owned here and is cancelled and awaited by ``stop()``; the ZeroMQ context is
  terminated last.
- With ``state_dir``: before any lane starts, the snapshot is loaded and the write-ahead log
  replayed through the lanes' own decode-and-apply path (so the state is what it was at the last
  logged batch), then a fresh snapshot is written; lanes start from the restored watermarks and
  ask their engine's replay endpoint for what followed. Everything that changes either index is
  logged from then on; ``stop()`` writes a final snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import aiohttp
import zmq.asyncio
from aiohttp import web
from prometheus_client import CollectorRegistry

from adapters import DIALECTS
from adapters.engine_tokenizer import EngineTokenizer
from adapters.llmd_sim import SimTokenizer
from kvindex import compat_api
from kvindex.approx import ApproxIndex
from kvindex.config import Config, EngineConfig
from kvindex.decisions import Decisions
from kvindex.drift import DriftAudit
from kvindex.http_api import Services, make_app
from kvindex.ingest import EngineLane, Fleet, LaneSettings
from kvindex.logs import BurstLog
from kvindex.metrics import Metrics, StateCollector
from kvindex.pods import PodDirectory
from kvindex.precise import TIERS, PreciseIndex
from kvindex.query import QueryService
from kvindex import state as snapshots
from kvindex.state import State, StateError
from kvindex.tokenize import CachingTokenizer, Tokenizer
from kvindex.wal import WriteAheadLog, fsync_and_close, read_from

log = logging.getLogger("kvindex.daemon")
_NO_LOG = 1 << 62  # a first log segment past any real one: replay nothing
_REFUSED = State(wal_from=_NO_LOG)  # marker: the local snapshot could not be used


class Daemon:
    def __init__(self, config: Config, *, registry: CollectorRegistry | None = None, token: str | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.index = PreciseIndex()
        for model, mc in config.models.items():
            if mc.block_size:
                self.index.set_block_size(model, mc.block_size)
        self.approx = ApproxIndex(config.approx, on_evict=lambda model: self.metrics.approx_evictions.labels(model).inc())
        self.ctx = zmq.asyncio.Context()
        self._burst = BurstLog(logging.getLogger("kvindex.ingest"))
        self.fleet = Fleet(self._make_lane, on_add=self._lane_added)
        self.drift = DriftAudit(self.index, self.approx, config.drift)
        self.pods = PodDirectory(self.fleet, self.index, self.approx, self.drift)
        self._tokenizers: dict[str, Tokenizer | None] = {}
        self._session: aiohttp.ClientSession | None = None
        self.query = QueryService(self.index, self.approx, self._tokenizer_for, config.max_token_ids)
        self.services = Services(config=config, metrics=self.metrics, query=self.query, fleet=self.fleet,
                                 pods=self.pods, decisions=Decisions(self.query, self.drift, self.metrics),
                                 drift=self.drift, token=token, state=self.state_bytes)
        self.registry.register(StateCollector(self._state_gauges))
        self.app = make_app(self.services, compat_api.routes())
        self.registrations = compat_api.Registrations()
        self.app[compat_api.REGISTRATIONS] = self.registrations
        self._token = token
        self._runner: web.AppRunner | None = None
        self._drift_task: asyncio.Task[None] | None = None
        self._snapshot_task: asyncio.Task[None] | None = None
        self._fsync_task: asyncio.Task[None] | None = None
        self._snapshot_lock = asyncio.Lock()
        self.wal: WriteAheadLog | None = None
        self._restored_streams: dict[str, list[dict[str, Any]]] = {}
        self.restored_from: str | None = None  # "state-dir", "peer" or None (started empty)
        self.port: int | None = None

    def _make_lane(self, engine: EngineConfig) -> EngineLane:
        dialect = DIALECTS[engine.dialect]
        settings = LaneSettings(replay_timeout=self.config.replay_timeout, rcvhwm=self.config.rcvhwm)
        return EngineLane(engine, ctx=self.ctx, decoder=dialect.decoder(), first_seq=dialect.first_seq,
                          index=self.index, metrics=self.metrics, settings=settings, burst=self._burst)

    def _tokenizer_for(self, model: str) -> Tokenizer | None:
        if model not in self._tokenizers:
            mc = self.config.model(model)
            inner: Tokenizer | None = None
            if mc.tokenizer == "llmd-sim":
                inner = SimTokenizer()
            elif mc.tokenizer == "engine" and mc.tokenize_url:
                if self._session is None:
                    self._session = aiohttp.ClientSession()
                inner = EngineTokenizer(mc.tokenize_url, self._session)
            self._tokenizers[model] = CachingTokenizer(inner) if inner is not None else None
        return self._tokenizers[model]

    def _state_gauges(self) -> Iterable[tuple[str, str, list[str], list[tuple[list[str], float]]]]:
        views = self.pods.views()
        yield ("kvindex_blocks_held", "Block copies held per pod and tier (precise index)", ["pod", "tier"],
               [([v["pod"], t], v["blocks"][t]) for v in views for t in TIERS])
        yield ("kvindex_orphan_blocks_held", "Keyless (orphan) engine hashes held per pod", ["pod"],
               [([v["pod"]], v["blocks"]["orphans"]) for v in views])
        yield ("kvindex_pod_synced", "1 when the pod's event stream is complete, 0 when unsynced", ["pod"],
               [([v["pod"]], 1.0 if v.get("synced", True) else 0.0) for v in views])
        yield ("kvindex_engine_connected", "1 when the engine's publisher is connected", ["pod"],
               [([v["pod"]], 1.0 if v.get("connected") else 0.0) for v in views if v.get("endpoint")])
        drift = self.drift.pods
        yield ("kvindex_drift_stale", "Sampled decisions whose prefix the router believes but the engine evicted",
               ["pod"], [([p], d.stale) for p, d in drift.items()])
        yield ("kvindex_drift_unseen", "Sampled requests whose prefix the pod holds but the router never recorded there",
               ["pod"], [([p], d.unseen) for p, d in drift.items()])
        yield ("kvindex_drift_sampled", "Decisions in the drift sample", ["pod"], [([p], d.sampled) for p, d in drift.items()])
        yield ("kvindex_approx_entries", "Approximate index entries, summed over pods (Kthena's prefix_cache_entries)",
               [], [([], float(self.approx.entries()))])

    # -- state: snapshot, write-ahead log, peer ------------------------------------------------
    def _capture(self) -> State:
        """Everything a snapshot holds, copied now (no await: consistent with the log)."""
        streams = {key: [snapshots.stream_state(st) for st in lane.state.streams.values()]
                   for key, lane in self.fleet.lanes().items()}
        return State(block_sizes=self.index.block_sizes(), entries=list(self.index.export_entries()),
                     approx=self.approx.export_state(), streams=streams,
                     registrations=[r.to_json() for r in self.registrations.by_key.values()], created=time.time())

    async def state_bytes(self) -> bytes:
        """The snapshot format, for ``GET /v1/state`` (peer recovery)."""
        state = self._capture()
        return await asyncio.to_thread(snapshots.encode, state)

    async def snapshot(self) -> None:
        """Write a snapshot, start a new log segment, drop the segments it covers."""
        if self.config.state_dir is None or self.wal is None:
            return
        async with self._snapshot_lock:
            state = self._capture()
            state.wal_from = self.wal.rotate()
            data = await asyncio.to_thread(snapshots.encode, state)
            await asyncio.to_thread(snapshots.write_atomic, self.config.state_dir / snapshots.SNAPSHOT_NAME, data)
            self.wal.drop_before(state.wal_from)
            log.info("snapshot: %d precise entries, %d approximate entries, %d bytes", len(state.entries),
                     self.approx.entries(), len(data))

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.snapshot_seconds)
            try:
                await self.snapshot()
            except Exception as exc:  # the timer must outlive a failed snapshot (disk full, ...)
                log.error("snapshot failed: %s: %s (the write-ahead log keeps everything)", type(exc).__name__, exc)

    async def _fsync_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            fd = self.wal.begin_sync() if self.wal is not None else None
            if fd is not None:
                try:
                    await asyncio.to_thread(fsync_and_close, fd)
                except OSError as exc:
                    log.error("write-ahead log fsync failed: %s", exc)

    def _load_local(self) -> State | None:
        d = self.config.state_dir
        assert d is not None
        d.mkdir(parents=True, exist_ok=True)
        path = d / snapshots.SNAPSHOT_NAME
        try:
            st = snapshots.read_file(path)
        except StateError as exc:
            aside = path.with_name(f"{path.name}.refused-{int(time.time())}")
            path.rename(aside)
            log.error("state: refusing snapshot %s: %s; starting EMPTY (the file is kept as %s, its write-ahead "
                      "log is not replayed)%s", path, exc, aside.name, "; trying the peer" if self.config.peer else "")
            return _REFUSED
        return st

    async def _load_peer(self, url: str) -> State | None:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                async with session.get(url.rstrip("/") + "/v1/state", headers=headers) as r:
                    if r.status != 200:
                        raise StateError(f"answered HTTP {r.status}: {(await r.text())[:200]}")
                    data = await r.read()
            return snapshots.decode(data)
        except (aiohttp.ClientError, TimeoutError, OSError, StateError) as exc:
            log.error("peer %s: cannot load its state (%s: %s); starting empty", url, type(exc).__name__, exc)
            return None

    def _install(self, st: State) -> None:
        for model, n in st.block_sizes.items():
            self.index.set_block_size(model, n)
        self.index.load_entries(st.entries)
        try:
            self.approx.load_state(st.approx)
        except ValueError as exc:
            log.error("state: approximate index not restored: %s", exc)
        for d in st.registrations:
            try:
                self.registrations.add(compat_api.Registration.from_json(d))
            except ValueError as exc:
                log.error("state: %s", exc)
        self._restored_streams = {k: list(v) for k, v in st.streams.items()}

    def _engine_for(self, key: str) -> EngineConfig | None:
        for engine in self.config.engines:
            if key == f"config:{engine.name}":
                return engine
        for reg in self.registrations.by_key.values():
            if reg.lane_key == key:
                return reg.engine
        return None

    def _replay_log(self, first: int) -> int:
        """Re-apply the write-ahead log's records through lanes that are not running yet."""
        assert self.config.state_dir is not None
        lanes: dict[str, EngineLane] = {}
        n = skipped = 0
        for rec in read_from(self.config.state_dir, first):
            try:
                kind = rec[0]
                if kind in ("b", "r"):
                    lane = lanes.get(rec[1])
                    if lane is None:
                        engine = self._engine_for(rec[1])
                        if engine is None:
                            skipped += 1
                            continue
                        lane = lanes[rec[1]] = self._make_lane(engine)
                        lane.key = rec[1]
                        lane.restore_streams(self._restored_streams.get(rec[1], []))
                    if kind == "b":
                        lane.apply_logged(rec[2], rec[3], rec[4])
                    else:
                        lane.resync_logged(rec[2])
                elif kind == "d":
                    self.approx.record(rec[1], rec[2], rec[3])
                elif kind == "x":
                    self.index.clear_pod(rec[1])
                    self.approx.remove_pod(rec[1])
                elif kind == "g":
                    reg = compat_api.Registration.from_json(rec[2])
                    if rec[1] == "add":
                        self.registrations.add(reg)
                    elif (reg.instance_id, reg.dp_rank) in self.registrations.by_key:
                        self.registrations.remove(reg)
                        self.index.clear_pod(reg.instance_id, reg.dp_rank)
                        self._restored_streams.pop(reg.lane_key, None)
                        lanes.pop(reg.lane_key, None)
                else:
                    skipped += 1
                    continue
                n += 1
            except (IndexError, TypeError, ValueError, KeyError) as exc:
                skipped += 1
                log.warning("write-ahead log: skipping a malformed record: %s", exc)
        for key, lane in lanes.items():
            self._restored_streams[key] = [snapshots.stream_state(st) for st in lane.state.streams.values()]
        if n or skipped:
            log.info("write-ahead log: re-applied %d records (%d skipped)", n, skipped)
        return n

    async def _restore(self) -> None:
        """Local state first (snapshot + log); else the peer's; else empty."""
        st: State | None = None
        refused = False
        if self.config.state_dir is not None:
            st = self._load_local()
            refused = st is _REFUSED
            if refused:
                st = None
            elif st is not None:
                self.restored_from = "state-dir"
        local_log = (self.config.state_dir is not None and st is None and not refused
                     and any(True for _ in read_from(self.config.state_dir, 0)))
        if st is None and not local_log and self.config.peer:
            st = await self._load_peer(self.config.peer)
            if st is not None:
                self.restored_from = "peer"
                st.wal_from = _NO_LOG  # the peer's log is not ours
        if st is not None:
            self._install(st)
        if self.config.state_dir is not None:
            first = st.wal_from if st is not None else _NO_LOG if refused else 0
            if self._replay_log(first) and self.restored_from is None:
                self.restored_from = "state-dir"
            self.wal = WriteAheadLog(self.config.state_dir, fsync=self.config.fsync)
            self._journal_on()
            await self.snapshot()
        if self.restored_from:
            log.info("state restored from %s: %d pods, %d approximate entries", self.restored_from,
                     len(self.index.pods()), self.approx.entries())

    def _journal_on(self) -> None:
        wal = self.wal
        assert wal is not None
        self.approx.on_record = lambda pod, model, hashes: wal.append(["d", pod, model, list(hashes)])
        self.pods.on_remove = lambda pod: wal.append(["x", pod])
        self.registrations.on_change = lambda kind, reg: wal.append(["g", kind, reg.to_json()])

    def _lane_added(self, key: str, lane: EngineLane) -> None:
        saved = self._restored_streams.pop(key, None)
        if saved:
            lane.restore_streams(saved)
        if self.wal is not None:
            lane.journal = _LaneJournal(self.wal)

    async def start(self) -> None:
        await self._restore()
        self._drift_task = asyncio.create_task(self.drift.run(), name="drift re-check")
        if self.wal is not None:
            self._snapshot_task = asyncio.create_task(self._snapshot_loop(), name="snapshot timer")
            if self.config.fsync == "interval":
                self._fsync_task = asyncio.create_task(self._fsync_loop(), name="wal fsync timer")
        for engine in self.config.engines:
            self.fleet.add(f"config:{engine.name}", engine)
        for reg in list(self.registrations.by_key.values()):
            self.fleet.add(reg.lane_key, reg.engine)
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("kvindex listening on http://%s:%d with %d engine(s)", self.config.host, self.port, len(self.config.engines))

    async def stop(self) -> None:
        tasks = [t for t in (self._drift_task, self._snapshot_task, self._fsync_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.wal is not None:  # while the lanes still hold their streams' watermarks
            try:
                await self.snapshot()
            except OSError as exc:
                log.error("final snapshot failed: %s (the write-ahead log keeps everything)", exc)
        await self.fleet.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.wal is not None:
            self.wal.close()  # what lanes and requests applied after the snapshot is in the log
            self.wal = None
        if self._session is not None:
            await self._session.close()
        self.ctx.term()
        log.info("kvindex stopped")

    async def run_forever(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()


class _LaneJournal:
    """What a lane logs: applied batches and operator resyncs."""

    __slots__ = ("_wal",)

    def __init__(self, wal: WriteAheadLog) -> None:
        self._wal = wal

    def batch(self, key: str, topic: str, seq: int, payload: bytes) -> None:
        self._wal.append(["b", key, topic, seq, payload])

    def resync(self, key: str, pod: str) -> None:
        self._wal.append(["r", key, pod])
