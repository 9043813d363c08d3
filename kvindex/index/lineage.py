"""Where each held key came from: its parent key and its block's local hash (Dynamo's ``tokens_hash``).

kvindex's keys are chained (``kvindex.keys``) and cannot be inverted, but Dynamo's ``/dump``
names every block by its local hash under its parent's engine hash. The precise index records,
per stored chain, ``(parent key, local hashes, keys)`` as two packed u64 arrays (16 bytes a
block, no object per block: the ingest path pays one dict probe and, for a chain not recorded
yet, two C-level array copies an event);
``GET /dump`` reads them back (``kvindex.registrations``) through ``lookup()``.

Invariants:
- A record is a pure function of its keys (same parent, same tokens, same keys), so a key
  recorded by several events or pods never has two answers and never goes stale; a chain is
  recorded once, by its last key, however often engines store it again.
- Bounded by what is held: once it holds more than four times the blocks it kept at its last
  prune (and at least ``MIN_PRUNE``), it drops every record none of whose keys a worker holds
  (``held`` gives the containers of the held keys: the index's holder maps).
- Blocks loaded from a snapshot have no record (their tokens were never seen): a dump leaves
  them out of Dynamo's tree (``kvindex.dynamo_dump``) until an engine stores them again.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection, Iterable, Sequence

MIN_PRUNE = 1 << 16

Lookup = Callable[[int], "tuple[int, int] | None"]


class Lineage:
    def __init__(self, held: Callable[[], Iterable[Collection[int]]]) -> None:
        self._held = held
        self._recs: dict[int, tuple[int, array, array]] = {}  # last key -> (parent, locals, keys)
        self._blocks = 0
        self._mark = MIN_PRUNE
        self._index: dict[int, tuple[int, int]] | None = None

    def add(self, parent: int, locals_: Sequence[int], keys: array) -> array:
        """Records the keys of one stored event (``keys[i]`` chains ``locals_[i]`` from the key
        before it, the first from ``parent``); returns ``keys``."""
        if keys and keys[-1] not in self._recs:  # the last key names the whole chain: a re-store adds nothing
            self._recs[keys[-1]] = (parent, array("Q", locals_ if len(locals_) == len(keys) else locals_[:len(keys)]),
                                    array("Q", keys))
            self._blocks += len(keys)
            self._index = None
            if self._blocks > self._mark:
                self.prune(keys)  # they are not in the tables yet: the caller stores them next
        return keys

    def prune(self, keep: Iterable[int] = ()) -> None:
        """Drops the records none of whose keys a worker holds (or is in ``keep``)."""
        alive = set(keep)
        for held in self._held():
            alive.update(held)
        self._recs = {k: r for k, r in self._recs.items() if not alive.isdisjoint(r[2])}
        self._blocks = sum(len(r[2]) for r in self._recs.values())
        self._mark = max(MIN_PRUNE, 4 * self._blocks)
        self._index = None

    def lookup(self) -> Lookup:
        """``key -> (parent key, local hash)`` (None when not recorded), as of now."""
        if self._index is None:
            index: dict[int, tuple[int, int]] = {}
            for parent, locals_, keys in self._recs.values():
                for local, key in zip(locals_, keys):
                    index[key] = (parent, local)
                    parent = key
            self._index = index
        return self._index.get

    def of(self, key: int) -> tuple[int, int] | None:
        return self.lookup()(key)

    def __len__(self) -> int:
        """Blocks recorded (a key in several recorded chains counts in each)."""
        return self._blocks
