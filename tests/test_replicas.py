"""Two kvindex replicas on one Redis, fed the recorded real-vLLM captures (issue #7, "Must pass in CI").

Real parts only: one ``redis-server`` per test (tests/redis_server.py, killed and restarted at
will), two ``python -m kvindex serve --store <url>`` processes, and one engine publisher — the
``FakeEngine`` of ``kvindex replay`` (a PUB socket plus vLLM's replay ROUTER) on ipc:// sockets —
publishing a capture step by step so that, before each recorded request, exactly the events vLLM
had published before that request are out. Both replicas subscribe to that publisher.

The truth compared with is the engine's own ``cached_tokens`` from the capture's ``meta.json``
(the requests ``tests/test_precise_fixtures.predictable`` keeps), never kvindex's own state.
Every wait and every sampling loop is bounded in count and in time.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvindex.tools.capture import Captured, load_capture
from kvindex.tools.fake_engine import FakeEngine
from tests.conftest import FIXTURES, ROOT, ipc_endpoint
from tests.faultkit import free_port, http, pods, serve, stop, wait_until
from tests.redis_server import RedisServer
from tests.test_precise_fixtures import predictable, requests_in_order

MODEL = "tiny"  # the captures' served model name (topic kv@<pod>@tiny)


# -- the engine: a vLLM-shaped publisher on its own event loop -----------------------------------
class Engine:
    """``FakeEngine`` on a thread of its own, so that the test's blocking HTTP calls never delay the
    replay answers a replica asks for. A seq that goes back (the capture's engine restart) forgets
    the replay history, as a restarted vLLM does."""

    def __init__(self, pub: str, replay: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine", daemon=True)
        self.thread.start()
        self.fake = FakeEngine(pub, replay_endpoint=replay)
        self._run(self.fake.start())
        self.last_seq: dict[str, int] = {}

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def publish(self, c: Captured) -> None:
        pod, seq = pod_of(c), int.from_bytes(c.frames[1], "big")
        if seq <= self.last_seq.get(pod, -1):
            self._run(self._forget())
        self._run(self.fake.publish(c.frames))
        self.last_seq[pod] = seq

    def wait_subscribers(self, n: int) -> None:
        """Until ``n`` SUB sockets are subscribed (what is published next reaches them all)."""
        self._run(self.fake.wait_subscribers(n, timeout=8))

    async def _forget(self) -> None:
        """On the engine's loop, so that no replay answer is iterating over the history meanwhile."""
        self.fake.clear_buffer()

    def close(self) -> None:
        try:
            self._run(self.fake.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()


def pod_of(c: Captured) -> str:
    return c.frames[0].decode().split("@")[1]


# -- the fleet: one Redis, two replicas, one engine -----------------------------------------------
@dataclass
class Fleet:
    """The processes of one test: replicas by name ("a", "b"), each keeping its port across restarts."""

    tmp: Path
    redis: RedisServer
    engine: Engine
    spec: str
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str) -> int:
        port = self.ports.setdefault(name, free_port())
        self.procs[name] = serve(port, "--store", self.redis.url, "--engine", self.spec, log=self.tmp / f"{name}.log")
        return port

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    @property
    def live(self) -> list[int]:
        return [self.ports[n] for n in self.procs]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    redis = RedisServer(tmp_path / "redis").start()
    engine = Engine(ipc_endpoint(tmp_path, "pub"), ipc_endpoint(tmp_path, "replay"))
    f = Fleet(tmp_path, redis, engine, f"endpoint={engine.fake.endpoint},replay={engine.fake.replay_address},model={MODEL}")
    try:
        for name in ("a", "b"):
            f.start(name)
        for port in f.live:  # both SUB sockets connected, and both subscriptions reached the engine
            wait_until(lambda: not any("not connected" in r for r in http(f"http://127.0.0.1:{port}/readyz")[1]
                                       .get("reasons", [])), 10, f"replica :{port} connected")
        engine.wait_subscribers(len(f.live))
        yield f
    finally:
        if redis.proc is not None:
            redis.proc.send_signal(signal.SIGCONT)  # a test that failed during a cut: let replicas stop quickly
        for name in list(f.procs):
            stop(f.procs.pop(name))
        engine.close()
        redis.stop()


# -- publishing and asking ------------------------------------------------------------------------
class Stream:
    """A capture published in order, up to each request's send time."""

    def __init__(self, capture: str, engine: Engine) -> None:
        self.captured = load_capture(FIXTURES / capture / "events.jsonl")
        self.engine = engine
        self.pos = 0

    def publish_until(self, t: float) -> dict[str, int]:
        """Publish every message recorded before ``t``; the last seq published per pod."""
        while self.pos < len(self.captured) and self.captured[self.pos].t < t:
            self.engine.publish(self.captured[self.pos])
            self.pos += 1
        return dict(self.engine.last_seq)

    def publish_rest(self) -> dict[str, int]:
        return self.publish_until(float("inf"))


def wait_applied(ports: list[int], seqs: dict[str, int], timeout: float = 10.0) -> None:
    def done() -> bool:
        return all((pods(port).get(pod) or {}).get("last_seq") == seq for port in ports for pod, seq in seqs.items())
    wait_until(done, timeout, f"replicas {ports} to apply {seqs}")


def ask(port: int, r: dict[str, Any], endpoint: str) -> tuple[int, Any]:
    """``endpoint`` (/query or /v1/score) for request ``r``: (200, matched tokens) or (status, error body)."""
    pod = r["server"].split("//")[1]
    url = f"http://127.0.0.1:{port}{endpoint}"
    if endpoint == "/query":
        status, q = http(url, "POST", {"token_ids": r["prompt_token_ids"], "model_name": MODEL})
        return status, q["instances"].get(pod, {}).get("longest_matched", 0) if status == 200 else q
    status, s = http(url, "POST", {"model": MODEL, "token_ids": r["prompt_token_ids"], "pods": [pod]})
    return status, s["pods"][pod]["precise"]["tokens"] if status == 200 else s


ENDPOINTS = ("/query", "/v1/score")


def precise(port: int, r: dict[str, Any]) -> list[tuple[int, Any]]:
    return [ask(port, r, endpoint) for endpoint in ENDPOINTS]


def assert_exact(ports: list[int], r: dict[str, Any]) -> None:
    for port in ports:
        assert precise(port, r) == [(200, r["cached_tokens"])] * 2, (port, r["i"], r["cached_tokens"])


def is_503_with_reason(status: int, body: Any) -> bool:
    return status == 503 and isinstance(body, dict) and bool(str(body.get("error") or "").strip())


# -- a. and b.: either replica answers exactly; one SIGKILLed, the other carries on ---------------
@pytest.mark.parametrize("capture", ["small", "reset_restart"])
def test_either_replica_answers_cached_tokens_and_one_survives_sigkill_of_the_other(capture: str, fleet: Fleet) -> None:
    stream = Stream(capture, fleet.engine)
    wanted = {r["i"] for r in predictable(capture)}
    reqs = requests_in_order(capture)
    kill_at = reqs[len(reqs) // 2]["t_sent"]
    checked = {"a": 0, "b": 0}
    for r in reqs:
        if "a" in fleet.procs and r["t_sent"] >= kill_at:
            fleet.kill("a")  # mid-stream: half the capture is still to come
        wait_applied(fleet.live, stream.publish_until(r["t_sent"]))
        if r["i"] in wanted:
            assert_exact(fleet.live, r)
            for name in fleet.procs:
                checked[name] += 1
    assert "a" not in fleet.procs and checked["a"] >= 8 and checked["b"] == len(wanted), checked
    wait_applied(fleet.live, stream.publish_rest())  # b kept ingesting to the end of the capture
    assert all(v["synced"] for v in pods(fleet.ports["b"]).values())


# -- c.: routers share beliefs ------------------------------------------------------------------
def approx_of(port: int, body: dict[str, Any], pod: str) -> dict[str, Any]:
    status, s = http(f"http://127.0.0.1:{port}/v1/score", "POST", {**body, "pods": [pod]})
    assert status == 200, s
    return s["pods"][pod]["approx"]


def decide(port: int, body: dict[str, Any], pod: str) -> dict[str, Any]:
    status, d = http(f"http://127.0.0.1:{port}/v1/decisions", "POST", {"pod": pod, "request": body})
    assert status == 200, d
    return d


def openai_body(r: dict[str, Any]) -> dict[str, Any]:
    """The request as the router sent it to vLLM (chat or completions)."""
    return {"model": MODEL, **{k: r[k] for k in ("messages", "prompt") if k in r}}


def test_a_decision_posted_to_one_replica_changes_the_others_approx_scores(fleet: Fleet) -> None:
    reqs = requests_in_order("small")
    pod = reqs[0]["server"].split("//")[1]
    one, two = (openai_body(r) for r in reqs if r["i"] in (0, 2))  # two tenants: no prefix in common
    a, b = fleet.ports["a"], fleet.ports["b"]
    assert approx_of(a, one, pod)["score"] == approx_of(b, one, pod)["score"] == 0
    decide(a, one, pod)
    seen_by_b = approx_of(b, one, pod)
    assert seen_by_b["score"] > 0 and seen_by_b == approx_of(a, one, pod)
    assert approx_of(b, two, pod)["score"] == 0  # a belief about that prompt, not about the pod
    decide(b, two, pod)  # and the other way round
    assert approx_of(a, two, pod) == approx_of(b, two, pod) and approx_of(a, two, pod)["score"] > 0
    fleet.kill("a")  # a router replica that restarts loses nothing
    fleet.start("a")
    assert approx_of(fleet.ports["a"], one, pod) == seen_by_b


# -- d.: Redis killed and restarted (or cut off) mid-stream ---------------------------------------
@dataclass(frozen=True)
class Outage:
    """How the store goes away and comes back, and how many answers to sample while it is away."""

    down: Callable[[RedisServer], None]
    up: Callable[[RedisServer], None]
    requests: int  # recorded requests whose events are published while the store is away
    samples: int  # answers per endpoint and replica for each of them


OUTAGES = {
    # a crash: the new server is empty, so every replica must resynchronise through engine replay
    "killed_restarted_empty": Outage(lambda r: r.stop(signal.SIGKILL), lambda r: r.start(), requests=5, samples=6),
    # a network cut: nothing answers (each call ends at kvindex's socket timeout), nothing is lost
    "cut_then_back": Outage(lambda r: r.proc.send_signal(signal.SIGSTOP), lambda r: r.proc.send_signal(signal.SIGCONT),
                            requests=2, samples=1),
}
SAMPLE_LIMIT, SAMPLE_SECONDS = 600, 30.0


def sample(ports: list[int], r: dict[str, Any], seen: dict[str, int], *, down: bool) -> bool:
    """One answer per endpoint per replica for ``r`` (asked concurrently); each must be 503 with a
    reason or exact (only a 503 while the store is away). True when every answer was exact."""
    asks = [(port, endpoint) for port in ports for endpoint in ENDPOINTS]
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda pe: ask(pe[0], r, pe[1]), asks))
    exact = True
    for (port, endpoint), (status, value) in zip(asks, answers):
        if status == 200 and value == r["cached_tokens"] and not down:
            seen["exact"] += 1
            continue
        assert is_503_with_reason(status, value), (f"request {r['i']} {endpoint} on :{port} while the store is "
                                                   f"{'away' if down else 'back'}: {status} {value!r}, "
                                                   f"engine cached {r['cached_tokens']}")
        seen["503"] += 1
        exact = False
    return exact


def converge(ports: list[int], r: dict[str, Any], seen: dict[str, int]) -> None:
    """Sample ``r`` continuously until both replicas answer it exactly (bounded)."""
    deadline = time.monotonic() + SAMPLE_SECONDS
    for _ in range(SAMPLE_LIMIT):
        if sample(ports, r, seen, down=False):
            return
        assert time.monotonic() < deadline, f"no convergence in {SAMPLE_SECONDS}s: {seen}"
        time.sleep(0.02)
    raise AssertionError(f"no convergence in {SAMPLE_LIMIT} samples: {seen}")


@pytest.mark.parametrize("outage", sorted(OUTAGES))
def test_redis_away_mid_stream_never_a_wrong_answer_then_converges(outage: str, fleet: Fleet) -> None:
    how = OUTAGES[outage]
    stream = Stream("small", fleet.engine)
    reqs = requests_in_order("small")
    first_down = 6
    away = reqs[first_down:first_down + how.requests]
    seen = {"exact": 0, "503": 0}
    for r in reqs[:first_down]:
        wait_applied(fleet.live, stream.publish_until(r["t_sent"]))
        assert_exact(fleet.live, r)
    how.down(fleet.redis)
    for r in away:
        stream.publish_until(r["t_sent"])  # the engine goes on while the store is away
        for _ in range(how.samples):
            sample(fleet.live, r, seen, down=True)
    status, ready = http(f"http://127.0.0.1:{fleet.ports['a']}/readyz")
    assert status == 503 and ready["reasons"], ready
    assert seen == {"exact": 0, "503": how.requests * how.samples * 2 * 2}, seen
    how.up(fleet.redis)
    converge(fleet.live, away[-1], seen)  # sampled all through the resync
    for r in reqs[first_down + how.requests:]:
        wait_applied(fleet.live, stream.publish_until(r["t_sent"]))
        converge(fleet.live, r, seen)  # exact now, or 503 while a resync is still running
    assert seen["exact"] >= (len(reqs) - first_down - how.requests + 1) * 2 * 2, seen
    wait_applied(fleet.live, stream.publish_rest())
    for port in fleet.live:
        wait_until(lambda: http(f"http://127.0.0.1:{port}/readyz")[0] == 200, 10, f"replica :{port} ready again")


# -- the replica benchmark runs end to end, every answer right (no timings asserted) ------------
def test_replica_benchmark_smoke_run_answers_every_request_right(tmp_path: Path) -> None:
    out = tmp_path / "replicas.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "replicas.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert set(doc["setups"]) == {"memoryx1", "redisx1", "redisx3", "clusterx1"} and doc["machine"]["cores"]
    for name, res in doc["setups"].items():
        assert set(res["load"]) == {"/v1/score", "/query"}, name
        for r in res["load"].values():
            assert r["ok"] == r["requests"] > 0 and r["wrong"] == r["errors"] == r["rounds_wrong_or_errors"] == 0, (name, r)
    assert {"redis_x3_over_redis_x1", "redis_x1_over_memory_x1", "cluster_x1_over_redis_x1"} <= set(doc["ratios"]["/v1/score"])
    assert "3 replicas / 1 replica" in proc.stdout and "cores on this machine" in proc.stdout
