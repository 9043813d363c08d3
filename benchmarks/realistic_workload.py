"""Generate issue 38's realistic workload: a vLLM fleet's traffic as it really batches its events.

  python benchmarks/realistic_workload.py OUT [--replicas 8] [--blocks 4000000] [--queries 300]

- 8 replicas (``--replicas``), each a ``kvindex.tools.engine_sim.SimulatedCache`` of 26,000 blocks of
  16 tokens (LRU free queue, children evicted before parents, one ``BlockRemoved`` per evicted block),
  vLLM >= 0.26's map dialect (tagged maps), int hashes (the simulator's xxh3 chain, seed 0).
- Requests come from ``kvindex.tools.workload.Workload`` (tenants with 2k-token system prompts,
  multi-turn chats), dealt round-robin to the replicas' waiting queues.
- Each replica runs engine steps (``Engine.step``): one chunked-prefill chunk of at most ``CHUNK_BLOCKS``
  (128) blocks of the head waiting request while fewer than ``--running`` requests decode, and one
  token for every decoding request; a request that has decoded 16 more tokens completes a block
  (one ``BlockStored`` of one block). A step's events are one batch ``[ts, events, 0]``; a step
  without events publishes nothing (as vLLM). The steps of the replicas interleave (replica 0's
  step t, replica 1's step t, ...): the file's order, published as fast as ZeroMQ takes it.
- The last message of each replica stores its *marker* block (``marker_tokens`` in the sidecar: 16
  tokens no prompt holds): a harness that sees every replica's marker in a ``/query`` has seen
  every batch applied (each replica's batches are applied in order).
- Stops once ``--blocks`` block operations (stored + removed hashes) were emitted.

The sidecar (OUT + ".json") has gen_workload.py's format (``common.Workload`` reads it), its
``queries`` being the next ``--queries`` requests of the stream with the full blocks each replica
holds of them (``prefix_blocks``), and its stats the mean block operations per batch, per decode
batch and per prefill batch. Invariants: same arguments => byte-identical outputs; no clock, no
global random.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from array import array
from collections import deque
from dataclasses import asdict
from pathlib import Path
from random import Random

import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gen_workload import Totals, replica_state  # noqa: E402

from kvindex.tools.engine_sim import SimulatedCache, block_hashes, encode_batch  # noqa: E402
from kvindex.tools.workload import Workload, write_messages  # noqa: E402

BLOCK_SIZE = 16
CHUNK_BLOCKS = 128  # chunked prefill: at most this many new blocks a step
TS_START = 1_760_000_000.0
STEP_SECONDS = 0.02
OUTPUT_TOKENS = (64, 512)  # tokens a request generates (inclusive bounds; mean 288)
VOCAB = 32_000  # kvindex.tools.workload.Workload's default vocabulary
VERSION = 1  # of the generator's rules: a cached file of another version is generated again
MARKER_BASE = 50_000  # marker tokens: ids >= the workload's vocabulary (32,000), per replica


class Running:
    """A request decoding: its prompt then the tokens it generates (``out``, drawn when it starts), how
    many it has generated (``pos``), and the hashes of its full blocks so far."""

    __slots__ = ("tokens", "hashes", "pos", "prompt")

    def __init__(self, tokens: list[int], hashes: list[int], out: list[int]) -> None:
        self.prompt, self.tokens, self.hashes, self.pos = len(tokens), tokens + out, hashes, 0


class Engine:
    """One replica's scheduler over its ``SimulatedCache``: chunked prefill, then decode."""

    def __init__(self, cache: SimulatedCache, max_running: int, seed: int) -> None:
        self.cache = cache
        self.max_running = max_running
        self.waiting: deque[tuple[list[int], list[int]]] = deque()
        self.prefilled: int | None = None  # blocks of the head waiting request prefilled (None: not begun)
        self.running: list[Running] = []
        self.rng = Random(seed)
        self.decode_batches = self.prefill_batches = self.decode_ops = self.prefill_ops = 0

    def step(self, totals: Totals) -> list[dict]:
        """One engine step's events (removals before their store, as vLLM emits them)."""
        events: list[dict] = []
        prefill = False
        if self.waiting and len(self.running) < self.max_running:
            tokens, hashes = self.waiting[0]
            if self.prefilled is None:  # a new request: its cached prefix is skipped (vLLM's last-token rule)
                self.prefilled = self.cache.held_prefix(hashes[:max(0, (len(tokens) - 1) // BLOCK_SIZE)])
                totals.requests += 1
                totals.prompt_tokens += len(tokens)
                totals.cached_tokens += self.prefilled * BLOCK_SIZE
            end = min(len(hashes), self.prefilled + CHUNK_BLOCKS)
            last = end >= len(hashes)
            adm = self.cache.admit(tokens if last else tokens[:end * BLOCK_SIZE], hashes if last else hashes[:end])
            events += adm.events
            prefill = bool(adm.events)
            self.prefilled = end
            if last:
                self.waiting.popleft()
                self.prefilled = None
                n = self.rng.randint(*OUTPUT_TOKENS)
                out = [w % VOCAB for w in array("I", self.rng.randbytes(4 * n))]
                self.running.append(Running(tokens, list(hashes), out))
        done = []
        for req in self.running:
            req.pos += 1
            end = req.prompt + req.pos
            if end % BLOCK_SIZE == 0:  # a block completed: stored after the one before it
                events += self._decoded(req, req.tokens[end - BLOCK_SIZE:end])
            if end == len(req.tokens):
                done.append(req)
        for req in done:  # finished: its blocks freed tail-first, the most recently used
            self.running.remove(req)
            n = len(req.hashes)
            events += self.cache.admit(req.tokens[:n * BLOCK_SIZE + 1], req.hashes).events
        ops = sum(len(e["block_hashes"]) for e in events)
        if events:
            if prefill:
                self.prefill_batches, self.prefill_ops = self.prefill_batches + 1, self.prefill_ops + ops
            else:
                self.decode_batches, self.decode_ops = self.decode_batches + 1, self.decode_ops + ops
        return events

    def _decoded(self, req: Running, block: list[int]) -> list[dict]:
        """The events of a decoded block: one free block taken (an eviction, once the cache is full),
        one BlockStored of one block whose parent is the request's previous block. The request's
        earlier blocks are held by it (vLLM references them until it finishes): only the previous one
        is looked up, unless the LRU evicted it meanwhile (then the whole chain is admitted again)."""
        parent = req.hashes[-1] if req.hashes else 0
        req.hashes += block_hashes_after(parent, block)
        n = len(req.hashes)
        if n >= 2 and self.cache.held_prefix(req.hashes[-2:-1]):
            return self.cache.admit(req.tokens[(n - 2) * BLOCK_SIZE:n * BLOCK_SIZE], req.hashes[-2:]).events
        return self.cache.admit(req.tokens[:n * BLOCK_SIZE], req.hashes).events


def block_hashes_after(parent: int, block: list[int]) -> list[int]:
    """The simulator's chained hash of one more full block after ``parent`` (``engine_sim``'s rule)."""
    return [xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + array("I", block).tobytes(), 0)]


def count(totals: Totals, events: list[dict]) -> None:
    """Add the events' block operations to the totals."""
    for ev in events:
        if ev["type"] == "BlockStored":
            totals.block_stored += len(ev["block_hashes"])
        else:
            totals.block_removed += len(ev["block_hashes"])


def messages(args: argparse.Namespace, wl: Workload, engines: list[Engine], totals: Totals, topics: list[str]):
    """Steps of every replica, interleaved, until ``args.blocks`` block-ops; then each replica's marker."""
    seqs = [0] * len(engines)
    dealt = 0
    step = 0
    while totals.block_ops < args.blocks:
        for i, eng in enumerate(engines):
            while len(eng.waiting) < 2:  # requests keep arriving: dealt round-robin
                tokens = list(wl.next_request().token_ids)
                engines[dealt % len(engines)].waiting.append((tokens, block_hashes(tokens, BLOCK_SIZE)))
                dealt += 1
            events = eng.step(totals)
            if events:
                count(totals, events)
                yield topics[i], seqs[i], encode_batch(events, TS_START + STEP_SECONDS * step, 0, "map")
                seqs[i] += 1
                totals.batches += 1
        step += 1
    for i, eng in enumerate(engines):
        events = eng.cache.admit(marker_tokens(i)).events
        count(totals, events)
        yield topics[i], seqs[i], encode_batch(events, TS_START + STEP_SECONDS * (step + 1), 0, "map")
        seqs[i] += 1
        totals.batches += 1
    totals.batches_per_replica = seqs


def marker_tokens(replica: int) -> list[int]:
    """The 16 tokens of replica ``replica``'s marker block (no prompt holds a token >= 32,000)."""
    return [MARKER_BASE + replica * BLOCK_SIZE + j for j in range(BLOCK_SIZE)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="output message file (binary)")
    p.add_argument("--replicas", type=int, default=8, help="simulated vLLM replicas (default 8)")
    p.add_argument("--capacity", type=int, default=26000, help="blocks of 16 tokens per replica (default 26000)")
    p.add_argument("--blocks", type=int, default=4_000_000, help="block operations in all (default 4M)")
    p.add_argument("--running", type=int, default=64, help="requests decoding at once per replica (default 64)")
    p.add_argument("--queries", type=int, default=300, help="router queries in the sidecar (default 300)")
    p.add_argument("--seed", type=int, default=38, help="workload seed (default 38)")
    p.add_argument("--model", default="bench-model", help="model part of the topic")
    p.add_argument("--quiet", action="store_true", help="no summary on stderr")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Generate the message file and its sidecar; return the sidecar."""
    args = parse_args(argv)
    started = time.perf_counter()
    wl = Workload(args.seed)
    caches = [SimulatedCache(args.capacity, BLOCK_SIZE) for _ in range(args.replicas)]
    engines = [Engine(c, args.running, args.seed * 1000 + i) for i, c in enumerate(caches)]
    topics = [f"kv@pod-{i}@{args.model}" for i in range(args.replicas)]
    totals = Totals()
    write_messages(args.out, messages(args, wl, engines, totals, topics))
    queries = [{"token_ids": list(r.token_ids), "prefix_blocks": [c.prefix_blocks(r.token_ids) for c in caches]}
               for r in wl.take(args.queries)]
    dec_b, dec_o = sum(e.decode_batches for e in engines), sum(e.decode_ops for e in engines)
    pre_b, pre_o = sum(e.prefill_batches for e in engines), sum(e.prefill_ops for e in engines)
    stats = asdict(totals) | {"block_ops": totals.block_ops, "hit_rate": totals.cached_tokens / max(1, totals.prompt_tokens),
                              "ops_per_batch": totals.block_ops / max(1, totals.batches),
                              "decode_batches": dec_b, "ops_per_decode_batch": dec_o / max(1, dec_b),
                              "prefill_batches": pre_b, "ops_per_prefill_batch": pre_o / max(1, pre_b)}
    params = {k: v for k, v in vars(args).items() if k not in ("out", "quiet")} | {
        "block_size": BLOCK_SIZE, "chunk_blocks": CHUNK_BLOCKS, "routing": "rr", "generator": "realistic",
        "version": VERSION}
    doc = {"format": "kvindex-workload/1", "messages_file": args.out.name,
           "framing": "kvindex.tools.workload.write_messages", "params": params, "topics": topics,
           "stats": stats, "replica_state": replica_state(caches, topics), "queries": queries,
           "marker_tokens": [marker_tokens(i) for i in range(args.replicas)]}
    args.out.with_name(args.out.name + ".json").write_text(json.dumps(doc, separators=(",", ":")))
    if not args.quiet:
        print(json.dumps({"out": str(args.out), **{k: v for k, v in stats.items() if k != "batches_per_replica"},
                          "seconds": round(time.perf_counter() - started, 1)}), file=sys.stderr)
    return doc


if __name__ == "__main__":
    main()
