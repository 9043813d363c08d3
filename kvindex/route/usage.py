"""An engine's response, read for what it says it served from cache: ``usage.prompt_tokens`` and
``usage.prompt_tokens_details.cached_tokens``, in a JSON answer or in the chunks of an SSE stream
(the usage chunk OpenAI servers send last with ``stream_options.include_usage``).

Invariants:
- ``UsageReader`` takes a response's body chunk by chunk, as Envoy hands them over, and never holds
  more than ``max_bytes``: a JSON answer past it, or an SSE line past it, gives no usage (the
  reader says why in ``problem``) and is never half-read into a wrong number.
- Only well-formed numbers count: non-negative integers (a bool is not one); a usage whose
  ``cached_tokens`` is missing or null has ``cached_tokens`` None (the engine did not report it:
  vLLM without ``--enable-prompt-tokens-details``), never 0.
- The last usage of a stream wins (engines send it once, last).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

MAX_RESPONSE_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None
    cached_tokens: int | None


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def usage_of(doc: Any) -> Usage | None:
    """The usage object of one decoded answer (or SSE chunk), if it has one."""
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(_count(usage.get("prompt_tokens")), cached)


class UsageReader:
    def __init__(self, content_type: str = "", max_bytes: int = MAX_RESPONSE_BYTES) -> None:
        self.sse = content_type.split(";")[0].strip().lower() == "text/event-stream"
        self._max = max_bytes
        self._buf = bytearray()
        self.usage: Usage | None = None
        self.problem: str | None = None  # why no usage could be read (a reason label)

    def feed(self, chunk: bytes) -> None:
        if self.problem is not None:
            return
        self._buf += chunk
        if self.sse:
            self._lines()
        if len(self._buf) > self._max:
            self._buf.clear()
            self.problem = "response_too_large"

    def _lines(self) -> None:
        buf = self._buf
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            line = bytes(buf[start:end]).strip()
            start = end + 1
            if line.startswith(b"data:") and b'"usage"' in line:
                self._sse_data(line[5:].strip())
        del buf[:start]

    def _sse_data(self, data: bytes) -> None:
        try:
            found = usage_of(msgspec.json.decode(data))
        except msgspec.DecodeError:
            return
        if found is not None:
            self.usage = found

    def end(self) -> Usage | None:
        """The usage, once the body is whole."""
        if self.problem is None:
            if self.sse:
                self._buf += b"\n"
                self._lines()
            elif self._buf:
                try:
                    self.usage = usage_of(msgspec.json.decode(bytes(self._buf)))
                except msgspec.DecodeError:
                    self.problem = "response_not_json"
            if self.usage is None and self.problem is None:
                self.problem = "no_usage"
        self._buf.clear()
        return self.usage
