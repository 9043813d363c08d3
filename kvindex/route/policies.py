"""Routing policies: which engine each would pick for one request, from the same candidates the
picker scores (``kvindex.route.scorers.Candidate``). The picker runs one of them live; every
decision is also shadowed by all of them (``kvindex.route.whatif``), and ``kvindex
replay-routing`` drives each over a trace (``kvindex.tools.replay_routing``).

The policies (reference/routing.md):
- ``precise``: llm-d's precise profile (prefix-cache-scorer on the precise index 2,
  kv-cache-utilization 1, queue 1);
- ``approx``: llm-d's default profile (prefix-cache-scorer on the approximate index 3, queue 2,
  kv-cache-utilization 2);
- ``load``: queue 1 and kv-cache-utilization 1 alone;
- ``kthena``: Kthena's prefix-cache plugin over the approximate index: the endpoint with the most
  matched blocks of the request, as its score ``100 * matched / blocks``;
- ``dynamo``: Dynamo's KV router with its default ``KvRouterConfig``, temperature 0: the lowest
  ``prefill_load_scale * max(0, prefill_blocks - credit) + decode_blocks``, where ``credit =
  overlap_score_credit * device + 0.75 * host + 0.25 * disk`` matched blocks (precise index),
  ``prefill_blocks`` = the request's blocks + the uncached blocks in flight there, and
  ``decode_blocks`` = the request's blocks + every block in flight there;
- ``round_robin``: the candidates in name order, one after the other.

Invariants:
- Pure given their state: ``Policies.pick_all`` reads nothing but its arguments and its own
  round-robin turn. Ties are broken with ``random.Random(seed)``, the seed given per request, so
  the picker and a shadow of the same policy pick the same endpoint from the same candidates.
- Every policy picks one of the candidates (there is at least one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from kvindex.route.scorers import Candidate, PrefixParams, best, combine, scores
from kvindex.settings import KV_SCORER, PRECISE_PROFILE, PREFIX_SCORER, QUEUE_SCORER

PRECISE, APPROX, KTHENA, LOAD, DYNAMO, ROUND_ROBIN = "precise", "approx", "kthena", "load", "dynamo", "round_robin"
POLICIES = (PRECISE, APPROX, KTHENA, LOAD, DYNAMO, ROUND_ROBIN)


@dataclass(frozen=True, slots=True)
class Profile:
    """A weighted sum of llm-d scorers, its prefix scorer fed by ``index``."""

    weights: Mapping[str, float]
    index: str


PROFILES: Mapping[str, Profile] = MappingProxyType({
    PRECISE: Profile(PRECISE_PROFILE, "precise"),
    APPROX: Profile(MappingProxyType({PREFIX_SCORER: 3.0, QUEUE_SCORER: 2.0, KV_SCORER: 2.0}), "approx"),
    LOAD: Profile(MappingProxyType({QUEUE_SCORER: 1.0, KV_SCORER: 1.0}), "precise"),
})


@dataclass(frozen=True, slots=True)
class DynamoConfig:
    """Dynamo's ``KvRouterConfig`` defaults (reference/routing.md §1.3)."""

    overlap_score_credit: float = 1.0
    prefill_load_scale: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25


def profile_of(weights: Mapping[str, float], index: str) -> str | None:
    """The name of the profile these settings are, or None (a profile of the operator's own)."""
    for name, p in PROFILES.items():
        if dict(p.weights) == dict(weights) and p.index == index:
            return name
    return None


def profile_pick(cands: Sequence[Candidate], profile: Profile, seed: int, prefix: PrefixParams = PrefixParams(),
                 recent: Sequence[str] = ()) -> tuple[str, dict[str, float]]:
    """The endpoint ``profile`` picks and every endpoint's total."""
    params = PrefixParams(profile.index, prefix.match_length_weight, prefix.match_length_scale_tokens)
    totals = combine(scores(cands, profile.weights, params, recent), profile.weights, [c.pod for c in cands])
    return best(totals, seed), totals


def kthena_scores(cands: Sequence[Candidate]) -> dict[str, float]:
    return {c.pod: 100.0 * c.approx_blocks / c.approx_total if c.approx_total else 0.0 for c in cands}


def dynamo_costs(cands: Sequence[Candidate], cfg: DynamoConfig = DynamoConfig()) -> dict[str, float]:
    out = {}
    for c in cands:
        request = c.request_blocks
        device, host, disk = c.tiers if c.tiers is not None else (0, 0, 0)
        credit = cfg.overlap_score_credit * device + cfg.host_cache_hit_weight * host + cfg.disk_cache_hit_weight * disk
        prefill = request + c.active.prefill_blocks
        out[c.pod] = cfg.prefill_load_scale * max(0.0, prefill - credit) + request + c.active.decode_blocks
    return out


class Policies:
    """Every policy's pick for one request; owns round-robin's turn."""

    def __init__(self, prefix: PrefixParams = PrefixParams(), dynamo: DynamoConfig = DynamoConfig()) -> None:
        self._prefix, self._dynamo = prefix, dynamo
        self._turn = 0

    def pick(self, policy: str, cands: Sequence[Candidate], seed: int) -> str:
        if policy in PROFILES:
            return profile_pick(cands, PROFILES[policy], seed, self._prefix)[0]
        if policy == KTHENA:
            return best(kthena_scores(cands), seed)
        if policy == DYNAMO:
            costs = dynamo_costs(cands, self._dynamo)
            return best({p: -v for p, v in costs.items()}, seed)
        if policy == ROUND_ROBIN:
            pods = sorted(c.pod for c in cands)
            self._turn += 1
            return pods[(self._turn - 1) % len(pods)]
        raise ValueError(f"unknown policy {policy!r}")

    def pick_all(self, cands: Sequence[Candidate], seed: int) -> dict[str, str]:
        """Every policy's pick; the profiles share their scorers' scores (each computed once)."""
        shared: dict[tuple[str, str], dict[str, float]] = {}
        pods = [c.pod for c in cands]
        out = {}
        for name in POLICIES:
            profile = PROFILES.get(name)
            if profile is None:
                out[name] = self.pick(name, cands, seed)
                continue
            per = {}
            for scorer in profile.weights:
                key = (scorer, profile.index if scorer == PREFIX_SCORER else "")
                if key not in shared:
                    params = PrefixParams(profile.index, self._prefix.match_length_weight,
                                          self._prefix.match_length_scale_tokens)
                    shared[key] = scores(cands, {scorer: 1.0}, params)[scorer]
                per[scorer] = shared[key]
            out[name] = best(combine(per, profile.weights, pods), seed)
        return out


def matched_tokens(c: Candidate) -> int:
    """The prefix tokens the precise index holds of the request on ``c`` (0 without an answer)."""
    return c.tiers[0] * c.block_tokens if c.tiers is not None else 0
