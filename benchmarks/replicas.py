"""Aggregate query throughput of kvindex replicas sharing one Redis, against one replica (issue #7 §5).

  python benchmarks/replicas.py [--smoke] [--out FILE]

Four configurations run side by side — one replica on the memory store (the in-memory reference
of the same run), one replica on its own Redis, three replicas sharing another Redis, one replica on
a 3-master Redis Cluster (``redis+cluster://``, issue 39 §1) — each Redis a ``redis-server`` on
TCP 127.0.0.1 with persistence off (tests/redis_server.py), each replica a
``python -m kvindex serve [--store URL]`` subscribed to every engine publisher of one process
(benchmarks/e2e.py ``publish``: one PUB socket per engine on tcp://127.0.0.1). All six replicas
are pre-loaded through ingest from that one publisher. Then, ``--rounds`` times, each
configuration in turn gets a separate load-client process: a closed loop of ``--concurrency``
requests in flight, ``--count`` requests in all, spread round-robin over the configuration's
replicas, on ``/v1/score`` then on ``/query`` (8k-token queries from benchmarks/common.py).
Interleaving the rounds spreads the other tenants of a shared machine over all configurations
alike; the figure per configuration is the median round. It prints requests/s, the CPU each
process used (and what the rest of the machine used meanwhile) and the ratios, and writes JSON to
benchmarks/results/.

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
from dataclasses import dataclass, field
from itertools import count as counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
import e2e  # noqa: E402

from tests.faultkit import cpu_seconds, free_port, http, pods, serve, stop, wait_until  # noqa: E402
from tests.redis_server import RedisClusterServers, RedisServer  # noqa: E402

ENDPOINTS = ("/v1/score", "/query")


@dataclass(frozen=True, slots=True)
class Setup:
    """One measured configuration: a store and how many kvindex replicas share it."""

    store: str  # "memory", "redis" (one server) or "cluster" (a 3-master Redis Cluster)
    replicas: int

    @property
    def name(self) -> str:
        return f"{self.store}x{self.replicas}"


SETUPS = (Setup("memory", 1), Setup("redis", 1), Setup("redis", 3), Setup("cluster", 1))


@dataclass
class Running:
    """A configuration's processes: its Redis (none for memory) and its replicas."""

    setup: Setup
    redis: RedisServer | RedisClusterServers | None
    ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def pids(self) -> dict[str, int]:
        out = {f"kvindex-{i}": p.pid for i, p in enumerate(self.procs)}
        nodes = self.redis.nodes if isinstance(self.redis, RedisClusterServers) else [self.redis] if self.redis else []
        for i, node in enumerate(nodes):  # every Redis process's CPU counts as "redis"
            if node.proc is not None:
                out["redis" if i == 0 else f"redis-{i}"] = node.proc.pid
        return out

    def stop(self) -> None:
        for p in self.procs:
            stop(p)
        if self.redis is not None:
            self.redis.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pods", type=int, default=8, help="engine replicas in the workload (default 8)")
    p.add_argument("--blocks", type=int, default=200_000, help="block-ops in the workload (default 200k)")
    p.add_argument("--queries", type=int, default=16, help="distinct 8k-token queries (default 16)")
    p.add_argument("--count", type=int, default=2000, help="requests per endpoint and configuration")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (closed loop)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per configuration (median reported)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (well under a minute), for CI")
    p.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/replicas-<timestamp>.json)")
    a = p.parse_args(argv)
    if a.smoke:
        a.pods, a.blocks, a.queries, a.count, a.concurrency, a.rounds = 4, 20_000, 4, 120, 8, 1
    return a


# -- the load client (its own process) --------------------------------------------------------------
def expected_tokens(queries: list[dict]) -> list[dict[str, int]]:
    """Per query: matched tokens per pod ("1".."N") the generator says a precise index must report."""
    return [{str(i + 1): b * common.BLOCK_SIZE for i, b in enumerate(q["expected"]) if b} for q in queries]


async def load(urls: list[str], endpoint: str, queries: list[dict], total: int, concurrency: int,
               servers: dict[str, int]) -> dict:
    """Closed loop: ``concurrency`` workers take request numbers until ``total``; request n goes to
    ``urls[n % len(urls)]`` with query ``n % len(queries)``. Every answer is checked. CPU seconds
    of this process, of each server process (``servers``: name -> pid) and of the whole machine
    are taken over the timed loop only."""
    import aiohttp

    bodies = [e2e.request_bodies("kvindex", q["token_ids"])[endpoint] for q in queries]
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
                tally["ok" if e2e.matched_tokens(endpoint, json.loads(raw)) == truth[q] else "wrong"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        for q in range(min(len(bodies), concurrency)):  # warm connections and caches, untimed
            async with s.post(urls[q % len(urls)] + endpoint, data=bodies[q], headers=hdr) as r:
                await r.read()
        cpu0 = cpu_snapshot(servers)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
        cpu = {k: v - cpu0[k] for k, v in cpu_snapshot(servers).items()}
    return {"endpoint": endpoint, "requests": total, "seconds": seconds, "requests_per_s": total / seconds,
            "concurrency": concurrency, **tally, "latency": common.latency_summary(latencies),
            "cpu_seconds": cpu}


def cpu_snapshot(servers: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far: this process ("client"), each server, and the machine ("machine": all cores,
    all processes, from /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
    return {"client": time.process_time(), "machine": busy, **{k: cpu_seconds(pid) for k, pid in servers.items()}}


def run_client(urls: list[str], queries_file: Path, total: int, concurrency: int, servers: dict[str, int]) -> list[dict]:
    """The load client as a separate process (so its CPU is not the replicas'); one result per endpoint."""
    out = []
    for endpoint in ENDPOINTS:
        cmd = [sys.executable, str(Path(__file__).resolve()), "client", "--urls", ",".join(urls), "--endpoint",
               endpoint, "--queries-file", str(queries_file), "--count", str(total), "--concurrency", str(concurrency),
               "--pids", ",".join(f"{k}={v}" for k, v in servers.items())]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"load client exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        out.append(json.loads(proc.stdout))
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


def store_of(setup: Setup, tmp: Path) -> RedisServer | RedisClusterServers | None:
    """The configuration's Redis, started: one server, a 3-master cluster, or none (memory)."""
    if setup.store == "redis":
        return RedisServer(tmp / setup.name, port=free_port()).start()
    if setup.store == "cluster":
        return RedisClusterServers(tmp / setup.name, masters=3).start()
    return None


def start_all(wl: common.Workload, pub: e2e.Publisher, tmp: Path) -> list[Running]:
    """Every configuration's Redis and replicas, each replica subscribed to every publisher socket."""
    running = []
    try:
        for setup in SETUPS:
            run = Running(setup, store_of(setup, tmp))
            running.append(run)
            store = ["--store", run.redis.url] if run.redis else []  # memory: the default store
            for i in range(setup.replicas):
                run.ports.append(free_port())
                run.procs.append(serve(run.ports[-1], *store, *engine_args(wl, pub), log=tmp / f"{setup.name}-{i}.log"))
    except BaseException:
        for run in running:
            run.stop()
        raise
    return running


def measure(running: list[Running], qfile: Path, args: argparse.Namespace) -> dict[str, list[list[dict]]]:
    """``args.rounds`` rounds; in each, every configuration in turn gets the load client."""
    rounds: dict[str, list[list[dict]]] = {run.setup.name: [] for run in running}
    for k in range(args.rounds):
        for run in running:
            print(f"... round {k + 1}/{args.rounds}: {run.setup.name}", file=sys.stderr, flush=True)
            rounds[run.setup.name].append(run_client(run.urls, qfile, args.count, args.concurrency, run.pids()))
    return rounds


def median_round(results: list[dict]) -> dict:
    """The round with the median requests/s (the lower middle one for an even count), every round's
    rate, and the wrong or failed answers of every round."""
    ranked = sorted(results, key=lambda r: r["requests_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "rounds_requests_per_s": [r["requests_per_s"] for r in results],
            "rounds_wrong_or_errors": sum(r["wrong"] + r["errors"] for r in results)}


def run_all(wl: common.Workload, qfile: Path, args: argparse.Namespace, tmp: Path) -> dict[str, dict]:
    """Publisher and every configuration up; one preload for all; interleaved rounds; all stopped."""
    pub = e2e.Publisher(wl.path)
    running: list[Running] = []
    try:
        running = start_all(wl, pub, tmp)
        ingest = preload([p for run in running for p in run.ports], pub, wl, timeout=max(60.0, wl.block_ops / 2000))
        rounds = measure(running, qfile, args)
    finally:
        for run in running:
            run.stop()
        pub.close()
    out = {}
    for run in running:
        per_endpoint = zip(*rounds[run.setup.name])  # rounds x endpoints -> endpoints x rounds
        out[run.setup.name] = {"store": run.setup.store, "replicas": run.setup.replicas, "ingest_all_replicas": ingest,
                               "load": {res[0]["endpoint"]: median_round(list(res)) for res in per_endpoint}}
    return out


# -- the whole run ----------------------------------------------------------------------------------
def ratios(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per endpoint: redis x3 over redis x1 (the replica figure), redis x1 over memory x1, and one
    replica on a 3-master cluster over one on one Redis."""
    def rps(name: str, ep: str) -> float:
        return results[name]["load"][ep]["requests_per_s"]
    return {ep: {"redis_x3_over_redis_x1": rps("redisx3", ep) / rps("redisx1", ep),
                 "redis_x3_over_memory_x1": rps("redisx3", ep) / rps("memoryx1", ep),
                 "redis_x1_over_memory_x1": rps("redisx1", ep) / rps("memoryx1", ep),
                 "cluster_x1_over_redis_x1": rps("clusterx1", ep) / rps("redisx1", ep)} for ep in ENDPOINTS}


def busy_cores(r: dict) -> str:
    """Cores busy during one load run: the client, the replicas (sum), Redis, everything else."""
    cpu, secs = r["cpu_seconds"], r["seconds"]
    kv = sum(v for k, v in cpu.items() if k.startswith("kvindex"))
    ours = sum(v for k, v in cpu.items() if k != "machine")
    rest = max(0.0, cpu["machine"] - ours)
    redis = sum(v for k, v in cpu.items() if k.startswith("redis"))
    return f"{cpu['client'] / secs:.2f} {kv / secs:.2f} {redis / secs:.2f} {rest / secs:.2f}"


def table(doc: dict) -> str:
    cores, a = doc["machine"]["cores"], doc["args"]
    lines = [f"kvindex replicas on one Redis: aggregate query throughput. {cores} cores on this machine, shared by "
             f"the load client, Redis, every replica and whatever else runs here",
             f"workload: {a['pods']} pods, {doc['workload']['block_ops']} block-ops, 8k-token queries; {a['count']} "
             f"requests per endpoint, {a['concurrency']} in flight; median of {a['rounds']} interleaved round(s)", ""]
    lines.append(f"{'setup':<10} {'endpoint':<10} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'ok':>6} {'wrong':>6} "
                 f"{'errors':>6}  cores busy: client kvindex redis other   (req/s of every round)")
    for name, res in doc["setups"].items():
        for ep, r in res["load"].items():
            lat = r["latency"]
            every = " ".join(f"{x:.0f}" for x in r["rounds_requests_per_s"])
            lines.append(f"{name:<10} {ep:<10} {r['requests_per_s']:>9.1f} {lat['p50_us'] / 1e3:>8.2f} "
                         f"{lat['p99_us'] / 1e3:>8.2f} {r['ok']:>6} {r['wrong']:>6} {r['errors']:>6}  "
                         f"{busy_cores(r)}   ({every})")
    bad = sum(r["rounds_wrong_or_errors"] for res in doc["setups"].values() for r in res["load"].values())
    lines.append(f"\nwrong or failed answers in every round of every setup: {bad}")
    lines.append("")
    for ep, row in doc["ratios"].items():
        lines.append(f"{ep:<10} 3 replicas / 1 replica (Redis): {row['redis_x3_over_redis_x1']:.2f}x   "
                     f"1 replica Redis / memory: {row['redis_x1_over_memory_x1']:.2f}x   "
                     f"cluster / one Redis: {row['cluster_x1_over_redis_x1']:.2f}x")
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
                 "workload": {"file": wl.path.name, "block_ops": wl.block_ops, "pods": wl.replicas},
                 "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="kvi-replicas-") as tmp:
        qfile = Path(tmp) / "queries.json"
        qfile.write_text(json.dumps(queries))
        doc["setups"] = run_all(wl, qfile, args, Path(tmp))
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
    p.add_argument("--pids", default="", help="name=pid,... of the server processes whose CPU to measure")
    a = p.parse_args(argv)
    queries = json.loads(a.queries_file.read_text())
    servers = {k: int(v) for k, v in (x.split("=") for x in a.pids.split(",") if x)}
    print(json.dumps(asyncio.run(load(a.urls.split(","), a.endpoint, queries, a.count, a.concurrency, servers))))


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        client_main(sys.argv[2:])
    else:
        main()
