"""Issue 38's realistic workload end to end: kvindex serve (one process, and --workers 2) beside Dynamo.

The workload is benchmarks/realistic_workload.py's (8 vLLM replicas, map dialect, int hashes,
26k-block LRU caches, chunked prefill and decode: ~24 block operations a batch, 4M in all). Each
target runs as a user runs it, in a process of its own, on the same bytes:

  kvindex      ``kvindex serve --workers 1`` (every lane in one process), engines added by POST /register
  kvindex-w2   ``kvindex serve --workers 2``, the same way
  kvindex-aiohttp, kvindex-w2-aiohttp   the same with ``--no-http-fast-path`` (every query through
               aiohttp; not run unless named in ``--targets``)
  dynamo       ``python -m dynamo.indexer --threads 2`` (ai-dynamo-runtime 1.6.1), workers given by --workers

A run: the publisher (``e2e.py publish``: one PUB per replica, published as fast as ZeroMQ takes
them) and the target start; once every engine is connected the publisher is told to go; the harness
polls ``/query`` with each replica's marker block (the last batch of its stream) on one keep-alive
``http.client`` connection until every marker is visible (``POLL_SECONDS`` between rounds):
  ingest       block operations / seconds from the go to the poll that saw the last marker
  memory       the target's process tree RSS (VmRSS, summed over its children) when the last
               marker was seen ("end of burst") and ``--settle`` (1 s) later ("settled"), minus the
               RSS before the go, per (block, replica) entry held at the end
  queries      300 sequential 8k-token ``/query`` (token_ids) then ``/query_by_hash`` on one
               keep-alive ``http.client`` connection: p50 / p99, and the matched tokens per instance
Matched tokens are compared with the generator's truth and between kvindex and Dynamo (zero
mismatches expected, reported). Rounds are interleaved across targets (round 1: every target, then
round 2, ...); the report takes the median over rounds of each figure. Dynamo binds 0.0.0.0, so
``run.py`` runs this module inside ``unshare -n`` (a private loopback) when Dynamo is compared.
Prints one JSON line. No assertion on timings.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import dynamo_peer  # noqa: E402
import e2e  # noqa: E402
import realistic_workload  # noqa: E402

POLL_SECONDS = 0.01
SETTLE_SECONDS = 1.0
CONNECT_TIMEOUT = 60.0
INGEST_TIMEOUT = 600.0
TARGETS = ("kvindex", "kvindex-w2", "dynamo")
EXTRA_TARGETS = ("kvindex-aiohttp", "kvindex-w2-aiohttp")  # the HTTP fast path off


def tree_rss(pid: int) -> int:
    """VmRSS of ``pid`` and every descendant, in bytes."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += dynamo_peer.vm_rss(p)
        except OSError:
            continue
        todo += children.get(p, [])
    return total


class Client:
    """One keep-alive ``http.client`` connection; ``post`` answers (status, JSON)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if data else {})

    def get(self, path: str) -> tuple[int, dict | list]:
        self.conn.request("GET", path)
        r = self.conn.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if data else {})

    def close(self) -> None:
        self.conn.close()


def wait_http(port: int, path: str, timeout: float = CONNECT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            c = Client(port)
            c.get(path)
            c.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def start_kvindex(workers: int, port: int, endpoints: list[str], log: Path, join_wait: float,
                  extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """``kvindex serve --workers N`` with no engine; each endpoint registered (instance i + 1), until
    every pod says connected."""
    cmd = [sys.executable, "-m", "kvindex", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--workers", str(workers), *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=common.ROOT)
    wait_http(port, "/healthz")
    c = Client(port)
    for i, ep in enumerate(endpoints):
        body = {"instance_id": i + 1, "endpoint": ep, "model_name": common.MODEL, "block_size": common.BLOCK_SIZE}
        status, answer = c.post("/register", json.dumps(body).encode())
        if status >= 300:
            raise RuntimeError(f"/register answered {status}: {answer}")
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while True:
        _, doc = c.get("/v1/pods")
        up = sum(1 for p in doc["pods"] if p.get("connected")) if isinstance(doc, dict) else 0
        if up >= len(endpoints):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"kvindex: {up} of {len(endpoints)} engines connected")
        time.sleep(0.05)
    c.close()
    time.sleep(join_wait)  # subscriptions propagate
    return proc


def kvindex_state(port: int) -> dict:
    """Gaps and unsynced pods as kvindex's /v1/pods says them."""
    c = Client(port)
    _, doc = c.get("/v1/pods")
    c.close()
    pods = doc["pods"] if isinstance(doc, dict) else []
    return {"gaps": sum(p.get("gaps", 0) for p in pods), "unsynced": sorted(p["pod"] for p in pods if not p["synced"]),
            "reasons": sorted({str(p.get("unsynced_reason")) for p in pods if not p["synced"]})}


def wait_markers(port: int, markers: list[list[int]], t_go: float) -> tuple[float, int]:
    """Polls ``/query`` with each replica's marker (plus one token) until every one is matched by its
    instance; the seconds from ``t_go`` to the start of the poll that saw the last one, and the polls."""
    c = Client(port)
    pending = dict(enumerate(markers))
    deadline = time.monotonic() + INGEST_TIMEOUT
    polls, t_seen = 0, t_go
    while pending:
        for i in list(pending):
            t0 = time.perf_counter()
            status, doc = c.post("/query", json.dumps({"token_ids": pending[i] + [0], "model_name": common.MODEL}).encode())
            polls += 1
            if status == 200 and e2e.matched_tokens("/query", doc).get(str(i + 1), 0) >= common.BLOCK_SIZE:
                del pending[i]
                t_seen = t0
            else:
                break  # the replicas' streams end together: look again at this one next round
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"markers of replicas {sorted(pending)} never visible")
            time.sleep(POLL_SECONDS)
    c.close()
    return t_seen - t_go, polls


def sequential_queries(port: int, queries: list[dict]) -> dict:
    """Every query on /query, then every one on /query_by_hash, one keep-alive connection."""
    bodies = [e2e.request_bodies("dynamo", q["token_ids"]) for q in queries]
    c = Client(port)
    out: dict = {"latency": {}, "matched": {}}
    for ep in ("/query", "/query_by_hash"):
        times, matched = [], []
        for b in bodies:
            t0 = time.perf_counter()
            status, doc = c.post(ep, b[ep])
            times.append(time.perf_counter() - t0)
            matched.append(e2e.matched_tokens(ep, doc) if status == 200 else {"status": status})
        out["latency"][ep], out["matched"][ep] = common.latency_summary(times), matched
    c.close()
    return out


def one_run(target: str, wl: common.Workload, queries: list[dict], args: argparse.Namespace, workdir: Path) -> dict:
    """One target on the workload: ingest, memory, queries."""
    pub = e2e.Publisher(wl.path)
    port = common.free_port()
    log = workdir / f"{target}.log"
    try:
        if target == "dynamo":
            proc = dynamo_peer.start_indexer(args.dynamo_python, port, pub.endpoints, args.dynamo_threads, log)
            dynamo_peer.wait_active(port, len(pub.endpoints))
        else:
            proc = start_kvindex(2 if target.startswith("kvindex-w2") else 1, port, pub.endpoints, log, args.join_wait,
                                 ("--no-http-fast-path",) if target.endswith("-aiohttp") else ())
        rss0 = tree_rss(proc.pid)
        t_go = time.perf_counter()
        pub.go()
        seconds, polls = wait_markers(port, wl.sidecar["marker_tokens"], t_go)
        rss_end = tree_rss(proc.pid)
        time.sleep(args.settle)
        rss_settled = tree_rss(proc.pid)
        sent = pub.sent()
        res = {"target": target, "seconds": seconds, "blocks_per_s": wl.block_ops / seconds, "marker_polls": polls,
               "rss_before_bytes": rss0, "rss_end_delta_bytes": rss_end - rss0,
               "rss_settled_delta_bytes": rss_settled - rss0, "publisher": sent}
        res["state"] = (kvindex_state(port) if target != "dynamo"
                        else dict(zip(("events_ok", "events_failed"), dynamo_peer.events_applied(port))))
        res["http"] = sequential_queries(port, queries)
        return res
    finally:
        if "proc" in locals():
            dynamo_peer.stop_indexer(proc)
        pub.close()


def median_of(runs: list[dict]) -> dict:
    """Per figure, the median over the rounds; every round's ingest rate; the first round's answers."""
    out = {k: statistics.median(r[k] for r in runs) for k in
           ("seconds", "blocks_per_s", "rss_end_delta_bytes", "rss_settled_delta_bytes")}
    out["rounds_blocks_per_s"] = [r["blocks_per_s"] for r in runs]
    out["latency"] = {ep: {q: statistics.median(r["http"]["latency"][ep][q] for r in runs) for q in ("p50_us", "p99_us")}
                      for ep in runs[0]["http"]["latency"]}
    out["state"] = [r["state"] for r in runs]
    out["matched"] = runs[0]["http"]["matched"]
    out["answers_differ_between_rounds"] = sum(a != b for r in runs[1:] for ep in out["matched"]
                                               for a, b in zip(r["http"]["matched"][ep], out["matched"][ep]))
    return out


def expected_tokens(queries: list[dict]) -> list[dict[str, int]]:
    """Per query, the generator's matched tokens per instance (non-zero only), as
    ``e2e.matched_tokens`` reads an answer."""
    return [{str(i + 1): b * common.BLOCK_SIZE for i, b in enumerate(q["expected"]) if b} for q in queries]


def compare(res: dict, queries: list[dict], entries: int) -> None:
    """Adds per-entry memory, mismatches vs the truth and vs Dynamo, and the kvindex/Dynamo ratios."""
    truth = expected_tokens(queries)
    dyn = res["targets"].get("dynamo")
    for name, t in res["targets"].items():
        t["rss_end_bytes_per_entry"] = t["rss_end_delta_bytes"] / entries
        t["rss_settled_bytes_per_entry"] = t["rss_settled_delta_bytes"] / entries
        t["vs_expected_mismatches"] = {ep: sum(a != b for a, b in zip(m, truth)) for ep, m in t["matched"].items()}
        if dyn is not None and name != "dynamo":
            t["vs_dynamo_mismatches"] = {ep: sum(a != b for a, b in zip(m, dyn["matched"][ep]))
                                         for ep, m in t["matched"].items()}
            t["vs_dynamo"] = {"ingest": t["blocks_per_s"] / dyn["blocks_per_s"],
                              "rss_end": t["rss_end_delta_bytes"] / max(1, dyn["rss_end_delta_bytes"]),
                              "rss_settled": t["rss_settled_delta_bytes"] / max(1, dyn["rss_settled_delta_bytes"])}
            for ep, lat in t["latency"].items():
                for q in ("p50_us", "p99_us"):
                    t["vs_dynamo"][f"{ep} {q[:3]}"] = lat[q] / dyn["latency"][ep][q]


def measure(args: argparse.Namespace) -> dict:
    """Every target, ``args.rounds`` interleaved rounds."""
    wl = workload(args.blocks, args.queries)
    queries = common.pick_queries(wl, args.queries)
    workdir = common.RESULTS / "realistic"
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=False, capture_output=True)
    runs: dict[str, list[dict]] = {t: [] for t in args.targets}
    for r in range(args.rounds):
        for t in args.targets:
            print(f"... realistic: {t}, round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            runs[t].append(one_run(t, wl, queries, args, workdir))
    entries = sum(s["held_blocks"] for s in wl.sidecar["replica_state"])
    st = wl.sidecar["stats"]
    res = {"workload": {"file": wl.path.name, "replicas": wl.replicas, "entries_held": entries, "queries": len(queries),
                        **{k: st[k] for k in ("batches", "block_ops", "block_stored", "block_removed", "hit_rate",
                                              "ops_per_batch", "ops_per_decode_batch", "ops_per_prefill_batch")}},
           "rounds": args.rounds, "targets": {t: median_of(rs) for t, rs in runs.items()},
           "runs": {t: [{k: v for k, v in r.items() if k != "http"} for r in rs] for t, rs in runs.items()}}
    compare(res, queries, entries)
    return res


LABELS = {"kvindex": "kvindex 1 process", "kvindex-w2": "kvindex --workers 2", "dynamo": "Dynamo",
          "kvindex-aiohttp": "kvindex 1 process, no fast path", "kvindex-w2-aiohttp": "kvindex --workers 2, no fast path"}


def render(res: dict) -> str:
    """The realistic workload's table: each target's medians, and kvindex/Dynamo per kvindex target."""
    if "error" in res or "skipped" in res:
        return f"\n== realistic workload: {res.get('error') or res.get('skipped')}"
    w, ts = res["workload"], res["targets"]
    names = [t for t in (*TARGETS, *EXTRA_TARGETS) if t in ts]
    kv = [t for t in names if t != "dynamo" and "vs_dynamo" in ts[t]]
    head = ["figure (median of %d)" % res["rounds"], *(LABELS[t] for t in names), *(f"{LABELS[t]} / Dynamo" for t in kv)]
    rows = [("ingest block-ops/s", lambda t: f"{t['blocks_per_s'] / 1e3:,.0f}k", "ingest"),
            ("RSS at the end of the burst, B/entry", lambda t: f"{t['rss_end_bytes_per_entry']:,.0f}", "rss_end"),
            ("RSS settled 1 s after, B/entry", lambda t: f"{t['rss_settled_bytes_per_entry']:,.0f}", "rss_settled")]
    for ep in ("/query", "/query_by_hash"):
        for q in ("p50", "p99"):
            rows.append((f"{ep} {q}", lambda t, ep=ep, q=q: f"{t['latency'][ep][q + '_us']:,.0f}µs", f"{ep} {q}"))
    lines = [f"\n== realistic workload (issue 38): {w['replicas']} replicas, {w['batches']:,} batches, "
             f"{w['block_ops']:,} block-ops ({w['ops_per_batch']:.1f} a batch, decode {w['ops_per_decode_batch']:.1f}), "
             f"{w['entries_held']:,} entries held, {w['queries']} queries",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, cell, ratio in rows:
        lines.append("| " + " | ".join([label, *(cell(ts[t]) for t in names),
                                        *(f"{ts[t]['vs_dynamo'][ratio]:.2f}" for t in kv)]) + " |")
    checks = []
    for t in names:
        mis = ts[t]["vs_expected_mismatches"]
        vs_d = ts[t].get("vs_dynamo_mismatches")
        gaps = [s.get("gaps", 0) for s in ts[t]["state"] if "gaps" in s]
        unsynced = sum(len(s.get("unsynced", [])) for s in ts[t]["state"])
        checks.append(f"{LABELS[t]}: mismatches vs expected {sum(mis.values())}"
                      + (f", vs Dynamo {sum(vs_d.values())}" if vs_d is not None else "")
                      + (f", gaps {sum(gaps)}, unsynced {unsynced}" if gaps else ""))
    lines.append("; ".join(checks))
    return "\n".join(lines)


def workload(blocks: int, queries: int) -> common.Workload:
    """The realistic workload (generated once, cached under benchmarks/results/workloads/)."""
    cache = common.RESULTS / "workloads"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"realistic_r8_b{blocks}_q{queries}.bin"
    side = path.with_name(path.name + ".json")
    try:
        fresh = path.exists() and json.loads(side.read_text())["params"].get("version") == realistic_workload.VERSION
    except (OSError, ValueError, KeyError):
        fresh = False
    if not fresh:
        subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "realistic_workload.py"), str(path),
                        "--blocks", str(blocks), "--queries", str(queries), "--model", common.MODEL, "--quiet"],
                       check=True)
    from kvindex.tools.workload import read_messages

    return common.Workload(path, 8, list(read_messages(path)), json.loads(side.read_text()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4_000_000, help="block operations (default 4M)")
    p.add_argument("--queries", type=int, default=300, help="8k-token queries (default 300)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, medians reported (default 3)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS + EXTRA_TARGETS)}")
    p.add_argument("--dynamo-python", default=sys.executable, help="Python with ai-dynamo-runtime==1.6.1")
    p.add_argument("--dynamo-threads", type=int, default=2, help="Dynamo indexer --threads (default 2)")
    p.add_argument("--settle", type=float, default=SETTLE_SECONDS, help="seconds to the settled RSS (default 1)")
    p.add_argument("--join-wait", type=float, default=1.0, help="seconds for the subscriptions once connected (1)")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds)")
    a = p.parse_args(argv)
    if a.smoke:
        a.blocks, a.queries, a.rounds, a.settle, a.join_wait = 30_000, 20, 1, 0.2, 0.5
    a.targets = [t for t in a.targets.split(",") if t]
    return a


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(measure(parse_args(argv))))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
