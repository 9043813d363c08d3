"""Sharded ingest benchmark: end-to-end ingest capacity with 1 and 2 workers, and what fan-out costs.

For each replica count (``--replicas 64,256``) and worker count (``--workers 1,2``): a publisher
process (``e2e.py publish``: one PUB socket per replica on tcp://127.0.0.1) sends the whole
workload as fast as it can, and a real ``kvindex.daemon.Daemon`` (``workers=1``: everything in
this process; ``workers=N``: this process is the parent, N worker processes ingest) applies it.

  ingest capacity   block-ops / (wall clock from the publisher's "go" to the last batch applied),
                    the median of ``--rounds`` runs (interleaved across worker counts)
  replicas carried  capacity / 5000 (the design load: 5k block-ops/s per replica)
  cores used        CPU seconds of kvindex's processes (parent + workers) / wall seconds: how much
                    of the shared machine the run got; blocks per kvindex CPU-second: the cost
  /query latency    8k-token /query, /query_by_hash, /v1/score over HTTP at the first replica
                    count (64 pods), from the e2e.py HTTP client process, p50/p99

Every figure is also printed as a ratio against workers=1 in the same invocation, and the matched
tokens of every query must be the same for every worker count (checked, reported as mismatches).
The machine's cores are shared by the publisher, the HTTP client, the parent and the workers:
the result says how many. Results: benchmarks/results/shards-<timestamp>.json and a table.
No assertion on timings; ``--smoke`` is a tiny run (seconds) that must complete.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import e2e  # noqa: E402

from kvindex.shard.channel import Stats  # noqa: E402

DESIGN_LOAD = 5000  # block-ops/s per replica
STATS_TIMEOUT = 120.0
POLL_SECONDS = 0.05  # the workers stamp each batch; polling only decides when to stop


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="64,256", help="comma-separated replica counts (default 64,256)")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts; 1 first (default 1,2)")
    p.add_argument("--blocks", type=int, default=1_200_000, help="block-ops per workload (default 1.2M)")
    p.add_argument("--queries", type=int, default=16, help="distinct 8k-token queries (default 16)")
    p.add_argument("--http-repeat", type=int, default=400, help="timed HTTP requests per endpoint")
    p.add_argument("--rounds", type=int, default=3, help="ingest runs per (replicas, workers); the median "
                   "is reported (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for ingest to finish")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    p.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/shards-<timestamp>.json)")
    a = p.parse_args(argv)
    if a.smoke:
        a.replicas, a.blocks, a.queries, a.http_repeat, a.timeout, a.rounds = "2,8", 20_000, 4, 20, 60.0, 1
    a.replica_counts = [int(x) for x in a.replicas.split(",") if x.strip()]
    a.worker_counts = [int(x) for x in a.workers.split(",") if x.strip()]
    return a


async def applied(daemon) -> dict:
    """Batches applied, gaps and the wall clock of the last batch, over every lane or worker."""
    if daemon.shards is None:
        sts = e2e._streams(daemon)
        return {"batches": sum(st.batches for st in sts), "gaps": sum(st.gaps for st in sts),
                "last_applied": max((st.last_applied or 0.0 for st in sts), default=0.0)}
    # a worker drains a backlog lane by lane (DRAIN_BURST messages each per round of its event
    # loop): under a burst of the whole workload, a round takes seconds and so does this answer
    parts = await asyncio.gather(*(ch.request(Stats(), timeout=STATS_TIMEOUT) for ch in daemon.shards.channels))
    return {"batches": sum(p["batches"] for p in parts), "gaps": sum(p["gaps"] for p in parts),
            "last_applied": max(p["last_applied"] for p in parts)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes(daemon, pub: e2e.Publisher) -> dict[str, int]:
    """The processes of one run: the publisher, this one (the daemon or its parent), the workers."""
    procs = {"publisher": pub.proc.pid, "daemon": os.getpid()}
    if daemon.shards is not None:
        procs.update({f"worker{i}": p.pid for i, p in enumerate(daemon.shards.procs)})
    return procs


async def wait_applied(daemon, total: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while (done := await applied(daemon))["batches"] < total and time.monotonic() < deadline:
        await asyncio.sleep(POLL_SECONDS)
    return done


async def one_run(wl: common.Workload, workers: int, qfile: Path | None, repeat: int, timeout: float) -> dict:
    """Publisher process -> Daemon with ``workers``; then the HTTP client if ``qfile``."""
    from kvindex.daemon import Daemon

    pub = e2e.Publisher(wl.path)
    daemon = Daemon(replace(e2e.daemon_config(pub.endpoints), workers=workers))
    await daemon.start()
    try:
        await e2e.wait_connected(daemon, len(pub.endpoints))
        procs = processes(daemon, pub)
        cpu0 = {name: cpu_seconds(pid) for name, pid in procs.items()}
        t_go = time.time()
        pub.go()
        done = await wait_applied(daemon, len(wl.messages), timeout)
        seconds = done["last_applied"] - t_go
        cpu = {name: round(cpu_seconds(pid) - cpu0[name], 3) for name, pid in procs.items()}
        out = {"workers": workers, "messages": done["batches"], "expected_messages": len(wl.messages),
               "gaps": done["gaps"], "seconds": seconds, "blocks_per_s": wl.block_ops / seconds,
               "replicas_at_design_load": wl.block_ops / seconds / DESIGN_LOAD,
               "cpu_seconds": cpu,  # per process, from "go" until every batch was applied (+ one poll)
               "kvindex_cores_used": sum(v for k, v in cpu.items() if k != "publisher") / seconds,
               "blocks_per_kvindex_cpu_s": wl.block_ops / max(1e-9, sum(v for k, v in cpu.items() if k != "publisher")),
               "publisher": await asyncio.to_thread(pub.sent)}
        if qfile is not None:
            out["http"] = await e2e.http_client_async(f"http://127.0.0.1:{daemon.port}", "kvindex", qfile, repeat)
        return out
    finally:
        await daemon.stop()
        pub.close()


def run_replicas(args: argparse.Namespace, n: int, with_http: bool) -> dict:
    wl = common.workload(n, args.blocks)
    qfile = None
    if with_http:
        qfile = common.RESULTS / f"queries_shards_r{n}.json"
        qfile.write_text(json.dumps(common.pick_queries(wl, args.queries)))
    rounds: dict[str, list[dict]] = {str(w): [] for w in args.worker_counts}
    for r in range(args.rounds):  # interleaved, so a noisy neighbour's burst hits every worker count
        for w in args.worker_counts:
            print(f"... {n} replicas, {w} worker(s), round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            http = qfile if r == 0 else None
            rounds[str(w)].append(common.run_daemon(one_run(wl, w, http, args.http_repeat, args.timeout)))
    runs = {w: median_run(rs) for w, rs in rounds.items()}
    base = runs[str(args.worker_counts[0])]
    for run in runs.values():
        run["ratio_vs_first"] = run["blocks_per_s"] / base["blocks_per_s"]
        if "http" in run:
            run["matched_mismatches_vs_first"] = sum(
                a != b for ep in base["http"]["matched"] for a, b in zip(run["http"]["matched"][ep],
                                                                       base["http"]["matched"][ep]))
    return {"block_ops": wl.block_ops, "messages": len(wl.messages), "runs": runs}


def median_run(rounds: list[dict]) -> dict:
    """The round with the median ingest rate, with every round's rate and the first round's HTTP."""
    ranked = sorted(rounds, key=lambda run: run["blocks_per_s"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    out["rounds_blocks_per_s"] = [run["blocks_per_s"] for run in rounds]
    out["messages"] = min(run["messages"] for run in rounds)  # every round must be complete
    out["gaps"] = sum(run["gaps"] for run in rounds)
    if "http" in rounds[0]:
        out["http"] = rounds[0]["http"]
    return out


def render(doc: dict) -> str:
    lines = [(f"machine: {doc['machine']['cpu']}, {doc['machine']['cores']} cores shared by the publisher, the "
              "kvindex parent and its workers (and the HTTP client)"), "",
             ("| replicas | workers | ingest blocks/s, median (every round, k) | vs first | replicas carried at 5k/s | "
              "messages | gaps | wall s | kvindex cores used | blocks per kvindex CPU-s | CPU s per process (median round) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in doc["replicas"].items():
        for w, run in r["runs"].items():
            every = "/".join(f"{x / 1e3:.0f}" for x in run["rounds_blocks_per_s"])
            lines.append(f"| {n} | {w} | {run['blocks_per_s'] / 1e3:,.0f}k ({every}) | {run['ratio_vs_first']:.2f}x | "
                         f"{run['replicas_at_design_load']:.0f} | {run['messages']}/{run['expected_messages']} | "
                         f"{run['gaps']} | {run['seconds']:.2f} | {run['kvindex_cores_used']:.2f} | "
                         f"{run['blocks_per_kvindex_cpu_s'] / 1e3:.0f}k | "
                         + ", ".join(f"{k} {v:.2f}" for k, v in run["cpu_seconds"].items()) + " |")
    first = next(iter(doc["replicas"].values()))
    http_runs = {w: run for w, run in first["runs"].items() if "http" in run}
    if http_runs:
        n = next(iter(doc["replicas"]))
        lines += ["", f"HTTP at {n} pods, p50 / p99 µs (ratio vs first worker count):", "",
                  "| endpoint | " + " | ".join(f"workers={w}" for w in http_runs) + " |",
                  "|---|" + "---|" * len(http_runs)]
        base = next(iter(http_runs.values()))["http"]["latency"]
        for ep in base:
            cells = []
            for run in http_runs.values():
                lat = run["http"]["latency"][ep]
                cells.append(f"{lat['p50_us']:.0f} / {lat['p99_us']:.0f} "
                             f"({lat['p50_us'] / base[ep]['p50_us']:.2f}x / {lat['p99_us'] / base[ep]['p99_us']:.2f}x)")
            lines.append(f"| {ep} | " + " | ".join(cells) + " |")
        lines.append("matched-token mismatches vs the first worker count: "
                     + ", ".join(f"workers={w}: {run['matched_mismatches_vs_first']}" for w, run in http_runs.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    doc: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": common.machine(),
                 "cpu_count": os.cpu_count(), "design_load_per_replica": DESIGN_LOAD,
                 "args": {k: v for k, v in vars(args).items() if k != "out"}, "replicas": {}}
    for i, n in enumerate(args.replica_counts):
        doc["replicas"][str(n)] = run_replicas(args, n, with_http=i == 0)
    doc["seconds"] = time.time() - t0
    out = args.out or common.RESULTS / ("shards-" + time.strftime("%Y%m%dT%H%M%S") + ".json")
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(render(doc))
    print(f"\nresults: {out}")
    return doc


if __name__ == "__main__":
    main()
