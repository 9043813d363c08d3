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
- The ``aiohttp.ClientSession`` belongs to the caller; this class never closes it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from kvindex.tokenize import tokenize_input


class TokenizeError(RuntimeError):
    """The engine could not tokenize a request; the message is one line."""


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


def _tokens_of(answer: Any) -> list[int]:
    """The validated ``tokens`` of a /tokenize answer, or ``TokenizeError``."""
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list):
        raise TokenizeError("malformed /tokenize answer: no 'tokens' list")
    for tok in tokens:
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise TokenizeError(f"malformed /tokenize answer: token {tok!r} is not an id")
    return tokens


class EngineTokenizer:
    """Tokenizes by asking an engine's ``/tokenize`` endpoint at ``base_url``."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession, timeout: float = 5.0) -> None:
        self.url = base_url.rstrip("/") + "/tokenize"
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._timeout_s = timeout

    async def _post(self, payload: dict[str, Any]) -> Any:
        """POST ``payload``; return the decoded JSON answer or raise ``TokenizeError``."""
        async with self._session.post(self.url, json=payload, timeout=self._timeout) as resp:
            text = (await resp.read()).decode("utf-8", errors="replace")
            if resp.status != 200:
                raise TokenizeError(f"POST {self.url}: HTTP {resp.status}: {_one_line(text)}")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise TokenizeError(f"POST {self.url}: answer is not JSON: {_one_line(text)}") from None

    async def tokenize(self, model: str, body: dict[str, Any]) -> list[int]:
        """Token ids of ``body`` as the engine computes them for ``model``."""
        payload = tokenize_request(model, body)
        try:
            answer = await self._post(payload)
        except asyncio.TimeoutError:
            raise TokenizeError(f"POST {self.url}: timed out after {self._timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            reason = _one_line(str(exc) or type(exc).__name__)
            raise TokenizeError(f"POST {self.url}: {reason}") from None
        return _tokens_of(answer)
