"""``kvindex replay-routing``: a request trace through N simulated engines, routed once per policy
by the policies the gateway's picker and shadows run (``kvindex.route.policies``).

The trace is Mooncake's JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids``: prefix block ids of 512 tokens; equal ids at equal positions are a shared prefix).

Model (simulated time; nothing sleeps unless ``speed`` > 0):
- An engine holds ``cache_blocks`` blocks of ``block_tokens`` (vLLM's 16) tokens, i.e. that many
  tokens' worth of trace blocks, in LRU order as vLLM's free queue evicts them: a request's hit is
  the longest prefix of its ``hash_ids`` the engine holds (never its whole prompt: the block of the
  last token is computed), then its blocks become the most recently used; new ones evict the least.
- Prefill is one queue per engine (FIFO): a request waits for the prefills before it, then takes
  ``prefill_seconds_per_token`` per uncached token; TTFT = wait + its prefill. Decode runs
  batched beside it: ``decode_seconds_per_token`` per output token, holding its blocks.
- What a policy sees per engine (``Candidate``): the precise match (the engine's own cache, as
  kvindex's precise index holds it) and the approximate one: a per-engine LRU of the blocks the
  router itself sent there, never told of evictions, with Kthena's defaults (it hashes only the
  first 128 blocks of 64 bytes of a prompt, about 2,048 tokens: the first 4 trace blocks; 50,000
  entries per pod of about 16 tokens each: 1,562 trace blocks);
  ``waiting`` (requests queued for prefill), ``kv_usage`` (blocks held / capacity) and the blocks
  in flight (``Active``: uncached blocks in the prefill queue, all blocks of decoding requests).
- Deterministic: the same trace, options and ``seed`` give the same table.

Outputs: a table per policy (hit rate as a ratio of sums: cached / prompt tokens; TTFT p50 and
p99; requests per engine, max and min), JSON and an SVG plot of hit rate and TTFT per policy.
"""

from __future__ import annotations

import gzip
import heapq
import json
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvindex.route.policies import POLICIES, Policies
from kvindex.route.scorers import Active, Candidate, Load

TRACE_BLOCK_TOKENS = 512
APPROX_PREFIX_BLOCKS = 128 * 64 // 4 // TRACE_BLOCK_TOKENS  # Kthena's maxBlocksToMatch x 64 bytes, ~4 bytes a token
APPROX_CAPACITY = 50000 * 16 // TRACE_BLOCK_TOKENS  # Kthena's maxHashCacheSize entries of ~16 tokens


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t: float  # seconds
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    engines: int = 8
    cache_blocks: int = 26000
    block_tokens: int = 16
    prefill_seconds_per_token: float = 100e-6
    decode_seconds_per_token: float = 20e-3
    seed: int = 0
    speed: float = 0.0  # 0: as fast as possible; else trace seconds per wall second


def read_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in file order (``limit``: the first ones; ``.gz``: gzip-compressed); a
    bad line is an error naming it."""
    out: list[TraceRequest] = []
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(TraceRequest(float(row["timestamp"]) / 1000.0, int(row["input_length"]),
                                        int(row["output_length"]), tuple(int(h) for h in row["hash_ids"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({exc})") from None
    return out


class BlockLRU:
    """Trace blocks held, least recently used first, at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[tuple[int, int], None] = OrderedDict()  # (position, id)

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, ids: Sequence[int]) -> int:
        n = 0
        for i, h in enumerate(ids):
            if (i, h) not in self._blocks:
                break
            n += 1
        return n

    def touch(self, ids: Sequence[int]) -> None:
        for key in enumerate(ids):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


@dataclass
class SimEngine:
    name: str
    cache: BlockLRU
    belief: BlockLRU  # what the router believes this engine holds
    prefill_free: float = 0.0  # when its prefill queue empties
    queued: list[tuple[float, int]] = field(default_factory=list)  # (prefill start, uncached blocks), a heap
    decoding: list[tuple[float, int]] = field(default_factory=list)  # (end, blocks), a heap
    requests: int = 0

    def settle(self, now: float) -> None:
        while self.queued and self.queued[0][0] <= now:
            heapq.heappop(self.queued)
        while self.decoding and self.decoding[0][0] <= now:
            heapq.heappop(self.decoding)

    def candidate(self, req: TraceRequest) -> Candidate:
        blocks = len(req.hash_ids)
        matched = min(self.cache.matched(req.hash_ids), _servable(req))
        held = sum(b for _, b in self.decoding)
        load = Load(waiting=float(len(self.queued)), kv_usage=min(1.0, (len(self.cache) + held) /
                                                                  max(1, self.cache.capacity)))
        seen = req.hash_ids[:APPROX_PREFIX_BLOCKS]
        return Candidate(self.name, float(matched), blocks, self.belief.matched(seen), len(seen),
                         TRACE_BLOCK_TOKENS, load, (matched, 0, 0),
                         Active(sum(b for _, b in self.queued), held))


def _servable(req: TraceRequest) -> int:
    """Blocks that may come from cache: never the one holding the last prompt token."""
    return max(0, (req.input_length - 1) // TRACE_BLOCK_TOKENS)


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    per_engine: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        t = sorted(self.ttft)
        counts = list(self.per_engine.values())
        return {"policy": self.policy, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "hit_rate": round(self.cached_tokens / self.prompt_tokens, 6) if self.prompt_tokens else None,
                "ttft_p50_s": round(quantile(t, 0.5), 6), "ttft_p99_s": round(quantile(t, 0.99), 6),
                "requests_per_engine_max": max(counts, default=0), "requests_per_engine_min": min(counts, default=0)}


def quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def replay(trace: Sequence[TraceRequest], policy: str, opts: ReplayOptions,
           progress: Callable[[int], None] = lambda n: None) -> PolicyResult:
    """``trace`` through ``opts.engines`` fresh engines, each request routed by ``policy``."""
    capacity = opts.cache_blocks * opts.block_tokens // TRACE_BLOCK_TOKENS
    engines = [SimEngine(f"engine-{i}", BlockLRU(capacity), BlockLRU(APPROX_CAPACITY)) for i in range(opts.engines)]
    by_name = {e.name: e for e in engines}
    policies, rng = Policies(), random.Random(opts.seed)
    result = PolicyResult(policy, per_engine=dict.fromkeys(by_name, 0))
    wall0 = time.monotonic()
    for n, req in enumerate(trace):
        if opts.speed > 0:
            time.sleep(max(0.0, wall0 + req.t / opts.speed - time.monotonic()))
        for e in engines:
            e.settle(req.t)
        cands = [e.candidate(req) for e in engines]
        engine = by_name[policies.pick(policy, cands, rng.getrandbits(63))]
        _serve(engine, req, opts, result)
        progress(n + 1)
    return result


def _serve(e: SimEngine, req: TraceRequest, opts: ReplayOptions, result: PolicyResult) -> None:
    matched = min(e.cache.matched(req.hash_ids), _servable(req))
    cached = min(matched * TRACE_BLOCK_TOKENS, req.input_length)
    e.cache.touch(req.hash_ids)
    e.belief.touch(req.hash_ids[:APPROX_PREFIX_BLOCKS])
    start = max(req.t, e.prefill_free)
    first_token = start + (req.input_length - cached) * opts.prefill_seconds_per_token
    e.prefill_free = first_token
    heapq.heappush(e.queued, (start, len(req.hash_ids) - matched))
    heapq.heappush(e.decoding, (first_token + req.output_length * opts.decode_seconds_per_token, len(req.hash_ids)))
    e.requests += 1
    result.requests += 1
    result.prompt_tokens += req.input_length
    result.cached_tokens += cached
    result.ttft.append(first_token - req.t)
    result.per_engine[e.name] += 1


# -- output ------------------------------------------------------------------------------------
def table(rows: Iterable[dict[str, Any]]) -> str:
    head = f"{'policy':<12} {'hit rate':>9} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'req/engine max':>15} {'min':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['policy']:<12} {r['hit_rate'] or 0:9.4f} {r['ttft_p50_s']:11.3f} {r['ttft_p99_s']:11.3f} "
                     f"{r['requests_per_engine_max']:15d} {r['requests_per_engine_min']:6d}")
    return "\n".join(lines)


def svg_plot(rows: Sequence[dict[str, Any]], title: str) -> str:
    """Two bar charts side by side: hit rate (linear), and TTFT p50 / p99 (log scale), one bar
    group per policy, each bar labelled with its value."""
    w, h, pad, gap = 400, 270, 30, 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w + gap + 20}" height="{h + 40}" '
           f'font-family="sans-serif" font-size="11"><text x="6" y="16" font-size="13">{_esc(title)}</text>']
    top_hit = max([float(r["hit_rate"] or 0.0) for r in rows] + [1e-9]) * 1.15
    top_ttft = max([float(r["ttft_p99_s"]) for r in rows] + [1e-9])
    charts = [("hit rate (cached / prompt tokens)", [("hit_rate", "#3b7dd8", "")], lambda v: v / top_hit),
              ("TTFT p50 and p99 (seconds, log scale)", [("ttft_p50_s", "#5aa469", "p50"), ("ttft_p99_s", "#d8843b", "p99")],
               lambda v: _log_share(v, top_ttft))]
    for k, (name, series, share) in enumerate(charts):
        x0, y0, plot_h = k * (w + gap) + pad, 30, h - 70
        legend = "  ".join(f"{label}" for _, _, label in series if label)
        out.append(f'<text x="{x0}" y="{y0 + 10}">{_esc(name)}</text>')
        for j, (_, colour, label) in enumerate(series):
            if label:
                out.append(f'<rect x="{x0 + w - 110 + 45 * j}" y="{y0 + 2}" width="10" height="10" fill="{colour}"/>'
                           f'<text x="{x0 + w - 97 + 45 * j}" y="{y0 + 11}">{label}</text>')
        out.append(f'<line x1="{x0}" y1="{y0 + 30 + plot_h}" x2="{x0 + w - pad}" y2="{y0 + 30 + plot_h}" '
                   f'stroke="#888"/><desc>{_esc(legend)}</desc>')
        slot = (w - pad) / max(1, len(rows))
        bar = (slot - 10) / len(series)
        for i, r in enumerate(rows):
            for j, (key, colour, _) in enumerate(series):
                v = float(r[key] or 0.0)
                bh = plot_h * max(0.0, min(1.0, share(v)))
                bx = x0 + i * slot + 5 + j * bar
                out.append(f'<rect x="{bx:.1f}" y="{y0 + 30 + plot_h - bh:.1f}" width="{bar:.1f}" height="{bh:.1f}" '
                           f'fill="{colour}"><title>{_esc(r["policy"])} {key} {v:g}</title></rect>')
                out.append(f'<text x="{bx + bar / 2:.1f}" y="{y0 + 26 + plot_h - bh:.1f}" font-size="9" '
                           f'text-anchor="middle">{_short(v)}</text>')
            out.append(f'<text x="{x0 + (i + 0.5) * slot:.1f}" y="{y0 + 44 + plot_h}" text-anchor="middle" '
                       f'font-size="10">{_esc(r["policy"])}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _log_share(v: float, top: float, floor: float = 0.01) -> float:
    """Where ``v`` falls between ``floor`` and ``top`` on a log scale, 0..1."""
    import math

    if v <= floor or top <= floor:
        return 0.0
    return math.log10(v / floor) / math.log10(top / floor)


def _short(v: float) -> str:
    return f"{v:.3f}" if v < 1 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Progress:
    """A one-line progress bar on ``stream`` (a terminal), at most every 1 %."""

    def __init__(self, total: int, label: str, stream: TextIO = sys.stderr) -> None:
        self.total, self.label, self.stream = max(1, total), label, stream
        self._shown = -1

    def __call__(self, n: int) -> None:
        pct = 100 * n // self.total
        if pct != self._shown and self.stream.isatty():
            self._shown = pct
            bar = "#" * (pct // 4)
            self.stream.write(f"\r{self.label:<12} [{bar:<25}] {pct:3d}%")
            if n >= self.total:
                self.stream.write("\n")
            self.stream.flush()


def run(trace: Sequence[TraceRequest], policies: Sequence[str], opts: ReplayOptions,
        progress: bool = True) -> list[dict[str, Any]]:
    rows = []
    for p in policies:
        bar = Progress(len(trace), p) if progress else (lambda n: None)
        rows.append(replay(trace, p, opts, bar).summary())
    return rows


def check_policies(names: Iterable[str]) -> list[str]:
    out = [n.strip() for n in names if n.strip()]
    unknown = [n for n in out if n not in POLICIES]
    if unknown or not out:
        raise ValueError(f"unknown policy {unknown[0]!r} (known: {', '.join(POLICIES)})" if unknown
                         else "no policy given")
    return out


def write_outputs(rows: list[dict[str, Any]], opts: ReplayOptions, trace: Path, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"trace": str(trace), "options": asdict(opts), "policies": rows}
    js, svg = out / "replay-routing.json", out / "replay-routing.svg"
    js.write_text(json.dumps(doc, indent=1) + "\n")
    svg.write_text(svg_plot(rows, f"{trace.name}: {rows[0]['requests'] if rows else 0} requests, "
                                  f"{opts.engines} engines of {opts.cache_blocks} blocks"))
    return js, svg


def replay_routing_main(args: Any) -> int:
    """Body of ``kvindex replay-routing``: the table on stdout, JSON and SVG in ``--out``; 2 on bad input."""
    try:
        policies = check_policies(args.policies.split(","))
        if args.speed < 0:
            raise ValueError("--speed must be >= 0")
        trace = read_trace(args.trace, args.limit)
    except (ValueError, OSError) as exc:
        print(f"kvindex: {exc}", file=sys.stderr)
        return 2
    if not trace:
        print(f"kvindex: {args.trace}: no requests", file=sys.stderr)
        return 2
    if args.gateway:
        return _through_gateway(trace, args)
    opts = ReplayOptions(args.engines, args.cache_blocks, prefill_seconds_per_token=args.prefill_us_per_token / 1e6,
                         decode_seconds_per_token=args.decode_us_per_token / 1e6, seed=args.seed, speed=args.speed)
    t0 = time.perf_counter()
    rows = run(trace, policies, opts)
    js, svg = write_outputs(rows, opts, args.trace, args.out)
    print(f"{len(trace)} requests, {opts.engines} engines of {opts.cache_blocks} blocks "
          f"({opts.cache_blocks * opts.block_tokens // TRACE_BLOCK_TOKENS} trace blocks of 512 tokens), "
          f"{time.perf_counter() - t0:.1f} s")
    print(table(rows))
    print(f"wrote {js} and {svg}")
    return 0


def _through_gateway(trace: Sequence[TraceRequest], args: Any) -> int:
    import asyncio

    from kvindex.tools.replay_gateway import gateway_run, whatif_table

    result, whatif = asyncio.run(gateway_run(trace, args.gateway, args.model, args.speed, args.kvindex))
    print(f"{result['requests']} requests through {args.gateway}: {result['answered']} answered, {result['errors']} "
          f"errors; realized hit rate {result['hit_rate'] or 0:.4f} ({result['cached_tokens']} cached of "
          f"{result['prompt_tokens']} prompt tokens); latency p50 {result['latency_p50_s']:.3f} s, "
          f"p99 {result['latency_p99_s']:.3f} s")
    if whatif is not None:
        print(whatif_table(whatif))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay-routing-gateway.json").write_text(json.dumps({"gateway": result, "whatif": whatif}, indent=1)
                                                          + "\n")
    return 0 if result["answered"] else 1
