"""A simulated vLLM engine: the OpenAI HTTP API on a real aiohttp server, plus vLLM KV-cache
events on real ZeroMQ sockets, for kvindex's gateway tests and benchmarks (an Envoy proxy routes
requests to several of these).

Job: answer ``/v1/completions`` and ``/v1/chat/completions`` as vLLM does, with the prefix-cache
hit (``usage.prompt_tokens_details.cached_tokens``) of a ``SimulatedCache``, and publish the KV
events of every admission on the engine's PUB socket, so a kvindex daemon subscribed to it indexes
exactly what the engine holds. ``/metrics`` carries the vLLM gauges a router scrapes.

Invariants:
- One ``OpenAIEngine`` = one ``Replica`` (``kvindex.tools.demo_replica``: a ``SimulatedCache``
  and a ``FakeEngine`` with PUB plus ROUTER replay), renamed to ``EngineOptions.pod`` (topic
  ``kv@<pod>@<model>``), seq counting from 0, one batch per admission that produced events.
- Tokens are ``SimTokenizer``'s (llm-d-inference-sim's, kvindex ``tokenizer = "llmd-sim"``): a
  completion's ``prompt`` string is ``tokenize_prompt(prompt)``, a list of ints is taken as is; a
  chat is ``tokenize_prompt(render_chat(messages))``.
- A request waits for one of ``max_running`` slots in FIFO order (the number waiting is
  ``vllm:num_requests_waiting``; ``pause()`` holds every request in the queue until
  ``resume()``). Holding a slot it is admitted into the cache and its events are published
  BEFORE any byte of its response is written (admit and publish run under one lock, so seqs and
  events follow admission order); then it sleeps prefill (uncached prompt tokens x
  ``prefill_seconds_per_token``) and decode (``max_tokens`` x ``decode_seconds_per_token``, paced
  per token when streaming), answers and frees its slot.
- Answers are deterministic apart from ``created``: the text is ``max_tokens`` words (default 16)
  from a fixed list, ``finish_reason`` "length"; the streamed chunks concatenate to that text.
- Bad input never crashes a handler: not JSON, no prompt/messages, bad fields -> 400, an unknown
  ``model`` -> 404, both in vLLM's ``{"error": {message, type, param, code}}`` shape; a request
  still queued when the engine closes -> 503.
- ``stats`` counts every admitted request with the usage its response reports; ``close()`` is
  idempotent, closes the HTTP server and both sockets (the ZeroMQ context belongs to the caller),
  and the engine owns no other task. No module-level mutable state.

``python -m kvindex.tools.openai_fleet`` runs N of them in one process (its module docstring).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import zmq.asyncio
from aiohttp import web

from adapters.llmd_sim import SimTokenizer
from kvindex.tools.demo_replica import BLOCK_SIZE, Replica
from kvindex.tools.engine_slots import Slots
from kvindex.tools.openai_api import (MAX_MODEL_LEN, Answer, ApiError, api_errors, bad_request, chat_tokens,
                                      completion_tokens, dumps, metric, padding_text, parse_generation, read_json, sse)
from kvindex.tools.engine_sim import Admission, SimulatedCache
from kvindex.tools.fake_engine import FakeEngine

log = logging.getLogger("kvindex.tools.openai_engine")

RECENT_PAIRS = 10_000
RECENT_ANSWERS = 64
"""``OpenAIEngine.answers`` keeps the bodies of this many last answers (tests compare what a client got)."""
MAX_BODY_BYTES = 64 * 1024 * 1024
SHUTDOWN_SECONDS = 0.5
_METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """One simulated engine's configuration (costs in seconds)."""

    pod: str
    model: str
    cache_blocks: int = 2048
    block_size: int = BLOCK_SIZE
    host: str = "127.0.0.1"
    port: int = 0
    prefill_seconds_per_token: float = 0.0
    decode_seconds_per_token: float = 0.0
    max_running: int = 8
    metrics_padding_lines: int = 0

    def __post_init__(self) -> None:
        if self.cache_blocks < 1 or self.block_size < 1 or self.max_running < 1:
            raise ValueError("cache_blocks, block_size and max_running must be >= 1")
        if self.prefill_seconds_per_token < 0 or self.decode_seconds_per_token < 0:
            raise ValueError("per-token costs must be >= 0")
        if self.metrics_padding_lines < 0 or not 0 <= self.port < 65536:
            raise ValueError("metrics_padding_lines must be >= 0 and port in [0, 65535]")


@dataclass
class EngineStats:
    """Sums of the usage every admitted request reports, and its last ``RECENT_PAIRS`` pairs."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=RECENT_PAIRS))

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.recent.append((prompt_tokens, cached_tokens))


class OpenAIEngine:
    """One simulated vLLM engine (see the module docstring). ``url``, ``address``,
    ``kv_endpoint`` and ``replay_endpoint`` are valid after ``start()``."""

    def __init__(self, options: EngineOptions, ctx: zmq.asyncio.Context) -> None:
        self.options = options
        self.replica = _replica(options, ctx)
        self.tokenizer = SimTokenizer()
        self.stats = EngineStats()
        self.answers: deque[bytes] = deque(maxlen=RECENT_ANSWERS)  # response bodies as written
        self._slots = Slots(options.max_running)
        self._publish_lock = asyncio.Lock()
        self._ids = itertools.count()
        self._padding = padding_text(options.model, options.metrics_padding_lines)
        self._labels = f'model_name="{options.model}"'
        self._waiting_override: int | None = None
        self._usage_override: float | None = None
        self._runner: web.AppRunner | None = None
        self._engine_started = False
        self._closed = False
        self.port: int | None = None

    # lifecycle

    async def start(self) -> None:
        """Bind the PUB and ROUTER sockets, then serve HTTP."""
        if self._runner is not None or self._closed:
            raise RuntimeError("OpenAIEngine.start() called twice or after close()")
        await self.replica.engine.start()
        self._engine_started = True
        self._runner = web.AppRunner(self._app(), access_log=None, shutdown_timeout=SHUTDOWN_SECONDS)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.options.host, self.options.port).start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        """Refuse queued requests, stop the HTTP server, close both sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._slots.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._engine_started:
            await self.replica.engine.close()

    async def __aenter__(self) -> OpenAIEngine:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # addresses

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("OpenAIEngine.address before start()")
        host = self.options.host
        host = "127.0.0.1" if host in _WILDCARD_HOSTS else host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def kv_endpoint(self) -> str:
        return self.replica.engine.endpoint

    @property
    def replay_endpoint(self) -> str:
        address = self.replica.engine.replay_address
        assert address is not None
        return address

    def describe(self) -> dict[str, str]:
        """What the CLI prints for this engine."""
        return {"pod": self.options.pod, "url": self.url, "address": self.address,
                "kv_endpoint": self.kv_endpoint, "replay_endpoint": self.replay_endpoint}

    # test hooks

    def set_waiting_override(self, n: int | None) -> None:
        """Report ``n`` as ``vllm:num_requests_waiting`` (None: the real queue length)."""
        self._waiting_override = n

    def set_usage_override(self, x: float | None) -> None:
        """Report ``x`` as ``vllm:kv_cache_usage_perc`` (None: the real usage)."""
        self._usage_override = x

    def pause(self) -> None:
        """Hold every new request in the queue (running ones finish)."""
        self._slots.pause()

    def resume(self) -> None:
        self._slots.resume()

    # gauges

    @property
    def waiting(self) -> int:
        return self._slots.waiting if self._waiting_override is None else self._waiting_override

    @property
    def running(self) -> int:
        return self._slots.running

    @property
    def kv_usage(self) -> float:
        if self._usage_override is not None:
            return self._usage_override
        return self.replica.cache.physical_blocks() / self.options.cache_blocks

    # HTTP

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[api_errors])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is None or model == self.options.model:
            return
        if not isinstance(model, str):
            raise bad_request("model must be a string", "model")
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await read_json(request)
        self._check_model(body)
        tokens = chat_tokens(self.tokenizer, body) if chat else completion_tokens(self.tokenizer, body)
        gen = parse_generation(body, chat)
        if not await self._slots.acquire():
            raise ApiError(503, "the engine is shutting down", "ServiceUnavailableError")
        try:
            adm = await self._admit(tokens)
            await self._sleep_tokens(adm.prompt_tokens - adm.cached_tokens, self.options.prefill_seconds_per_token)
            prefix = "chatcmpl" if chat else "cmpl"
            answer = Answer(f"{prefix}-{self.options.pod}-{next(self._ids)}", self.options.model, int(time.time()),
                            chat, gen, adm)
            if gen.stream:
                return await self._stream(request, answer)
            await self._sleep_tokens(gen.max_tokens, self.options.decode_seconds_per_token)
            text = dumps(answer.full())
            self.answers.append(text.encode())
            return web.Response(text=text, content_type="application/json")
        finally:
            self._slots.release()

    async def _admit(self, tokens: Sequence[int]) -> Admission:
        """Prefill into the cache and publish the admission's events (in admission order)."""
        async with self._publish_lock:
            adm = self.replica.admit(tuple(tokens))
            await self.replica.publish(adm)
        self.stats.record(adm.prompt_tokens, adm.cached_tokens)
        return adm

    @staticmethod
    async def _sleep_tokens(n: int, cost: float) -> None:
        if cost > 0 and n > 0:
            await asyncio.sleep(n * cost)

    async def _stream(self, request: web.Request, answer: Answer) -> web.StreamResponse:
        """One SSE chunk per generated token, paced by the decode cost, then usage and [DONE]."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        cost, t0 = self.options.decode_seconds_per_token, loop.time()
        written: list[bytes] = []

        async def write(data: bytes) -> None:
            written.append(data)
            await resp.write(data)
        try:
            for i in range(answer.gen.max_tokens):
                if cost > 0:
                    await asyncio.sleep(max(0.0, t0 + (i + 1) * cost - loop.time()))
                await write(sse(answer.chunk(i)))
            if answer.gen.include_usage:
                await write(sse(answer.usage_chunk()))
            await write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.answers.append(b"".join(written))
        except ConnectionResetError:
            log.debug("%s: client left mid-stream", answer.rid)
        return resp

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self._check_model(body)
        if "messages" in body:
            tokens = chat_tokens(self.tokenizer, body)
        else:
            tokens = completion_tokens(self.tokenizer, body)
        ids = list(tokens)
        return web.json_response({"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                                  "token_strs": None}, dumps=dumps)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=(self._padding + self.metrics_text()).encode(),
                            headers={"Content-Type": _METRICS_CONTENT_TYPE})

    def metrics_text(self) -> str:
        """The vLLM metrics this engine reports (without the padding)."""
        o, lb, s = self.options, self._labels, self.stats
        return "".join((
            metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", lb,
                   self.running),
            metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", lb,
                   self.waiting),
            metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", lb,
                   self.kv_usage),
            metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", lb, s.prompt_tokens),
            metric("vllm:prefix_cache_queries_total", "counter",
                   "Prefix cache queries, in terms of number of queried tokens.", lb, s.prompt_tokens),
            metric("vllm:prefix_cache_hits_total", "counter",
                   "Prefix cache hits, in terms of number of cached tokens.", lb, s.cached_tokens),
            metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.",
                   f'block_size="{o.block_size}",enable_prefix_caching="True",num_gpu_blocks="{o.cache_blocks}"',
                   1),
        ))

    async def _models(self, request: web.Request) -> web.Response:
        model = self.options.model
        card = {"id": model, "object": "model", "created": 0, "owned_by": "vllm", "root": model, "parent": None,
                "max_model_len": MAX_MODEL_LEN}
        return web.json_response({"object": "list", "data": [card]}, dumps=dumps)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()


def _replica(options: EngineOptions, ctx: zmq.asyncio.Context) -> Replica:
    """A ``Replica`` renamed to the options' pod, with their block size and host."""
    replica = Replica(0, options.model, options.cache_blocks, ctx)
    replica.pod = options.pod
    replica.topic = f"kv@{options.pod}@{options.model}".encode()
    if options.block_size != BLOCK_SIZE:
        replica.cache = SimulatedCache(options.cache_blocks, options.block_size)
    if options.host != "127.0.0.1":
        endpoint = f"tcp://{options.host}:*"
        replica.engine = FakeEngine(endpoint, replay_endpoint=endpoint, context=ctx)
    return replica
