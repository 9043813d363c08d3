"""The request path's scorers, as llm-d's Router defines and combines them.

A scorer is a pure function of the candidates (each endpoint's index answers and engine load, and
for ``no_hit_lru`` the order of recent picks) to a score in [0, 1] per endpoint, so that the
picker, shadow policies and replays all call the same code and tests need no server. Formulas
(reference/routing.md §1.1), for an endpoint e among the candidates:
- ``prefix-cache-scorer``: ``(1-w)·m/T + w·min(1, m·B/S)²`` with ``m`` the matched blocks of the
  request's prefix on e, floored to an integer (tier-weighted on the precise index: a block on the
  GPU counts 1.0, on the CPU 0.8), ``T`` the request's blocks, ``B`` tokens per block,
  ``w = matchLengthWeight`` (0) and ``S = matchLengthScaleTokens`` (8192). Fed by the precise
  index, an endpoint whose precise answer is missing (its pod unsynced, or no tokens) is scored
  from the approximate index instead: ``prefix_view`` says which.
- ``queue-scorer``: ``(max-q_e)/(max-min)`` over ``vllm:num_requests_waiting``; 1.0 when all equal.
- ``kv-cache-utilization-scorer``: ``1 - kv_cache_usage``.
- ``no-hit-lru-scorer``: 0.5 for all when any endpoint has a match; for a cold request, never
  picked endpoints first (by name), then the least recently picked: ``1 - rank/(n-1)``.
- An endpoint whose load is unknown or stale gets 0.5 from the two load scorers (neutral) and
  takes no part in the queue scorer's min and max.
- ``combine``: the weighted sum (weights as configured, not normalised) of every score clamped to
  [0, 1]; ``best``: the highest total, ties broken uniformly at random with the ``rng`` given.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvindex.settings import KV_SCORER, NO_HIT_LRU_SCORER, PREFIX_SCORER, QUEUE_SCORER

NEUTRAL = 0.5


@dataclass(frozen=True, slots=True)
class Load:
    waiting: float | None = None  # requests queued on the engine; None: unknown or stale
    kv_usage: float | None = None  # KV cache in use, 0..1


@dataclass(frozen=True, slots=True)
class Active:
    """What kvindex has routed to an endpoint and not yet seen answered, in blocks."""

    prefill_blocks: int = 0  # the uncached blocks of those requests
    decode_blocks: int = 0  # all their blocks


@dataclass(frozen=True, slots=True)
class Candidate:
    """One endpoint as the scorers see it for one request."""

    pod: str
    precise_blocks: float | None  # tier-weighted matched blocks; None: no precise answer to trust
    precise_total: int  # the request's blocks the engine could serve from cache
    approx_blocks: int
    approx_total: int
    block_tokens: int  # tokens per precise block (the match-length term)
    load: Load = Load()
    tiers: tuple[int, int, int] | None = None  # matched blocks on the device, then host, then disk only
    active: Active = Active()

    @property
    def request_blocks(self) -> int:
        """The request's blocks: engine blocks when it was tokenized, else approximate-index blocks."""
        return self.precise_total or self.approx_total


@dataclass(frozen=True, slots=True)
class PrefixParams:
    index: str = "precise"  # precise | approx
    match_length_weight: float = 0.0
    match_length_scale_tokens: int = 8192


def prefix_view(c: Candidate, index: str) -> tuple[int, int, str]:
    """(matched blocks, request blocks, which index) the prefix scorer uses for ``c``."""
    if index == "precise" and c.precise_blocks is not None:
        return int(c.precise_blocks), c.precise_total, "precise"
    return c.approx_blocks, c.approx_total, "approx"


def prefix_cache(cands: Sequence[Candidate], p: PrefixParams) -> dict[str, float]:
    out = {}
    for c in cands:
        matched, total, _ = prefix_view(c, p.index)
        ratio = matched / total if total else 0.0
        length = min(1.0, matched * c.block_tokens / p.match_length_scale_tokens) ** 2
        out[c.pod] = (1 - p.match_length_weight) * ratio + p.match_length_weight * length
    return out


def queue(cands: Sequence[Candidate]) -> dict[str, float]:
    known = [c.load.waiting for c in cands if c.load.waiting is not None]
    lo, hi = (min(known), max(known)) if known else (0.0, 0.0)
    out = {}
    for c in cands:
        q = c.load.waiting
        out[c.pod] = NEUTRAL if q is None else 1.0 if hi == lo else (hi - q) / (hi - lo)
    return out


def kv_utilization(cands: Sequence[Candidate]) -> dict[str, float]:
    return {c.pod: NEUTRAL if c.load.kv_usage is None else 1.0 - c.load.kv_usage for c in cands}


def no_hit_lru(cands: Sequence[Candidate], recent: Sequence[str], index: str = "precise") -> dict[str, float]:
    """``recent``: pods by their last pick, most recent first."""
    if any(prefix_view(c, index)[0] > 0 for c in cands):
        return {c.pod: NEUTRAL for c in cands}
    pods = {c.pod for c in cands}
    picked = [p for p in recent if p in pods]
    ranked = sorted(pods - set(picked)) + picked[::-1]
    n = len(ranked)
    return {p: 1.0 if n == 1 else 1.0 - i / (n - 1) for i, p in enumerate(ranked)}


def scores(cands: Sequence[Candidate], weights: Mapping[str, float], prefix: PrefixParams,
           recent: Sequence[str] = ()) -> dict[str, dict[str, float]]:
    """Every weighted scorer's scores (scorer name -> pod -> score)."""
    out: dict[str, dict[str, float]] = {}
    for name in weights:
        if name == PREFIX_SCORER:
            out[name] = prefix_cache(cands, prefix)
        elif name == QUEUE_SCORER:
            out[name] = queue(cands)
        elif name == KV_SCORER:
            out[name] = kv_utilization(cands)
        elif name == NO_HIT_LRU_SCORER:
            out[name] = no_hit_lru(cands, recent, prefix.index)
        else:
            raise ValueError(f"unknown scorer {name!r}")
    return out


def combine(per_scorer: Mapping[str, Mapping[str, float]], weights: Mapping[str, float],
            pods: Sequence[str]) -> dict[str, float]:
    totals = dict.fromkeys(pods, 0.0)
    for name, s in per_scorer.items():
        w = weights[name]
        for p in pods:
            v = s.get(p, 0.0)
            totals[p] += w * (1.0 if v > 1.0 else 0.0 if v < 0.0 else v)
    return totals


def best(totals: Mapping[str, float], rng: random.Random | int) -> str:
    """The highest total; a tie broken by ``rng`` (a seed: its own ``random.Random``, made only
    when there is a tie, so that every caller with the same seed breaks it alike)."""
    top = max(totals.values())
    tied = sorted(p for p, v in totals.items() if v == top)
    if len(tied) == 1:
        return tied[0]
    return (random.Random(rng) if isinstance(rng, int) else rng).choice(tied)
