"""Replay the Mooncake conversation trace through simulated vLLM replicas into a vLLM-format workload.

  python benchmarks/trace_workload.py OUT [--replicas 8] [--capacity 26000] [--requests N] [--queries 64]

The trace (``../shared/traces/mooncake_conversation_trace.jsonl``, 12,031 requests of a production
service; see its README) gives, per request, an arrival time, ``input_length``, ``output_length``
and ``hash_ids`` (one id per 512-token prefix block). From it:

- Tokens: hash id ``h`` becomes 512 token ids, ``Random(TOKEN_SALT + h).randbytes(1024)`` read as
  512 little-endian u16 (ids 0..65535). Equal hash ids give equal tokens, so requests share
  exactly the prefixes they share in production. A request's prompt is the concatenation of its
  blocks, cut to ``input_length`` (the last 512-token block may be partial).
- Replicas: ``--replicas`` ``kvindex.tools.engine_sim.SimulatedCache`` (vLLM's prefix cache: block
  size 16, LRU free queue, children evicted before parents, no dedup), ``--capacity`` blocks each
  (default 26,000 = 416k tokens, a GPU's worth: the trace's 5.8M distinct 16-token blocks do not
  fit, so evictions happen). Engine hashes are the simulator's xxh3-64 chain (seed 0, the same on
  every replica, as with a shared PYTHONHASHSEED).
- Placement (a KV-aware router's cost rule; Dynamo 1.6.1's ``KvRouterConfig`` defaults are the same
  shape: prefill load after the cache-hit credit, scale 1.0, plus active blocks, temperature 0): a
  request goes to the replica with the lowest ``blocks to prefill + blocks in flight``, where
  blocks to prefill = prompt blocks minus the prefix that replica holds, and blocks in flight =
  the (input + output) tokens / 16 of its requests still running at the arrival time (a request
  runs ``output_length`` × ``DECODE_MS_PER_TOKEN`` ms after its arrival); ties go to the lowest
  replica index. Pure longest-prefix placement would send every request to one replica: every
  request of this trace starts with hash id 0.
- Messages: each admission that emits events is one vLLM batch ``[ts, events, 0]`` (removals of
  evicted blocks, then one BlockStored with block_hashes, parent_block_hash, token_ids,
  block_size; encoded by ``engine_sim.encode_batch``, the map dialect) published by that replica
  as ``[topic "kv@pod-{i}@{model}", seq u64 BE, payload]``, seq from 0 per replica; ts is the
  trace's arrival time. Written with ``kvindex.tools.workload.write_messages`` in arrival order.
- Queries: the last ``--queries`` requests of the trace are not admitted: each is a router's
  query just before the request is sent (its tokens, plus one pad token when its length is a
  multiple of 16, so that kvindex's last-token rule and Dynamo's full-block hashing look at the
  same blocks), with ``expected`` = the full blocks of it each replica holds after the replay.

The sidecar (OUT + ".json") has gen_workload.py's format, so ``common.Workload`` and run.py read
both alike. Invariants: same arguments => byte-identical outputs; no clock, no global random.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from array import array
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from random import Random

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gen_workload import Totals, replica_state  # noqa: E402

from kvindex.tools.engine_sim import SimulatedCache, block_hashes, encode_batch  # noqa: E402
from kvindex.tools.workload import write_messages  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
TRACE_BLOCK = 512  # tokens per trace hash id
BLOCK_SIZE = 16
TOKEN_SALT = 0x6D6F6F6E  # "moon": token runs of this generator, not of any other
DECODE_MS_PER_TOKEN = 30.0
TS_START = 1_760_000_000.0
PAD_TOKEN = 7


def tokens_of(hash_id: int) -> array:
    """The 512 token ids of one trace block (u16 values), a pure function of ``hash_id``."""
    run = array("H", Random(TOKEN_SALT + hash_id).randbytes(2 * TRACE_BLOCK))
    if sys.byteorder == "big":
        run.byteswap()
    return run


def prompt_of(record: dict) -> array:
    """A trace record's prompt: its blocks' tokens, cut to ``input_length``."""
    out = array("H")
    for h in record["hash_ids"]:
        out.extend(tokens_of(h))
    del out[record["input_length"]:]
    return array("I", out)


def read_trace(path: Path, limit: int | None = None) -> list[dict]:
    """The first ``limit`` records (all when None), in file order (arrival order)."""
    out = []
    with path.open() as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if limit is not None and len(out) >= limit:
                    break
    return out


class Router:
    """Least ``prefill + in-flight`` blocks placement over the replicas (see the module docstring)."""

    def __init__(self, caches: list[SimulatedCache]) -> None:
        self.caches = caches
        self.in_flight = [0] * len(caches)  # blocks of running requests, per replica
        self._ends: list[list[tuple[float, int]]] = [[] for _ in caches]  # (end ms, blocks) heaps

    def _expire(self, now_ms: float) -> None:
        for i, ends in enumerate(self._ends):
            while ends and ends[0][0] <= now_ms:
                self.in_flight[i] -= heapq.heappop(ends)[1]

    def place(self, record: dict, hashes: list[int]) -> int:
        """The replica for this request; records it as in flight there."""
        now = float(record["timestamp"])
        self._expire(now)
        limit = max(0, (record["input_length"] - 1) // BLOCK_SIZE)  # vLLM never hits the last token's block
        head = hashes[:limit]
        costs = [len(hashes) - c.held_prefix(head) + self.in_flight[i] for i, c in enumerate(self.caches)]
        best = min(range(len(costs)), key=costs.__getitem__)
        blocks = (record["input_length"] + record["output_length"]) // BLOCK_SIZE
        heapq.heappush(self._ends[best], (now + record["output_length"] * DECODE_MS_PER_TOKEN, blocks))
        self.in_flight[best] += blocks
        return best


def messages(records: list[dict], caches: list[SimulatedCache], topics: list[str],
             totals: Totals, placed: list[int]) -> Iterator[tuple[str, int, bytes]]:
    """Admit every record at its replica; one message per admission that emitted events."""
    router = Router(caches)
    seqs = [0] * len(caches)
    for rec in records:
        tokens = prompt_of(rec)
        hashes = block_hashes(tokens, BLOCK_SIZE)
        replica = router.place(rec, hashes)
        placed[replica] += 1
        adm = caches[replica].admit(tokens, hashes)
        if not totals.admitted(adm):
            continue
        ts = TS_START + rec["timestamp"] / 1000.0
        yield topics[replica], seqs[replica], encode_batch(adm.events, ts, 0, "map")
        seqs[replica] += 1
        totals.batches += 1
    totals.batches_per_replica = seqs


def queries(records: list[dict], caches: list[SimulatedCache]) -> list[dict]:
    """The held-out records as router queries, with the full blocks each replica holds of them."""
    out = []
    for rec in records:
        tokens = prompt_of(rec)
        hashes = block_hashes(tokens, BLOCK_SIZE)
        padded = list(tokens) + ([PAD_TOKEN] if len(tokens) % BLOCK_SIZE == 0 else [])
        out.append({"timestamp": rec["timestamp"], "input_length": rec["input_length"], "token_ids": padded,
                    "expected": [c.held_prefix(hashes) for c in caches]})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="output message file (binary)")
    p.add_argument("--trace", type=Path, default=TRACE, help=f"trace JSONL (default {TRACE})")
    p.add_argument("--replicas", type=int, default=8, help="simulated vLLM replicas (default 8)")
    p.add_argument("--capacity", type=int, default=26000, help="blocks of 16 tokens per replica (default 26000)")
    p.add_argument("--requests", type=int, help="use only the first N records of the trace (default all)")
    p.add_argument("--queries", type=int, default=64, help="last records held out as queries (default 64)")
    p.add_argument("--model", default="bench-model", help="model part of the topic")
    p.add_argument("--quiet", action="store_true", help="no summary on stderr")
    a = p.parse_args(argv)
    if a.replicas < 1 or a.capacity < 1 or a.queries < 1:
        p.error("--replicas, --capacity and --queries must be positive")
    return a


def main(argv: list[str] | None = None) -> dict:
    """Generate the message file and its sidecar; return the sidecar."""
    args = parse_args(argv)
    started = time.perf_counter()
    records = read_trace(args.trace, args.requests)
    if len(records) <= args.queries:
        raise SystemExit(f"{len(records)} records: not enough for {args.queries} queries")
    replay, held_out = records[:-args.queries], records[-args.queries:]
    caches = [SimulatedCache(args.capacity, BLOCK_SIZE) for _ in range(args.replicas)]
    topics = [f"kv@pod-{i}@{args.model}" for i in range(args.replicas)]
    totals, placed = Totals(), [0] * args.replicas
    write_messages(args.out, messages(replay, caches, topics, totals, placed))
    stats = asdict(totals) | {"block_ops": totals.block_ops,
                              "hit_rate": totals.cached_tokens / max(totals.prompt_tokens, 1),
                              "requests_per_replica": placed}
    params = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
              if k not in ("out", "quiet", "trace")} | {"trace": args.trace.name, "block_size": BLOCK_SIZE,
                                                        "token_salt": TOKEN_SALT, "routing": "kv-cost"}
    doc = {"format": "kvindex-workload/1", "messages_file": args.out.name,
           "framing": "kvindex.tools.workload.write_messages", "params": params, "topics": topics,
           "stats": stats, "replica_state": replica_state(caches, topics), "queries": queries(held_out, caches)}
    args.out.with_name(args.out.name + ".json").write_text(json.dumps(doc, separators=(",", ":")))
    if not args.quiet:
        print(json.dumps({"out": str(args.out), **stats, "seconds": round(time.perf_counter() - started, 1)}),
              file=sys.stderr)
    return doc


if __name__ == "__main__":
    main()
