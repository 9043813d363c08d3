"""Tokenizing through the engine itself: vLLM's (and the simulator's) ``POST /tokenize``.

Invariants:
- A completions body becomes ``{"model", "prompt"}``; a chat body becomes ``{"model", "messages",
  "add_generation_prompt": true}`` (``add_generation_prompt`` and the other rendering fields of
  ``kvindex.tokenize.TOKENIZE_KEYS`` are passed through when the body sets them), so the ids equal
  what the engine computes for the same chat completion.
- The answer's ``tokens`` must be a list of non-negative ints; anything else, an HTTP status other
  than 200, a connection error or a timeout (``timeout`` seconds, whole request) raises
  ``TokenizeError`` with a one-line reason. A body with neither a string ``prompt`` nor a list
  ``messages`` raises ``ValueError`` before any request.
- An answer is read up to ``max_answer_bytes`` (default ``MAX_ANSWER_BYTES``: a ``max_token_ids``
  answer of 2^20 ids of 7 digits is ~8 MiB of JSON); a longer one raises ``TokenizeError`` without
  reading the rest.
- The ``aiohttp.ClientSession`` belongs to the caller; this class never closes it.
- ``RenderTokenizer`` (``tokenizer = "render"``) asks vLLM's render endpoints instead
  (``POST /v1/chat/completions/render`` answers one ``GenerateRequest`` object, ``POST
  /v1/completions/render`` a list of them, one per prompt; the ids are its ``token_ids``), with the
  same session, timeout and errors. An engine whose render endpoints are off (HTTP 403: vLLM 0.32
  without ``--enable-scale-out``; 404/405: older vLLM, other engines) is asked ``/tokenize`` from
  then on: the fallback is remembered (``render_off``, once ``/tokenize`` answered) and logged once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from kvindex.tokenize import tokenize_input


RENDER_OFF_STATUSES = (403, 404, 405)  # render endpoints disabled or absent: use /tokenize
MAX_ANSWER_BYTES = 32 << 20  # an engine's /tokenize or render answer (module invariants)
log = logging.getLogger(__name__)


class TokenizeError(RuntimeError):
    """The engine could not tokenize a request; the message is one line; ``status`` its HTTP status."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _one_line(text: str, limit: int = 200) -> str:
    """``text`` squeezed to one line of at most ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def tokenize_request(model: str, body: dict[str, Any]) -> dict[str, Any]:
    """The JSON body for ``POST /tokenize``; ``ValueError`` if ``body`` has no prompt/messages."""
    fields = tokenize_input(body)
    if isinstance(fields.get("prompt"), str):
        fields.pop("messages", None)
        return {"model": model, **fields}
    if isinstance(fields.get("messages"), list):
        fields.pop("prompt", None)
        fields.setdefault("add_generation_prompt", True)
        return {"model": model, **fields}
    raise ValueError("request body needs a string 'prompt' or a list 'messages'")


def _tokens_of(answer: Any, key: str = "tokens", where: str = "/tokenize") -> list[int]:
    """The validated ids under ``key`` of an engine's answer, or ``TokenizeError``."""
    tokens = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(tokens, list):
        raise TokenizeError(f"malformed {where} answer: no {key!r} list")
    for tok in tokens:
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise TokenizeError(f"malformed {where} answer: token {tok!r} is not an id")
    return tokens


class EngineTokenizer:
    """Tokenizes by asking an engine's ``/tokenize`` endpoint at ``base_url``."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession, timeout: float = 5.0,
                 max_answer_bytes: int = MAX_ANSWER_BYTES) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_answer_bytes = max_answer_bytes
        self.url = self.base_url + "/tokenize"
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._timeout_s = timeout

    async def _post(self, url: str, payload: dict[str, Any]) -> Any:
        """POST ``payload``; return the decoded JSON answer or raise ``TokenizeError``."""
        async with self._session.post(url, json=payload, timeout=self._timeout) as resp:
            text = (await self._read_capped(url, resp)).decode("utf-8", errors="replace")
            if resp.status != 200:
                raise TokenizeError(f"POST {url}: HTTP {resp.status}: {_one_line(text)}", resp.status)
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise TokenizeError(f"POST {url}: answer is not JSON: {_one_line(text)}") from None

    async def _read_capped(self, url: str, resp: aiohttp.ClientResponse) -> bytes:
        """The answer's bytes, or ``TokenizeError`` once they pass ``max_answer_bytes``."""
        cap, got = self.max_answer_bytes, bytearray()
        if (resp.content_length or 0) > cap:
            raise TokenizeError(f"POST {url}: answer of {resp.content_length} bytes; the limit is {cap}")
        async for chunk in resp.content.iter_chunked(1 << 16):
            got += chunk
            if len(got) > cap:
                raise TokenizeError(f"POST {url}: answer over {cap} bytes (the limit)")
        return bytes(got)

    async def ask(self, url: str, payload: dict[str, Any]) -> Any:
        """``_post`` with the timeout and connection errors as ``TokenizeError``."""
        try:
            return await self._post(url, payload)
        except asyncio.TimeoutError:
            raise TokenizeError(f"POST {url}: timed out after {self._timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            reason = _one_line(str(exc) or type(exc).__name__)
            raise TokenizeError(f"POST {url}: {reason}") from None

    async def tokenize(self, model: str, body: dict[str, Any]) -> list[int]:
        """Token ids of ``body`` as the engine computes them for ``model``."""
        return _tokens_of(await self.ask(self.url, tokenize_request(model, body)))


class RenderTokenizer:
    """Tokenizes through vLLM's render endpoints, falling back to ``/tokenize`` when they are off."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession, timeout: float = 5.0,
                 max_answer_bytes: int = MAX_ANSWER_BYTES) -> None:
        self.engine = EngineTokenizer(base_url, session, timeout, max_answer_bytes)
        self.render_off = False  # set once the engine answered that render is off or absent

    async def tokenize(self, model: str, body: dict[str, Any]) -> list[int]:
        """Token ids of ``body`` from the engine's render endpoint (or its /tokenize)."""
        payload = tokenize_request(model, body)
        if self.render_off:
            return await self.engine.tokenize(model, body)
        chat = "messages" in payload
        url = self.engine.base_url + ("/v1/chat/completions/render" if chat else "/v1/completions/render")
        try:
            answer = await self.engine.ask(url, payload)
        except TokenizeError as exc:
            if exc.status not in RENDER_OFF_STATUSES:
                raise
            tokens = await self.engine.tokenize(model, body)  # a 404 /tokenize shares (unknown model) is not remembered
            self.render_off = True
            log.warning("%s: render endpoints off (%s); tokenizing through %s from now on", url, exc, self.engine.url)
            return tokens
        if not chat:  # one GenerateRequest per prompt; a string prompt is one
            if not isinstance(answer, list) or len(answer) != 1:
                raise TokenizeError(f"malformed {url} answer: expected a list of one object")
            answer = answer[0]
        return _tokens_of(answer, "token_ids", url)
