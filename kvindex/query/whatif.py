"""What-if: every decision beside what each routing policy would have picked for it.

A ``Shadow`` is one decision as the policies saw it (``kvindex.route.policies``, evaluated off the
request's critical path by ``kvindex.route.shadows``): the pod each would have picked and the
prefix tokens the precise index held of the request there *at decision time* (a prediction: a
counterfactual is never observed), beside the pod that actually served it, the tokens predicted
there, and the engine's realized ``cached_tokens``.

Invariants:
- Every sum is of tokens (ratios of sums, never a mean of ratios); the metrics are counters of
  the same sums, so that a Prometheus ratio of two of them is the same ratio.
- ``regret`` of a decision = the most tokens any policy predicted minus what the actual pick's pod
  had, both from the same precise state: >= 0, and 0 when the actual pick was as good as any.
- Bounded: the window keeps at most ``max_bytes`` of shadows (an estimate per shadow), the oldest
  dropped first; a summary reads only the window it asks for.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

MAX_BYTES = 16 << 20
ACTUAL = "actual"


@dataclass(frozen=True, slots=True)
class Shadow:
    t: float  # wall time of the decision
    source: str  # pick | observe | api
    policy: str  # the policy that made the decision (a name of kvindex.route.policies, "gateway", "router")
    pod: str  # the pod that served it
    prompt_tokens: int
    predicted: int  # precise-index tokens on ``pod`` at decision time
    realized: int | None  # the engine's cached_tokens
    picks: Mapping[str, tuple[str, int]]  # policy -> (pod it picks, precise tokens there)

    def size(self) -> int:
        return 240 + 120 * len(self.picks)

    def regret(self) -> int:
        return max([self.predicted, *(t for _, t in self.picks.values())]) - self.predicted


class WhatIfMetrics:
    def __init__(self, registry: CollectorRegistry, policies: Sequence[str] = ()) -> None:
        r = registry
        self.decisions = Counter("kvindex_whatif_decisions", "Decisions shadowed by every policy, by policy "
                                 "(actual: what served them)", ["policy"], registry=r)
        self.agreements = Counter("kvindex_whatif_agreements", "Shadowed decisions where the policy picks the pod "
                                  "that served the request", ["policy"], registry=r)
        self.predicted = Counter("kvindex_whatif_predicted_tokens", "Prefix tokens the precise index held, at "
                                 "decision time, on the pod each policy picks (a prediction)", ["policy"], registry=r)
        self.prompt = Counter("kvindex_whatif_prompt_tokens", "Prompt tokens of the shadowed decisions", registry=r)
        self.realized = Counter("kvindex_whatif_realized_tokens", "The engines' cached_tokens of the shadowed "
                                "decisions that reported them", registry=r)
        self.regret = Counter("kvindex_whatif_regret_tokens", "Per decision: the most tokens any policy predicted "
                              "minus what the actual pick's pod held, summed", registry=r)
        self._children: dict[str, tuple[Any, Any, Any]] = {}
        for policy in (ACTUAL, *policies):  # every series exists from the start, at 0
            self.of(policy)

    def of(self, policy: str) -> tuple[Any, Any, Any]:
        """``policy``'s (decisions, agreements, predicted tokens) counters."""
        children = self._children.get(policy)
        if children is None:
            children = self._children[policy] = (self.decisions.labels(policy), self.agreements.labels(policy),
                                                  self.predicted.labels(policy))
        return children


class WhatIf:
    def __init__(self, registry: CollectorRegistry | None = None, max_bytes: int = MAX_BYTES,
                 clock: Callable[[], float] = time.time, policies: Sequence[str] = ()) -> None:
        self._window: deque[Shadow] = deque()
        self._bytes, self.max_bytes, self._clock = 0, max_bytes, clock
        self.metrics = WhatIfMetrics(registry, policies) if registry is not None else None
        self.added = 0

    def add(self, s: Shadow) -> None:
        self._window.append(s)
        self._bytes += s.size()
        self.added += 1
        while self._bytes > self.max_bytes and self._window:
            self._bytes -= self._window.popleft().size()
        m = self.metrics
        if m is None:
            return
        m.prompt.inc(s.prompt_tokens)
        if s.realized is not None:
            m.realized.inc(s.realized)
        m.regret.inc(s.regret())
        for policy, (pod, tokens) in [(ACTUAL, (s.pod, s.predicted)), *s.picks.items()]:
            decisions, agreements, predicted = m.of(policy)
            decisions.inc()
            predicted.inc(tokens)
            if pod == s.pod:
                agreements.inc()

    def latest(self, window: float | None) -> list[Shadow]:
        """The shadows of the last ``window`` seconds (None: all that are kept), oldest first."""
        if window is None:
            return list(self._window)
        since = self._clock() - window
        out = []
        for s in reversed(self._window):
            if s.t < since:
                break
            out.append(s)
        return out[::-1]

    def summary(self, window: float | None) -> dict[str, Any]:
        return summarize(self.latest(window), window)


def summarize(shadows: list[Shadow], window: float | None = None) -> dict[str, Any]:
    """Per policy over ``shadows``: decisions, agreement with the actual pick, predicted tokens
    and their ratio to the prompt tokens; the actual decisions' predicted and realized; regret."""
    prompt = sum(s.prompt_tokens for s in shadows)
    reported = [s for s in shadows if s.realized is not None]
    policies: dict[str, dict[str, Any]] = {}
    for s in shadows:
        for policy, (pod, tokens) in s.picks.items():
            row = policies.setdefault(policy, {"decisions": 0, "agree": 0, "predicted_tokens": 0})
            row["decisions"] += 1
            row["agree"] += pod == s.pod
            row["predicted_tokens"] += tokens
    for row in policies.values():
        row["agreement"] = _ratio(row.pop("agree"), row["decisions"])
        row["predicted_hit_rate"] = _ratio(row["predicted_tokens"], prompt)
        row["kind"] = "predicted"
    regret = sum(s.regret() for s in shadows)
    by_policy: dict[str, int] = {}
    for s in shadows:
        by_policy[s.policy] = by_policy.get(s.policy, 0) + 1
    return {
        "window_seconds": window, "decisions": len(shadows), "prompt_tokens": prompt,
        "actual": {"decided_by": by_policy, "predicted_tokens": sum(s.predicted for s in shadows),
                   "predicted_hit_rate": _ratio(sum(s.predicted for s in shadows), prompt),
                   "realized_tokens": sum(s.realized or 0 for s in reported),
                   "realized_hit_rate": _ratio(sum(s.realized or 0 for s in reported),
                                               sum(s.prompt_tokens for s in reported)),
                   "kind": "realized"},
        "policies": dict(sorted(policies.items())),
        "regret": {"tokens": regret, "fraction_of_prompt": _ratio(regret, prompt), "kind": "predicted"},
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 6) if b else None
