"""``kvindex serve`` in one process against ``--workers 2``, in the same run, as a user measures it.

The harness of issue 38 (the pattern that showed ``--workers 2`` answering /query in ~25 ms):
a ``kvindex serve`` subprocess (``--workers 1`` then ``--workers 2``, the order alternating per
round), its engines registered through ``POST /register``; a publisher process (``e2e.py publish``:
one PUB per replica on tcp://127.0.0.1) sends the burst as fast as ZeroMQ takes it, then one marker
block per replica, and the harness polls ``/query`` for each marker until every replica shows it
(the ingest time: publisher's go to the last marker visible). Then ``--queries`` sequential
8k-token ``/query`` (Dynamo API, ``token_ids``) and as many ``/query_by_hash``, each on one
keep-alive ``http.client`` connection (what a user's script does: no TCP_NODELAY on its side).

The workload (``workload``): ``--replicas`` engines, vLLM map dialect, int hashes, each an LRU cache
of ``--capacity`` blocks; requests share a few 8k-token prefixes, are prefilled in 128-block chunks
(one batch per chunk, with the evictions it caused) and decode in batches of ~8 one-block events;
~24 block operations a batch on average.

Printed (and written to ``--out`` as JSON): per mode ingest block-ops/s, /query and /query_by_hash
p50/p99, then the ratios ``--workers 2`` / one process: ingest (>= 1.0 is the goal) and latency
(<= 1.5 is the goal), the median over ``--rounds``. The matched tokens of every query must be the
same in both modes (mismatches counted). No assertion on timings; ``--smoke`` is a tiny run.

Measured (2 shared cores, ``--blocks 1000000 --rounds 3``, 22.7 block-ops a batch; --workers 2 /
one process, medians; ``--kvindex-root`` a checkout of fe64b40 for "before"): marker polls 5 ms
apart: ingest 1.35x -> 1.38x, /query p50 1.66x -> 1.28x, p99 1.43x -> 1.33x, /query_by_hash p50
1.51x -> 1.35x, p99 1.66x -> 1.45x; polls back to back (``--poll-sleep 0``): ingest 1.47x -> 1.45x,
/query p50 1.43x -> 1.14x, p99 1.41x -> 1.03x, /query_by_hash p50 1.26x -> 1.25x, p99 1.47x -> 1.42x;
0 mismatches. No pattern tried here gave the issue's ~25 ms (see the commit that added this file).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import e2e  # noqa: E402
from common import BLOCK_SIZE, MODEL  # noqa: E402

from kvindex import keys as K  # noqa: E402
from kvindex.tools.engine_sim import block_removed, block_stored, encode_batch  # noqa: E402
from kvindex.tools.workload import write_messages  # noqa: E402

PREFILL_CHUNK = 128  # blocks per chunked-prefill batch
DECODE_EVENTS = 8  # one-block BlockStored events per decode batch
PREFIX_BLOCKS = 512  # a shared prefix: 8k tokens
MARKER_BASE = 3_000_000  # marker token ids (never in the workload)
MASK = (1 << 64) - 1


class Replica:
    """One engine's LRU block cache (hash -> None, oldest first) and its batches."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.batches: list[list[dict]] = []
        self.ops = 0

    def _store(self, hashes: list[int], parent: int | None, tokens: list[int]) -> list[dict]:
        events: list[dict] = []
        evicted = []
        for h in hashes:
            if h in self.lru:
                self.lru.move_to_end(h)
                continue
            while len(self.lru) >= self.capacity:
                evicted.append(self.lru.popitem(last=False)[0])
            self.lru[h] = None
        if evicted:
            events.append({**block_removed(evicted[0]), "block_hashes": evicted})
        events.append(block_stored(hashes, parent, tokens, BLOCK_SIZE))
        self.ops += len(evicted) + len(hashes)
        return events

    def request(self, rng: random.Random, prefix: list[int], suffix_blocks: int, decode_blocks: int) -> None:
        """A prompt (``prefix`` + a unique suffix) prefilled in chunks, then its decode blocks."""
        tokens = prefix + [rng.randrange(1 << 20) + 100_000 for _ in range(suffix_blocks * BLOCK_SIZE)]
        hashes, h = [], 0
        for i in range(len(tokens) // BLOCK_SIZE):
            h = hash((h, *tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])) & MASK
            hashes.append(h)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.lru:
            self.lru.move_to_end(hashes[hit])
            hit += 1
        for start in range(hit, len(hashes), PREFILL_CHUNK):
            part = hashes[start:start + PREFILL_CHUNK]
            parent = hashes[start - 1] if start else None
            self.batches.append(self._store(part, parent, tokens[start * BLOCK_SIZE:(start + len(part)) * BLOCK_SIZE]))
        batch: list[dict] = []
        for _ in range(decode_blocks):
            new = [rng.randrange(1 << 20) + 100_000 for _ in range(BLOCK_SIZE)]
            parent, h = h, hash((h, *new)) & MASK
            batch += self._store([h], parent, new)
            if len(batch) >= DECODE_EVENTS:
                self.batches.append(batch)
                batch = []
        if batch:
            self.batches.append(batch)


def workload(path: Path, replicas: int, capacity: int, block_ops: int, seed: int = 0) -> dict:
    """Writes the message file; returns its totals and the query prompts (the shared prefixes)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1 << 20) + 100_000 for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)] for _ in range(16)]
    reps = [Replica(capacity) for _ in range(replicas)]
    while sum(r.ops for r in reps) < block_ops:
        r = rng.randrange(replicas)
        reps[r].request(rng, prefixes[rng.randrange(len(prefixes))], rng.randrange(8, 120), rng.randrange(8, 48))
    messages, seqs = [], [0] * replicas
    pending = [list(reversed(r.batches)) for r in reps]
    ts = 1_760_000_000.0
    while any(pending):  # replicas interleaved, one batch each in turn
        for i, left in enumerate(pending):
            if left:
                messages.append((f"kv@pod-{i}@{MODEL}", seqs[i], encode_batch(left.pop(), ts)))
                seqs[i] += 1
                ts += 0.001
    batches = len(messages)
    for i in range(replicas):  # the markers: one block each, after the burst
        marker = [MARKER_BASE + i * BLOCK_SIZE + t for t in range(BLOCK_SIZE)]
        messages.append((f"kv@pod-{i}@{MODEL}", seqs[i], encode_batch([block_stored([MASK - i], None, marker,
                                                                                     BLOCK_SIZE)], ts)))
    write_messages(path, messages)
    ops = sum(r.ops for r in reps)
    return {"block_ops": ops, "batches": batches, "ops_per_batch": ops / batches, "queries": prefixes,
            "markers": [[MARKER_BASE + i * BLOCK_SIZE + t for t in range(BLOCK_SIZE)] for i in range(replicas)]}


# -- the daemon and its client ---------------------------------------------------------------------
class Client:
    """One keep-alive ``http.client`` connection, as a user's script opens it."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, path: str, body: bytes) -> dict:
        self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        if r.status >= 300:
            raise RuntimeError(f"{path}: {r.status} {data[:200]!r}")
        return json.loads(data)

    def close(self) -> None:
        self.conn.close()


def start_kvindex(workers: int, port: int, root: Path | None = None) -> subprocess.Popen:
    """``kvindex serve`` (this tree's, or ``root``'s: a baseline checkout with its native modules built)."""
    cmd = [sys.executable, "-m", "kvindex", "serve", "--port", str(port), "--workers", str(workers),
           "--log-level", "WARNING"]
    env = dict(os.environ, PYTHONPATH=str(root)) if root is not None else None
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                c.close()
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("kvindex did not start")


def scores(doc: dict) -> dict[str, int]:
    return {str(i): max(r.values()) for i, r in doc.get("scores", {}).items() if r and max(r.values())}


def one_run(wl: dict, path: Path, workers: int, queries: int, timeout: float, poll_sleep: float = 0.005,
            root: Path | None = None) -> dict:
    pub = e2e.Publisher(path)
    port = common.free_port()
    proc = start_kvindex(workers, port, root)
    client = Client(port)
    try:
        for i, ep in enumerate(pub.endpoints):
            client.post("/register", json.dumps({"instance_id": i + 1, "model_name": MODEL, "endpoint": ep,
                                                 "block_size": BLOCK_SIZE}).encode())
        time.sleep(2.0)  # SUB sockets connect, subscriptions land
        markers = [json.dumps({"token_ids": m, "model_name": MODEL}).encode() for m in wl["markers"]]
        t_go = time.perf_counter()
        pub.go()
        deadline = t_go + timeout
        for i, body in enumerate(markers):  # polled until visible, replica by replica
            while scores(client.post("/query", body)).get(str(i + 1), 0) < BLOCK_SIZE:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"marker of replica {i} not visible")
                if poll_sleep:
                    time.sleep(poll_sleep)
        secs = time.perf_counter() - t_go
        qbodies = [json.dumps({"token_ids": q, "model_name": MODEL}).encode() for q in wl["queries"]]
        hbodies = [json.dumps({"block_hashes": [h - (1 << 64) if h >= 1 << 63 else h
                                                for h in K.local_hashes(q, BLOCK_SIZE)],
                               "model_name": MODEL}).encode() for q in wl["queries"]]
        out: dict = {"workers": workers, "seconds": secs, "blocks_per_s": wl["block_ops"] / secs}
        for ep, bodies in (("/query", qbodies), ("/query_by_hash", hbodies)):
            times, matched = [], []
            for n in range(queries):
                t0 = time.perf_counter()
                doc = client.post(ep, bodies[n % len(bodies)])
                times.append(time.perf_counter() - t0)
                if n < len(bodies):
                    matched.append(scores(doc))
            out[ep] = {**common.latency_summary(times), "matched": matched}
        return out
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        pub.close()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--capacity", type=int, default=26_000, help="blocks per replica's cache (26,000)")
    p.add_argument("--blocks", type=int, default=1_000_000, help="block operations in the burst (1M)")
    p.add_argument("--queries", type=int, default=300, help="sequential requests per endpoint (300)")
    p.add_argument("--rounds", type=int, default=3, help="runs per mode; the median ratio is reported (3)")
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--poll-sleep", type=float, default=0.005, help="seconds between two polls of a marker "
                   "(0: back to back)")
    p.add_argument("--kvindex-root", type=Path, help="serve another checkout's kvindex (a baseline, native "
                   "modules built in place)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.smoke:
        a.blocks, a.capacity, a.queries, a.rounds = 60_000, 4_000, 30, 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "burst.bin"
        wl = workload(path, a.replicas, a.capacity, a.blocks)
        print(f"workload: {a.replicas} replicas, {wl['block_ops']:,} block-ops in {wl['batches']:,} batches "
              f"({wl['ops_per_batch']:.1f} a batch)", flush=True)
        rounds = []
        for r in range(a.rounds):
            order = (1, 2) if r % 2 == 0 else (2, 1)
            res = {w: one_run(wl, path, w, a.queries, a.timeout, a.poll_sleep, a.kvindex_root) for w in order}
            one, two = res[1], res[2]
            ratio = {"ingest": two["blocks_per_s"] / one["blocks_per_s"]}
            for ep in ("/query", "/query_by_hash"):
                for q in ("p50_us", "p99_us"):
                    ratio[f"{ep} {q[:3]}"] = two[ep][q] / one[ep][q]
            mism = sum(x != y for ep in ("/query", "/query_by_hash") for x, y in zip(one[ep]["matched"],
                                                                                   two[ep]["matched"]))
            rounds.append({"one": one, "two": two, "ratio": ratio, "mismatches": mism})
            print(f"round {r + 1}: " + ", ".join(f"{w}: {res[w]['blocks_per_s']:,.0f} ops/s, /query p50 "
                                                 f"{res[w]['/query']['p50_us']:,.0f} us p99 {res[w]['/query']['p99_us']:,.0f} us,"
                                                 f" /query_by_hash p50 {res[w]['/query_by_hash']['p50_us']:,.0f} us"
                                                 for w in (1, 2)), flush=True)
    med = {k: statistics.median(r["ratio"][k] for r in rounds) for k in rounds[0]["ratio"]}
    doc = {"args": {k: str(v) for k, v in vars(a).items()}, "workload": {k: v for k, v in wl.items()
                                                                      if k not in ("queries", "markers")},
           "rounds": rounds, "median_ratio": med,
           "mismatches": sum(r["mismatches"] for r in rounds), "machine": common.machine()}
    print("--workers 2 / one process (median of %d): " % len(rounds)
          + ", ".join(f"{k} {v:.2f}x" for k, v in med.items()) + f"; mismatches {doc['mismatches']}")
    out = a.out or Path(__file__).resolve().parent / "results" / f"workers-latency-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    return doc


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
