"""The sequence rules: where an engine stream stands, and whether a batch applies on top of it.

Pure functions and values, no I/O. Every precise-index backend decides ``judge`` inside the same
atomic step that applies a batch (so when several replicas offer the same batch exactly one applies
it), and the ingest lanes (``kvindex.ingest.sequencer``) act on the ``Outcome``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import msgspec


@dataclass(frozen=True, slots=True)
class StreamRef:
    """One engine event stream (a topic of a publisher). ``id`` is the same on every replica."""

    id: str
    pod: str
    model: str

    @classmethod
    def of(cls, pod: str, topic: str, model: str) -> StreamRef:
        return cls(f"{pod}|{topic}", pod, model)


class Position(msgspec.Struct, frozen=True):
    """Where a stream stands in the store: last applied seq (None: nothing since the start or the
    last restart), its epoch (one more per engine restart), and whether its history is complete.
    (A Struct, as the events are: one is made per batch applied; a frozen dataclass costs 5x.)"""

    last_seq: int | None = None
    epoch: int = 0
    synced: bool = True
    reason: str | None = None  # why unsynced


class Outcome(str, Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seq <= last_seq in this epoch: applied already (another replica, a replay)
    STALE = "stale"  # an older epoch: the engine restarted since; skip it
    GAP = "gap"  # seq > last_seq + 1: not applied; recover [last_seq + 1, seq) or apply with force
    BEHIND = "behind"  # the store is at an older epoch than the caller: it lost writes; resync the stream


def judge(pos: Position | None, seq: int, epoch: int, force: str | None) -> Outcome:
    """Whether a batch ``seq`` offered at ``epoch`` applies on top of ``pos``.

    ``force`` (a reason) applies across a gap the caller could not fill; it never overrides
    DUPLICATE, STALE or BEHIND."""
    if pos is None:
        return Outcome.APPLIED
    if epoch < pos.epoch:
        return Outcome.STALE
    if epoch > pos.epoch:
        return Outcome.BEHIND
    if pos.last_seq is None:
        return Outcome.APPLIED
    if seq <= pos.last_seq:
        return Outcome.DUPLICATE
    if seq > pos.last_seq + 1 and force is None:
        return Outcome.GAP
    return Outcome.APPLIED


def next_position(pos: Position | None, seq: int, epoch: int, force: str | None, cleared: bool) -> Position:
    """The position after applying batch ``seq``: a forced gap makes the stream unsynced; a batch
    holding AllBlocksCleared makes it synced again (its history restarts there)."""
    if force is not None:
        return Position(seq, epoch, False, force)
    if cleared or pos is None:
        return Position(seq, epoch, True, None)
    return Position(seq, epoch, pos.synced, pos.reason)
