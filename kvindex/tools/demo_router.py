"""The in-process demo's router: scores every request with kvindex over real HTTP, picks a pod,
has the pod's simulated engine admit it, and reports the decision with the engine's own
``cached_tokens`` (``POST /v1/decisions``), as a router sidecar would.

Routing rule (an approximate, Kthena-style router; the precise index is only observed):
    value(pod) = approx_score(pod) - LOAD_WEIGHT * recent_share(pod)
where ``approx_score`` is kvindex's ``/v1/score`` ``pods[pod].approx.score`` (Kthena's 0..100 prefix
score from the router's own decisions) and ``recent_share`` is the pod's percentage (0..100) of the
requests routed in the last ``LOAD_WINDOW`` seconds. The highest value wins; ties go to the pod
with fewer recent requests, then to the lower pod name. A request is served synchronously (one in
flight at a time), so the recent-request count is the load signal.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from kvindex.tools.demo_replica import Replica
from kvindex.tools.workload import Request

LOAD_WEIGHT = 0.5
LOAD_WINDOW = 10.0


class Router:
    """Scores with kvindex, picks a pod (see the module docstring), sends, reports the decision."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, replicas: dict[str, Replica],
                 clock: Callable[[], float] = time.monotonic,
                 settle: Callable[[], Awaitable[None]] | None = None) -> None:
        self._session = session
        self._settle = settle
        self._url = base_url
        self._model = model
        self._replicas = replicas
        self._clock = clock
        self._recent: deque[tuple[float, str]] = deque()
        self.decisions = 0
        self.exact = 0  # requests whose score-time precise tokens equalled the engine's cached_tokens

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._session.post(self._url + path, json=body) as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"kvindex {path} answered {r.status}: {data}")
            return data

    def _recent_counts(self) -> dict[str, int]:
        now = self._clock()
        while self._recent and self._recent[0][0] < now - LOAD_WINDOW:
            self._recent.popleft()
        counts = dict.fromkeys(self._replicas, 0)
        for _, pod in self._recent:
            counts[pod] += 1
        return counts

    def pick(self, scores: dict[str, float]) -> str:
        """The pod maximising approx_score - LOAD_WEIGHT * recent_share (ties: less loaded, then name)."""
        counts = self._recent_counts()
        total = sum(counts.values()) or 1
        value = {p: scores.get(p, 0) - LOAD_WEIGHT * 100.0 * counts[p] / total for p in self._replicas}
        return min(self._replicas, key=lambda p: (-value[p], counts[p], p))

    async def handle(self, req: Request) -> str:
        """Route one request end to end; return the pod that served it."""
        if self._settle is not None:
            await self._settle()
        body = {"model": self._model, "prompt": req.text}
        ids = list(req.token_ids)
        scored = await self._post("/v1/score", {**body, "token_ids": ids, "pods": list(self._replicas)})
        pod = self.pick({p: a.get("approx", {}).get("score", 0) for p, a in scored["pods"].items()})
        self._recent.append((self._clock(), pod))
        replica = self._replicas[pod]
        adm = replica.admit(req.token_ids)
        self.exact += (scored["pods"][pod].get("precise") or {}).get("tokens") == adm.cached_tokens
        await replica.publish(adm)
        await self._post("/v1/decisions", {"pod": pod, "request": body, "token_ids": ids,
                                           "cached_tokens": adm.cached_tokens, "prompt_tokens": adm.prompt_tokens})
        self.decisions += 1
        return pod
