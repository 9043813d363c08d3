"""Requests in flight: what kvindex predicted when a request arrived, kept until its answer passes.

Invariants:
- Entries are keyed by the request's id (16 hex digits: the ``x-kvindex-request`` header a picker
  tags the request with, so that the ext_proc filter watching the answer finds it); the value is
  the request path's own (``kvindex.route.path.Pending``), with the size its owner estimated.
- Bounded three ways: at most ``max_entries`` entries and ``max_bytes`` bytes, the oldest going
  first when a new one needs room; and none older than ``ttl`` seconds (``expire``, on every
  ``add``). Each one that leaves without being taken is handed to ``on_drop`` with why (``expired``,
  ``evicted``, ``too_large``: one alone over the budget is not kept).
- ``take`` hands an entry over exactly once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class InFlight(Generic[T]):
    def __init__(self, max_entries: int, max_bytes: int, ttl: float, on_drop: Callable[[str, T], None] = lambda why, value: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.ttl = max_entries, max_bytes, ttl
        self._on_drop, self._clock = on_drop, clock
        self._entries: OrderedDict[str, tuple[T, int, float]] = OrderedDict()  # key -> (value, bytes, added)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def add(self, key: str, value: T, size: int) -> bool:
        """Keep ``value``; False when it alone is over the byte budget (not kept, counted)."""
        self.expire()
        if size > self.max_bytes:
            self._on_drop("too_large", value)
            return False
        while self._entries and (len(self._entries) >= self.max_entries or self.bytes + size > self.max_bytes):
            self._pop_oldest("evicted")
        self._entries[key] = (value, size, self._clock())
        self.bytes += size
        return True

    def take(self, key: str) -> T | None:
        item = self._entries.pop(key, None)
        if item is None:
            return None
        self.bytes -= item[1]
        return item[0]

    def expire(self) -> None:
        deadline = self._clock() - self.ttl
        while self._entries and next(iter(self._entries.values()))[2] < deadline:
            self._pop_oldest("expired")

    def _pop_oldest(self, why: str) -> None:
        _, (value, size, _) = self._entries.popitem(last=False)
        self.bytes -= size
        self._on_drop(why, value)
