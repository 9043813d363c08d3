"""Turning a request body into the token ids an engine would see, with a bounded cache.

Invariants:
- A ``Tokenizer`` maps (model, OpenAI-style request body) to the prompt's token ids; it raises
  ``ValueError`` for a body it cannot tokenize (no string ``prompt`` / list ``messages``) and may
  raise its own error type (a ``RuntimeError``) when a remote tokenizer fails.
- ``tokenize_input(body)`` is the part of a body that decides its tokens; two bodies with equal
  ``tokenize_input`` (and model, and ``cache_epoch`` below) tokenize identically, so they are the cache key. Sampling parameters,
  ``max_tokens``, ``stream``... are not part of it.
- ``CachingTokenizer`` holds at most ``maxsize`` entries and ``budget`` bytes (estimated: the key's
  str and the token tuple; an entry over the budget is not kept), evicting the least recently used; it never
  caches a failure; every call counts as exactly one hit or one miss (a failed miss still counts);
  callers get a fresh list they may mutate.
- A tokenizer whose tokens also depend on something outside the body (a chat template that puts
  today's date in the prompt via ``strftime_now``) has ``cache_epoch(model, body) -> str``: its
  current value is part of the cache key, so an entry made under another value is never answered
  (it ages out by LRU). ``cache_epoch`` is cheap and never raises for a body ``tokenize`` refuses.
- A ``ValueError`` a tokenizer raises may carry ``reason`` (the rejection's metric label).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvindex.budget import ByteLRU, str_bytes

TOKENIZE_KEYS = (
    "prompt",
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "reasoning_effort",
)
"""Body fields that can change a prompt's tokens (vLLM's chat request renders with all of them)."""
TOKENIZER_CACHE_BYTES = 64 << 20  # what one model table's tokenizer cache may retain, estimated
_TOKEN_BYTES = 32  # a token id in the cached tuple: its int object (most are not small ints)


@runtime_checkable
class Tokenizer(Protocol):
    """Anything that tokenizes request bodies for a model."""

    async def tokenize(self, model: str, body: dict[str, Any]) -> Sequence[int]: ...


def tokenize_input(body: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``body`` (among ``TOKENIZE_KEYS``) that are present and decide its tokens."""
    return {k: body[k] for k in TOKENIZE_KEYS if k in body}


def cache_key(model: str, body: dict[str, Any]) -> str:
    """Canonical JSON of (model, tokenize_input(body)): sorted keys, no spaces, non-ASCII kept."""
    return json.dumps(
        [model, tokenize_input(body)], sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


class CachingTokenizer:
    """Wraps a ``Tokenizer`` with a bounded LRU cache keyed by ``cache_key``."""

    def __init__(self, inner: Tokenizer, maxsize: int = 4096, budget: int = TOKENIZER_CACHE_BYTES) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self._inner = inner
        self._maxsize = maxsize
        self._cache: ByteLRU[str, tuple[int, ...]] = ByteLRU(budget, maxsize)
        self._hits = 0
        self._misses = 0

    @property
    def hits(self) -> int:
        """Calls answered from the cache."""
        return self._hits

    @property
    def misses(self) -> int:
        """Calls passed to the wrapped tokenizer."""
        return self._misses

    @property
    def maxsize(self) -> int:
        """The most entries the cache holds."""
        return self._maxsize

    @property
    def bytes(self) -> int:
        """The estimated bytes the cached entries retain."""
        return self._cache.bytes

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        self._cache.clear()

    async def tokenize(self, model: str, body: dict[str, Any]) -> list[int]:
        """Cached ``inner.tokenize``; errors propagate and are not cached."""
        key = cache_key(model, body)
        epoch = getattr(self._inner, "cache_epoch", None)
        if epoch is not None:
            key += "\x1f" + epoch(model, body)
        cached = self._cache.get(key)
        if cached is not None:
            self._hits += 1
            return list(cached)
        self._misses += 1
        tokens = await self._inner.tokenize(model, body)
        kept = tuple(tokens)
        self._cache.put(key, kept, str_bytes(key) + sys.getsizeof(kept) + _TOKEN_BYTES * len(kept))
        return list(tokens)
