"""kvindex benchmark: one command, every figure next to a baseline measured in the same run.

First (``--workload realistic``, or ``all``) issue 38's realistic workload, benchmarks/realistic.py:
8 vLLM replicas' chunked-prefill and decode batches (~24 block operations a batch, 4M in all, the
generator is benchmarks/realistic_workload.py), published as fast as ZeroMQ takes them to
``kvindex serve`` in one process and with ``--workers 2`` (engines by POST /register) and to Dynamo's
indexer: ingest, RSS at the end of the burst and settled, 300 sequential 8k-token /query and
/query_by_hash, zero mismatches checked (medians of ``--realistic-rounds``).

For each replica count (``--replicas 8,64``) it generates (or reuses, cached under
benchmarks/results/workloads/) a deterministic vLLM-wire-format workload with
benchmarks/gen_workload.py (design-load shape: 26k blocks per replica, tenants with 2k-token
system prompts, multi-turn chats, round-robin routing so several pods hold deep prefixes), then:

  ingest (in-process)   decode + PreciseIndex.apply, blocks/s     vs msgpack + dict per replica
  ingest (end to end)   publisher process -> ZeroMQ tcp -> Daemon  vs plain pyzmq + msgpack + dicts
                        (and with --workers 2: the core budget of Dynamo's --threads 2);
                        every e2e rate, Dynamo's too, is timed from the publisher's go to the
                        last batch applied
  lookup (in-process)   PreciseIndex.match, 512 blocks, p50/p99   vs walking the per-replica dicts
  HTTP                  /query, /query_by_hash, /v1/score          vs GET /health round trip
                        (and the floor: the same bodies to an empty aiohttp handler)
  approximate           hash + record + score of an 8 KB prompt   vs XXH64 of its 64-byte slices
  memory                RSS per (block, pod) entry, 1M and 5M      vs dict per replica (fresh process)

With ai-dynamo-runtime importable by --dynamo-python (default: this Python), Dynamo's standalone
indexer runs on the same bytes and queries inside a private network namespace (it binds 0.0.0.0),
and each figure gets a kvindex/Dynamo ratio plus a check that both match the same tokens.

``--workload mooncake`` (or ``all``, the default) also replays the Mooncake conversation trace
(``../shared/traces/``, 12,031 production requests) through simulated vLLM replicas with
benchmarks/trace_workload.py (block size 16, 26k-block LRU caches, KV-aware placement) and measures
the end-to-end figures on it (ingest over ZeroMQ, /query on the last 64 requests of the trace,
held out as a router's queries just before each is sent, matched tokens, RSS per entry) for
kvindex and Dynamo on the same bytes.
Results: benchmarks/results/<timestamp>.json and a table on stdout. No assertion on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import e2e  # noqa: E402
import inproc  # noqa: E402
import shards  # noqa: E402

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; --smoke shrinks every size."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="8,64", help="comma-separated replica counts (default 8,64)")
    p.add_argument("--blocks", type=int, default=1_200_000, help="block-ops per workload (default 1.2M)")
    p.add_argument("--queries", type=int, default=16, help="distinct 8k-token queries (default 16)")
    p.add_argument("--repeat", type=int, default=2000, help="timed in-process lookups per replica count")
    p.add_argument("--http-repeat", type=int, default=400, help="timed HTTP requests per endpoint")
    p.add_argument("--max-entries", type=int, default=5_000_000, help="largest RSS fill (1M and this)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (< 30 s), for CI")
    p.add_argument("--no-dynamo", action="store_true", help="skip the Dynamo comparison")
    p.add_argument("--dynamo-python", default=sys.executable,
                   help="Python with ai-dynamo-runtime==1.6.1 installed (default: this one)")
    p.add_argument("--dynamo-threads", type=int, default=2, help="Dynamo indexer --threads (default 2)")
    p.add_argument("--kvindex-workers", type=int, default=2, help="also measure e2e ingest with kvindex serve "
                   "--workers N, the same core budget as Dynamo's threads (default 2; 1 skips it)")
    p.add_argument("--workload", choices=("realistic", "synthetic", "mooncake", "all"), default="all",
                   help="realistic (issue 38's), synthetic (generated, per --replicas), mooncake (the production "
                   "trace) or all (default)")
    p.add_argument("--realistic-blocks", type=int, default=4_000_000, help="realistic workload's block-ops (4M)")
    p.add_argument("--realistic-queries", type=int, default=300, help="realistic workload's queries (300)")
    p.add_argument("--realistic-rounds", type=int, default=3, help="realistic workload's rounds, medians (3)")
    p.add_argument("--trace-replicas", type=int, default=8, help="simulated vLLM replicas for the trace (default 8)")
    p.add_argument("--trace-capacity", type=int, default=26000, help="LRU blocks per replica for the trace (26000)")
    p.add_argument("--trace-requests", type=int, help="replay only the first N trace requests (default all)")
    p.add_argument("--trace-queries", type=int, default=64, help="last trace requests held out as queries (64)")
    p.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/<timestamp>.json)")
    a = p.parse_args(argv)
    if a.smoke:
        a.replicas, a.blocks, a.queries, a.repeat, a.http_repeat = "2,8", 20_000, 4, 100, 20
        a.max_entries = min(a.max_entries, 100_000)
        a.trace_replicas, a.trace_capacity, a.trace_requests, a.trace_queries = 2, 3000, 200, 8
        a.realistic_blocks, a.realistic_queries, a.realistic_rounds = 20_000, 8, 1
    a.replica_counts = [int(x) for x in a.replicas.split(",") if x.strip()]
    return a


def dynamo_status(args: argparse.Namespace) -> str | None:
    """None when Dynamo can run; otherwise why not."""
    if args.no_dynamo:
        return "--no-dynamo given"
    try:
        probe = subprocess.run([args.dynamo_python, "-c", "import dynamo.indexer"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {args.dynamo_python}: {exc}"
    if probe.returncode:
        return (f"ai-dynamo-runtime is not importable by {args.dynamo_python} "
                "(pip install ai-dynamo-runtime==1.6.1, or pass --dynamo-python)")
    try:
        isolated = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        isolated = False
    if not isolated:
        return "cannot create a private network namespace (unshare -n) to hide its 0.0.0.0 port"
    return None


def run_dynamo(args: argparse.Namespace, wl: common.Workload, queries_file: Path) -> dict:
    """The Dynamo side in a fresh network namespace (see dynamo_peer.py)."""
    cmd = ["unshare", "-n", sys.executable, str(HERE / "dynamo_peer.py"), "--workload", str(wl.path),
           "--replicas", str(wl.replicas), "--dynamo-python", args.dynamo_python,
           "--threads", str(args.dynamo_threads), "--queries", str(queries_file), "--repeat", str(args.http_repeat)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ing = out["ingest"]
    ing["complete"] = ing["events_ok"] + ing["events_failed"] >= ing["expected_events"]
    # block-ops / seconds holds only if every event was applied by then; else the share applied
    share = 1.0 if ing["complete"] else ing["events_ok"] / max(1, ing["expected_events"])
    ing["blocks_per_s"] = share * wl.block_ops / ing["seconds"] if ing["seconds"] > 0 else 0.0
    return out


def run_realistic(args: argparse.Namespace, dyn_reason: str | None) -> dict:
    """benchmarks/realistic.py in a child (inside ``unshare -n`` when Dynamo runs: it binds 0.0.0.0);
    --smoke measures kvindex in one process only."""
    targets = ["kvindex"] if args.smoke else ["kvindex", "kvindex-w2"]
    cmd = [sys.executable, str(HERE / "realistic.py"), "--blocks", str(args.realistic_blocks),
           "--queries", str(args.realistic_queries), "--rounds", str(args.realistic_rounds),
           "--dynamo-python", args.dynamo_python, "--dynamo-threads", str(args.dynamo_threads)]
    if args.smoke:
        cmd += ["--settle", "0.2", "--join-wait", "0.5"]
    if dyn_reason is None:
        cmd, targets = ["unshare", "-n", *cmd], [*targets, "dynamo"]
    proc = subprocess.run([*cmd, "--targets", ",".join(targets)], capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def entries_held(wl: common.Workload) -> int:
    """(block, pod) entries held at the end of the workload."""
    return sum(s["held_blocks"] for s in wl.sidecar["replica_state"])


def compare_matches(kv: dict, dyn: dict | None, queries: list[dict]) -> dict:
    """Per endpoint: queries where kvindex differs from the generator's truth, and from Dynamo."""
    truth = [{str(i + 1): b * common.BLOCK_SIZE for i, b in enumerate(q["expected"]) if b} for q in queries]
    out = {}
    for ep, answers in kv["matched"].items():
        row = {"vs_expected_mismatches": sum(a != t for a, t in zip(answers, truth))}
        if dyn is not None and ep in dyn["matched"]:
            row["vs_dynamo_mismatches"] = sum(a != d for a, d in zip(answers, dyn["matched"][ep]))
        out[ep] = row
    out["kvindex_answers_changed_after_ingest"] = kv.get("changed_after_ingest", 0)
    if dyn is not None:
        out["dynamo_vs_expected"] = {ep: sum(a != t for a, t in zip(ans, truth)) for ep, ans in dyn["matched"].items()}
        out["dynamo_first_pass_vs_expected"] = {ep: sum(a != t for a, t in zip(ans, truth))
                                                for ep, ans in dyn.get("matched_first", {}).items()}
        out["dynamo_answers_changed_after_ingest"] = dyn.get("changed_after_ingest", 0)
    return out


def run_replicas(args: argparse.Namespace, n: int, dyn_reason: str | None) -> dict:
    """Every per-replica-count measurement on the synthetic workload."""
    wl = common.workload(n, args.blocks)
    return measure(args, wl, common.pick_queries(wl, args.queries), f"r{n}", dyn_reason, with_inproc=True)


def run_trace(args: argparse.Namespace, dyn_reason: str | None) -> dict:
    """The end-to-end measurements on the Mooncake trace replay (no in-process figures)."""
    if not common.TRACE.exists():
        return {"skipped": f"no trace at {common.TRACE}"}
    wl = common.trace_workload(args.trace_replicas, args.trace_capacity, args.trace_requests, args.trace_queries)
    queries = [{"token_ids": q["token_ids"], "expected": q["expected"]} for q in wl.sidecar["queries"]]
    # --smoke keeps the whole run < 30 s: the trace then skips the HTTP floor and the --workers run
    res = measure(args, wl, queries, "mooncake", dyn_reason, with_inproc=False, extras=not args.smoke)
    lengths = sorted(len(q["token_ids"]) for q in queries)
    res["workload"] |= {"replicas": wl.replicas, "requests": wl.sidecar["stats"]["requests"],
                        "capacity_blocks": wl.sidecar["params"]["capacity"], "queries": len(queries),
                        "query_tokens_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]]}
    return res


def measure(args: argparse.Namespace, wl: common.Workload, queries: list[dict], name: str,
            dyn_reason: str | None, with_inproc: bool, extras: bool = True) -> dict:
    """Every figure on one workload: in-process (optional), e2e kvindex / reference / Dynamo, HTTP, checks;
    ``extras``: also the HTTP floor and kvindex with ``--kvindex-workers``."""
    qfile = common.RESULTS / f"queries_{name}.json"
    qfile.write_text(json.dumps(queries))
    res: dict = {"workload": {"file": wl.path.name, **{k: wl.sidecar["stats"][k] for k in
                 ("batches", "block_stored", "block_removed", "block_ops", "hit_rate")},
                 "entries_held": entries_held(wl)}}
    if with_inproc:
        res["ingest_inproc"], index, held = inproc.ingest(wl)
        res["query_inproc"] = inproc.query(wl, index, held, queries, args.repeat)
        del index, held
    res["e2e_reference"] = e2e.reference_e2e(wl)
    kv = common.run_daemon(e2e.kvindex_e2e(wl, qfile, args.http_repeat))
    kv["ingest"]["ratio_vs_reference"] = kv["ingest"]["blocks_per_s"] / res["e2e_reference"]["blocks_per_s"]
    kv["ingest"]["rss_bytes_per_entry"] = kv["ingest"]["rss_delta_bytes"] / max(1, res["workload"]["entries_held"])
    res["e2e_kvindex"] = kv["ingest"]
    res["http_kvindex"] = kv["http"]
    if extras:
        res["http_floor"] = common.run_daemon(e2e.floor_http(qfile, args.http_repeat))
    if extras and args.kvindex_workers > 1:
        res["e2e_kvindex_workers"] = common.run_daemon(shards.one_run(wl, args.kvindex_workers, None, 0, 300.0))
    dyn = None
    if dyn_reason is None:
        dyn = run_dynamo(args, wl, qfile)
        res["dynamo"] = dyn
        if "error" in dyn:
            dyn = None
        else:
            dyn["ingest"]["rss_bytes_per_entry"] = dyn["ingest"]["rss_delta_bytes"] / max(1, res["workload"]["entries_held"])
    res["match_check"] = compare_matches(kv["http"], dyn["http"] if dyn else None, queries)
    return res


def run_rss(args: argparse.Namespace) -> dict:
    """RSS per entry for kvindex and the reference, each in a fresh subprocess."""
    sizes = sorted({min(1_000_000, args.max_entries), args.max_entries})
    pods = {1_000_000: 64}
    out = {}
    for n in sizes:
        row = {}
        for impl in ("kvindex", "reference"):
            cmd = [sys.executable, str(HERE / "inproc.py"), "rss", "--impl", impl, "--entries", str(n),
                   "--pods", str(pods.get(n, 64 if n <= 1_000_000 else 200))]
            row[impl] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        row["ratio_vs_reference"] = row["kvindex"]["bytes_per_entry"] / row["reference"]["bytes_per_entry"]
        out[str(n)] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    """Run everything, write the JSON, print the table; returns the result document."""
    args = parse_args(argv)
    t0 = time.time()
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    dyn_reason = dynamo_status(args)
    if dyn_reason:
        print(f"Dynamo comparison skipped: {dyn_reason}", file=sys.stderr)
    doc: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": common.machine(),
                 "args": {k: v for k, v in vars(args).items() if k != "out"},
                 "dynamo": {"status": "skipped", "reason": dyn_reason} if dyn_reason else {"status": "ran"},
                 "load_average_before": os.getloadavg(),  # the machine may be shared: say how busy it was
                 "replicas": {}}
    if args.workload in ("realistic", "all"):
        print("... realistic workload", file=sys.stderr, flush=True)
        doc["realistic"] = run_realistic(args, dyn_reason)
    if args.workload in ("synthetic", "all"):
        for n in args.replica_counts:
            print(f"... {n} replicas", file=sys.stderr, flush=True)
            doc["replicas"][str(n)] = run_replicas(args, n, dyn_reason)
    if args.workload in ("mooncake", "all"):
        print("... Mooncake trace", file=sys.stderr, flush=True)
        doc["mooncake"] = run_trace(args, dyn_reason)
    if args.workload in ("synthetic", "all"):
        doc["approx"] = {str(p): inproc.approx(p, args.repeat) for p in (8, 64)}
        doc["rss"] = run_rss(args)
    doc["load_average_after"] = os.getloadavg()
    doc["seconds"] = time.time() - t0
    out = args.out or common.RESULTS / (time.strftime("%Y%m%dT%H%M%S") + ".json")
    out.write_text(json.dumps(doc, indent=1, default=str))
    import report

    print(report.render(doc))
    print(f"\nresults: {out}")
    return doc


if __name__ == "__main__":
    main()
