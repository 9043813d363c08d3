"""The composition root: the only module that knows every part and wires them together.

Invariants:
- Every part gets its dependencies passed in; metrics live in one registry created here (or
  passed in by a test); nothing is module-global.
- Every background task (engine lanes, the drift timer, the HTTP site, the snapshot and fsync
  timers) is owned here and is cancelled and awaited by ``stop()``; the ZeroMQ context is
  terminated last.
- With ``state_dir`` (or ``peer``): ``start()`` takes the state dir's lock first (a second daemon
  exits 2), starts HTTP (503 "loading" until the state is whole), then ``Recovery`` restores the
  state before any lane starts; a stop during ``start()`` cancels it (``run_forever``);
  ``stop()`` writes a final snapshot while the lanes still hold their watermarks.
- ``stop()`` undoes whatever ``start()`` got to, even when it failed half-way (``run_forever``
  calls it either way), and is idempotent: a failed start leaves no task, socket or fd behind.
- Write-ahead log failures never stop the daemon: they are counted
  (``kvindex_wal_errors_total{op}``) and ``kvindex_wal_degraded`` / ``wal_degraded`` say whether
  a change is missing from the log until the next snapshot.
- Every ZeroMQ socket of the daemon's context refuses messages over ``max_message_bytes`` (the
  context's default ``MAXMSGSIZE``; libzmq drops the connection that sent one).
- The indexes live in the stores chosen by ``config.store`` (``kvindex.index.factory.build_stores``):
  every part reads and writes them through the store contracts. ``start()`` opens them first: a
  store that cannot be reached then raises ``StoreUnavailable`` before anything is served (the
  CLI exits 2); ``stop()`` closes them (and the Redis client) after the lanes stopped. A Redis
  store is wrapped by the ``StoreGuard`` (errors counted, 503s, a loss makes every lane
  resynchronise); the memory store is used as it is. ``index`` / ``approx`` are the memory
  store's ``PreciseIndex`` / ``ApproxIndex`` (None with Redis); snapshots, the write-ahead log
  and peers (``Recovery``) exist only with the memory store.
- With ``workers`` >= 2 (``kvindex.shard.supervisor``) the engines' lanes run in worker processes this
  daemon starts (``start()``, after the stores) and stops (``stop()``, after the HTTP site); the
  precise store is the ``ShardedPreciseStore`` over their channels, ``index`` is None, and the
  fleet and pod directory are the workers' (``ShardedFleet``, ``ShardedPods``). A worker that
  dies makes ``run_forever`` stop the daemon after ``WORKER_EXIT_GRACE`` seconds (readyz says
  why meanwhile) and raise ``ShardFailed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from adapters.dialects import DIALECTS
from adapters.engine_models import EnginePollers
from adapters.engine_tokenizer import EngineTokenizer, RenderTokenizer
from adapters.hf_tokenizer import HFTokenizer
from adapters.llmd_sim import SimTokenizer
from kvindex import native
from kvindex.config import Config, EngineConfig
from kvindex.query.decisions import Decisions
from kvindex.query.drift import DriftAudit
from kvindex.http import dynamo
from kvindex.http import native as native_api
from kvindex.http.app import Services, make_app
from kvindex.http.fastpath import FastPath
from kvindex.http.server import HttpServer, connection_cap, runner_options
from kvindex.index.approx import ApproxIndex
from kvindex.index.factory import build_stores
from kvindex.index.guarded import Guarded, StoreGuard
from kvindex.index.memory import AnyPrecise, core_missing, new_precise_index
from kvindex.index.protocol import StoreUnavailable
from kvindex.ingest.fleet import Fleet
from kvindex.ingest.lane import EngineLane
from kvindex.ingest.streams import LaneSettings
from kvindex.ingest.intake import Intake
from kvindex.ingest.transport import raise_nofile
from kvindex.logs import BurstLog
from kvindex.lora import LoraAdapters, checked_adapters
from kvindex.metrics import Metrics, StateCollector
from kvindex.persist.restore import Recovery
from kvindex.pods import Gauge, Orphans, PodDirectory, pod_census, state_gauges
from kvindex.query.service import QueryService
from kvindex.route.shadows import Shadows
from kvindex.registrations import EngineRegistry, Registrations
from kvindex.shard.channel import Metrics as WorkerMetrics
from kvindex.shard.channel import WorkerSettings
from kvindex.shard.store import ShardedPreciseStore
from kvindex.shard.supervisor import MergedRegistry, ShardedFleet, ShardedPods, ShardFailed, Shards
from kvindex.sglang.service import build_indexer
from kvindex.storeurl import describe, is_memory
from kvindex.tokenize import CachingTokenizer, Tokenizer
from kvindex.views import FleetView, PodsView

log = logging.getLogger("kvindex.daemon")
SHARED_GAUGES_SECONDS = 10.0  # the pod gauges of a shared store are read at most this often
WORKER_EXIT_GRACE = 5.0  # seconds between a worker's death and the daemon's exit (readyz says why)
ROUTE_GRACE = 5.0  # seconds the gRPC calls in flight (ext_proc, --grpc-port) get to finish at stop


class Daemon:
    def __init__(self, config: Config, *, registry: CollectorRegistry | None = None, token: str | None = None) -> None:
        self.config = config
        self._tokenizers: dict[str, Tokenizer | None] = {  # loaded first: a bad tokenizer_path stops the start
            name: CachingTokenizer(HFTokenizer.load(mc.tokenizer_path or "", name,
                                                    mc.trust_request_chat_template))
            for name, mc in config.models.items() if mc.tokenizer == "hf"}
        default_registry = MergedRegistry() if config.workers > 1 else CollectorRegistry()
        self.registry = registry if registry is not None else default_registry
        self.metrics = Metrics(self.registry)
        for name in [*config.models, *config.approx.models]:
            self.metrics.known(None, name)
        for engine in config.engines:
            self.metrics.known(engine.pod, engine.model)
        memory = self._wire_stores(config)
        self._gauges: tuple[list[dict[str, Any]], int] = ([], 0)
        self._gauges_at = float("-inf")
        self.intake = Intake.for_process(config.max_message_bytes)  # the lanes' ZeroMQ context and SUB sockets
        self.shards = self._wire_shards(config)
        self.failure: str | None = None  # why a worker died (the daemon then exits)
        self._fatal = asyncio.Event()
        self.wal_errors = Counter("kvindex_wal_errors", "Write-ahead log failures (append, open, truncate, fsync, "
                                  "close); kvindex keeps serving", ["op"], registry=self.registry)
        self.snapshot_errors = Counter("kvindex_snapshot_errors", "Snapshot writes that failed (disk full, EIO); kvindex "
                                       "keeps serving and retries at the next snapshot", registry=self.registry)
        self.loading: str | None = None  # while start() restores the state: HTTP answers 503 with this
        self._burst = BurstLog(logging.getLogger("kvindex.ingest.lane"))
        self.fleet: FleetView = (
            ShardedFleet(self.shards) if self.shards is not None
            else Fleet(self._make_lane, on_add=lambda key, lane: self.recovery.lane_added(key, lane)))
        self.drift = DriftAudit(self.store, self.approx_store, config.drift)
        self.orphans = Orphans(self.fleet, config.orphan_grace_seconds)
        self.pods: PodsView = (
            ShardedPods(self.shards, self.store, self.approx_store, self.drift)  # type: ignore[arg-type]
            if self.shards is not None else PodDirectory(self.fleet, self.store, self.approx_store, self.drift,
                                                         self.orphans))
        self._session: aiohttp.ClientSession | None = None
        self.lora = LoraAdapters(checked_adapters({m: mc.base_model for m, mc in config.models.items()}), self.metrics,
                                 bases=[m for m, mc in config.models.items() if mc.base_model is None and m != "*"]
                                 + [e.model for e in config.engines if e.model])
        self.lora_pollers = EnginePollers({mc.adapters_url: m for m, mc in config.models.items() if mc.adapters_url},
                                          self.lora, self.metrics)  # each engine's /v1/models: its adapters
        if self.shards is not None:  # the workers' lanes report their events' lora_names every WATCH_SECONDS
            self.shards.on_lora = self.lora.learn_from_events
        self.query = QueryService(self.store, self.approx_store, self._tokenizer_for, config.max_token_ids,
                                  behind=self.fleet.behind, adapters=self.lora, orphans=self.orphans.excluded)
        self.registrations = Registrations()
        self.shadows = Shadows.create(self.registry)  # what-if: every decision beside each policy's pick
        self.services = Services(config=config, metrics=self.metrics, query=self.query, fleet=self.fleet,
                                 pods=self.pods, decisions=Decisions(self.query, self.drift, self.metrics,
                                                     pod_census(self.fleet, self.store, self.approx_store),
                                                     tier_weights=config.tiers, shadow=self.shadows.hook(self.query)),
                                 whatif=self.shadows.whatif,
                                 drift=self.drift, token=token,
                                 engines=EngineRegistry(self.registrations, self.store, self.fleet, self.pods),
                                 state=(lambda: self.recovery.state_bytes()) if memory and not self.shards else None,
                                 before_metrics=self._refresh_gauges, store_problem=self._store_problem,
                                 loading=lambda: self.loading)
        self.route = None if config.ext_proc_port is None else self._wire_route(config)
        self.indexer = build_indexer(config, self.store, self.fleet, self.orphans, self.registry, token)
        self.registry.register(StateCollector(self._state_gauges))
        self.app = make_app(self.services, [*native_api.routes(), *dynamo.routes()])
        self.recovery = Recovery(config, index=self.index or new_precise_index(),
                                 approx=self.approx or ApproxIndex(config.approx), fleet=self.fleet, pods=self.pods,
                                 registrations=self.registrations, make_lane=self._make_lane, token=token,
                                 on_wal_error=lambda op: self.wal_errors.labels(op).inc(),
                                 on_snapshot_error=self.snapshot_errors.inc, on_peer_refused=self.metrics.peer_refused)
        self._runner: web.AppRunner | None = None
        self._http: HttpServer | None = None
        self._stopped = False
        self._drift_task: asyncio.Task[None] | None = None
        self._snapshot_task: asyncio.Task[None] | None = None
        self._fsync_task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.ext_proc_port: int | None = None

    def _wire_stores(self, config: Config) -> bool:
        """The stores of ``config.store`` (not opened yet), guarded unless in memory; True for memory."""
        self.stores = build_stores(config.store, config.approx,
                                   on_evict=lambda model: self.metrics.approx_evictions.labels(
                                       self.metrics.models.label(model)).inc(), lineage=config.dynamo_dump)
        self.guard = StoreGuard(self.stores, self.metrics, BurstLog(logging.getLogger("kvindex.store")))
        self.guard.on_lost = self._store_lost
        memory = is_memory(config.store)
        # the memory backend's own indexes (tests, snapshots, the write-ahead log); None with Redis
        self.index: AnyPrecise | None = self.stores.precise.index if memory else None  # type: ignore[attr-defined]
        self.approx: ApproxIndex | None = self.stores.approx.index if memory else None  # type: ignore[attr-defined]
        self.store = self.stores.precise if memory else Guarded(self.stores.precise, self.guard)
        self.approx_store = self.stores.approx if memory else Guarded(self.stores.approx, self.guard)
        return memory

    def _wire_route(self, config: Config) -> Any:
        """The request path (``kvindex.route``): Envoy's ext_proc port, built only when asked for."""
        from kvindex.route.build import build_route

        return build_route(config, self.fleet, self.pods, self.services.decisions, self.lora.base_of, self.registry,
                           self._client, lambda: self.loading is None and self._runner is not None, self.shadows)

    def _client(self) -> aiohttp.ClientSession:
        """The one HTTP client session (engines' /tokenize, /metrics), made on first use."""
        self._session = self._session or aiohttp.ClientSession()
        return self._session

    def _wire_shards(self, config: Config) -> Shards | None:
        """With ``workers`` >= 2: the worker processes (not started yet) and the store over them."""
        if config.workers < 2:
            return None
        settings = WorkerSettings(**asdict(LaneSettings.of(config)))  # a lane's settings, on the wire
        shards = Shards(config.workers, settings, on_failure=self._worker_failed)
        self.store = ShardedPreciseStore(shards.channels)
        self.index = None
        return shards

    def _worker_failed(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("%s; kvindex exits in %g s", reason, WORKER_EXIT_GRACE)
            asyncio.get_running_loop().call_later(WORKER_EXIT_GRACE, self._fatal.set)

    @property
    def restored_from(self) -> str | None:
        return self.recovery.restored_from

    @property
    def wal_degraded(self) -> bool:
        """A change the indexes hold is missing from the write-ahead log until the next snapshot."""
        return self.recovery.wal_degraded

    async def snapshot(self) -> None:
        await self.recovery.snapshot()

    def _make_lane(self, engine: EngineConfig) -> EngineLane:
        dialect = DIALECTS[engine.dialect]
        settings = LaneSettings.of(self.config)
        lane = EngineLane(engine, intake=self.intake, decoder=dialect.decoder(), first_seq=dialect.first_seq,
                          store=self.store, metrics=self.metrics, settings=settings, burst=self._burst,
                          ensure_open=self.guard.ensure_open)
        lane.writer.on_lora, lane.writer.lookahead = self.lora.learn_from_events, self.query.lookahead  # (lora: an adapter)
        return lane

    # -- the store's health --------------------------------------------------------------------
    def _store_lost(self) -> None:
        self.fleet.store_lost()

    def _store_problem(self) -> str | None:
        if self.loading is not None:
            return self.loading
        if self.guard.reopen_due:
            return f"store lost its state ({self.guard.reason}): resynchronising"
        if not self.guard.up:
            return f"store unavailable: {self.guard.reason}"
        return None

    async def _refresh_gauges(self) -> None:
        """Read the store-backed gauges (before a scrape); the store unreachable: keep the last.
        A shared store is read at most every ``SHARED_GAUGES_SECONDS`` (per-pod holdings are a
        scan of the pod's entries there; every replica's scrape would repeat it)."""
        self.fleet.flush_metrics()
        now = time.monotonic()
        if not is_memory(self.config.store) and now - self._gauges_at < SHARED_GAUGES_SECONDS:
            return
        if self.shards is not None and isinstance(self.registry, MergedRegistry):
            texts = await self.shards.ask_all(WorkerMetrics())
            self.registry.remote = [t.decode() for t in texts if isinstance(t, bytes)]
        try:
            self._gauges = (await self.pods.views(), await self.approx_store.entries())
            self._gauges_at = now
        except StoreUnavailable:
            pass  # kvindex_store_up says so

    def _tokenizer_for(self, model: str) -> Tokenizer | None:
        """The tokenizer of ``model``'s table (``[models."*"]`` for a model without one): one per
        configured table, never one per model name a request carries."""
        model = model if model in self.config.models else "*"
        if model not in self._tokenizers:
            mc = self.config.model(model)
            inner: Tokenizer | None = None
            if mc.tokenizer == "llmd-sim":
                inner = SimTokenizer()
            elif mc.tokenizer in ("engine", "render") and mc.tokenize_url:
                inner = (EngineTokenizer if mc.tokenizer == "engine" else RenderTokenizer)(mc.tokenize_url, self._client())
            cheap = isinstance(inner, SimTokenizer)  # tokenizing costs less than the cache key (C)
            self._tokenizers[model] = inner if cheap else CachingTokenizer(inner) if inner is not None else None
        return self._tokenizers[model]

    def _state_gauges(self) -> Iterable[Gauge]:
        views, approx_entries = self._gauges
        return state_gauges(views, approx_entries, self.metrics, self.drift, self.wal_degraded)

    async def start(self) -> None:
        self.recovery.lock()  # a second daemon on the state dir stops here (exit 2), before anything else
        await self.stores.open()  # StoreUnavailable: the store cannot be reached at start
        log.info("store: %s", describe(self.config.store))
        if self.shards is not None:
            await self.shards.start()
        for model, mc in self.config.models.items():
            if mc.block_size:
                await self.store.set_block_size(model, mc.block_size, configured=True)
        for engine in self.config.engines:
            if engine.model and engine.block_size:
                await self.store.set_block_size(engine.model, engine.block_size, configured=True)
        self.loading = self.recovery.loading_reason()
        await self._listen()  # HTTP first: while the state loads it answers 503 "loading"
        await self.recovery.restore()
        self.lora_pollers.start()
        self._drift_task = asyncio.create_task(self.drift.run(), name="drift re-check")
        if self.recovery.wal is not None:
            self._snapshot_task = asyncio.create_task(self.recovery.snapshot_loop(), name="snapshot timer")
            if self.config.fsync == "interval":
                self._fsync_task = asyncio.create_task(self.recovery.fsync_loop(), name="wal fsync timer")
        for engine in self.config.engines:
            self.fleet.add(engine.lane_key, engine)
        for reg in list(self.registrations.by_key.values()):
            self.fleet.add(reg.lane_key, reg.engine)
        if self.recovery.restored_from:  # restored pods no engine publishes for: in no answer
            await self.orphans.settle(self.store)
        self.loading = None
        if self.route is not None:
            self.ext_proc_port = await self.route.start(self.config.ext_proc_host or self.config.host,
                                                        self.config.ext_proc_port)
            log.info("request path: Envoy ext_proc (gRPC) on %s:%d", self.config.ext_proc_host or self.config.host,
                     self.ext_proc_port)
        if self.indexer is not None:  # SGLang's indexer API (kvindex.sglang)
            await self.indexer.start(self.config.grpc_host or self.config.host, self.config.grpc_port or 0)
        if self.index is not None and (why := core_missing()):
            log.warning("%s", why)
        log.info("kvindex listening on http://%s:%d with %d engine(s), at most %d connections; event loop %s; %s",
                 self.config.host, self.port, len(self.config.engines), self._http.max_connections if self._http else 0,
                 type(asyncio.get_running_loop()).__module__.split(".")[0], native.status())

    async def _listen(self) -> None:
        """The HTTP server: capped connections (``--max-connections``, else derived from the
        open-file limit, raised first), idle/header and body timeouts (``kvindex.http.server``)."""
        nofile = raise_nofile()
        cap = self.config.max_connections or connection_cap(nofile, len(self.config.engines))
        self._runner = web.AppRunner(self.app, **runner_options(self.config.idle_timeout))
        await self._runner.setup()
        front = FastPath(self.app, dynamo.fast_routes()) if self.config.http_fast_path else None
        self._http = HttpServer(self._runner, cap, self.metrics, front)
        self.port = await self._http.start(self.config.host, self.config.port)

    async def stop(self) -> None:
        """Undo whatever ``start()`` got to (all of it, part of it, or nothing); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        tasks = [t for t in (self._drift_task, self._snapshot_task, self._fsync_task) if t is not None]
        self._drift_task = self._snapshot_task = self._fsync_task = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.lora_pollers.stop()
        doors, self.route, self.indexer = [d for d in (self.route, self.indexer) if d is not None], None, None
        await asyncio.gather(*(d.stop(ROUTE_GRACE) for d in doors))  # calls in flight finish (GOAWAY), then tasks stop
        if self.recovery.wal is not None:  # while the lanes still hold their streams' watermarks
            await self.recovery.try_snapshot("final")  # (no log before the state was whole: no snapshot)
        try:
            await self.fleet.close()
        except Exception:
            log.exception("closing the engine lanes failed")
        http, self._http = self._http, None
        if http is not None:
            await http.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            try:
                await runner.cleanup()
            except Exception:
                log.exception("stopping the HTTP server failed")
        self.recovery.close()
        if self.shards is not None:
            await self.shards.stop()
        try:
            await self.stores.close()
        except Exception:
            log.exception("closing the store failed")
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        self.intake.close()
        log.info("kvindex stopped")

    async def run_forever(self, stop: asyncio.Event) -> None:
        """Start, serve until ``stop`` (or a fatal failure), stop. A stop during ``start()`` (SIGTERM
        while a big state loads) cancels the start: the process exits promptly, state untouched."""
        starting = asyncio.create_task(self.start(), name="start")
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self._fatal.wait())]
        try:
            await asyncio.wait([starting, *waits], return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                starting.result()  # start's error, if it failed
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (starting, *waits):
                t.cancel()
            await asyncio.gather(starting, *waits, return_exceptions=True)
            await self.stop()
        if self._fatal.is_set():
            raise ShardFailed(self.failure or "a worker died")
