"""Dynamo's standalone KV indexer (``python -m dynamo.indexer``) on the same bytes and queries.

Its HTTP server binds 0.0.0.0 and has no host flag, so ``run.py`` starts this script inside a
fresh network namespace (``unshare -n``) holding only a loopback interface: the publisher, the
indexer and the HTTP client all live there, and nothing outside can reach the port. Prints one
JSON line: ingest (blocks/s from the publisher's go to the last event applied, polled from its
``dynamo_kvrouter_kv_cache_events_applied`` metric), process RSS per entry, HTTP latencies and
matched tokens per query.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BLOCK_SIZE, MODEL, RSS_SETTLE_SECONDS  # noqa: E402
from e2e import Publisher, http_client_async  # noqa: E402

from kvindex.tools.workload import read_messages

STALL_SECONDS = 30.0
APPLIED = re.compile(r'^dynamo_kvrouter_kv_cache_events_applied\{([^}]*)\}\s+([0-9.e+]+)', re.M)


def _get(url: str, timeout: float = 5.0) -> str:
    """GET a 127.0.0.1 URL as text."""
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (127.0.0.1 only)
        return r.read().decode()


def events_applied(port: int) -> tuple[float, float]:
    """(ok, not ok) events from the indexer's metrics."""
    ok = bad = 0.0
    for labels, value in APPLIED.findall(_get(f"http://127.0.0.1:{port}/metrics")):
        if 'status="ok"' in labels:
            ok += float(value)
        else:
            bad += float(value)
    return ok, bad


def count_events(path: Path) -> int:
    """Events (not batches) in the workload: what the applied-events metric must reach."""
    return sum(len(msgpack.unpackb(p)[1]) for _, _, p in read_messages(path))


def start_indexer(python: str, port: int, endpoints: list[str], threads: int, log: Path) -> subprocess.Popen:
    """``python -m dynamo.indexer`` with worker i+1 subscribed to endpoint i; its output goes to ``log``."""
    workers = ",".join(f"{i + 1}={ep}" for i, ep in enumerate(endpoints))
    cmd = [python, "-m", "dynamo.indexer", "--port", str(port), "--block-size", str(BLOCK_SIZE),
           "--model-name", MODEL, "--workers", workers, "--threads", str(threads)]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def wait_active(port: int, workers: int, timeout: float = 30.0) -> None:
    """Until /workers lists every worker active, then a little for subscriptions to land."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ws = json.loads(_get(f"http://127.0.0.1:{port}/workers"))
            if sum(1 for w in ws if w.get("status") == "active") >= workers:
                time.sleep(1.0)
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("Dynamo's workers did not become active")


def vm_rss(pid: int) -> int:
    """VmRSS of a process in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def applied_or_none(port: int) -> float | None:
    """Events applied so far, or None when the metrics endpoint did not answer in time.

    Under a burst of large batches (the Mooncake trace: ~1,300 blocks per batch) the indexer's
    HTTP server can take seconds to answer; a poll that times out is skipped, not fatal."""
    try:
        return sum(events_applied(port))
    except OSError:  # URLError and socket timeouts are OSErrors
        return None


def check_alive(proc: subprocess.Popen, log: Path) -> None:
    """Raises with the end of the indexer's output if it has exited."""
    if proc.poll() is not None:
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"dynamo.indexer exited with code {proc.returncode}: {tail}")


def wait_applied(port: int, total: int, timeout: float, proc: subprocess.Popen, log: Path, t_go: float) -> dict:
    """Polls the metric: first event applied (1 ms polls), then ``total`` applied or stalled.

    Stalled = no change for ``STALL_SECONDS`` between answered polls (on the Mooncake trace the
    count once stood still for over 5 s with 1.3% of the events still to come). ``seconds`` runs
    from the publisher's go (``t_go``, as kvindex's does) to the start of the poll that saw the last
    change: the count was reached before that poll answered, so a slow metrics endpoint costs
    Dynamo at most one poll. ``seconds_from_first_seen`` starts at the first poll that saw an event
    applied instead (how this was measured before: it favours Dynamo by however late that poll was)."""
    deadline = time.monotonic() + timeout
    while not applied_or_none(port):
        check_alive(proc, log)
        if time.monotonic() > deadline:
            raise TimeoutError("Dynamo applied nothing")
        time.sleep(0.001)
    t_first, last_n, t_last = time.perf_counter(), 0.0, time.perf_counter()
    skipped = 0
    while time.monotonic() < deadline:
        t_poll = time.perf_counter()
        n = applied_or_none(port)
        if n is None:
            check_alive(proc, log)
            skipped += 1
            time.sleep(0.01)
            continue
        if n != last_n:
            last_n, t_last = n, t_poll
        if n >= total or time.perf_counter() - t_last > STALL_SECONDS:
            break
        time.sleep(0.01)
    ok, bad = events_applied(port)
    return {"events_ok": ok, "events_failed": bad, "expected_events": total, "seconds": t_last - t_go,
            "seconds_from_first_seen": t_last - t_first, "metric_polls_timed_out": skipped}


def run(wl_path: Path, replicas: int, python: str, port: int, threads: int, queries: Path, repeat: int) -> dict:
    """Publisher + indexer + HTTP client, all on this namespace's loopback."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=False)
    total = count_events(wl_path)
    pub = Publisher(wl_path)
    log = queries.with_name(queries.stem + ".dynamo-indexer.log")
    proc = start_indexer(python, port, pub.endpoints, threads, log)
    try:
        wait_active(port, len(pub.endpoints))
        rss0 = vm_rss(proc.pid)
        t_go = time.perf_counter()
        pub.go()
        ingest = wait_applied(port, total, 600.0, proc, log, t_go)
        time.sleep(RSS_SETTLE_SECONDS)
        ingest["rss_delta_bytes"] = vm_rss(proc.pid) - rss0
        ingest["publisher"] = pub.sent()
        http = asyncio.run(http_client_async(f"http://127.0.0.1:{port}", "dynamo", queries, repeat))
        return {"threads": threads, "ingest": ingest, "http": http}
    finally:
        stop_indexer(proc)
        pub.close()


def stop_indexer(proc: subprocess.Popen) -> None:
    """Terminate the indexer; killed if it has not exited within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv: list[str] | None = None) -> None:
    """Command line (run inside ``unshare -n`` by run.py)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--dynamo-python", required=True)
    p.add_argument("--port", type=int, default=18090)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--queries", type=Path, required=True)
    p.add_argument("--repeat", type=int, default=200)
    a = p.parse_args(argv)
    out = run(a.workload, a.replicas, a.dynamo_python, a.port, a.threads, a.queries, a.repeat)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
