"""The decision log: the latest routing decisions of every source, newest first (``GET /v1/decisions``).

Invariants:
- An ``Entry`` is what one decision was, as recorded: which request (``id``), from where
  (``source``: ``pick`` kvindex chose the engine, ``observe`` a gateway did and kvindex watched,
  ``api`` a router posted it), the pod that served it, what each index predicted there in tokens
  (precise: the engine's cached prefix by kvindex's events; approx: the router's belief, its
  matched fraction of the prompt times the prompt's tokens) and what the engine reported
  (``realized``: its ``cached_tokens``; None when it reported none). ``details`` are plain JSON
  values (per source: scores, why a pod was scored from which index, the endpoint, the status).
- Bounded: at most ``max_entries`` entries and ``max_bytes`` bytes (estimated by ``entry_bytes``);
  the oldest leave first; an entry over the whole budget is not kept (it is still counted).
- ``latest(n)`` never returns more than asked, and never an entry twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvindex.budget import str_bytes

SOURCES = ("pick", "observe", "api")
LOG_BYTES = 16 << 20
_ENTRY_BYTES = 400  # an entry's own objects: the dataclass, its floats and ints, the details dict


@dataclass(frozen=True, slots=True)
class Entry:
    id: str
    time: float
    source: str
    model: str
    pod: str | None
    prompt_tokens: int | None
    precise: int | None  # predicted cached tokens on ``pod`` (None: no tokens to match)
    approx: int | None
    realized: int | None  # the engine's cached_tokens
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "time": round(self.time, 6), "source": self.source, "model": self.model,
                "pod": self.pod, "prompt_tokens": self.prompt_tokens,
                "predicted": {"precise": self.precise, "approx": self.approx},
                "realized_cached_tokens": self.realized, **self.details}


def entry_bytes(e: Entry) -> int:
    """What an entry retains, estimated: its strings and a flat cost per detail (a pod's score)."""
    return (_ENTRY_BYTES + str_bytes(e.id) + str_bytes(e.model) + str_bytes(e.pod or "")
            + sum(str_bytes(k) + _detail_bytes(v) for k, v in e.details.items()))


def _detail_bytes(value: Any) -> int:
    if isinstance(value, str):
        return str_bytes(value)
    if isinstance(value, Mapping):
        return sum(str_bytes(str(k)) + 64 for k in value) + 64
    if isinstance(value, (list, tuple)):
        return 64 * len(value) + 64
    return 32


class DecisionLog:
    def __init__(self, max_entries: int = 1024, max_bytes: int = LOG_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: deque[tuple[Entry, int]] = deque()
        self.bytes = 0
        self.added = 0  # every entry ever added, kept or not

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: Entry) -> None:
        self.added += 1
        size = entry_bytes(entry)
        if size > self.max_bytes:
            return
        while self._entries and (len(self._entries) >= self.max_entries or self.bytes + size > self.max_bytes):
            self.bytes -= self._entries.popleft()[1]
        self._entries.append((entry, size))
        self.bytes += size

    def latest(self, limit: int) -> list[Entry]:
        """The newest ``limit`` entries, newest first."""
        out: list[Entry] = []
        for entry, _ in reversed(self._entries):
            if len(out) >= limit:
                break
            out.append(entry)
        return out
