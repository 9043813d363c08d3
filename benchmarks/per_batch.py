"""The per-batch fixed cost: µs per batch at 1, 4, 24 and 128 block operations a batch (issue 38 §1).

  python benchmarks/per_batch.py [--ops 1,4,24,128] [--rounds 3] [--scale 1.0] [--no-dynamo]
                                 [--dynamo-python ~/.cache/kvindex-dynamo-venv/bin/python] [--out FILE]

For each size a workload of 8 replicas is generated (vLLM ≥ 0.26 map dialect, int hashes; each
batch carries exactly ``ops`` block operations: BlockStored events of 1–8 blocks chained on the
replica's newest request, and 0–20% of the operations BlockRemoved, evicted tail-first from the
replica's oldest request, so every store's parent and every removal is known to an indexer that
saw the stream from the start). Each round measures, on the same bytes:

- ``decode``: the vLLM decoder alone (``adapters.vllm``), in this process;
- ``decode+apply``: decoder + ``PreciseIndex.apply_batch`` (the index's native core), in this process;
- ``lane``: every batch through a running ``Daemon``'s engine lane (``EngineLane.handle``: decode,
  seq rules, the store's judgement and apply, capacity, metrics), no sockets;
- ``kvindex e2e``: a publisher process (benchmarks/e2e.py ``publish``, one PUB per replica on
  tcp://127.0.0.1) -> a ``Daemon`` with one lane per replica, from the publisher's go to the last
  batch applied;
- ``dynamo e2e``: the same publisher -> Dynamo's standalone indexer (``python -m dynamo.indexer``,
  ai-dynamo-runtime 1.6.1) inside a private network namespace (``unshare -n``; its HTTP port binds
  0.0.0.0), from the go to the last event applied (its ``kv_cache_events_applied`` metric).

The table prints the median of the rounds per cell, and kvindex e2e / Dynamo e2e (< 1: kvindex
spends less per batch). Runs interleave kvindex and Dynamo per round so a shared machine's
other tenants hit both alike. Only loopback addresses are used; every process started here is
stopped here. Invariant: every message is applied (a run short of it raises, never reports).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from random import Random

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import e2e  # noqa: E402
from common import BLOCK_SIZE, MODEL  # noqa: E402

from kvindex.tools.engine_sim import block_removed, block_stored, encode_batch  # noqa: E402
from kvindex.tools.workload import read_messages, write_messages  # noqa: E402

REPLICAS = 8
OPS = (1, 4, 24, 128)
BATCHES = {1: 24_000, 4: 24_000, 24: 12_000, 128: 4_000}  # ~0.5-2 s a run at today's speed
DYNAMO_PYTHON = str(Path.home() / ".cache" / "kvindex-dynamo-venv" / "bin" / "python")


# -- the workload ---------------------------------------------------------------------------------
class _Replica:
    """One simulated engine: its requests (chains of hashes), oldest first."""

    def __init__(self, rng: Random) -> None:
        self.rng = rng
        self.chains: list[list[int]] = []
        self.seq = 0

    def batch(self, ops: int) -> list[dict]:
        rng = self.rng
        held = sum(len(c) for c in self.chains)
        removals = min(held, int(ops * rng.uniform(0.0, 0.2) + rng.random()))
        if ops > 1:
            removals = min(removals, ops - 1)
        events: list[dict] = []
        left = removals
        while left:  # tail-first from the oldest request: children before parents
            chain = self.chains[0]
            k = min(left, len(chain))
            gone = chain[-k:][::-1]
            del chain[-k:]
            if not chain:
                self.chains.pop(0)
            events.append(block_removed(gone[0]) | {"block_hashes": gone})
            left -= k
        stores = ops - removals
        while stores:
            k = min(stores, rng.randint(1, 8))
            if self.chains and rng.random() < 0.7:  # the newest request goes on (decode / next chunk)
                chain = self.chains[-1]
            else:
                chain = []
                self.chains.append(chain)
            hashes = [rng.getrandbits(63) | 1 for _ in range(k)]
            tokens = [rng.randrange(1, 32000) for _ in range(k * BLOCK_SIZE)]
            events.append(block_stored(hashes, chain[-1] if chain else None, tokens, BLOCK_SIZE))
            chain.extend(hashes)
            stores -= k
        return events


def workload(ops: int, batches: int, cache: Path | None = None) -> common.Workload:
    """``batches`` batches of ``ops`` block operations over REPLICAS topics, round robin (cached)."""
    cache = cache or common.RESULTS / "workloads"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"perbatch_o{ops}_n{batches}_r{REPLICAS}.bin"
    side = path.with_name(path.name + ".json")
    topics = [f"kv@pod-{i}@{MODEL}" for i in range(REPLICAS)]
    if not (path.exists() and side.exists()):
        rng = Random(38_000 + ops)
        reps = [_Replica(rng) for _ in topics]
        msgs, stored, removed = [], 0, 0
        for n in range(batches):
            i = n % REPLICAS
            evs = reps[i].batch(ops)
            for ev in evs:
                if ev["type"] == "BlockStored":
                    stored += len(ev["block_hashes"])
                else:
                    removed += len(ev["block_hashes"])
            msgs.append((topics[i], reps[i].seq, encode_batch(evs, 1_760_000_000.0 + n * 1e-3)))
            reps[i].seq += 1
        write_messages(path, msgs)
        per = [sum(1 for t, _, _ in msgs if t == topic) for topic in topics]
        side.write_text(json.dumps({"params": {"ops": ops, "batches": batches, "replicas": REPLICAS},
                                    "topics": topics, "queries": [],
                                    "stats": {"block_ops": stored + removed, "block_stored": stored,
                                              "block_removed": removed, "batches_per_replica": per}}))
    return common.Workload(path, REPLICAS, list(read_messages(path)), json.loads(side.read_text()))


# -- in process -------------------------------------------------------------------------------------
def inproc(wl: common.Workload) -> dict[str, float]:
    """µs per batch: decode alone, decode + the index's apply_batch (no sockets, no lane)."""
    from adapters.dialects import DIALECTS
    from kvindex.index.memory import new_precise_index
    from kvindex.ingest.streams import split_topic

    pods = {t: split_topic(t)[0] or t for t in wl.topics}
    decoders = {t: DIALECTS["vllm"].decoder() for t in wl.topics}
    n = len(wl.messages)
    t0 = time.perf_counter()
    for topic, _seq, payload in wl.messages:
        decoders[topic].decode(payload)
    decode = time.perf_counter() - t0
    decoders = {t: DIALECTS["vllm"].decoder() for t in wl.topics}
    index = new_precise_index()
    index.set_block_size(MODEL, BLOCK_SIZE)
    apply = index.apply_batch
    t0 = time.perf_counter()
    for topic, _seq, payload in wl.messages:
        batch = decoders[topic].decode(payload)
        apply(pods[topic], MODEL, batch.dp_rank, batch.events)
    both = time.perf_counter() - t0
    return {"decode": decode / n * 1e6, "decode+apply": both / n * 1e6}


async def lane_run(wl: common.Workload) -> float:
    """µs per batch through a running Daemon's lane (``handle``), its socket idle."""
    from kvindex.daemon import Daemon
    from kvindex.events import Frame

    daemon = Daemon(e2e.daemon_config(["tcp://127.0.0.1:1"]))  # nobody publishes there
    await daemon.start()
    try:
        lane = next(iter(daemon.fleet.lanes().values()))
        frames = [Frame(t, s, p) for t, s, p in wl.messages]
        handle = lane.handle
        t0 = time.perf_counter()
        for f in frames:
            await handle(f)
        secs = time.perf_counter() - t0
        applied = sum(st.batches for st in lane.state.streams.values())
        if applied != len(frames):
            raise RuntimeError(f"lane applied {applied} of {len(frames)} batches")
        return secs / len(frames) * 1e6
    finally:
        await daemon.stop()


async def kvindex_e2e(wl: common.Workload) -> float:
    """µs per batch: publisher process -> Daemon lanes, go to last batch applied."""
    from kvindex.daemon import Daemon

    pub = e2e.Publisher(wl.path)
    daemon = Daemon(e2e.daemon_config(pub.endpoints))
    await daemon.start()
    try:
        await e2e.wait_connected(daemon, len(pub.endpoints))
        first = e2e.record_first_apply(daemon)
        t_go = time.time()
        pub.go()
        got = await e2e.wait_ingested(daemon, t_go, first, len(wl.messages), 120.0)
        await asyncio.to_thread(pub.sent)
        if got["messages"] != len(wl.messages) or got["gaps"] or got["unsynced"]:
            raise RuntimeError(f"kvindex e2e incomplete: {got}")
        return got["seconds"] / len(wl.messages) * 1e6
    finally:
        await daemon.stop()
        pub.close()


# -- Dynamo (the child runs inside unshare -n) -----------------------------------------------------
def dynamo_child(paths: list[Path], python: str, threads: int) -> list[float]:
    """µs per batch for each workload file: publisher -> dynamo.indexer, go to last event applied."""
    import dynamo_peer as dp

    subprocess.run(["ip", "link", "set", "lo", "up"], check=False)
    out = []
    for path in paths:
        total = dp.count_events(path)
        batches = sum(1 for _ in read_messages(path))
        pub = e2e.Publisher(path)
        port = common.free_port()
        log = path.with_name(path.stem + ".dynamo-indexer.log")
        proc = dp.start_indexer(python, port, pub.endpoints, threads, log)
        try:
            dp.wait_active(port, len(pub.endpoints))
            t_go = time.perf_counter()
            pub.go()
            got = dp.wait_applied(port, total, 120.0, proc, log, t_go)
            pub.sent()
            if got["events_ok"] != total:
                raise RuntimeError(f"Dynamo applied {got['events_ok']} of {total} events ({got['events_failed']} failed)")
            out.append(got["seconds"] / batches * 1e6)
        finally:
            dp.stop_indexer(proc)
            pub.close()
    return out


def run_dynamo(paths: list[Path], python: str, threads: int) -> list[float]:
    cmd = ["unshare", "-n", sys.executable, str(Path(__file__).resolve()), "dynamo-child", "--dynamo-python", python,
           "--threads", str(threads), *(x for path in paths for x in ("--workload", str(path)))]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise RuntimeError(f"dynamo child exited {res.returncode}: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# -- the table --------------------------------------------------------------------------------------
COLUMNS = ("decode", "decode+apply", "lane", "kvindex e2e", "dynamo e2e")


def table(rows: dict[int, dict[str, list[float]]]) -> str:
    head = ["ops/batch", *(f"{c} µs" for c in COLUMNS), "kvindex/dynamo"]
    lines = ["  ".join(f"{h:>14}" for h in head)]
    for ops, cells in rows.items():
        med = {c: statistics.median(v) if v else float("nan") for c, v in cells.items()}
        ratio = med["kvindex e2e"] / med["dynamo e2e"] if cells["dynamo e2e"] else float("nan")
        vals = [f"{ops:>14}", *(f"{med[c]:>14.2f}" for c in COLUMNS), f"{ratio:>14.2f}"]
        lines.append("  ".join(vals))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="run", choices=["run", "dynamo-child"])
    p.add_argument("--workload", dest="paths", action="append", type=Path, default=[],
                   help="dynamo-child: a workload file (repeatable)")
    p.add_argument("--ops", default=",".join(map(str, OPS)), help="block operations a batch (default 1,4,24,128)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (the median is reported)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the batches of every size")
    p.add_argument("--no-dynamo", action="store_true")
    p.add_argument("--no-e2e", action="store_true", help="in-process lines only")
    p.add_argument("--dynamo-python", default=DYNAMO_PYTHON)
    p.add_argument("--threads", type=int, default=2, help="Dynamo indexer --threads (default 2, as run.py)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.what == "dynamo-child":
        print(json.dumps(dynamo_child(a.paths, a.dynamo_python, a.threads)))
        return
    sizes = [int(x) for x in a.ops.split(",")]
    wls = {ops: workload(ops, max(REPLICAS, int(BATCHES.get(ops, 8000) * a.scale))) for ops in sizes}
    dynamo = not a.no_dynamo and not a.no_e2e and Path(a.dynamo_python).exists()
    rows: dict[int, dict[str, list[float]]] = {ops: {c: [] for c in COLUMNS} for ops in sizes}
    for r in range(a.rounds):
        for ops, wl in wls.items():
            cells = rows[ops]
            for k, v in inproc(wl).items():
                cells[k].append(v)
            cells["lane"].append(common.run_daemon(lane_run(wl)))
            if not a.no_e2e:
                cells["kvindex e2e"].append(common.run_daemon(kvindex_e2e(wl)))
        if dynamo:
            for ops, us in zip(wls, run_dynamo([w.path for w in wls.values()], a.dynamo_python, a.threads)):
                rows[ops]["dynamo e2e"].append(us)
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    print(table(rows))
    out = a.out or common.RESULTS / f"per_batch-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": common.machine(), "rounds": a.rounds, "rows": rows,
                               "block_ops": {ops: wl.block_ops for ops, wl in wls.items()},
                               "batches": {ops: len(wl.messages) for ops, wl in wls.items()},
                               "event_loop": os.environ.get("KVINDEX_LOOP", "auto")}, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
