"""Every decision shadowed by every policy (``kvindex.route.policies``), into ``WhatIf``
(``kvindex.query.whatif``).

Invariants:
- One rule makes a candidate from both indexes' answers for a pod (``candidate``): the picker's
  scoring (``kvindex.route.path``) and the shadows of a router's ``POST /v1/decisions`` both use it.
- Off the critical path: the request path shadows a request when its answer has passed, from the
  candidates and the tie-break seed kept since it was routed (so a shadow of the live policy picks
  what the picker picked); a router's decision is shadowed before it is recorded, from what the
  router's last ``/v1/score`` of the same prompt saw on every pod it asked about (none seen in the
  last 30 s: not shadowed, counted). What a policy predicts is the precise index's tokens there.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from kvindex.query.answers import ApproxAnswer, PreciseAnswer
from kvindex.query.whatif import Shadow, WhatIf
from kvindex.route.policies import POLICIES, Policies, matched_tokens
from kvindex.route.scorers import Active, Candidate, Load

ROUTER = "router"  # the policy of a decision a router posted


TIERS = (1.0, 0.8, 0.0)  # a matched block on the GPU, the CPU, disk: llm-d's precise producer


def candidate(pod: str, precise: PreciseAnswer | None, approx: ApproxAnswer | None, synced: bool, load: Load,
              tier_weights: tuple[float, float, float] = TIERS, active: Active = Active()) -> Candidate:
    """``pod`` as the scorers see it: its prefix weighed by tier (None unless ``synced``: an
    unsynced pod's precise answer is not trusted), its load and what is in flight there."""
    tiers: tuple[int, int, int] | None = None
    weighted: float | None = None
    if precise is not None:
        m = precise.matches.get(pod)
        tiers = (m.gpu, m.cpu - m.gpu, m.disk - m.cpu) if m is not None else (0, 0, 0)
        if synced:
            weighted = sum(w * n for w, n in zip(tier_weights, tiers))
    return Candidate(pod, weighted, len(precise.keys) if precise is not None else 0,
                     approx.blocks.get(pod, 0) if approx is not None else 0,
                     len(approx.hashes) if approx is not None else 0,
                     precise.block_size if precise is not None else 0, load, tiers, active)


class Recaller(Protocol):
    """What shadowing a router's decision needs of the query service."""

    def recall_all(self, model: str, token_ids: Sequence[int], answer: PreciseAnswer
                   ) -> tuple[PreciseAnswer, frozenset[str] | None] | None: ...

    async def approx_match(self, model: str, hashes: tuple[int, ...], pods: Iterable[str]) -> ApproxAnswer: ...

    async def candidates(self, requested: Iterable[str] | None, precise: PreciseAnswer | None) -> list[str]: ...


class Shadows:
    def __init__(self, whatif: WhatIf, policies: Policies | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.whatif, self.policies = whatif, policies or Policies()
        self._rng, self._clock = rng or random.Random(), clock
        self.unshadowed = 0  # router decisions with no score to shadow them from

    @classmethod
    def create(cls, registry: CollectorRegistry) -> Shadows:
        """Every policy's shadows, their what-if and its metrics in ``registry``."""
        return cls(WhatIf(registry, policies=POLICIES))

    def hook(self, query: Recaller) -> Callable[[Any, Any, Any], Awaitable[None]]:
        """``Decisions``' shadow hook: a router's decision shadowed before it is recorded."""
        return lambda p, prediction, outcome: self.router_decision(query, p, prediction, outcome)

    def shadow(self, source: str, policy: str, pod: str, cands: Sequence[Candidate], seed: int,
               prompt_tokens: int | None, realized: int | None) -> Shadow | None:
        if not cands:
            return None
        by_pod = {c.pod: c for c in cands}
        picks = {name: (p, matched_tokens(by_pod[p])) for name, p in self.policies.pick_all(cands, seed).items()}
        served = by_pod.get(pod)
        total = prompt_tokens if prompt_tokens is not None else 0
        s = Shadow(self._clock(), source, policy, pod, total, matched_tokens(served) if served else 0, realized, picks)
        self.whatif.add(s)
        return s

    async def router_decision(self, query: Recaller, p: Any, prediction: Any, outcome: Any) -> None:
        """Shadow a router's decision (``kvindex.query.decisions``' ``Prepared``, ``Prediction`` and
        ``Outcome``: ``Decisions`` calls it before recording it)."""
        precise = prediction.precise
        recalled = query.recall_all(p.precise_model or p.model, p.token_ids, precise) \
            if precise is not None and p.token_ids is not None else None
        if recalled is None:
            self.unshadowed += 1
            return
        wide, asked = recalled
        pods = sorted(set(await query.candidates(asked, wide)) | {outcome.pod})
        approx = await query.approx_match(p.model, p.hashes, pods) if p.hashes is not None else None
        cands = [candidate(pod, wide, approx, True, Load()) for pod in pods]
        prompt = outcome.prompt_tokens if outcome.prompt_tokens is not None else wide.prompt_tokens
        self.shadow(outcome.source, ROUTER, outcome.pod, cands, self._rng.getrandbits(63), prompt,
                    outcome.cached_tokens)
