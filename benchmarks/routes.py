"""The Dynamo read routes' own Python, in one process: where a /query or /query_by_hash spends its µs.

  python benchmarks/routes.py [--blocks 1000000] [--queries 100] [--reps 5] [--smoke]

Builds issue 38's realistic state (benchmarks/realistic_workload.py's workload, generated once and
cached: 8 replicas' LRU caches, ~208k entries once full) in a ``Daemon``'s memory store, its batches
decoded and applied in order, then calls what the aiohttp handlers and the HTTP fast path call
(``kvindex.http.dynamo.query_data`` / ``by_hash_data``, the answer encoded by ``json_body``) on the
harness's 8k-token queries (``common.pick_queries``, ``e2e.request_bodies``), no sockets; and each
step of ``/query_by_hash`` alone, in the route's order, on the same bodies. Median µs over every
call; every answer is first checked against the generator's (``mismatches``). Prints one JSON
line. The route functions on the memory store never suspend: each coroutine
is run to its end by one ``send``. No assertion on timings.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import e2e  # noqa: E402
import realistic  # noqa: E402

from adapters.dialects import DIALECTS  # noqa: E402
from kvindex import keys as K  # noqa: E402
from kvindex import loops  # noqa: E402
from kvindex.config import Config  # noqa: E402
from kvindex.daemon import Daemon  # noqa: E402
from kvindex.http import dynamo  # noqa: E402
from kvindex.http.app import Services  # noqa: E402
from kvindex.http.bodies import QueryByHashBody, block_hashes, decode_body, json_body, parse  # noqa: E402
from kvindex.ingest.streams import split_topic  # noqa: E402

JSON = "application/json"


def done(coro: Coroutine[Any, Any, Any]) -> Any:
    """A coroutine that never suspends, run to its end."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the route suspended: not the memory store?")


def load(daemon: Daemon, wl: common.Workload) -> None:
    """Every batch of the workload applied to the daemon's index, replica i as instance i + 1 (as
    realistic.py registers them)."""
    index = daemon.index
    assert index is not None
    index.set_block_size(common.MODEL, common.BLOCK_SIZE)
    decode = DIALECTS["vllm"].decoder().decode
    pods = {t: str(int(split_topic(t)[0].rsplit("-", 1)[1]) + 1) for t in wl.topics}  # pod-0 is instance 1
    for topic, _seq, payload in wl.messages:
        batch = decode(payload)
        index.apply_batch(pods[topic], common.MODEL, batch.dp_rank, batch.events)


def median_us(step: Callable[[Any], Any], inputs: Sequence[Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        for x in inputs:
            t0 = time.perf_counter()
            step(x)
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 2)


def layers(svc: Services, raws: list[bytes], reps: int) -> dict[str, float]:
    """Each step of ``by_hash_data`` alone, in its order, each on what the step before made."""
    q = svc.query
    root = K.root_key(common.MODEL, None)
    decode = lambda raw: decode_body(raw, JSON, allow_msgpack=True, go=False, u64_field="block_hashes")  # noqa: E731
    bodies = [decode(r) for r in raws]
    args = [parse(b, QueryByHashBody) for b in bodies]
    hashes = [block_hashes(a, svc.config.max_token_ids) for a in args]
    keys = [K.chain_keys(root, h) for h in hashes]
    answers = [done(q.precise_by_local_hashes(common.MODEL, h, None)) for h in hashes]
    return {
        "decode_body": median_us(decode, raws, reps),
        "parse": median_us(lambda b: parse(b, QueryByHashBody), bodies, reps),
        "block_hashes": median_us(lambda a: block_hashes(a, svc.config.max_token_ids), args, reps),
        "identity, candidates, block_size, check_current": median_us(
            lambda _: (q.identity(common.MODEL), done(svc.engines.candidates(common.MODEL, None)),
                       done(q.store.block_size(common.MODEL)), q.check_current(common.MODEL)), hashes, reps),
        "chain_keys": median_us(lambda h: K.chain_keys(root, h), hashes, reps),
        "store.match": median_us(lambda k: done(q.store.match(k, None, model=common.MODEL)), keys, reps),
        "precise_by_local_hashes (the three above)": median_us(
            lambda h: done(q.precise_by_local_hashes(common.MODEL, h, None)), hashes, reps),
        "metric": median_us(lambda _: svc.metrics.query_timer("/query_by_hash").observe(1e-4), answers, reps),
        "answer (dynamo_body, json_body)": median_us(lambda a: json_body(dynamo.dynamo_body(a, JSON)), answers, reps),
    }


def mismatches(svc: Services, bodies: list[dict[str, bytes]], queries: list[dict]) -> dict[str, int]:
    """Per route, the answers (as the client reads them) whose matched tokens per pod are not the
    generator's: what is timed is checked to answer right."""
    truth = realistic.expected_tokens(queries)
    out = {}
    for path, route in dynamo.fast_routes().items():
        docs = [json.loads(json_body(done(route(svc, body[path], JSON, time.perf_counter())))) for body in bodies]
        out[path] = sum(e2e.matched_tokens(path, doc) != want for doc, want in zip(docs, truth, strict=True))
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    wl = realistic.workload(args.blocks, args.queries)
    queries = common.pick_queries(wl, args.queries)
    bodies = [e2e.request_bodies("dynamo", q["token_ids"]) for q in queries]
    daemon = Daemon(Config())
    load(daemon, wl)
    svc = daemon.services
    gc.collect()
    out: dict[str, Any] = {"workload": wl.path.name, "queries": len(bodies), "reps": args.reps,
                           "mismatches": mismatches(svc, bodies, queries), "routes_us": {}}
    for path, route in dynamo.fast_routes().items():
        raws = [b[path] for b in bodies]
        out["routes_us"][path] = median_us(lambda raw: json_body(done(route(svc, raw, JSON, time.perf_counter()))),
                                           raws, args.reps)
    out["query_by_hash_steps_us"] = layers(svc, [b["/query_by_hash"] for b in bodies], args.reps)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=1_000_000, help="block operations (default 1M: the caches full)")
    p.add_argument("--queries", type=int, default=100, help="8k-token queries (default 100)")
    p.add_argument("--reps", type=int, default=5, help="passes over the queries (default 5)")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds)")
    a = p.parse_args(argv)
    if a.smoke:
        a.blocks, a.queries, a.reps = 30_000, 10, 1
    return a


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(json.dumps(loops.run(measure(args), "auto")))


if __name__ == "__main__":
    main()
