"""What kvindex costs and gains in the request path: a real Envoy in front of simulated vLLM engines
(``kvindex.tools.openai_fleet``, in their own process), with kvindex (``kvindex serve
--ext-proc-port``, its own process) as the picker or the observer.

Measured in one run, configurations interleaved round by round so that the machine's noise falls
on all of them alike:
- **latency**, sequential, one keep-alive connection, 8k-token chat bodies (each request a new
  user turn after one of 8 tenants' system prompts): Envoy round-robin without ext_proc (the
  baseline), kvindex's picker (buffered body, and FULL_DUPLEX_STREAMED), kvindex's observer; p50
  and p99, and what each adds over the baseline;
- **latency under load**: ``wrk`` with 64 connections for each configuration (errors, p50, p99);
- **hit rate** on the Mooncake conversation trace (``../shared/traces``; each ``hash_id`` becomes
  the same 32 words every time, so a shared 512-token block of the trace is a shared 2-block
  prefix here): the trace's requests in order through Envoy round-robin and through kvindex's
  picker, each in front of its own fresh engines; realized hit rate = the engines' cached tokens /
  prompt tokens (their /metrics), and the observer's count of the round-robin run beside the
  engines' own.

``python benchmarks/gateway.py`` (about 3 minutes); ``--smoke`` runs a small version. JSON to
``benchmarks/results/gateway.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, free_port, latency_summary, machine  # noqa: E402
from kvindex.route.envoy import ENGINES_CLUSTER, EnvoyPlan, envoy_config  # noqa: E402
from kvindex.route.gateway import Envoy, find_envoy  # noqa: E402
from kvindex.tools.replay_gateway import prompt_of, whatif_table  # noqa: E402
from kvindex.tools.replay_routing import read_trace  # noqa: E402

MODEL = "bench-model"
TRACE = ROOT / "fixtures" / "traces" / "mooncake_conversation_trace.jsonl.gz"


class Proc:
    """A subprocess whose first stdout line is JSON (the engines) or that serves a URL (kvindex)."""

    def __init__(self, argv: list[str]) -> None:
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT, text=True)

    def first_line(self) -> str:
        assert self.p.stdout is not None
        return self.p.stdout.readline()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()


def start_engines(n: int, cache_blocks: int) -> tuple[Proc, list[dict[str, Any]]]:
    proc = Proc([sys.executable, "-m", "kvindex.tools.openai_fleet", "--replicas", str(n), "--model", MODEL,
                 "--cache-blocks", str(cache_blocks), "--metrics-padding-lines", "400"])
    return proc, json.loads(proc.first_line())["engines"]


def start_kvindex(engines: list[dict[str, Any]], tmp: Path, name: str) -> tuple[Proc, str, int]:
    http_port, ext = free_port(), free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(f'[server]\nport = {http_port}\next_proc_port = {ext}\n\n[models."{MODEL}"]\ntokenizer = "llmd-sim"\n'
                   '\n[route]\nseed = 1\n')
    argv = [sys.executable, "-m", "kvindex", "serve", "--config", str(cfg), "--log-level", "warning"]
    for e in engines:
        argv += ["--engine", f"endpoint={e['kv_endpoint']},replay={e['replay_endpoint']},pod={e['pod']},"
                             f"model={MODEL},block_size=16,url={e['url']}"]
    proc = Proc(argv)
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if get(url, "/readyz")[0] == 200:
                time.sleep(0.5)  # the first load scrapes and subscriptions
                return proc, url, ext
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("kvindex did not get ready")


def get(base: str, path: str) -> tuple[int, Any]:
    host, port = base.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, json.loads(body) if body and r.getheader("Content-Type", "").startswith("application/json") else body


def shape(mode: str, listen: int, ext: int, engines: list[dict[str, Any]], body: str = "buffered") -> dict[str, Any]:
    """The Envoy configuration of one measured setup; ``rr``: round-robin, no ext_proc at all."""
    urls = [e["url"] for e in engines]
    cfg = envoy_config(EnvoyPlan("observe" if mode == "rr" else mode, "127.0.0.1", listen, "127.0.0.1", ext, urls,
                                 picker_body=body))
    if mode == "rr":
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [f for f in hcm["http_filters"] if not f["name"].startswith("kvindex.")]
        cfg["static_resources"]["clusters"] = [c for c in cfg["static_resources"]["clusters"]
                                               if c["name"] == ENGINES_CLUSTER]
    return cfg


# -- request bodies ----------------------------------------------------------------------------
def chat_bodies(n: int, rng: random.Random) -> list[bytes]:
    """8k-token chat bodies: one of 8 tenants' 6,000-word system prompts, then a new 2,000-word turn."""
    tenants = [" ".join(f"t{t}w{i}" for i in range(6000)) for t in range(8)]
    return [json.dumps({"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": tenants[i % 8]},
        {"role": "user", "content": " ".join(f"q{i}x{rng.randrange(10**6)}" for _ in range(2000))}]}).encode()
        for i in range(n)]


def trace_bodies(limit: int) -> list[bytes]:
    """The trace's first requests as completions whose text blocks follow their hash_ids."""
    return [json.dumps({"model": MODEL, "prompt": prompt_of(req), "max_tokens": 1}).encode()
            for req in read_trace(TRACE, limit)]


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> int:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    return r.status


# -- the measurements --------------------------------------------------------------------------
def sequential(ports: dict[str, int], bodies: list[bytes], rounds: int) -> dict[str, dict[str, float]]:
    conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=30) for name, port in ports.items()}
    lat: dict[str, list[float]] = {name: [] for name in ports}
    names = list(ports)
    per = max(1, len(bodies) // rounds)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for body in bodies[r * per:(r + 1) * per]:
            for name in order:
                t = time.perf_counter()
                status = post(conns[name], "/v1/chat/completions", body)
                lat[name].append(time.perf_counter() - t)
                assert status == 200, (name, status)
    for c in conns.values():
        c.close()
    out = {name: latency_summary(v[len(v) // 10:]) for name, v in lat.items()}  # the first tenth warms up
    base = out["rr"]
    for name, s in out.items():
        s["added_p50_us"], s["added_p99_us"] = s["p50_us"] - base["p50_us"], s["p99_us"] - base["p99_us"]
    return out


def concurrent(ports: dict[str, int], body: bytes, seconds: int, tmp: Path, pause_ms: int) -> dict[str, Any]:
    """64 connections with ``wrk``: each pausing a random 0..2x``pause_ms`` between requests (a
    load this machine serves with headroom, arrivals spread out: the latency kvindex adds), and
    with no pause (saturated: what each setup can serve on these cores)."""
    if shutil.which("wrk") is None:
        return {"status": "skipped: wrk is not installed (apt-get install wrk)"}
    (tmp / "body.json").write_bytes(body)
    out: dict[str, Any] = {"pause_ms": pause_ms}
    for kind, pause in (("paced", pause_ms), ("saturated", 0)):
        script = tmp / f"post-{kind}.lua"
        script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                          f'local f = io.open("{tmp / "body.json"}", "rb")\nwrk.body = f:read("*a")\nf:close()\n'
                          + (f"function delay() return math.random(0, {2 * pause}) end\n" if pause else ""))
        runs: dict[str, Any] = {}
        for name, port in ports.items():
            res = subprocess.run(["wrk", "-t2", "-c64", f"-d{seconds}s", "--latency", "-s", str(script),
                                  f"http://127.0.0.1:{port}/v1/chat/completions"], capture_output=True, text=True)
            runs[name] = parse_wrk(res.stdout)
        for name, r in runs.items():
            r["added_p50_ms"] = r["p50_ms"] - runs["rr"]["p50_ms"]
            r["added_p99_ms"] = r["p99_ms"] - runs["rr"]["p99_ms"]
            r["throughput_vs_rr"] = r["requests"] / max(1, runs["rr"]["requests"])
        out[kind] = runs
    return out


def parse_wrk(text: str) -> dict[str, float]:
    def ms(v: str) -> float:
        n, unit = float(re.match(r"[\d.]+", v).group()), re.sub(r"[\d.]", "", v)  # type: ignore[union-attr]
        return n * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    got = {f"p{q}_ms": ms(m.group(1)) for q in (50, 99) if (m := re.search(rf"\s{q}%\s+(\S+)", text))}
    req = re.search(r"(\d+) requests in", text)
    errors = sum(int(x) for x in re.findall(r"(?:connect|read|write|timeout) (\d+)", text))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    return {**got, "requests": int(req.group(1)) if req else 0, "errors": errors + (int(non2xx.group(1)) if non2xx else 0)}


def engine_totals(engines: list[dict[str, Any]]) -> tuple[float, float]:
    prompt = cached = 0.0
    for e in engines:
        text = get(e["url"], "/metrics")[1].decode()
        prompt += float(re.search(r"^vllm:prompt_tokens_total\S* (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
        cached += float(re.search(r"^vllm:prefix_cache_hits_total\S* (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
    return prompt, cached


async def hit_rates(envoy: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The trace through Envoy round-robin (watched by kvindex) and through kvindex's picker."""
    bodies = trace_bodies(args.trace_requests)
    out: dict[str, Any] = {"requests": len(bodies), "engines": args.trace_engines, "cache_blocks": args.cache_blocks}
    for mode in ("observe", "pick"):
        eng_proc, engines = start_engines(args.trace_engines, args.cache_blocks)
        kv_proc, kv, ext = start_kvindex(engines, tmp, f"trace-{mode}")
        listen = free_port()
        env = Envoy(envoy, shape(mode, listen, ext, engines))
        try:
            await env.start()
            conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=60)
            t0 = time.perf_counter()
            for body in bodies:
                assert post(conn, "/v1/completions", body) == 200
            seconds = time.perf_counter() - t0
            conn.close()
            time.sleep(1.0)  # the observer's last records
            prompt, cached = engine_totals(engines)
            text = get(kv, "/metrics")[1].decode()
            source = "observe" if mode == "observe" else "pick"
            out[f"whatif_{mode}"] = get(kv, "/v1/whatif?window=86400")[1]
            out["round_robin" if mode == "observe" else "pick"] = {
                "hit_rate": cached / prompt, "prompt_tokens": prompt, "cached_tokens": cached, "seconds": seconds,
                "recorded": _metric(text, "kvindex_route_requests_total", f'outcome="recorded",source="{source}"'),
                "recorded_cached_tokens": _metric(text, "kvindex_decision_tokens_total",
                                                  f'kind="realized",source="{source}"'),
                "recorded_prompt_tokens": _metric(text, "kvindex_decision_tokens_total",
                                                  f'kind="prompt",source="{source}"'),
                "precise_predicted_tokens": _metric(text, "kvindex_decision_tokens_total",
                                                    f'kind="precise",source="{source}"')}
        finally:
            await env.stop()
            kv_proc.stop()
            eng_proc.stop()
    out["pick_over_round_robin"] = out["pick"]["hit_rate"] / out["round_robin"]["hit_rate"]
    return out


async def latency(envoy: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Sequential and concurrent latency of every setup, against two engines and one kvindex."""
    eng_proc, engines = start_engines(2, args.cache_blocks)
    kv_proc, kv, ext = start_kvindex(engines, tmp, "latency")
    shapes = {"rr": ("rr", "buffered"), "pick": ("pick", "buffered"), "pick_full_duplex": ("pick", "full-duplex"),
              "observe": ("observe", "buffered")}
    ports = {name: free_port() for name in shapes}
    envoys = [Envoy(envoy, shape(mode, ports[name], ext, engines, body)) for name, (mode, body) in shapes.items()]
    result: dict[str, Any] = {}
    try:
        for e in envoys:
            await e.start()
        bodies = chat_bodies(args.requests, random.Random(1))
        result["body_bytes"] = len(bodies[0])
        result["sequential"] = sequential(ports, bodies, args.rounds)
        status, text = get(kv, "/metrics")
        result["kvindex_pick_seconds_mean"] = _mean_metric(text.decode(), "kvindex_route_pick_seconds", 'source="pick"')
        result["concurrent_64"] = concurrent(ports, bodies[0], args.seconds, tmp, args.pause_ms)
    finally:
        for e in envoys:
            await e.stop()
        kv_proc.stop()
        eng_proc.stop()
    return result


async def main(args: argparse.Namespace) -> dict[str, Any]:
    envoy = find_envoy(None)
    version = subprocess.run([envoy, "--version"], capture_output=True, text=True).stdout.strip().split()[-1]
    tmp = Path(tempfile.mkdtemp(prefix="kvindex-bench-gw-"))
    result: dict[str, Any] = {"machine": machine(), "envoy": version, "args": vars(args)}
    if not args.skip_latency:
        result.update(await latency(envoy, args, tmp))
    if args.trace_requests:
        result["hit_rate"] = await hit_rates(envoy, args, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def _metric(text: str, name: str, labels: str) -> float:
    """The sample of ``name`` whose labels are ``labels`` (in any order), 0 if none."""
    want = set(labels.split(","))
    for m in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)", text, re.M):
        if set(m.group(1).split(",")) == want:
            return float(m.group(2))
    return 0.0


def _mean_metric(text: str, name: str, label: str) -> float | None:
    s = re.search(rf"{name}_sum{{{label}}} (\S+)", text)
    c = re.search(rf"{name}_count{{{label}}} (\S+)", text)
    return float(s.group(1)) / float(c.group(1)) if s and c and float(c.group(1)) else None


def report(r: dict[str, Any]) -> None:
    if "sequential" in r:
        report_latency(r)
    h = r.get("hit_rate")
    if h:
        report_hit_rate(h)


def report_latency(r: dict[str, Any]) -> None:
    print(f"Envoy {r['envoy']}, body {r['body_bytes']} bytes (8k tokens), sequential, one connection:")
    print(f"  {'setup':<18} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}")
    for name, s in r["sequential"].items():
        print(f"  {name:<18} {s['p50_us'] / 1e3:8.3f} {s['p99_us'] / 1e3:8.3f} {s['added_p50_us'] / 1e3:8.3f} "
              f"{s['added_p99_us'] / 1e3:8.3f}")
    if r.get("kvindex_pick_seconds_mean") is not None:
        print(f"  kvindex's own time per pick (tokenize, both indexes, score): {r['kvindex_pick_seconds_mean'] * 1e3:.3f} ms")
    c = r["concurrent_64"]
    if "status" in c:
        print(f"64 connections: {c['status']}")
    else:
        for kind, title in (("paced", f"each pausing {c['pause_ms']} ms on average between requests"),
                            ("saturated", "no pause")):
            print(f"64 connections (wrk, one fixed body), {title}:")
            for name, s in c[kind].items():
                print(f"  {name:<18} p50 {s.get('p50_ms', float('nan')):7.3f} ms  p99 {s.get('p99_ms', float('nan')):7.3f} ms  "
                      f"+p50 {s['added_p50_ms']:7.3f} ms  +p99 {s['added_p99_ms']:7.3f} ms  {s['requests']} requests "
                      f"({s['throughput_vs_rr']:.2f}x rr), {s['errors']} errors")


def report_hit_rate(h: dict[str, Any]) -> None:
    rr, pk = h["round_robin"], h["pick"]
    print(f"Mooncake trace, {h['requests']} requests, {h['engines']} engines of {h['cache_blocks']} blocks:")
    print(f"  realized hit rate: round-robin {rr['hit_rate']:.3f}, kvindex pick {pk['hit_rate']:.3f} "
          f"({h['pick_over_round_robin']:.2f}x)")
    print(f"  the observer behind round-robin recorded {rr['recorded']:.0f}/{h['requests']} requests, cached tokens "
          f"{rr['recorded_cached_tokens']:.0f} (the engines counted {rr['cached_tokens']:.0f}), prompt tokens "
          f"{rr['recorded_prompt_tokens']:.0f} ({rr['prompt_tokens']:.0f})")
    print(f"  the picker recorded {pk['recorded']:.0f}/{h['requests']}, cached tokens {pk['recorded_cached_tokens']:.0f} "
          f"(engines {pk['cached_tokens']:.0f}); its precise prediction summed {pk['precise_predicted_tokens']:.0f}")
    print("behind round-robin, " + whatif_table(h["whatif_observe"]))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300, help="sequential requests per setup (default 300)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--seconds", type=int, default=8, help="wrk seconds per setup (default 8)")
    p.add_argument("--pause-ms", type=int, default=250, help="each wrk connection's pause between requests in the "
                   "paced run (default 250: about 250 requests/s from 64 connections)")
    p.add_argument("--trace-requests", type=int, default=3000, help="Mooncake requests replayed (default 3000; 0: none)")
    p.add_argument("--trace-engines", type=int, default=8)
    p.add_argument("--cache-blocks", type=int, default=4096, help="KV blocks (16 tokens) per engine (default 4096)")
    p.add_argument("--skip-latency", action="store_true", help="only the hit rates on the trace")
    p.add_argument("--smoke", action="store_true", help="a small run (CI): 30 requests, 2 s of wrk, 200 trace requests")
    p.add_argument("--out", type=Path, default=RESULTS / "gateway.json")
    a = p.parse_args()
    if a.smoke:
        a.requests, a.rounds, a.seconds, a.trace_requests = 30, 3, 2, 200
    res = asyncio.run(main(a))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    report(res)
    print(f"wrote {a.out}")
