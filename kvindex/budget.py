"""A least-recently-used map bounded by bytes: what request-fed caches and memories hold.

A count alone does not bound memory when a request chooses the size of what is kept (a 7 MiB
model name, 10 000 long pod names): every cache fed by requests is a ``ByteLRU`` whose entries
carry an estimate of the bytes they retain (``str_bytes`` and the caller's own sums).

Invariants: ``bytes`` is the sum of the sizes of the entries held and never exceeds ``budget``
after ``put`` returns; at most ``max_entries`` entries; an entry larger than the budget is not
kept; eviction drops the least recently used first (``get`` and ``put`` make an entry the most
recent). Not thread-safe (one event loop owns it).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


def str_bytes(s: str | None) -> int:
    """What a str object occupies (CPython's compact representation; O(1))."""
    return 0 if s is None else sys.getsizeof(s)


class ByteLRU(Generic[K, V]):
    def __init__(self, budget: int, max_entries: int) -> None:
        if budget < 1 or max_entries < 1:
            raise ValueError("budget and max_entries must be >= 1")
        self.budget, self.max_entries = budget, max_entries
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0

    @property
    def bytes(self) -> int:
        """The estimated bytes the entries held retain."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, size: int) -> bool:
        """Keep ``value`` (``size`` bytes) under ``key``, evicting the least recently used as needed;
        False (and nothing kept, any older value under ``key`` dropped) when it exceeds the budget."""
        self.pop(key)
        if size > self.budget:
            return False
        self._entries[key] = (value, size)
        self._bytes += size
        while self._bytes > self.budget or len(self._entries) > self.max_entries:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped
        return True

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._bytes -= entry[1]
        return entry[0]

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
