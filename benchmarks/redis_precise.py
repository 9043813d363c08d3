"""The precise index on Redis against the in-memory backend, measured in the same run.

- apply: one generated multi-replica vLLM workload (benchmarks/gen_workload.py, evictions on),
  decoded once, applied through ``MemoryPreciseStore`` (sequentially: it never awaits) and through
  ``RedisPreciseStore`` with every stream applying concurrently over ``--clients`` clients; then
  again with every client offering every batch (leaderless replicas: each applied exactly once);
- memory: ``INFO memory`` used_memory per (block, pod) entry, and ``MEMORY USAGE`` of sample keys;
- match: an 8k-token prompt (512 blocks of 16) at ``--pods`` pods, p50/p99 of ``match`` with the
  model (one round trip) and without, and of the memory backend.

Invariants: the Redis state is checked equal to the memory state (blocks held, entries, matches)
before any figure is reported; a redis-server is started for the run (tests/redis_server.py) and
always stopped. ``--smoke`` runs everything small. JSON goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import redis.asyncio as aioredis  # noqa: E402
from common import (  # noqa: E402
    BLOCK_SIZE,
    MODEL,
    QUERY_BLOCKS,
    RESULTS,
    latency_summary,
    machine,
    pct,
)

from adapters.dialects import DIALECTS  # noqa: E402
from kvindex import keys as K  # noqa: E402
from kvindex.events import BlockStored  # noqa: E402
from kvindex.index.memory import MemoryPreciseStore
from kvindex.index.redis_precise import RedisPreciseStore
from kvindex.ingest.streams import split_topic
from kvindex.sequence import Outcome, StreamRef
from kvindex.tools.workload import read_messages
from tests.redis_server import RedisServer  # noqa: E402

Batch = tuple[StreamRef, int, int, tuple]




def generate(replicas: int, blocks: int, capacity: int) -> tuple[list[Batch], int]:
    """Decoded batches of a generated workload (cached under results/workloads); block ops."""
    cache = RESULTS / "workloads"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"redis_r{replicas}_b{blocks}_c{capacity}.bin"
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gen_workload.py"), str(path), "--replicas",
                        str(replicas), "--blocks", str(blocks), "--routing", "rr", "--capacity", str(capacity),
                        "--block-size", str(BLOCK_SIZE), "--queries", "0", "--model", MODEL, "--quiet"], check=True)
    decode = DIALECTS["vllm"].decoder().decode
    out, ops = [], 0
    for topic, seq, payload in read_messages(path):
        batch = decode(payload)
        pod = split_topic(topic)[0]
        out.append((StreamRef.of(pod, topic, MODEL), seq, batch.dp_rank, batch.events))
        ops += sum(len(getattr(ev, "block_hashes", ())) for ev in batch.events)
    return out, ops


async def apply_memory(batches: list[Batch]) -> tuple[MemoryPreciseStore, float]:
    mem = MemoryPreciseStore()
    await mem.set_block_size(MODEL, BLOCK_SIZE)
    t0 = time.perf_counter()
    for stream, seq, rank, events in batches:
        await mem.apply(stream, seq, 0, rank, events)
    return mem, time.perf_counter() - t0


async def apply_redis(stores: list[RedisPreciseStore], batches: list[Batch], every_client: bool) -> tuple[float, dict[str, int]]:
    """Each stream applied in order by its own task (all streams at once); ``every_client``: every
    client offers every batch, as leaderless replicas do. Returns seconds and outcome counts."""
    by_stream: dict[str, list[Batch]] = {}
    for b in batches:
        by_stream.setdefault(b[0].id, []).append(b)
    outcomes: dict[str, int] = {}

    async def feed(store: RedisPreciseStore, mine: list[Batch]) -> None:
        for stream, seq, rank, events in mine:
            r = await store.apply(stream, seq, 0, rank, events)
            outcomes[r.outcome.value] = outcomes.get(r.outcome.value, 0) + 1

    jobs = []
    for i, mine in enumerate(by_stream.values()):
        chosen = stores if every_client else [stores[i % len(stores)]]
        jobs += [feed(s, mine) for s in chosen]
    t0 = time.perf_counter()
    await asyncio.gather(*jobs)
    return time.perf_counter() - t0, outcomes


async def same_state(mem: MemoryPreciseStore, red: RedisPreciseStore) -> None:
    pods = await mem.pods()
    if await red.pods() != pods:
        raise SystemExit("redis and memory disagree on pods")
    for pod in pods:
        if await red.blocks_held(pod) != await mem.blocks_held(pod):
            raise SystemExit(f"redis and memory disagree on blocks held by {pod}")
    if sorted(await red.export_entries()) != sorted(await mem.export_entries()):
        raise SystemExit("redis and memory disagree on entries")


async def used_memory(client: aioredis.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def sample_usage(client: aioredis.Redis) -> dict[str, Any]:
    """MEMORY USAGE of a few keys of each kind, per key and per holder bit or hash field."""
    out: dict[str, Any] = {}
    for kind, pattern, count in (("holder_bitmaps", "*}:g:*", client.bitcount), ("engine_hashes", "*}:b:*", client.hlen)):
        keys = [k async for k in client.scan_iter(match=pattern, count=1000)][:200]
        total = sum([await client.memory_usage(k, samples=0) or 0 for k in keys])
        items = sum([await count(k) for k in keys])
        out[kind] = {"keys_sampled": len(keys), "bytes_per_key": round(total / len(keys), 1) if keys else None,
                     "bytes_per_item": round(total / items, 1) if items else None}
    return out


async def time_split(client: aioredis.Redis, cpu_s: float, batches: int) -> dict[str, float]:
    """Per batch: this process's CPU (client Python, redis-py, syscalls), the scripts' time inside
    Redis (INFO commandstats, reset before the run) and the script calls (round trips)."""
    stats = (await client.info("commandstats")).get("cmdstat_evalsha", {})
    return {"client_cpu_us_per_batch": cpu_s * 1e6 / batches,
            "server_script_us_per_batch": stats.get("usec", 0) / batches,
            "script_calls_per_batch": stats.get("calls", 0) / batches}


async def fresh(stores: list[RedisPreciseStore], client: aioredis.Redis) -> None:
    await client.flushall()
    for s in stores:
        await s.open()


async def apply_sequential(store: RedisPreciseStore, batches: list[Batch]) -> float:
    """One client, one batch at a time in publish order: two round trips per batch, no overlap."""
    t0 = time.perf_counter()
    for stream, seq, rank, events in batches:
        await store.apply(stream, seq, 0, rank, events)
    return time.perf_counter() - t0


def rates(seconds: float, batches: int, ops: int, streams: int, mem_s: float) -> dict[str, float]:
    return {"seconds": seconds, "batches_per_s": batches / seconds, "block_ops_per_s": ops / seconds,
            "batches_per_s_per_stream": batches / seconds / streams, "ratio_vs_memory": mem_s / seconds}


async def bench_apply(args: argparse.Namespace, url: str) -> tuple[dict[str, Any], MemoryPreciseStore]:
    batches, ops = generate(args.streams, args.blocks, args.capacity)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mem, _ = await apply_memory(batches)
    mem_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    mem, mem_s = await apply_memory(batches)  # timed without tracing
    clients = [aioredis.Redis.from_url(url) for _ in range(args.clients)]
    stores = [RedisPreciseStore(c) for c in clients]
    try:
        await fresh(stores, clients[0])
        base_mem = await used_memory(clients[0])
        await clients[0].config_resetstat()
        cpu0 = time.process_time()
        red_s, outcomes = await apply_redis(stores, batches, every_client=False)
        split = await time_split(clients[0], time.process_time() - cpu0, len(batches))
        await same_state(mem, stores[0])
        entries = len(await mem.export_entries())
        used = await used_memory(clients[0]) - base_mem
        usage = await sample_usage(clients[0])
        await fresh(stores, clients[0])
        rep_s, rep_outcomes = await apply_redis(stores, batches, every_client=True)
        await same_state(mem, stores[0])
        await fresh(stores, clients[0])
        seq_s = await apply_sequential(stores[0], batches)
        await same_state(mem, stores[0])
    finally:
        for c in clients:
            await c.aclose()
    if outcomes != {"applied": len(batches)} or rep_outcomes.get("applied") != len(batches):
        raise SystemExit(f"outcomes {outcomes} / {rep_outcomes}: each batch must apply exactly once")
    n, k = len(batches), args.streams
    result = {
        "batches": n, "block_ops": ops, "streams": k, "clients": args.clients,
        "memory": rates(mem_s, n, ops, k, mem_s),
        "redis": {**rates(red_s, n, ops, k, mem_s), **split},
        "redis_one_batch_at_a_time": rates(seq_s, n, ops, k, mem_s),
        "redis_every_client_offers_every_batch": {**rates(rep_s, n, ops, k, mem_s), "outcomes": rep_outcomes},
        "entry_memory": {"entries": entries, "redis_used_memory_delta": used,
                         "redis_bytes_per_entry": round(used / entries, 1) if entries else None,
                         "memory_backend_bytes_per_entry": round(mem_bytes / entries, 1) if entries else None,
                         "ratio_vs_memory": round(used / mem_bytes, 2) if mem_bytes else None,
                         "redis_samples": usage},
    }
    return result, mem


async def build_match_scene(stores: list[Any], pods: int, background: int, seed: int) -> list[int]:
    """``pods`` pods holding the 8k prompt to various depths (a quarter in full), plus
    ``background`` blocks of other prompts each. Returns the prompt's 512 keys."""
    rng = random.Random(seed)
    tokens = [rng.randrange(1, 32000) for _ in range(QUERY_BLOCKS * BLOCK_SIZE)]
    keys = K.prompt_keys(K.root_key(MODEL), tokens, BLOCK_SIZE)
    for i in range(pods):
        depth = QUERY_BLOCKS if i < pods // 4 else rng.randrange(0, QUERY_BLOCKS + 1)
        other = [rng.randrange(1, 32000) for _ in range(background * BLOCK_SIZE)]
        events = (BlockStored(tuple(range(i << 20, (i << 20) + depth)), None, array("I", tokens[:depth * BLOCK_SIZE]), BLOCK_SIZE),
                  BlockStored(tuple(range((i << 20) + 600, (i << 20) + 600 + background)), None, array("I", other), BLOCK_SIZE))
        stream = StreamRef.of(f"pod-{i}", f"kv@pod-{i}@{MODEL}", MODEL)
        for s in stores:
            assert (await s.apply(stream, 0, 0, 0, events)).outcome is Outcome.APPLIED
    return keys


async def interleaved(cases: dict[str, Any], iters: int) -> dict[str, list[float]]:
    """Seconds per call of each case, the cases taking turns (so a noisy neighbour on the machine
    hits them alike), with the garbage collector paused."""
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    gc.collect()
    gc.disable()
    try:
        for _ in range(iters):
            for name, call in cases.items():
                t0 = time.perf_counter()
                await call()
                seconds[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return seconds


async def bench_match(args: argparse.Namespace, url: str) -> dict[str, Any]:
    client = aioredis.Redis.from_url(url)
    try:
        await client.flushall()
        red = RedisPreciseStore(client)
        await red.open()
        mem = MemoryPreciseStore()
        for s in (mem, red):
            await s.set_block_size(MODEL, BLOCK_SIZE)
        keys = await build_match_scene([mem, red], args.pods, args.background, 7)
        pods = [f"pod-{i}" for i in range(args.pods)]
        out: dict[str, Any] = {"pods": args.pods, "blocks": len(keys), "background_blocks_per_pod": args.background}
        cases = {"memory": lambda: mem.match(keys), "redis_model": lambda: red.match(keys, model=MODEL),
                 "redis_model_pods": lambda: red.match(keys, pods, model=MODEL), "redis_no_model": lambda: red.match(keys)}
        want = await mem.match(keys)
        for name, call in cases.items():  # warm up (script cache, connection) and check
            if await call() != want:
                raise SystemExit(f"{name}: match differs from memory")
        seconds = await interleaved(cases, args.match_iters)
        for name, s in seconds.items():
            out[name] = {**latency_summary(s), "p90_us": pct([x * 1e6 for x in s], 90),
                         "over_2ms_fraction": sum(x > 0.002 for x in s) / len(s)}
        for name in ("redis_model", "redis_model_pods"):  # the script's own time, as Redis counts it
            await client.config_resetstat()
            for _ in range(100):
                await cases[name]()
            stats = (await client.info("commandstats")).get("cmdstat_evalsha", {})
            out[name]["server_us_per_call"] = stats.get("usec_per_call")
        out["matched_pods"] = len(want)
        out["p99_ratio_vs_memory"] = out["redis_model"]["p99_us"] / out["memory"]["p99_us"]
        out["target_p99_us"] = 2000
        return out
    finally:
        await client.aclose()


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    apply, _ = await bench_apply(args, url)
    match = await bench_match(args, url)
    return {"machine": machine(), "load_average": os.getloadavg(), "args": vars(args), "apply": apply, "match": match}


def report(doc: dict[str, Any]) -> None:
    a, m = doc["apply"], doc["match"]
    print(f"apply: {a['batches']} batches, {a['block_ops']} block ops, {a['streams']} streams, {a['clients']} clients")
    for name in ("memory", "redis", "redis_one_batch_at_a_time", "redis_every_client_offers_every_batch"):
        r = a[name]
        print(f"  {name:<38} {r['block_ops_per_s']:>11,.0f} block ops/s  {r['batches_per_s']:>8,.0f} batches/s "
              f"({r['batches_per_s_per_stream']:,.0f} per stream)  ratio vs memory {r['ratio_vs_memory']:.3f}")
    r = a["redis"]
    print(f"  per batch, concurrent run: client CPU {r['client_cpu_us_per_batch']:.0f} us, scripts in redis "
          f"{r['server_script_us_per_batch']:.0f} us over {r['script_calls_per_batch']:.2f} calls")
    print(f"  outcomes when every client offers every batch: {a['redis_every_client_offers_every_batch']['outcomes']}")
    em = a["entry_memory"]
    print(f"  bytes per (block, pod) entry over {em['entries']} entries: redis {em['redis_bytes_per_entry']}, "
          f"memory backend {em['memory_backend_bytes_per_entry']}, ratio {em['ratio_vs_memory']}")
    print(f"  redis samples: {em['redis_samples']}")
    print(f"match: {m['blocks']} blocks at {m['pods']} pods ({m['matched_pods']} matched); "
          f"machine load average {doc['load_average'][0]:.2f} on {os.cpu_count()} cores")
    for name in ("memory", "redis_model", "redis_model_pods", "redis_no_model"):
        server = m[name].get("server_us_per_call")
        print(f"  {name:<17} p50 {m[name]['p50_us']:>7.0f} us  p90 {m[name]['p90_us']:>7.0f} us  "
              f"p99 {m[name]['p99_us']:>7.0f} us  over 2 ms {100 * m[name]['over_2ms_fraction']:.1f}%"
              + (f"  (script {server:.0f} us in redis)" if server else ""))
    print(f"  redis p99 / memory p99 = {m['p99_ratio_vs_memory']:.1f} (target p99 <= {m['target_p99_us']} us)")


def workload_args(description: str) -> argparse.Namespace:
    """The command line of the Redis benchmarks (this one and redis_cluster.py): the workload's sizes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="everything small (seconds)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--blocks", type=int, default=120_000, help="block ops in the apply workload")
    p.add_argument("--capacity", type=int, default=4000, help="blocks per simulated engine (evictions)")
    p.add_argument("--pods", type=int, default=64)
    p.add_argument("--background", type=int, default=2000, help="other blocks per pod in the match scene")
    p.add_argument("--match-iters", type=int, default=1000)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        args.blocks, args.capacity, args.background, args.match_iters = 6000, 600, 50, 30
    return args


def main() -> None:
    args = workload_args(__doc__.splitlines()[0])
    out = args.out or RESULTS / ("redis_precise_smoke.json" if args.smoke else "redis_precise.json")
    server = RedisServer(Path(tempfile.mkdtemp(prefix="kvi-bench-redis-"))).start()
    try:
        doc = asyncio.run(run(args, server.url))
    finally:
        server.stop()
    doc["args"]["out"] = str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str))
    report(doc)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
