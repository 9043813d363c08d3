"""Values every layer shares about held blocks: what a batch did, one held engine hash, one pod's match.

Plain, immutable-by-convention values and no imports from kvindex: the index contracts
(``kvindex.index.protocol``) return them, every backend builds them, and the query, persistence and
shard layers read them. ``merged`` is the one rule for a pod matched on several ranks (or workers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(slots=True)
class Applied:
    """What a batch of events did (counts), filled in as it is applied."""

    stored: int = 0  # block copies
    removed: int = 0
    orphans: int = 0  # stores kept without a key
    unknown_removals: int = 0
    block_size_mismatch: int = 0  # BlockStored events whose block size differs from the model's
    tier_unkeyed: int = 0  # lower-tier copies stored with no identity (no keyed copy of the hash held)
    stored_events: int = 0
    removed_events: int = 0
    cleared: int = 0  # AllBlocksCleared events
    reannounced: int = 0  # blocks of re-announcements (stores of held hashes that add no copy)


class Entry(NamedTuple):
    """One held engine hash, as exported and loaded (snapshots, peer recovery)."""

    pod: str
    dp_rank: int
    medium: str
    hash: int
    key: int | None
    copies: int


EntryRow = tuple[str, int, str, int, int | None, int]
"""An ``Entry``'s fields as a plain tuple (an ``Entry`` is one): what a snapshot decodes to for a
restore, millions of them, without an object per entry beyond the tuple."""


class PodMatch(NamedTuple):
    """Longest matched prefix of one pod, in blocks. ``dp`` per rank; tiers cumulative."""

    gpu: int
    cpu: int
    disk: int
    dp: dict[int, int]


TIERS = ("gpu", "cpu", "disk")  # the keys of blocks_held beside "orphans"; match's PodMatch fields


def merged(a: PodMatch | None, b: PodMatch) -> PodMatch:
    """Two matches of one pod, on other ranks, as one: per tier the deeper, ``dp`` the union."""
    if a is None:
        return b
    return PodMatch(max(a.gpu, b.gpu), max(a.cpu, b.cpu), max(a.disk, b.disk), {**a.dp, **b.dp})
