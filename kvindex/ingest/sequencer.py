"""The sequencer: what a lane does with a stream's next batch, decided from seqs alone.

Pure functions and values: no I/O, no sockets, no store, no asyncio. The lane (``ingest.lane``)
reads a stream's state, asks here, and carries the answer out (offer to the store, restart the
stream, recover a range from the replay endpoint, skip). Whether a batch *applies* is the store's
judgement (``kvindex.sequence.judge``, atomic with the apply, shared by every replica); these
rules decide what this replica does around it.

Invariants:
- A seq that goes back is a duplicate or an engine restart, told apart by ``payload_digest``
  (XXH3-64 of the payload): the stream remembers the digests of its last ``RECENT_DIGESTS``
  batches of the engine's current life; the same seq with the same digest is a duplicate
  (``Live.DUPLICATE``: dropped, counted), with other bytes a restart (``Live.RESTART``), but only
  a batch with a usable event is evidence enough (``Live.NO_EVIDENCE``; the lane judges it as the new life would decode the batch: what the old
  one learned, a hybrid model's prefix group, may skip all of it). A seq older than that memory asks the engine's replay whether it still
  holds the stream's watermark batch (``Live.CHECK_LIFE``, ``same_life``): it does, a duplicate;
  it does not (other bytes there, or its history stops before it), a restart. When the replay
  cannot tell (it timed out, failed, was cut, no longer reaches the watermark) the batch is
  rejected and the stream unsynced (``Live.LIFE_UNKNOWN``, reason ``LIFE_UNKNOWN``): a guess never
  clears a pod. Only an engine without a replay endpoint, where seq going back is all the evidence
  there is, restarts on it (``went_back_to``). A stream asks at most once per
  ``LIFE_CHECK_SECONDS`` about one watermark (``recheck_life``); in between the last answer holds.
  A batch a replay already applied ahead of the live socket (same seq,
  same digest) is dropped silently (``Live.REPLAYED``).
- The engine's incarnation does not depend on seq going back: the digest of the watermark batch is
  saved with the watermark; a restored stream asks the replay for that seq (``same_life``): other
  bytes there, or a history that stops before it, is a life kvindex did not see.
- A stream whose stored history is unknown and whose first batch is past the first seq joined
  mid-stream: ``[expect_from, seq)`` is recovered first (``join_gap``).
- A GAP from the store recovers ``[gap_start, seq)``; a BEHIND store resyncs the stream; a
  STALE batch asks the engine's replay which life it belongs to, once every
  ``LIFE_CHECK_EVERY`` STALE batches in a row (``after`` and ``check_life``).
- A replay is walked in seq order from its start (``ReplayWalk``); its verdict says whether the
  range is complete, lost, or never published in the engine's current life (``NOT_THIS_LIFE``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum

import xxhash

from kvindex.events import Frame
from kvindex.sequence import Outcome, Position

NOT_THIS_LIFE = "not_this_life"  # a recovery's verdict: the engine's history ends before the batch
HISTORY_LOST = "history_lost"
LIFE_CHECK_EVERY = 64  # STALE batches in a row between two replay checks of the batch's engine life
RECENT_DIGESTS = 256  # a stream's remembered (seq -> payload digest) of its current life, for duplicates
RESTARTED_UNSEEN = "engine_restarted_unseen"  # unsynced while a life kvindex did not see is replayed
LIFE_UNKNOWN = "life_unknown"  # unsynced: a seq went back and the engine's replay could not tell why
LIFE_CHECK_SECONDS = 1.0  # between two replay checks of one watermark (``recheck_life``)

payload_digest = xxhash.xxh3_64_intdigest
"""A batch's identity within its engine life: XXH3-64 of the payload, a third of CRC-32's time on a
batch (snapshots save the watermark's as ``last_digest``; their ``last_crc`` before was a CRC-32,
not read: such a stream restores as one of an older snapshot, without it)."""


class Live(Enum):
    """What to do with a live batch before it is offered to the store."""

    OFFER = "offer"  # offer it
    LIVE_AGAIN = "live_again"  # past what a replay applied ahead of the socket: forget that, offer it
    REPLAYED = "replayed"  # a replay ahead of the socket applied these very bytes: drop it
    RESTART = "restart"  # seq went back with other bytes: the engine restarted; restart the stream, offer it
    NO_EVIDENCE = "no_evidence"  # seq went back but the batch carries no usable event: reject it
    DUPLICATE = "duplicate"  # seq went back with the very bytes this life had there: drop it, count it
    CHECK_LIFE = "check_life"  # seq went back past what the stream remembers: ask the replay (``same_life``)
    LIFE_UNKNOWN = "life_unknown"  # ... and the replay cannot tell: reject it, the stream unsynced


# members as module globals for the per-batch functions: on Python 3.11 an enum member's lookup
# through its class costs ~150 ns, several times a batch's own bookkeeping
_OFFER, _LIVE_AGAIN, _REPLAYED, _RESTART, _NO_EVIDENCE, _DUP, _CHECK = (
    Live.OFFER, Live.LIVE_AGAIN, Live.REPLAYED, Live.RESTART, Live.NO_EVIDENCE, Live.DUPLICATE, Live.CHECK_LIFE)


def live(last_seq: int | None, replayed: Mapping[int, int], seq: int, payload: bytes, has_events: bool,
         recent: Mapping[int, int]) -> Live:
    """The step for live batch ``seq`` of a stream that last handled ``last_seq``; ``recent`` maps
    the seqs of the stream's current life it remembers to their payload digests."""
    if replayed:
        if replayed.get(seq) == payload_digest(payload):
            return _REPLAYED
        if last_seq is not None and seq > last_seq:
            return _LIVE_AGAIN
    if last_seq is not None and seq <= last_seq:
        known = recent.get(seq)
        if known is not None and known == payload_digest(payload):
            return _DUP
        if not has_events:
            return _NO_EVIDENCE
        return _RESTART if known is not None else _CHECK
    return _OFFER


def went_back_to(same: bool | None, replay_endpoint: bool) -> Live:
    """``CHECK_LIFE`` answered: the engine still holds the watermark batch (True: the batch is an
    old duplicate), or not (False: a restart), or it cannot tell (None): with a replay endpoint
    that is no evidence of a restart (``LIFE_UNKNOWN``: reject the batch, unsynced); without one,
    seq going back is the only evidence the engine gives: a restart."""
    if same is None:
        return Live.LIFE_UNKNOWN if replay_endpoint else _RESTART
    return _DUP if same else _RESTART


def recheck_life(checked_at: float | None, now: float) -> bool:
    """Whether a stream whose watermark was last checked at ``checked_at`` (None: never) asks the
    replay again at ``now``, or keeps the last answer."""
    return checked_at is None or not 0 <= now - checked_at < LIFE_CHECK_SECONDS


def went_back(last_seq: int | None, seq: int) -> bool:
    """Whether ``seq`` is at or before what the stream last handled (the engine restarted)."""
    return last_seq is not None and seq <= last_seq


def join_gap(force: str | None, baseline_unknown: bool, expect_from: int | None, seq: int) -> tuple[int, int] | None:
    """The range to recover before ``seq`` when the stream joins mid-stream (no stored history,
    a complete history starts at ``expect_from`` and ``seq`` is past it); None otherwise, or when
    the batch is to be forced across anyway."""
    if force is None and baseline_unknown and expect_from is not None and seq > expect_from:
        return expect_from, seq
    return None


class After(Enum):
    """What follows the store's outcome for a batch."""

    DONE = "done"  # applied or skipped: nothing more
    FILL_GAP = "fill_gap"  # recover [gap_start, seq) from the replay, then apply
    RESYNC = "resync"  # the store lost writes: clear the stream, replay its history, apply again
    ADOPT = "adopt"  # another replica saw a restart: adopt the store's epoch if the batch is of this life


_APPLIED, _DUPLICATE, _GAP, _BEHIND = Outcome.APPLIED, Outcome.DUPLICATE, Outcome.GAP, Outcome.BEHIND
_DONE, _FILL_GAP, _RESYNC, _ADOPT = After.DONE, After.FILL_GAP, After.RESYNC, After.ADOPT


def after(outcome: Outcome) -> After:
    if outcome is _APPLIED or outcome is _DUPLICATE:
        return _DONE
    if outcome is _GAP:
        return _FILL_GAP
    return _RESYNC if outcome is _BEHIND else _ADOPT


def gap_start(stored: Position, first_seq: int) -> int:
    """The first missing seq when the store answered GAP at ``stored``."""
    return (stored.last_seq if stored.last_seq is not None else first_seq - 1) + 1


def check_life(stale_run: int) -> bool:
    """Whether the ``stale_run``-th STALE batch in a row asks the replay for its engine life."""
    return (stale_run - 1) % LIFE_CHECK_EVERY == 0


class Seed(Enum):
    """What a stream's first batch asks of the engine's replay once the store's position is read."""

    TRUST = "trust"  # nothing stored (or no batch to check): adopt the stored position
    CHECK_LIFE = "check_life"  # the store has history: the batch must be of the engine's current life
    CHECK_LIFE_AND_HISTORY = "check_life_and_history"  # and the batch is behind the store: did the
    # engine restart while no replica watched (its history ends before the stored seq)?


def seed(stored: Position | None, seq: int | None) -> Seed:
    if stored is None or stored.last_seq is None or seq is None:
        return Seed.TRUST
    return Seed.CHECK_LIFE_AND_HISTORY if seq <= stored.last_seq else Seed.CHECK_LIFE


def first_to_clear(after_restart: Position, epoch: int) -> bool:
    """Whether this replica's restart at ``epoch`` is the one that cleared the stream."""
    return after_restart.epoch == epoch + 1 and after_restart.last_seq is None


def logged(last_seq: int | None, expect_from: int | None, baseline_unknown: bool, seq: int) -> tuple[str | None, bool]:
    """A logged batch re-applied (after any restart it shows): (force, whether it is past a gap).
    A gap is the unsynced stretch it was: the live lane could not fill it either."""
    if last_seq is None:
        if expect_from is not None and seq > expect_from and baseline_unknown:
            return HISTORY_LOST, False
        return None, False
    if seq > last_seq + 1:
        return HISTORY_LOST, True
    return None, False


def _of(frames: Sequence[Frame], topic: str) -> list[Frame]:
    return [f for f in frames if f.topic in ("", topic)]


def life_of(frames: Sequence[Frame], complete: bool, topic: str, seq: int, payload: bytes) -> bool | None:
    """Whether batch ``seq`` is of the engine's current life, by its replay from ``seq``: True (it
    holds these very bytes at ``seq``), False (other bytes there, or its history stops before),
    None (its history no longer reaches ``seq``)."""
    return same_life(frames, complete, topic, seq, payload_digest(payload))


def same_life(frames: Sequence[Frame], complete: bool, topic: str, seq: int, digest: int | None) -> bool | None:
    """Whether the engine's replay from ``seq`` holds, at ``seq``, the batch whose payload digest is
    ``digest`` (the same life of the engine): True, False (other bytes there, or its history stops
    before ``seq``: a new life), None (its history no longer reaches ``seq``, or the answer was
    cut short, or a batch is there and ``digest`` is unknown: cannot tell)."""
    mine = _of(frames, topic)
    at = next((f for f in mine if f.seq == seq), None)
    if at is not None:
        return None if digest is None else payload_digest(at.payload) == digest
    return False if not mine and complete else None


def restored_life(last_seq: int | None, last_digest: int | None) -> bool:
    """Whether a restored stream can ask the engine's replay if its watermark is of the engine's
    current life (it holds a watermark and the digest of the batch at it)."""
    return last_seq is not None and last_digest is not None


def history_ends_before(frames: Sequence[Frame], complete: bool, topic: str) -> bool:
    """Whether a replay asked from some seq shows the engine's history stops before it."""
    return complete and not _of(frames, topic)


class Walk(Enum):
    SKIP = "skip"  # another topic's, or before the start: next frame
    STOP = "stop"  # at the range's end
    APPLY = "apply"  # the next batch of the range: decode and apply it
    BROKEN = "broken"  # a batch of the range is missing


class Recovered(Enum):
    COMPLETE = "complete"
    HISTORY_LOST = "history_lost"  # the engine no longer holds part of the range
    NOT_THIS_LIFE = "not_this_life"  # the engine never published the range's end in its current life


class ReplayWalk:
    """Walks a replay's frames in order over the range ``[start, stop)`` (``stop`` None: all of
    the engine's history from ``start``): which frame applies next, and the verdict."""

    __slots__ = ("broken", "expected", "newest", "stop", "topic")

    def __init__(self, topic: str, start: int, stop: int | None) -> None:
        self.topic, self.stop = topic, stop
        self.expected = start  # the next seq of the range
        self.newest: int | None = None  # the newest seq of this topic seen
        self.broken = False

    def step(self, frame: Frame) -> Walk:
        if frame.topic not in ("", self.topic):
            return Walk.SKIP
        self.newest = frame.seq if self.newest is None else max(self.newest, frame.seq)
        if frame.seq < self.expected:
            return Walk.SKIP
        if self.stop is not None and frame.seq >= self.stop:
            return Walk.STOP
        if frame.seq != self.expected:
            self.broken = True
            return Walk.BROKEN
        return Walk.APPLY

    def applied(self) -> None:
        self.expected += 1

    def failed(self) -> None:
        """The frame ``step`` offered could not be applied in order (undecodable, a gap)."""
        self.broken = True

    def verdict(self, ended: bool) -> Recovered:
        """``ended``: the replay's end marker arrived (the engine sent all it holds)."""
        stop = self.stop
        complete = not self.broken and (self.expected == stop if stop is not None else ended)
        if complete:
            return Recovered.COMPLETE
        if not self.broken and ended and stop is not None and self.newest is not None and self.newest < stop - 1:
            return Recovered.NOT_THIS_LIFE
        return Recovered.HISTORY_LOST
