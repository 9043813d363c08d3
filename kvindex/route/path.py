"""The request path: a request Envoy holds, read, scored and routed (``pick``) or only watched
(``observe``); its answer, once it has passed, recorded as a decision (``finish``).

Invariants:
- One rule for both modes: when a request's body is whole, it is prepared and both indexes are
  asked about every endpoint that serves its model (``kvindex.query.decisions``); in pick mode the
  scorers choose among them (``kvindex.route.scorers``); either way the prediction waits in
  ``InFlight`` under the request's id until ``finish`` records it for the pod that actually
  served the request, with the engine's own ``cached_tokens``.
- A candidate is an endpoint of the model (``Directory``) whose engine answers (``LoadScraper``:
  one that refuses connections is left out), within the subset Envoy allows when it gives one.
  Its prefix is scored from the precise index only while its pod is synced; otherwise from the
  approximate index, and the decision says which (``prefix_from``). No candidate: 503.
- A request kvindex cannot read is the caller's error, answered before any engine sees it (400
  naming the problem, 413 over ``max_body_bytes``); a tokenizer that fails (kvindex's problem) does
  not fail the request: it is scored without the precise side. Every refusal and outcome is
  counted (``RouteMetrics``).
- Only a successful answer (2xx) from a known endpoint is recorded, as a router records only the
  requests it served; every other outcome is counted and forgotten.
- A recorded request is then shadowed by every routing policy (``kvindex.route.shadows``) from the
  candidates and the tie-break seed it was routed with. A picked request's blocks count as in
  flight on its pod (``Active``: Dynamo's load) from its pick until it is answered or forgotten.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvindex.approx.gojson import NestingTooDeep, RenderError, check_nesting, go_json_fast
from kvindex.logs import BurstLog
from kvindex.query.answers import QueryError
from kvindex.query.decisions import Decisions, Outcome, Prediction, Prepared
from kvindex.route.endpoints import Directory, Endpoint
from kvindex.route.inflight import InFlight
from kvindex.route.load import LoadScraper
from kvindex.route.metrics import RouteMetrics
from kvindex.route.policies import profile_of
from kvindex.route.scorers import Active, Candidate, PrefixParams, best, combine, prefix_view, scores
from kvindex.route.shadows import Shadows, candidate
from kvindex.route.usage import Usage
from kvindex.route.verdicts import Refused, Routed
from kvindex.settings import PICK, RouteSettings

log = logging.getLogger("kvindex.route")
RECENT_PICKS = 1024  # no-hit-lru-scorer's memory of picks (llm-d's lruSize)
PENDING_BYTES = 256 << 20


@dataclass(slots=True)
class Pending:
    """A request's prediction, waiting for its answer (``InFlight``)."""

    id: str
    source: str  # pick | observe
    prepared: Prepared
    prediction: Prediction
    started: float  # monotonic
    picked: str | None = None  # the pod kvindex chose (pick)
    details: dict[str, Any] = field(default_factory=dict)
    candidates: tuple[Candidate, ...] = ()  # as scored, for the shadows (kvindex.route.shadows)
    seed: int = 0  # the tie-break's, shared with the shadows
    active: tuple[int, int] = (0, 0)  # the (prefill, decode) blocks it adds to its picked pod until answered


def pending_bytes(p: Pending) -> int:
    """What a pending request retains, estimated: its token ids, hashes, keys and per-pod answers."""
    tokens = len(p.prepared.token_ids) if p.prepared.token_ids is not None else 0
    precise, approx = p.prediction.precise, p.prediction.approx
    return (1200 + 4 * tokens + 36 * len(p.prepared.hashes or ()) + 64 * len(p.details) + len(p.prepared.model)
            + (8 * len(precise.keys) + 96 * len(precise.matches) if precise is not None else 0)
            + (96 * len(approx.blocks) if approx is not None else 0) + 160 * len(p.candidates))


@dataclass(slots=True)
class _Scored:
    candidates: list[Candidate]
    endpoints: dict[str, Endpoint]
    details: dict[str, Any] = field(default_factory=dict)


class RequestPath:
    def __init__(self, settings: RouteSettings, directory: Directory, scraper: LoadScraper, decisions: Decisions,
                 metrics: RouteMetrics, bases: Any = None, shadows: Shadows | None = None) -> None:
        self.settings, self.directory, self.scraper, self.decisions, self.metrics = \
            settings, directory, scraper, decisions, metrics
        self._bases = bases  # model -> its LoRA base (kvindex.lora.LoraAdapters.base_of), if any
        self.shadows = shadows
        self.inflight: InFlight[Pending] = InFlight(settings.max_pending, PENDING_BYTES, settings.pending_seconds,
                                                    on_drop=self._dropped)
        self._active: dict[str, list[int]] = {}  # pod -> [prefill, decode] blocks routed there, unanswered
        self._tiers = (settings.gpu_weight, settings.cpu_weight, settings.disk_weight)
        self.policy = profile_of(settings.weights, settings.prefix_index) or "configured"  # the live one
        self.rng = random.Random(settings.seed)
        self._recent: OrderedDict[str, None] = OrderedDict()  # pods by last pick, most recent last
        self._prefix = PrefixParams(settings.prefix_index, settings.match_length_weight,
                                    settings.match_length_scale_tokens)
        self._burst = BurstLog(log)
        self.max_body_bytes = settings.max_body_bytes

    def count(self, source: str, outcome: str) -> None:
        self.metrics.outcomes.labels(source, outcome).inc()

    async def refresh(self) -> None:
        await self.directory.refresh()
        self.scraper.watch(self.directory.urls())

    async def close(self) -> None:
        await self.scraper.close()

    # -- a request arrives -----------------------------------------------------------------------
    async def route(self, body: bytes, subset: tuple[str, ...] | None, source: str) -> Routed | Refused:
        """Read ``body``, predict on every candidate, choose one (``source`` pick and the model's
        mode pick) and keep the prediction for ``finish``."""
        t0 = time.perf_counter()
        read = self._read(body)
        if isinstance(read, Refused):
            return self._refused(source, read)
        model, request = read
        endpoints = self._candidates(model, subset)
        if not endpoints:
            why = f"no engine can serve model {model!r}" + (" within the subset hint" if subset is not None else "")
            return self._refused(source, Refused(503, why + self._down_note(model), "no_endpoint"))
        try:
            prepared = await self._prepare(model, request)
        except QueryError as exc:
            return self._refused(source, Refused(exc.status, str(exc), exc.reason))
        prediction = await self.decisions.predict(prepared, [e.pod for e in endpoints])
        scored = self._score(prepared, prediction, endpoints)
        picking = source == PICK and self.settings.mode_of(model) == PICK
        seed = self.rng.getrandbits(63)
        pod = self._choose(scored, seed) if picking else None
        pending = Pending(secrets.token_hex(8), PICK if picking else "observe", prepared, prediction,
                          time.monotonic(), pod, scored.details, tuple(scored.candidates), seed)
        if self.inflight.add(pending.id, pending, pending_bytes(pending)) and pod is not None:
            self._hold(pending, pod)
        self.metrics.outcomes.labels(pending.source, "routed" if picking else "watched").inc()
        self.metrics.pick_seconds.labels(pending.source).observe(time.perf_counter() - t0)
        return Routed(pending.id, scored.endpoints[pod].address if pod else None, pod)

    def _read(self, body: bytes) -> tuple[str, dict[str, Any]] | Refused:
        if len(body) > self.settings.max_body_bytes:
            return Refused(413, f"request body over {self.settings.max_body_bytes} bytes", "too_large")
        try:
            request = check_nesting(go_json_fast(body), body)
        except NestingTooDeep as exc:
            return Refused(400, str(exc), "too_deep")
        except RenderError:
            return Refused(400, "request body is not valid JSON", "malformed")
        if not isinstance(request, dict):
            return Refused(400, "request body must be a JSON object", "malformed")
        model = request.get("model")
        if not isinstance(model, str) or not model:
            return Refused(400, "request body needs a model (a non-empty string)", "missing_model")
        return model, request

    def _candidates(self, model: str, subset: tuple[str, ...] | None) -> list[Endpoint]:
        base = self._bases(model) if self._bases is not None else None
        out = [e for e in self.directory.for_model(model, [base] if base else []) if not self.scraper.down(e.url)]
        return [e for e in out if e.address in subset] if subset is not None else out

    def _down_note(self, model: str) -> str:
        down = [e.pod for e in self.directory.for_model(model) if self.scraper.down(e.url)]
        return f" (refusing connections: {', '.join(down[:8])})" if down else ""

    async def _prepare(self, model: str, request: dict[str, Any]) -> Prepared:
        try:
            return await self.decisions.prepare(model, request)
        except QueryError as exc:
            if exc.status < 500:
                raise
            self._burst.log(logging.WARNING, ("tokenizer", model), "model %s: %s; scored without the precise index",
                            model, exc)
            self.metrics.errors.labels("tokenizer_unavailable").inc()
            return await self.decisions.prepare(model, request, tokenize=False)

    def _score(self, p: Prepared, prediction: Prediction, endpoints: list[Endpoint]) -> _Scored:
        precise, approx = prediction.precise, prediction.approx
        out = _Scored([], {e.pod: e for e in endpoints})
        from_, stale = {}, []
        for e in endpoints:
            load = self.scraper.load(e.url)
            if self.scraper.stale(e.url):
                stale.append(e.pod)
            active = self._active.get(e.pod)
            cand = candidate(e.pod, precise, approx, e.synced, load, self._tiers,
                             Active(*active) if active else Active())
            out.candidates.append(cand)
            from_[e.pod] = prefix_view(cand, self._prefix.index)[2]
        out.details.update(prefix_from=from_, load_stale=stale, candidates=len(endpoints))
        return out

    def _hold(self, pending: Pending, pod: str) -> None:
        """What ``pending`` adds to ``pod`` until answered: its uncached and all its blocks."""
        c = next((c for c in pending.candidates if c.pod == pod), None)
        total = c.request_blocks if c else 0
        pending.active = (max(0, total - (c.tiers[0] if c and c.tiers else 0)), total)
        held = self._active.setdefault(pod, [0, 0])
        held[0] += pending.active[0]
        held[1] += pending.active[1]

    def _release(self, pending: Pending) -> None:
        held = self._active.get(pending.picked or "")
        if held is None or pending.active == (0, 0):
            return
        held[0] -= pending.active[0]
        held[1] -= pending.active[1]
        if held == [0, 0]:
            del self._active[pending.picked or ""]

    def _dropped(self, why: str, pending: Pending) -> None:
        self._release(pending)
        self.metrics.outcomes.labels("none", why).inc()

    def _choose(self, scored: _Scored, seed: int) -> str:
        weights = self.settings.weights
        per = scores(scored.candidates, weights, self._prefix, list(reversed(self._recent)))
        totals = combine(per, weights, [c.pod for c in scored.candidates])
        pod = best(totals, seed)
        self._recent.pop(pod, None)
        self._recent[pod] = None
        while len(self._recent) > RECENT_PICKS:
            self._recent.popitem(last=False)
        scored.details["scores"] = {p: round(v, 6) for p, v in totals.items()}
        scored.details["picked"] = pod
        return pod

    def _refused(self, source: str, refused: Refused) -> Refused:
        self.metrics.outcomes.labels(source, refused.reason).inc()
        self._burst.log(logging.INFO, ("refused", refused.reason), "request refused %d (%s): %s", refused.status,
                        refused.reason, refused.message)
        return refused

    # -- its answer has passed -------------------------------------------------------------------
    async def finish(self, request_id: str, served: str | None, status: int | None, usage: Usage | None,
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """Record the request ``request_id`` as served by the endpoint at ``served``; the
        decision's answer, or None when it is not recorded (counted why)."""
        pending = self.inflight.take(request_id)
        if pending is None:
            self.metrics.outcomes.labels("none", "unknown_request").inc()
            return None
        self._release(pending)
        endpoint = self.directory.by_address(served)
        why = None if status is not None and 200 <= status < 300 else "error_status"
        if why is None and endpoint is None:
            why = "unknown_upstream"
            self._burst.log(logging.WARNING, ("upstream", str(served)), "a request was served by %s, which is no known "
                            "engine's address: not recorded", served)
        if why is not None:
            self.metrics.outcomes.labels(pending.source, why).inc()
            return None
        assert endpoint is not None
        details = {**pending.details, "endpoint": served, "status": status, **(extra or {}),
                   "latency_ms": round(1000 * (time.monotonic() - pending.started), 3)}
        outcome = Outcome(endpoint.pod, usage.cached_tokens if usage else None, usage.prompt_tokens if usage else None,
                          pending.source, pending.id, details)
        answer = await self.decisions.commit(pending.prepared, pending.prediction, outcome)
        self.metrics.outcomes.labels(pending.source, "recorded").inc()
        if self.shadows is not None:
            self.shadows.shadow(pending.source, self.policy if pending.source == PICK else "gateway", endpoint.pod,
                                pending.candidates, pending.seed, answer.get("prompt_tokens"), outcome.cached_tokens)
        return answer

    def forget(self, request_id: str, why: str) -> None:
        """The request ended without an answer (reset, client gone): nothing to record."""
        pending = self.inflight.take(request_id)
        if pending is not None:
            self._release(pending)
            self.metrics.outcomes.labels(pending.source, why).inc()
