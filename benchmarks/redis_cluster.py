"""The precise index on a Redis Cluster beside one Redis, measured in the same run.

- apply: one generated multi-replica vLLM workload (benchmarks/gen_workload.py, evictions on),
  decoded once, applied through ``RedisPreciseStore`` on one Redis and on a 3-master cluster, every
  stream concurrently over ``--clients`` clients; then again with every client offering every
  batch (leaderless replicas: each applied exactly once);
- match: an 8k-token prompt (512 blocks of 16) at ``--pods`` pods, p50/p99 of ``match`` with the
  model, the two stores taking turns.

What a cluster buys is room and failover, not speed for one model: every key of one model shares a
hash tag (one slot, one master), so a cluster spreads models over its masters, and every script
first checks the node it runs on (``kvindex/index/lua/store_guard.lua``: its replication id and
that its slot is not migrating). These figures are that check's and the cluster client's cost.

Invariants: both Redis states are checked equal to the memory backend's (blocks held, entries,
matches) before any figure is reported; every server is started for the run (tests/redis_server.py)
and always stopped. ``--smoke`` runs everything small. JSON goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import BLOCK_SIZE, MODEL, RESULTS, latency_summary, machine  # noqa: E402
from redis_precise import (  # noqa: E402
    apply_memory,
    apply_redis,
    build_match_scene,
    generate,
    interleaved,
    same_state,
    workload_args,
)

from kvindex.index.factory import CONNECT_TIMEOUT, SOCKET_TIMEOUT  # noqa: E402
from kvindex.index.memory import MemoryPreciseStore  # noqa: E402
from kvindex.index.redis_cluster import cluster_client  # noqa: E402
from kvindex.index.redis_precise import RedisPreciseStore  # noqa: E402
from kvindex.storeurl import is_cluster  # noqa: E402
from tests.redis_server import RedisClusterServers, RedisServer  # noqa: E402


def client_of(url: str) -> Any:
    import redis.asyncio as aioredis

    if is_cluster(url):
        return cluster_client(url, socket_timeout=SOCKET_TIMEOUT, connect_timeout=CONNECT_TIMEOUT)
    return aioredis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=CONNECT_TIMEOUT)


async def opened(url: str, n: int, flush: Any) -> tuple[list[Any], list[RedisPreciseStore]]:
    flush()
    clients = [client_of(url) for _ in range(n)]
    stores = [RedisPreciseStore(c) for c in clients]
    for s in stores:
        await s.open()
    return clients, stores


async def bench_store(args: argparse.Namespace, url: str, flush: Any, batches: list, mem: MemoryPreciseStore,
                      keys_of: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for every in (False, True):
        clients, stores = await opened(url, args.clients, flush)
        try:
            seconds, outcomes = await apply_redis(stores, batches, every_client=every)
            await same_state(mem, stores[0])
        finally:
            for c in clients:
                await c.aclose()
        if outcomes.get("applied") != len(batches):
            raise SystemExit(f"{url}: outcomes {outcomes}: each batch must apply exactly once")
        out["every_client_offers_every_batch" if every else "apply"] = {
            "seconds": seconds, "batches_per_s": len(batches) / seconds, "outcomes": outcomes}
    clients, stores = await opened(url, 1, flush)
    out["client"] = clients[0]
    out["store"] = stores[0]
    await stores[0].set_block_size(MODEL, BLOCK_SIZE)
    out["keys"] = await keys_of(stores[0])
    return out


async def run(args: argparse.Namespace, urls: dict[str, str], flushes: dict[str, Any]) -> dict[str, Any]:
    batches, ops = generate(args.streams, args.blocks, args.capacity)
    mem, mem_s = await apply_memory(batches)
    scene_mem = MemoryPreciseStore()
    await scene_mem.set_block_size(MODEL, BLOCK_SIZE)
    keys = await build_match_scene([scene_mem], args.pods, args.background, 7)
    want = await scene_mem.match(keys)
    results = {}
    for name, url in urls.items():
        results[name] = await bench_store(args, url, flushes[name], batches, mem,
                                          lambda s: build_match_scene([s], args.pods, args.background, 7))
    try:
        cases = {name: (lambda s=r["store"]: s.match(keys, model=MODEL)) for name, r in results.items()}
        for name, call in cases.items():
            if await call() != want:
                raise SystemExit(f"{name}: match differs from memory")
        seconds = await interleaved(cases, args.match_iters)
    finally:
        for r in results.values():
            await r.pop("client").aclose()
            r.pop("store"), r.pop("keys")
    doc: dict[str, Any] = {"machine": machine(), "load_average": os.getloadavg(), "args": vars(args),
                           "batches": len(batches), "block_ops": ops, "memory_apply_seconds": mem_s}
    for name, r in results.items():
        doc[name] = {**r, "match": latency_summary(seconds[name])}
    one, cl = doc["one_redis"], doc["cluster"]
    doc["ratios_cluster_vs_one_redis"] = {
        "apply_batches_per_s": cl["apply"]["batches_per_s"] / one["apply"]["batches_per_s"],
        "every_client_batches_per_s": (cl["every_client_offers_every_batch"]["batches_per_s"]
                                       / one["every_client_offers_every_batch"]["batches_per_s"]),
        "match_p50": cl["match"]["p50_us"] / one["match"]["p50_us"],
        "match_p99": cl["match"]["p99_us"] / one["match"]["p99_us"]}
    return doc


def report(doc: dict[str, Any]) -> None:
    print(f"apply: {doc['batches']} batches, {doc['block_ops']} block ops; machine load average "
          f"{doc['load_average'][0]:.2f} on {os.cpu_count()} cores")
    for name in ("one_redis", "cluster"):
        r = doc[name]
        print(f"  {name:<10} apply {r['apply']['batches_per_s']:>8,.0f} batches/s   every client offers every batch "
              f"{r['every_client_offers_every_batch']['batches_per_s']:>8,.0f} batches/s   match p50 "
              f"{r['match']['p50_us']:>6.0f} us  p99 {r['match']['p99_us']:>6.0f} us")
    print("  cluster / one Redis: " + ", ".join(f"{k} {v:.2f}" for k, v in doc["ratios_cluster_vs_one_redis"].items()))


def main() -> None:
    args = workload_args(__doc__.splitlines()[0])
    out = args.out or RESULTS / ("redis_cluster_smoke.json" if args.smoke else "redis_cluster.json")
    base = Path(tempfile.mkdtemp(prefix="kvi-bench-cluster-"))
    one = RedisServer(base / "one").start()
    cluster = None
    try:
        cluster = RedisClusterServers(base / "cluster", masters=3).start()
        doc = asyncio.run(run(args, {"one_redis": one.url, "cluster": cluster.url},
                              {"one_redis": one.flush, "cluster": cluster.flush}))
    finally:
        one.stop()
        if cluster is not None:
            cluster.stop()
    doc["args"]["out"] = str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str))
    report(doc)


if __name__ == "__main__":
    main()
