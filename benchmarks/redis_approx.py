"""Benchmark: the approximate index over Redis (RedisApproxStore) against memory, in one run.

``python benchmarks/redis_approx.py [--smoke] [--pods 64] [--out FILE]`` starts its own
redis-server (tests/redis_server.py, imported by path; persistence off), fills both backends with
the same beliefs (every pod recorded with distinct 8 KB prompts), then measures per call, each
backend in turn, sequentially from one client:

- ``record_refresh``: the same 8 KB prompt (128 blocks) re-recorded on one pod (refresh only);
- ``record_new``: a new 8 KB prompt each call (128 new keys);
- ``score``: score of an 8 KB prompt over all pods (Kthena, top-k 5; server-side walk);
- ``depth``: the same without the top-k cut-off (the drift audit's question);
- ``score_shared``: score of a prompt a quarter of the pods hold at staggered depths (the top-k
  fills within the deepest levels, so the walk stops early).

p50/p99 in microseconds and Redis/memory ratios, over a unix socket and over TCP loopback. Memory
per entry in Redis: the ``INFO memory`` ``used_memory`` delta over the fill divided by the entries
recorded, once with distinct prompts (every block its own hash -> pods set) and once with each
prompt recorded on 4 pods (sets shared), plus ``MEMORY USAGE`` of sample keys. Hashing (client
side, identical for both backends) is not part of the timed calls.

JSON goes to ``benchmarks/results/redis_approx.json`` (or ``--out``). No figure is asserted here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402
from common import RESULTS, latency_summary, machine  # noqa: E402

from kvindex.approx.hashing import hash_request  # noqa: E402
from kvindex.index.approx import ApproxIndex  # noqa: E402
from kvindex.index.memory import MemoryApproxStore
from kvindex.index.redis_approx import RedisApproxStore
from kvindex.settings import ApproxConfig, ApproxSettings
from tests.redis_server import RedisServer  # noqa: E402

MODEL = "bench-model"
OPS = ("record_refresh", "record_new", "score", "depth", "score_shared")




def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt_8kb(n: int) -> str:
    """A deterministic 8 KB prompt; distinct ``n`` differ from the first block on."""
    words = " ".join(f"w{(n * 7919 + i * 104729) % 32000}" for i in range(2000))
    return f"{n:08d} " + words[: 8192 - 9]


async def time_calls(call: Callable[[], Awaitable[Any]], repeat: int) -> list[float]:
    """Wall seconds of ``repeat`` awaited calls (after 3 warm-up calls)."""
    for _ in range(3):
        await call()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return out


async def fill(store: Any, pods: list[str], prompts_per_pod: int, copies: int, start: int = 0) -> int:
    """Record ``prompts_per_pod`` distinct prompts per pod, each on ``copies`` pods; entries added."""
    added = 0
    for i in range(prompts_per_pod * len(pods) // copies):
        hashes = hash_request(store.config, MODEL, {"prompt": prompt_8kb(start + i)})
        for c in range(copies):
            await store.record(pods[(i + c) % len(pods)], MODEL, hashes)
            added += len(hashes)
    return added


async def latencies(store: Any, pods: list[str], repeat: int) -> dict[str, Any]:
    """record_refresh / record_new / score / depth latency of one backend."""
    hashes = hash_request(store.config, MODEL, {"prompt": prompt_8kb(1)})
    shared = hash_request(store.config, MODEL, {"prompt": prompt_8kb(999_999)})
    for i, pod in enumerate(pods[: max(1, len(pods) // 4)]):
        await store.record(pod, MODEL, shared[: len(shared) - 4 * i])
    fresh = iter(range(10**6, 10**7))
    new_prompts = [hash_request(store.config, MODEL, {"prompt": prompt_8kb(next(fresh))}) for _ in range(repeat + 3)]
    queue = iter(new_prompts)
    out = {
        "record_refresh": await time_calls(lambda: store.record(pods[0], MODEL, hashes), repeat),
        "record_new": await time_calls(lambda: store.record(pods[1], MODEL, next(queue)), repeat),
        "score": await time_calls(lambda: store.score(MODEL, hashes, pods), repeat),
        "depth": await time_calls(lambda: store.depth(MODEL, hashes, pods), repeat),
        "score_shared": await time_calls(lambda: store.score(MODEL, shared, pods), repeat),
    }
    result: dict[str, Any] = {name: latency_summary(t) for name, t in out.items()}
    result["record_plus_score_p50_us"] = result["record_refresh"]["p50_us"] + result["score"]["p50_us"]
    result["answers"] = {"score": await store.score(MODEL, hashes, pods),
                         "depth": await store.depth(MODEL, hashes, pods),
                         "score_shared": await store.score(MODEL, shared, pods)}
    return result


def ratios(red: dict[str, Any], mem: dict[str, Any]) -> dict[str, Any]:
    out = {op: {"p50": red[op]["p50_us"] / mem[op]["p50_us"], "p99": red[op]["p99_us"] / mem[op]["p99_us"]}
           for op in OPS}
    out["record_plus_score_p50"] = red["record_plus_score_p50_us"] / mem["record_plus_score_p50_us"]
    return out


async def used_memory(client: aioredis.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def memory_per_entry(client: aioredis.Redis, config: ApproxConfig, pods: list[str], prompts: int,
                           copies: int, prefix: str) -> dict[str, Any]:
    """``used_memory`` delta per entry for a fill, plus MEMORY USAGE of sample keys."""
    store = RedisApproxStore(client, config, prefix=prefix)
    await store.open()
    before = await used_memory(client)
    entries = await fill(store, pods, prompts, copies)
    after = await used_memory(client)
    tag = f"{{{prefix}:approx}}"
    lru = await client.memory_usage(f"{tag}:k:lru:{pods[0]}", samples=0) or 0
    lru_len = await store.entries(pods[0])
    h = hash_request(store.config, MODEL, {"prompt": prompt_8kb(0)})[5]
    holders = await client.memory_usage(f"{tag}:k:h:{h}:{MODEL}", samples=0) or 0
    return {"entries": entries, "stored_entries": await store.entries(), "copies_per_prompt": copies,
            "used_memory_delta_bytes": after - before, "bytes_per_entry": (after - before) / max(entries, 1),
            "memory_usage_lru_bytes_per_key": lru / max(lru_len, 1),
            "memory_usage_one_hash_to_pods_set_bytes": holders}


async def one_transport(url: str, pods: list[str], prompts: int, repeat: int) -> dict[str, Any]:
    config = ApproxConfig(ApproxSettings())
    client = aioredis.from_url(url)
    try:
        await client.flushall()
        red = RedisApproxStore(client, config, prefix="bench")
        await red.open()
        mem = MemoryApproxStore(ApproxIndex(config))
        for store in (red, mem):
            await fill(store, pods, prompts, 1)
        r, m = await latencies(red, pods, repeat), await latencies(mem, pods, repeat)
        same = r.pop("answers") == m.pop("answers") and await red.export_state() == await mem.export_state()
        return {"url_kind": url.split(":", 1)[0], "redis": r, "memory": m, "ratio_redis_vs_memory": ratios(r, m),
                "answers_equal": same, "entries": await red.entries()}
    finally:
        await client.aclose()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    pods = [f"pod-{i}" for i in range(args.pods)]
    server_cls = RedisServer
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvi-bench-redis-") as tmp:
        server = server_cls(Path(tmp), port=args.port).start()
        try:
            unix = f"unix://{server.socket}?db=0"
            tcp = f"redis://127.0.0.1:{args.port}/0"
            out: dict[str, Any] = {"latency": {"unix": await one_transport(unix, pods, args.prompts, args.repeat),
                                               "tcp": await one_transport(tcp, pods, args.prompts, args.repeat)}}
            client = aioredis.from_url(unix)
            try:
                await client.flushall()
                config = ApproxConfig(ApproxSettings())
                out["memory"] = {
                    "distinct": await memory_per_entry(client, config, pods, args.prompts, 1, "mem1"),
                    "shared_x4": await memory_per_entry(client, config, pods, args.prompts, 4, "mem4"),
                }
                out["redis_version"] = (await client.info("server"))["redis_version"]
            finally:
                await client.aclose()
        finally:
            server.stop()
    out["seconds"] = time.perf_counter() - t0
    return out


def summary(doc: dict[str, Any]) -> str:
    lines = []
    for kind, res in doc["latency"].items():
        for op in OPS:
            r, m = res["redis"][op], res["memory"][op]
            lines.append(f"{kind:4} {op:14} redis p50 {r['p50_us']:8.1f} us p99 {r['p99_us']:8.1f} us | memory p50 "
                         f"{m['p50_us']:7.1f} us p99 {m['p99_us']:7.1f} us | ratio p50 "
                         f"{res['ratio_redis_vs_memory'][op]['p50']:5.1f}x")
        lines.append(f"{kind:4} record+score p50: redis {res['redis']['record_plus_score_p50_us']:.0f} us, memory "
                     f"{res['memory']['record_plus_score_p50_us']:.0f} us; answers equal: {res['answers_equal']}")
    for kind, mem in doc["memory"].items():
        lines.append(f"redis memory per entry ({kind}): {mem['bytes_per_entry']:.0f} B over {mem['entries']} entries "
                     f"(LRU {mem['memory_usage_lru_bytes_per_key']:.0f} B/key, one hash->pods set "
                     f"{mem['memory_usage_one_hash_to_pods_set_bytes']} B)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--smoke", action="store_true", help="tiny run: few pods, prompts and repeats")
    p.add_argument("--pods", type=int, default=64)
    p.add_argument("--prompts", type=int, default=20, help="distinct 8 KB prompts per pod in the fill")
    p.add_argument("--repeat", type=int, default=1000)
    p.add_argument("--port", type=int, default=0, help="TCP port of the benchmark's own redis-server (0: a free one)")
    p.add_argument("--out", type=Path, default=RESULTS / "redis_approx.json")
    args = p.parse_args(argv)
    args.port = args.port or free_port()
    if args.smoke:
        args.pods, args.prompts, args.repeat = 8, 2, 20
    doc = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, **asyncio.run(run(args))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(summary(doc))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
