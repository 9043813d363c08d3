"""Routing decisions in: what both indexes predicted for the pod that served a request, recorded.

Three sources feed it: a router's ``POST /v1/decisions`` (the HTTP layer checks its shape,
``kvindex.http.bodies`` -> ``DecisionIn``; ``record``), and kvindex's own request path
(``kvindex.route``), which ``prepare``s and ``predict``s when a request arrives and ``commit``s when
its answer has passed (kvindex picked the engine, or watched a gateway pick it).

Invariants:
- One rule for all three: ``commit`` records the decision into the approximate index (as the
  router does after a successful response), the drift sample, the metrics (token-weighted
  counters per source, so that hit rates are ratios of sums) and the decision log
  (``kvindex.query.ledger``), with the prediction for the pod that served it, taken before.
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
- What-if: a router's decision is handed to the ``shadow`` hook after its prediction and before it
  is recorded (``kvindex.route.shadows``), so the shadows see the state the router's score saw.
"""

from __future__ import annotations

import secrets
import time
from array import array
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvindex.query.answers import (
    ApproxAnswer,
    PodAnswer,
    PreciseAnswer,
    QueryError,
    cacheable_tokens,
)
from kvindex.query.drift import Decision, DriftAudit
from kvindex.query.ledger import DecisionLog, Entry
from kvindex.metrics import Metrics
from kvindex.settings import TierWeights

MAX_BATCH = 1024  # decisions in one request
MAX_DECISION_PODS = 256  # pods known only from decisions (no engine stream, no precise state)

# of the pods asked about: those known from nowhere, and how many pods are known only from decisions now
Census = Callable[[set[str]], Awaitable[tuple[set[str], int]]]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request validated for recording: everything that does not depend on the indexes' state
    (the pick and the observer prepare one when the request arrives, commit it when it is answered)."""

    model: str
    token_ids: Sequence[int] | None
    hashes: tuple[int, ...] | None
    lora_name: str | None = None
    cache_salt: str | None = None
    label: str = ""  # drift.Decision.label
    precise_model: str = ""  # the model the precise side keys it by (an adapter's base), when not ``model``


@dataclass(frozen=True, slots=True)
class Prediction:
    """What both indexes answered for a prepared request, over the pods asked about."""

    precise: PreciseAnswer | None
    approx: ApproxAnswer | None
    from_score: bool = False  # the precise side is what the caller's last /v1/score saw


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a request ended: the pod that served it, what the engine reported, who decided."""

    pod: str
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    source: str = "api"  # kvindex.query.ledger.SOURCES
    id: str = ""  # "": one is made
    details: dict[str, Any] = field(default_factory=dict)  # the log entry's extra fields


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
    """What a decision needs of the query service (``kvindex.query.service.QueryService``)."""

    def check_token_ids(self, value: Any) -> array: ...

    async def token_ids_for(self, model: str, body: dict[str, Any]) -> Sequence[int] | None: ...

    def approx_hashes(self, model: str, body: dict[str, Any]) -> tuple[int, ...] | None: ...

    def identity(self, model: str, lora_name: str | None = None) -> tuple[str, str | None]: ...

    async def precise(self, model: str, token_ids: Sequence[int], pods: Iterable[str] | None,
                      lora_name: str | None = None, cache_salt: str | None = None) -> PreciseAnswer: ...

    def recall(self, model: str, token_ids: Sequence[int], pod: str, answer: PreciseAnswer) -> PreciseAnswer | None: ...

    async def approx_match(self, model: str, hashes: tuple[int, ...], pods: Iterable[str]) -> ApproxAnswer: ...

    async def record_approx(self, pod: str, model: str, hashes: Sequence[int]) -> None: ...


ShadowHook = Callable[[Prepared, Prediction, Outcome], Awaitable[None]]


class Decisions:
    def __init__(self, query: Predictor, drift: DriftAudit, metrics: Metrics, census: Census | None = None,
                 max_pods: int = MAX_DECISION_PODS, tier_weights: TierWeights = TierWeights(),
                 log: DecisionLog | None = None, shadow: ShadowHook | None = None) -> None:
        self._query = query
        self._tier_weights = tier_weights  # [tiers]: the answer's tier_score, as /v1/score gives it
        self._drift = drift
        self._metrics = metrics
        self._census = census
        self._max_pods = max_pods
        self.log = log if log is not None else DecisionLog()
        self._shadow = shadow  # what-if: a router's decision shadowed before it is recorded

    async def record(self, items: Sequence[DecisionIn]) -> list[dict[str, Any]]:
        """Decisions in order: all are validated before any is recorded, then each is predicted
        and recorded in order (a later one sees the earlier ones)."""
        ready = [(item, await self.prepare(item.model, item.request, item.token_ids, item.has_token_ids))
                 for item in items]
        await self.check_pods({item.pod for item, _ in ready})
        out = []
        for item, prepared in ready:
            prediction = await self.predict(prepared, [item.pod], recall=True)
            outcome = Outcome(item.pod, item.cached_tokens, item.prompt_tokens)
            if self._shadow is not None:
                await self._shadow(prepared, prediction, outcome)
            out.append(await self.commit(prepared, prediction, outcome))
        return out

    async def check_pods(self, pods: set[str]) -> None:
        """Refuse pods known from nowhere past the bound of pods known only from decisions."""
        if self._census is None:
            return
        unknown, only = await self._census(pods)
        if unknown and only + len(unknown) > self._max_pods:
            pod = min(unknown)
            raise QueryError(f"unknown pod {pod!r}: no engine stream or state names it, and {only} pods are "
                             f"known only from decisions (the limit is {self._max_pods})", field="pod", status=409,
                             reason="unknown_pod")

    async def prepare(self, model: str, request: dict[str, Any], token_ids: Any = None,
                      has_token_ids: bool = False, tokenize: bool = True) -> Prepared:
        """``request`` tokenized (``token_ids`` when given; not at all without ``tokenize``) and
        hashed, nothing recorded yet."""
        q = self._query
        tokens = q.check_token_ids(token_ids) if has_token_ids else \
            await q.token_ids_for(model, request) if tokenize else None
        hashes = q.approx_hashes(model, request)
        if tokens is None and hashes is None:
            raise QueryError("nothing to record: the request has no prompt, messages or input", field="request")
        lora, salt = request.get("lora_name"), request.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        base, lora = q.identity(model, lora if isinstance(lora, str) else None)  # an adapter: on its base
        return Prepared(model, tokens, hashes, lora, salt, prompt_label(request, salt), base if base != model else "")

    async def predict(self, p: Prepared, pods: Sequence[str], recall: bool = False) -> Prediction:
        """Both indexes' answers over ``pods``. ``recall`` (one pod): the precise side as the
        caller's last ``/v1/score`` of the prompt saw it, when there was one."""
        q = self._query
        precise, scored = None, False
        if p.token_ids is not None:
            precise = await q.precise(p.precise_model or p.model, p.token_ids, pods, p.lora_name, p.cache_salt)
            recalled = q.recall(p.model, p.token_ids, pods[0], precise) if recall and len(pods) == 1 else None
            precise, scored = (recalled, True) if recalled is not None else (precise, False)
        approx = await q.approx_match(p.model, p.hashes, pods) if p.hashes is not None else None
        return Prediction(precise, approx, scored)

    async def commit(self, p: Prepared, prediction: Prediction, outcome: Outcome) -> dict[str, Any]:
        """Record ``outcome`` (the pod that served ``p``) with what was predicted for that pod:
        into the approximate index, the drift sample, the metrics and the log; its answer."""
        pod, precise, approx = outcome.pod, prediction.precise, prediction.approx
        prompt_tokens = outcome.prompt_tokens if outcome.prompt_tokens is not None else \
            precise.prompt_tokens if precise else None
        answer = PodAnswer(pod, precise, approx).to_json(self._tier_weights)
        decision = self._decision(p, prediction, outcome, prompt_tokens)
        if p.hashes:
            self._metrics.models.learn(p.model)  # the approximate index now holds the model (evictions name it)
            await self._query.record_approx(pod, p.model, p.hashes)
        self._drift.add(decision)
        self._metrics.observe_decision(
            pod, {"approx": decision.approx, "precise": decision.precise, "actual": decision.actual},
            {"approx": decision.approx_error, "precise": decision.precise_error})
        entry = self._entry(p, decision, outcome, answer)
        self.log.add(entry)
        self._metrics.observe_tokens(outcome.source, prompt_tokens, entry.realized, entry.precise, entry.approx)
        if approx is not None:
            answer["approx"]["ratio"] = round(decision.approx, 6)
        actual = decision.actual
        answer.update(pod=pod, model=p.model, prompt_tokens=prompt_tokens, id=entry.id,
                      precise_from="score" if prediction.from_score else "decision",
                      actual={"cached_tokens": outcome.cached_tokens, "ratio": round(actual, 6)}
                      if actual is not None else None,
                      errors={"approx": _r(decision.approx_error), "precise": _r(decision.precise_error)}
                      if actual is not None else None)
        return answer

    def _decision(self, p: Prepared, prediction: Prediction, outcome: Outcome, prompt_tokens: int | None) -> Decision:
        pod, precise, approx, cached = outcome.pod, prediction.precise, prediction.approx, outcome.cached_tokens
        actual = min(cached / prompt_tokens, 1.0) if cached is not None and prompt_tokens else None
        decision = Decision(
            t=time.time(), pod=pod, model=p.model,
            hashes=array("Q", p.hashes or ()), keys=array("Q", precise.keys if precise else ()),
            block_size=precise.block_size if precise else 0, prompt_tokens=prompt_tokens,
            truth_tokens=precise.prompt_tokens if precise else 0,
            approx=approx.ratio(pod) if approx else 0.0, precise=precise.ratio(pod) if precise else None,
            actual=actual, label=p.label, precise_model=p.precise_model)
        if precise is not None and precise.block_size == 0 and p.token_ids is not None:
            decision.pending = (precise.root, array("I", p.token_ids[:cacheable_tokens(p.token_ids)]))
        return decision

    def _entry(self, p: Prepared, d: Decision, outcome: Outcome, answer: dict[str, Any]) -> Entry:
        precise = answer["precise"]["tokens"] if answer["precise"] is not None else None
        approx = round(d.approx * d.prompt_tokens) if answer["approx"] is not None and d.prompt_tokens else \
            (0 if answer["approx"] is not None else None)
        return Entry(outcome.id or secrets.token_hex(8), d.t, outcome.source, p.model, outcome.pod, d.prompt_tokens,
                     precise, approx, outcome.cached_tokens, outcome.details)


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
