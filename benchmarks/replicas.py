"""Aggregate query throughput of kvindex replicas sharing one Redis, against one replica (issue #7 §5).

  python benchmarks/replicas.py [--smoke] [--out FILE]

Per configuration — one replica on the memory store (the in-memory reference of the same run), one
replica on Redis, three replicas on the same Redis — it starts one ``redis-server`` (TCP on
127.0.0.1, persistence off; tests/redis_server.py), the workload's engine publishers (one process,
benchmarks/e2e.py ``publish``: one PUB socket per engine on tcp://127.0.0.1) and the replicas
(``python -m kvindex serve --store URL``, each subscribed to every publisher), pre-loads them
through ingest, then runs a separate load-client process: a closed loop of ``--concurrency``
requests in flight, ``--count`` requests in all, spread round-robin over the replicas, first on
``/v1/score`` then on ``/query`` (8k-token queries from benchmarks/common.py). It prints
requests/s per configuration and the ratios, and writes JSON to benchmarks/results/.

Invariants: every answer the client gets is compared with the workload generator's expectation
(matched tokens per pod); a run with a non-200 answer or a wrong one is reported as such, never as a
throughput. Only loopback sockets are used; every process started here is stopped here. This
machine has few cores (2 where this was written): the client, Redis and every replica share them,
which caps what three replicas can add — the output says how many cores there were.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import count as counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import e2e  # noqa: E402

from tests.faultkit import cpu_seconds, free_port, http, pods, serve, stop, wait_until  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

ENDPOINTS = ("/v1/score", "/query")


@dataclass(frozen=True, slots=True)
class Setup:
    """One measured configuration: a store and how many kvindex replicas share it."""

    store: str  # "memory" or "redis"
    replicas: int

    @property
    def name(self) -> str:
        return f"{self.store}x{self.replicas}"


SETUPS = (Setup("memory", 1), Setup("redis", 1), Setup("redis", 3))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pods", type=int, default=8, help="engine replicas in the workload (default 8)")
    p.add_argument("--blocks", type=int, default=200_000, help="block-ops in the workload (default 200k)")
    p.add_argument("--queries", type=int, default=16, help="distinct 8k-token queries (default 16)")
    p.add_argument("--count", type=int, default=2000, help="requests per endpoint and configuration")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (closed loop)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (well under a minute), for CI")
    p.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/replicas-<timestamp>.json)")
    a = p.parse_args(argv)
    if a.smoke:
        a.pods, a.blocks, a.queries, a.count, a.concurrency = 4, 20_000, 4, 120, 8
    return a


# -- the load client (its own process) --------------------------------------------------------------
def expected_tokens(queries: list[dict]) -> list[dict[str, int]]:
    """Per query: matched tokens per pod ("1".."N") the generator says a precise index must report."""
    return [{str(i + 1): b * common.BLOCK_SIZE for i, b in enumerate(q["expected"]) if b} for q in queries]


async def load(urls: list[str], endpoint: str, queries: list[dict], total: int, concurrency: int) -> dict:
    """Closed loop: ``concurrency`` workers take request numbers until ``total``; request n goes to
    ``urls[n % len(urls)]`` with query ``n % len(queries)``. Every answer is checked."""
    import aiohttp

    bodies = [e2e._bodies("kvindex", q["token_ids"])[endpoint] for q in queries]
    truth = expected_tokens(queries)
    numbers = counter()
    tally = {"ok": 0, "wrong": 0, "errors": 0}
    latencies: list[float] = []
    hdr = {"Content-Type": "application/json"}

    async def worker(s: aiohttp.ClientSession) -> None:
        while (n := next(numbers)) < total:
            q = n % len(bodies)
            t0 = time.perf_counter()
            async with s.post(urls[n % len(urls)] + endpoint, data=bodies[q], headers=hdr) as r:
                raw = await r.read()
            latencies.append(time.perf_counter() - t0)
            if r.status != 200:
                tally["errors"] += 1
            else:
                tally["ok" if e2e._matched(endpoint, json.loads(raw)) == truth[q] else "wrong"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        for q in range(min(len(bodies), concurrency)):  # warm connections and caches, untimed
            async with s.post(urls[q % len(urls)] + endpoint, data=bodies[q], headers=hdr) as r:
                await r.read()
        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"endpoint": endpoint, "requests": total, "seconds": seconds, "requests_per_s": total / seconds,
            "concurrency": concurrency, **tally, "latency": common.latency_summary(latencies),
            "client_cpu_fraction": cpu / seconds}


def run_client(urls: list[str], queries_file: Path, total: int, concurrency: int, servers: dict[str, int]) -> list[dict]:
    """The load client as a separate process (so its CPU is not the replicas'); one result per endpoint,
    with the CPU seconds each server process (``servers``: name -> pid) spent meanwhile."""
    out = []
    for endpoint in ENDPOINTS:
        cpu0 = {name: cpu_seconds(pid) for name, pid in servers.items()}
        cmd = [sys.executable, str(Path(__file__).resolve()), "client", "--urls", ",".join(urls), "--endpoint",
               endpoint, "--queries-file", str(queries_file), "--count", str(total), "--concurrency", str(concurrency)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"load client exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        res = json.loads(proc.stdout)
        res["server_cpu_seconds"] = {name: cpu_seconds(pid) - cpu0[name] for name, pid in servers.items()}
        out.append(res)
    return out


# -- one configuration ------------------------------------------------------------------------------
def pod_of(wl: common.Workload, topic: str) -> str:
    """The pod id of a workload topic: "1".."N" in replica order, the names the expectations use."""
    return str(wl.topics.index(topic) + 1)


def engine_args(wl: common.Workload, pub: e2e.Publisher) -> list[str]:
    """One ``--engine`` per publisher socket (no replay endpoint: the publisher has none)."""
    out = []
    for topic, ep in zip(pub.topics, pub.endpoints):
        out += ["--engine", f"endpoint={ep},pod={pod_of(wl, topic)},model={common.MODEL},block_size={common.BLOCK_SIZE}"]
    return out


def preload(ports: list[int], pub: e2e.Publisher, wl: common.Workload, timeout: float) -> dict:
    """Connect, publish the whole workload once, wait until every replica reports every pod's last seq."""
    for port in ports:
        wait_until(lambda: not any("not connected" in r for r in http(f"http://127.0.0.1:{port}/readyz")[1]
                                   .get("reasons", [])), 20, f"replica :{port} connected")
    time.sleep(1.0)  # subscriptions reach the publishers (no replay endpoint here: nothing may be dropped)
    want = {pod_of(wl, t): seq for t, seq in wl.last_seqs().items()}
    t0 = time.perf_counter()
    pub.go()
    pub.sent()
    wait_until(lambda: all({p: (pods(port).get(p) or {}).get("last_seq") for p in want} == want for port in ports),
               timeout, "every replica to reach the last seq of every pod")
    views = [pods(port) for port in ports]
    return {"seconds": time.perf_counter() - t0, "block_ops": wl.block_ops,
            "unsynced": sum(not v["synced"] for view in views for v in view.values()),
            "gaps": sum(v.get("gaps") or 0 for view in views for v in view.values())}


def run_setup(setup: Setup, wl: common.Workload, qfile: Path, args: argparse.Namespace, tmp: Path) -> dict:
    """Redis (if any), publishers and replicas up; preload; the load client; everything stopped."""
    redis = RedisServer(tmp / setup.name / "redis", port=free_port()).start() if setup.store == "redis" else None
    store = ["--store", redis.url] if redis else []  # memory: the default store
    pub = e2e.Publisher(wl.path)
    procs, ports = [], [free_port() for _ in range(setup.replicas)]
    try:
        for i, port in enumerate(ports):
            procs.append(serve(port, *store, *engine_args(wl, pub), log=tmp / f"{setup.name}-{i}.log"))
        res: dict = {"store": setup.store, "replicas": setup.replicas, "store_url": redis.url if redis else "memory://"}
        res["ingest"] = preload(ports, pub, wl, timeout=max(60.0, wl.block_ops / 2000))
        servers = {f"kvindex-{i}": p.pid for i, p in enumerate(procs)}
        if redis is not None and redis.proc is not None:
            servers["redis"] = redis.proc.pid
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        res["load"] = {r["endpoint"]: r for r in run_client(urls, qfile, args.count, args.concurrency, servers)}
        return res
    finally:
        for p in procs:
            stop(p)
        pub.close()
        if redis is not None:
            redis.stop()


# -- the whole run ----------------------------------------------------------------------------------
def ratios(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per endpoint: redis x3 over redis x1 (the replica figure) and redis x1 over memory x1."""
    def rps(name: str, ep: str) -> float:
        return results[name]["load"][ep]["requests_per_s"]
    return {ep: {"redis_x3_over_redis_x1": rps("redisx3", ep) / rps("redisx1", ep),
                 "redis_x3_over_memory_x1": rps("redisx3", ep) / rps("memoryx1", ep),
                 "redis_x1_over_memory_x1": rps("redisx1", ep) / rps("memoryx1", ep)} for ep in ENDPOINTS}


def table(doc: dict) -> str:
    cores = doc["machine"]["cores"]
    lines = [f"kvindex replicas on one Redis: aggregate query throughput ({cores} cores on this machine, shared by "
             f"the load client, Redis and every replica)",
             f"workload: {doc['args']['pods']} pods, {doc['workload']['block_ops']} block-ops, 8k-token queries; "
             f"{doc['args']['count']} requests per endpoint, {doc['args']['concurrency']} in flight", ""]
    lines.append(f"{'setup':<10} {'endpoint':<10} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'ok':>6} {'wrong':>6} "
                 f"{'errors':>6}  cores busy: client, kvindex (sum), redis")
    for name, res in doc["setups"].items():
        for ep, r in res["load"].items():
            lat, cpu = r["latency"], r["server_cpu_seconds"]
            kv = sum(v for k, v in cpu.items() if k.startswith("kvindex")) / r["seconds"]
            lines.append(f"{name:<10} {ep:<10} {r['requests_per_s']:>9.1f} {lat['p50_us'] / 1e3:>8.2f} "
                         f"{lat['p99_us'] / 1e3:>8.2f} {r['ok']:>6} {r['wrong']:>6} {r['errors']:>6}  "
                         f"{r['client_cpu_fraction']:.2f}, {kv:.2f}, {cpu.get('redis', 0.0) / r['seconds']:.2f}")
    lines.append("")
    for ep, row in doc["ratios"].items():
        lines.append(f"{ep:<10} 3 replicas / 1 replica (Redis): {row['redis_x3_over_redis_x1']:.2f}x   "
                     f"1 replica Redis / memory: {row['redis_x1_over_memory_x1']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    wl = common.workload(args.pods, args.blocks)
    queries = common.pick_queries(wl, args.queries)
    doc: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": common.machine(),
                 "note": f"{os.cpu_count()} cores: the load client, Redis and all replicas run on them",
                 "args": {k: v for k, v in vars(args).items() if k != "out"},
                 "workload": {"file": wl.path.name, "block_ops": wl.block_ops, "pods": wl.replicas}, "setups": {}}
    with tempfile.TemporaryDirectory(prefix="kvi-replicas-") as tmp:
        qfile = Path(tmp) / "queries.json"
        qfile.write_text(json.dumps(queries))
        for setup in SETUPS:
            print(f"... {setup.name}", file=sys.stderr, flush=True)
            doc["setups"][setup.name] = run_setup(setup, wl, qfile, args, Path(tmp))
    doc["ratios"] = ratios(doc["setups"])
    doc["seconds"] = time.time() - t0
    out = args.out or common.RESULTS / f"replicas-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(table(doc))
    print(f"\nresults: {out}")
    return doc


def client_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="replicas.py client", description="the closed-loop load client")
    p.add_argument("--urls", required=True, help="comma-separated replica base URLs")
    p.add_argument("--endpoint", choices=ENDPOINTS, required=True)
    p.add_argument("--queries-file", type=Path, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--concurrency", type=int, required=True)
    a = p.parse_args(argv)
    queries = json.loads(a.queries_file.read_text())
    print(json.dumps(asyncio.run(load(a.urls.split(","), a.endpoint, queries, a.count, a.concurrency))))


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        client_main(sys.argv[2:])
    else:
        main()
