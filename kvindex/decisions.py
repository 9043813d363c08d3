"""Routing decisions in: ``{pod, request, token_ids?, cached_tokens?, prompt_tokens?}``.

The HTTP layer checks a decision's shape (``kvindex.http.bodies`` -> ``DecisionIn``); this module
computes what both indexes predicted, records it and feeds the drift sample.

Invariants:
- A decision is validated whole before anything changes; then, in this order, both indexes are
  asked what they predicted for the decided pod (the precise side answers what the router's last
  ``/v1/score`` of the same prompt saw, when there was one in the last 30 s: by the time a
  decision is reported the engine has usually published the request's own blocks), the decision is recorded into the approximate
  index (as the router does after a successful response), and it joins the drift sample.
- A decision may name a pod kvindex knows from nowhere else (no engine stream, no state held):
  a decision is how a router tells kvindex about a pod. Such pods are bounded: at most
  ``max_pods`` pods known only from decisions (``Census``; default ``MAX_DECISION_PODS``); a
  decision that would add one more is refused whole (409 ``unknown_pod``, naming the pod), so
  ``/v1/pods``, which lists every pod either index holds, cannot be flooded with made-up names.
- The store unreachable (``StoreUnavailable``): the decision fails before it is recorded (the
  reads come first); in a batch, the decisions before it stay recorded.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvindex.answers import (
    ApproxAnswer,
    PodAnswer,
    PreciseAnswer,
    QueryError,
    cacheable_tokens,
)
from kvindex.drift import Decision, DriftAudit
from kvindex.metrics import Metrics
from kvindex.settings import TierWeights

MAX_BATCH = 1024  # decisions in one request
MAX_DECISION_PODS = 256  # pods known only from decisions (no engine stream, no precise state)

# of the pods asked about: those known from nowhere, and how many pods are known only from decisions now
Census = Callable[[set[str]], Awaitable[tuple[set[str], int]]]


@dataclass(frozen=True, slots=True)
class _Ready:
    """A validated decision: everything computed that does not depend on the indexes' state."""

    pod: str
    model: str
    token_ids: Sequence[int] | None
    hashes: tuple[int, ...] | None
    cached_tokens: int | None
    prompt_tokens: int | None
    lora_name: str | None = None
    cache_salt: str | None = None
    label: str = ""  # drift.Decision.label
    precise_model: str = ""  # the model the precise side keys it by (an adapter's base), when not ``model``


@dataclass(frozen=True, slots=True)
class DecisionIn:
    """A decision as the HTTP layer read it (``kvindex.http.bodies``): its shape checked, nothing
    computed yet. ``token_ids`` is as sent, and only read when ``has_token_ids``."""

    pod: str
    model: str
    request: dict[str, Any]
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    has_token_ids: bool = False
    token_ids: Any = None


class Predictor(Protocol):
    """What a decision needs of the query service (``kvindex.query.QueryService``)."""

    def check_token_ids(self, value: Any) -> array: ...

    async def token_ids_for(self, model: str, body: dict[str, Any]) -> Sequence[int] | None: ...

    def approx_hashes(self, model: str, body: dict[str, Any]) -> tuple[int, ...] | None: ...

    def identity(self, model: str, lora_name: str | None = None) -> tuple[str, str | None]: ...

    async def precise(self, model: str, token_ids: Sequence[int], pods: Iterable[str] | None,
                      lora_name: str | None = None, cache_salt: str | None = None) -> PreciseAnswer: ...

    def recall(self, model: str, token_ids: Sequence[int], pod: str, answer: PreciseAnswer) -> PreciseAnswer | None: ...

    async def approx_match(self, model: str, hashes: tuple[int, ...], pods: Iterable[str]) -> ApproxAnswer: ...

    async def record_approx(self, pod: str, model: str, hashes: Sequence[int]) -> None: ...


class Decisions:
    def __init__(self, query: Predictor, drift: DriftAudit, metrics: Metrics, census: Census | None = None,
                 max_pods: int = MAX_DECISION_PODS, tier_weights: TierWeights = TierWeights()) -> None:
        self._query = query
        self._tier_weights = tier_weights  # [tiers]: the answer's tier_score, as /v1/score gives it
        self._drift = drift
        self._metrics = metrics
        self._census = census
        self._max_pods = max_pods

    async def record(self, items: Sequence[DecisionIn]) -> list[dict[str, Any]]:
        """Decisions in order: all are validated before any is recorded, then each is predicted
        and recorded in order (a later one sees the earlier ones)."""
        ready = [await self._validate(item) for item in items]
        await self._check_pods({r.pod for r in ready})
        return [await self._commit(r) for r in ready]

    async def _check_pods(self, pods: set[str]) -> None:
        """Refuse pods known from nowhere past the bound of pods known only from decisions."""
        if self._census is None:
            return
        unknown, only = await self._census(pods)
        if unknown and only + len(unknown) > self._max_pods:
            pod = min(unknown)
            raise QueryError(f"unknown pod {pod!r}: no engine stream or state names it, and {only} pods are "
                             f"known only from decisions (the limit is {self._max_pods})", field="pod", status=409,
                             reason="unknown_pod")

    async def _validate(self, d: DecisionIn) -> _Ready:
        q, model, request = self._query, d.model, d.request
        token_ids = q.check_token_ids(d.token_ids) if d.has_token_ids else await q.token_ids_for(model, request)
        hashes = q.approx_hashes(model, request)
        if token_ids is None and hashes is None:
            raise QueryError("nothing to record: the request has no prompt, messages or input", field="request")
        lora, salt = request.get("lora_name"), request.get("cache_salt")
        base, lora = q.identity(model, lora if isinstance(lora, str) else None)  # an adapter: on its base
        return _Ready(d.pod, model, token_ids, hashes, d.cached_tokens, d.prompt_tokens,
                      lora, salt if isinstance(salt, str) else None,
                      prompt_label(request, salt if isinstance(salt, str) else None), base if base != model else "")

    async def _commit(self, r: _Ready) -> dict[str, Any]:
        q, pod = self._query, r.pod
        precise, scored = None, False
        if r.token_ids is not None:
            precise = await q.precise(r.precise_model or r.model, r.token_ids, [pod], r.lora_name, r.cache_salt)
            recalled = q.recall(r.model, r.token_ids, pod, precise)
            precise, scored = (recalled, True) if recalled is not None else (precise, False)
        approx = await q.approx_match(r.model, r.hashes, [pod]) if r.hashes is not None else None
        prompt_tokens = r.prompt_tokens if r.prompt_tokens is not None else precise.prompt_tokens if precise else None
        answer = PodAnswer(pod, precise, approx).to_json(self._tier_weights)
        cached = r.cached_tokens
        actual = min(cached / prompt_tokens, 1.0) if cached is not None and prompt_tokens else None
        decision = Decision(
            t=time.time(), pod=pod, model=r.model,
            hashes=array("Q", r.hashes or ()), keys=array("Q", precise.keys if precise else ()),
            block_size=precise.block_size if precise else 0, prompt_tokens=prompt_tokens,
            truth_tokens=precise.prompt_tokens if precise else 0,
            approx=approx.ratio(pod) if approx else 0.0, precise=precise.ratio(pod) if precise else None,
            actual=actual, label=r.label, precise_model=r.precise_model)
        if precise is not None and precise.block_size == 0 and r.token_ids is not None:
            decision.pending = (precise.root, array("I", r.token_ids[:cacheable_tokens(r.token_ids)]))
        if r.hashes:
            self._metrics.models.learn(r.model)  # the approximate index now holds the model (evictions name it)
            await q.record_approx(pod, r.model, r.hashes)
        self._drift.add(decision)
        self._metrics.observe_decision(
            pod, {"approx": decision.approx, "precise": decision.precise, "actual": decision.actual},
            {"approx": decision.approx_error, "precise": decision.precise_error})
        if approx is not None:
            answer["approx"]["ratio"] = round(decision.approx, 6)
        answer.update(pod=pod, model=r.model, prompt_tokens=prompt_tokens,
                      precise_from="score" if scored else "decision",
                      actual={"cached_tokens": cached, "ratio": round(actual, 6)} if actual is not None else None,
                      errors={"approx": _r(decision.approx_error), "precise": _r(decision.precise_error)}
                      if actual is not None else None)
        return answer


LABEL_CHARS = 48  # of a prompt's text kept to name it (the dashboard's per-pod view)


def prompt_label(request: dict[str, Any], cache_salt: str | None) -> str:
    """A person's name for a prompt: its cache_salt (a tenant), else its first characters."""
    if cache_salt:
        return "cache_salt " + cache_salt[:LABEL_CHARS]
    text = request.get("prompt")
    if not isinstance(text, str):
        messages = request.get("messages")
        first = messages[0] if isinstance(messages, list) and messages and isinstance(messages[0], dict) else {}
        content = first.get("content")
        text = content if isinstance(content, str) else ""
    return text[:LABEL_CHARS]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
