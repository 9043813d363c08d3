"""Generate a deterministic multi-replica KV-event workload in vLLM's wire format.

Every request of a ``kvindex.tools.workload.Workload`` is routed to one of ``--replicas`` simulated
engines (``kvindex.tools.engine_sim.SimulatedCache``); each admission that produces events becomes one
batch ``[ts, events, 0]`` published by that replica as ``[topic "kv@pod-{i}@{model}", seq, payload]``
with seq counting from 0 per replica. Messages are written, in global publish order, to OUT in the
framing of ``kvindex.tools.workload.write_messages``; a JSON sidecar (OUT + ".json" by default) records
the parameters, totals, each replica's final state and router queries with the expected answer.

Invariants: same arguments => byte-identical outputs; a query's ``cached_tokens[i]`` is what
replica i's engine would serve from cache after the whole file (vLLM last-token rule), and
``prefix_blocks[i]`` is the number of leading full blocks replica i holds (what a precise index
fed this file must report).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvindex.tools.engine_sim import Admission, SimulatedCache, encode_batch
from kvindex.tools.workload import Request, Workload, write_messages

TS_START = 1_760_000_000.0
TS_STEP = 0.001


@dataclass(slots=True)
class Totals:
    """Running counts over the whole generation (mutated only by ``admitted``)."""

    requests: int = 0
    batches: int = 0
    block_stored: int = 0
    block_removed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    batches_per_replica: list[int] = field(default_factory=list)

    @property
    def block_ops(self) -> int:
        return self.block_stored + self.block_removed

    def admitted(self, adm: Admission) -> bool:
        """Count one admitted request (a ``SimulatedCache.admit`` answer); True when it published events."""
        self.requests += 1
        self.prompt_tokens += adm.prompt_tokens
        self.cached_tokens += adm.cached_tokens
        for ev in adm.events:
            if ev["type"] == "BlockStored":
                self.block_stored += len(ev["block_hashes"])
            else:
                self.block_removed += len(ev["block_hashes"])
        return bool(adm.events)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", type=Path, help="output message file (binary)")
    p.add_argument("--sidecar", type=Path, help="JSON sidecar path (default: OUT.json)")
    p.add_argument("--replicas", type=int, default=8, help="number of engines (default 8)")
    p.add_argument("--capacity", type=int, default=26000, help="blocks per replica (26000)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    p.add_argument("--blocks", type=int, default=1_000_000,
                   help="stop once this many block-ops (stored + removed hashes) were emitted")
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument("--hash-seed", type=int, default=0, help="engine block-hash seed (0)")
    p.add_argument("--distinct-hash-seeds", action="store_true",
                   help="replica i hashes with seed HASH_SEED + i, like vLLM replicas without a "
                        "shared PYTHONHASHSEED (engine hashes then differ across replicas)")
    p.add_argument("--dialect", choices=("map", "array"), default="map",
                   help="map = vLLM >= #42892 events, array = vLLM <= 0.23 tagged arrays")
    p.add_argument("--routing", choices=("tenant", "rr"), default="tenant",
                   help="tenant = tenant i goes to replica i %% N; rr = round-robin")
    p.add_argument("--tenants", type=int, default=32, help="number of tenants (32)")
    p.add_argument("--system-tokens", type=int, default=2000, help="system prompt length")
    p.add_argument("--one-off-fraction", type=float, default=0.2, help="share of one-off prompts")
    p.add_argument("--queries", type=int, default=128, help="router queries in the sidecar")
    p.add_argument("--model", default="model", help="model part of the topic")
    p.add_argument("--quiet", action="store_true", help="no summary on stderr")
    return p.parse_args(argv)


def _route(args: argparse.Namespace, req: Request, index: int) -> int:
    if args.routing == "rr":
        return index % args.replicas
    return int(req.tenant.rsplit("-", 1)[1]) % args.replicas


def _messages(
    args: argparse.Namespace, wl: Workload, caches: list[SimulatedCache], totals: Totals
) -> Iterator[tuple[str, int, bytes]]:
    """Admit requests until ``args.blocks`` block-ops; yield one message per non-empty step."""
    topics = [f"kv@pod-{i}@{args.model}" for i in range(args.replicas)]
    seqs = [0] * args.replicas
    while totals.block_ops < args.blocks:
        req = wl.next_request()
        replica = _route(args, req, totals.requests)
        adm = caches[replica].admit(req.token_ids)
        if not totals.admitted(adm):
            continue
        ts = TS_START + TS_STEP * totals.requests
        yield topics[replica], seqs[replica], encode_batch(adm.events, ts, 0, args.dialect)
        seqs[replica] += 1
        totals.batches += 1
    totals.batches_per_replica = seqs


def _queries(args: argparse.Namespace, wl: Workload, caches: list[SimulatedCache]) -> list[dict]:
    """The next ``args.queries`` requests of the stream (not admitted) and their expected hits."""
    out = []
    for req in wl.take(args.queries):
        out.append({
            "tenant": req.tenant,
            "conversation": req.conversation,
            "routed_to": _route(args, req, -1) if args.routing == "tenant" else None,
            "token_ids": list(req.token_ids),
            "cached_tokens": [c.lookup(req.token_ids) for c in caches],
            "prefix_blocks": [c.prefix_blocks(req.token_ids) for c in caches],
        })
    return out


def replica_state(caches: list[SimulatedCache], topics: list[str]) -> list[dict]:
    """Per replica: distinct held hashes, physical blocks, and an order-free digest of the set."""
    state = []
    for topic, cache in zip(topics, caches):
        held = sorted(cache.held())
        raw = b"".join(h.to_bytes(8, "little") for h in held)
        state.append({
            "topic": topic,
            "held_blocks": len(held),
            "physical_blocks": cache.physical_blocks(),
            "held_digest": xxhash.xxh3_64_hexdigest(raw),
        })
    return state


def _sidecar(args: argparse.Namespace, totals: Totals, state: list[dict],
             queries: list[dict]) -> dict:
    """The sidecar document; deterministic (no paths, no timings)."""
    stats = asdict(totals) | {
        "block_ops": totals.block_ops,
        "hit_rate": totals.cached_tokens / max(totals.prompt_tokens, 1),
    }
    params = {k: v for k, v in vars(args).items() if k not in ("out", "sidecar", "quiet")}
    return {
        "format": "kvindex-workload/1",
        "messages_file": args.out.name,
        "framing": "kvindex.tools.workload.write_messages",
        "params": params,
        "topics": [s["topic"] for s in state],
        "stats": stats,
        "replica_state": state,
        "queries": queries,
    }


def main(argv: list[str] | None = None) -> dict:
    """Generate the files; return the sidecar dict."""
    args = parse_args(argv)
    started = time.perf_counter()
    wl = Workload(args.seed, tenants=args.tenants, system_tokens=args.system_tokens,
                  one_off_fraction=args.one_off_fraction)
    step = 1 if args.distinct_hash_seeds else 0
    caches = [SimulatedCache(args.capacity, args.block_size, args.hash_seed + step * i)
              for i in range(args.replicas)]
    totals = Totals()
    write_messages(args.out, _messages(args, wl, caches, totals))
    topics = [f"kv@pod-{i}@{args.model}" for i in range(args.replicas)]
    state = replica_state(caches, topics)
    queries = _queries(args, wl, caches)
    doc = _sidecar(args, totals, state, queries)
    elapsed = time.perf_counter() - started
    sidecar = args.sidecar or args.out.with_name(args.out.name + ".json")
    sidecar.write_text(json.dumps(doc, separators=(",", ":")))
    if not args.quiet:
        print(json.dumps({"out": str(args.out), "sidecar": str(sidecar), **doc["stats"],
                          "seconds": round(elapsed, 2)}), file=sys.stderr)
    return doc


if __name__ == "__main__":
    main()
