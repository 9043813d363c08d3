"""The LoRA adapters an engine serves, from its OpenAI ``GET /v1/models``, polled with backoff.

vLLM (0.32: ``vllm/entrypoints/openai/models/serving.py``, ``OpenAIServingModels.show_available_models``)
lists its base model(s) as cards with ``parent: null`` and every loaded adapter as a card whose
``id`` is the adapter's served name (the ``lora_name`` of its blocks) and whose ``parent`` is the
base model's served name (``ModelCard`` in ``vllm/entrypoints/serve/engine/protocol.py``).

Invariants:
- One ``ModelsPoller`` per distinct URL; each answer replaces what that URL said before
  (``LoraAdapters.sync_engine``: an unloaded adapter is forgotten).
- Never fatal: a failed poll (refused, timed out, not JSON, not a model list) is counted in
  ``kvindex_lora_models_poll_failures_total{model}``, logged once until a poll succeeds again
  (then once more: recovered), and retried after a delay doubling from ``retry`` up to ``every``.
- A card that is not an object with string ``id`` and ``parent`` is skipped; at most
  ``MAX_CARDS`` cards are read; an answer is read to its end (however many writes the server
  made of it), and one over ``MAX_ANSWER_BYTES`` is a failed poll.
- The poll loop never ends but by cancellation: the backoff's exponent is capped (no overflow
  however long the engine is down), and any other exception of a poll is counted as a failure,
  logged with its traceback at most once per ``ERROR_LOG_SECONDS``, and retried like one.
- ``EnginePollers`` owns its tasks and its HTTP session: ``start`` creates them, ``stop`` cancels
  and awaits them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec

from kvindex.logs import BurstLog
from kvindex.lora import LoraAdapters
from kvindex.metrics import Metrics

log = logging.getLogger("kvindex.lora")
EVERY_SECONDS = 30.0  # between two polls of an engine that answers
RETRY_SECONDS = 1.0  # the first retry after a failure; doubled per failure up to EVERY_SECONDS
MAX_CARDS = 4096
MAX_ANSWER_BYTES = 4 << 20
MAX_BACKOFF_DOUBLINGS = 30  # retry * 2**30 is past any sane ``every``: the exponent stops growing there
ERROR_LOG_SECONDS = 60.0  # an unexpected poll error is logged at most this often per URL


class PollFailed(Exception):
    pass


def listed_models(answer: Any) -> tuple[dict[str, str], list[str]]:
    """``({adapter: parent}, [base models])`` of a ``/v1/models`` answer; ``PollFailed`` if it is
    not a model list."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise PollFailed("answer is not a model list ({\"data\": [...]})")
    adapters: dict[str, str] = {}
    bases: list[str] = []
    for card in data[:MAX_CARDS]:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            if isinstance(card.get("parent"), str):
                adapters[card["id"]] = card["parent"]
            elif card.get("parent") is None:
                bases.append(card["id"])
    return adapters, bases


class ModelsPoller:
    def __init__(self, url: str, model: str, adapters: LoraAdapters, metrics: Metrics, session: aiohttp.ClientSession,
                 every: float = EVERY_SECONDS, retry: float = RETRY_SECONDS, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/") + "/v1/models"
        self._origin = url
        self._model = model  # the [models] table it came from: the failure metric's label
        self._adapters, self._metrics, self._session = adapters, metrics, session
        self._every, self._retry, self._timeout = every, retry, aiohttp.ClientTimeout(total=timeout)
        self.failures = 0  # consecutive
        self.polls = 0  # successful
        self.errors = 0  # polls that raised something other than PollFailed (a bug or a broken session)
        self._burst = BurstLog(log, interval=ERROR_LOG_SECONDS)

    async def poll_once(self) -> None:
        """One GET; the adapters it lists synced, or ``PollFailed`` with the reason."""
        try:
            async with self._session.get(self.url, timeout=self._timeout) as resp:
                raw = await read_answer(resp.content)
                if resp.status != 200:
                    raise PollFailed(f"HTTP {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise PollFailed(f"{type(exc).__name__}: {exc}"[:200]) from None
        if len(raw) > MAX_ANSWER_BYTES:
            raise PollFailed(f"answer over {MAX_ANSWER_BYTES} bytes")
        try:
            answer = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise PollFailed("answer is not JSON") from None
        self._adapters.sync_engine(self._origin, *listed_models(answer))
        self.polls += 1

    def backoff(self) -> float:
        """Seconds before the next poll after ``failures`` consecutive failures (at least one)."""
        return min(self._retry * 2.0 ** min(self.failures - 1, MAX_BACKOFF_DOUBLINGS), self._every)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(await self._poll_counted())

    async def _poll_counted(self) -> float:
        """One poll, its outcome counted and logged; the seconds to wait before the next."""
        try:
            await self.poll_once()
        except PollFailed as exc:
            self._failed()
            if self.failures == 1:
                log.warning("GET %s failed (%s): its LoRA adapters are not learned from it until it answers; "
                            "retrying with backoff", self.url, exc)
            return self.backoff()
        except Exception as exc:  # not an engine's fault: never the end of the loop
            self.errors += 1
            self._failed()
            self._burst.log(logging.ERROR, (self.url,), "GET %s: unexpected error polling its LoRA adapters (%s); "
                            "retrying with backoff", self.url, type(exc).__name__, exc_info=exc)
            return self.backoff()
        if self.failures:
            log.info("GET %s answers again after %d failed poll(s)", self.url, self.failures)
        self.failures = 0
        return self._every

    def _failed(self) -> None:
        self._metrics.lora_poll_failures.labels(self._metrics.models.label(self._model)).inc()
        self.failures += 1


async def read_answer(body: aiohttp.StreamReader) -> bytes:
    """The whole body (``read(n)`` alone gives what has arrived so far), at most one byte past
    ``MAX_ANSWER_BYTES`` (the caller refuses such an answer)."""
    raw = bytearray()
    while len(raw) <= MAX_ANSWER_BYTES:
        chunk = await body.read(MAX_ANSWER_BYTES + 1 - len(raw))
        if not chunk:
            break
        raw += chunk
    return bytes(raw)


class EnginePollers:
    """One poller per distinct adapters URL of the ``[models]`` tables (``ModelConfig.adapters_url``)."""

    def __init__(self, urls: Mapping[str, str], adapters: LoraAdapters, metrics: Metrics, **kw: Any) -> None:
        self._urls = dict(urls)  # url -> the model table naming it
        self._adapters, self._metrics, self._kw = adapters, metrics, kw
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.pollers: list[ModelsPoller] = []

    def start(self) -> None:
        if not self._urls or self._session is not None:
            return
        self._session = aiohttp.ClientSession()
        self.pollers = [ModelsPoller(url, model, self._adapters, self._metrics, self._session, **self._kw)
                        for url, model in sorted(self._urls.items())]
        self._tasks = [asyncio.create_task(p.run(), name=f"poll {p.url}") for p in self.pollers]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        session, self._session = self._session, None
        if session is not None:
            await session.close()
