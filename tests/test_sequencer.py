"""The sequencer alone: every branch of the pure seq / gap / restart / epoch rules, table-driven.
No sockets, no store, no event loop."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import pytest
import xxhash
from prometheus_client import CollectorRegistry

from kvindex.config import EngineConfig
from kvindex.events import Frame
from kvindex.ingest import sequencer as S
from kvindex.ingest.sequencer import After, Live, Recovered, ReplayWalk, Seed, Walk
from kvindex.ingest.streams import new_stream
from kvindex.metrics import Metrics
from kvindex.sequence import Outcome, Position

P = b"payload"
CRC = S.payload_digest(P)


OTHER = {n: CRC + 1 for n in range(8)}  # the stream remembers other bytes at seqs 0..7 (an earlier life)


@pytest.mark.parametrize(("last_seq", "replayed", "seq", "has_events", "recent", "want"), [
    (None, {}, 0, True, {}, Live.OFFER),  # the first batch
    (4, {}, 5, True, OTHER, Live.OFFER),  # the next one
    (4, {}, 9, True, OTHER, Live.OFFER),  # past a gap: the store judges it
    (4, {}, 4, True, OTHER, Live.RESTART),  # the same seq again with other bytes: the engine restarted
    (4, {}, 0, True, OTHER, Live.RESTART),  # back to the start, other bytes
    (4, {}, 2, False, OTHER, Live.NO_EVIDENCE),  # went back without a usable event
    (4, {5: CRC}, 5, True, OTHER, Live.REPLAYED),  # a replay applied these very bytes ahead of the socket
    (6, {5: CRC}, 5, True, OTHER, Live.REPLAYED),  # even behind last_seq
    (4, {5: CRC + 1}, 5, True, OTHER, Live.LIVE_AGAIN),  # other bytes past last_seq: live again
    (4, {3: CRC}, 7, True, OTHER, Live.LIVE_AGAIN),  # past what the replay applied
    (6, {5: CRC + 1}, 5, True, OTHER, Live.RESTART),  # other bytes, behind: a restart
    (6, {5: CRC + 1}, 5, False, OTHER, Live.NO_EVIDENCE),
    (None, {5: CRC + 1}, 5, True, {}, Live.OFFER),  # nothing handled yet
    # duplicates: the very bytes this life had at that seq (issue 13, class 2)
    (4, {}, 4, True, {3: CRC + 1, 4: CRC}, Live.DUPLICATE),  # seq N twice
    (4, {}, 3, True, {3: CRC, 4: CRC + 1}, Live.DUPLICATE),  # N - 1 after N
    (4, {}, 3, False, {3: CRC}, Live.DUPLICATE),  # a duplicate even without a usable event
    (4, {5: CRC + 1}, 3, True, {3: CRC}, Live.DUPLICATE),
    (4, {}, 5, True, {5: CRC}, Live.OFFER),  # ahead of last_seq: the memory is not asked
    # went back past what the stream remembers: the replay is asked
    (400, {}, 3, True, {n: CRC for n in range(144, 401)}, Live.CHECK_LIFE),
    (4, {}, 4, True, {}, Live.CHECK_LIFE),  # restored without its CRC memory
    (400, {}, 3, False, {}, Live.NO_EVIDENCE),
])
def test_live(last_seq: int | None, replayed: dict[int, int], seq: int, has_events: bool, recent: dict[int, int],
              want: Live) -> None:
    assert S.live(last_seq, replayed, seq, P, has_events, recent) is want


@pytest.mark.parametrize(("same", "replay_endpoint", "want"), [
    (True, True, Live.DUPLICATE),  # the engine still holds the watermark batch: an old duplicate
    (False, True, Live.RESTART),  # other bytes there, or its history stops before it: a new life
    (None, True, Live.LIFE_UNKNOWN),  # cannot tell (timeout, failure, cut, EMFILE, history gone): no guess
    (None, False, Live.RESTART),  # no replay endpoint: seq going back is all the evidence there is
])
def test_went_back_to(same: bool | None, replay_endpoint: bool, want: Live) -> None:
    """The replay's answer for the stream's watermark: still the engine's (a duplicate), not (a
    restart), or unknown: a pod is never cleared on a guess while a replay could tell."""
    assert S.went_back_to(same, replay_endpoint) is want


@pytest.mark.parametrize(("checked_at", "now", "want"), [
    (None, 5.0, True),  # never asked
    (5.0, 5.0, False),  # just asked: the answer holds
    (5.0, 5.0 + S.LIFE_CHECK_SECONDS * 0.99, False),
    (5.0, 5.0 + S.LIFE_CHECK_SECONDS, True),  # a second later: asked again
    (5.0, 4.0, True),  # a clock that went back never pins an answer
])
def test_recheck_life_at_most_once_per_interval(checked_at: float | None, now: float, want: bool) -> None:
    assert S.recheck_life(checked_at, now) is want


@pytest.mark.parametrize(("last_seq", "seq", "want"), [(None, 0, False), (3, 4, False), (3, 3, True), (3, 0, True)])
def test_went_back(last_seq: int | None, seq: int, want: bool) -> None:
    assert S.went_back(last_seq, seq) is want


@pytest.mark.parametrize(("force", "baseline_unknown", "expect_from", "seq", "want"), [
    (None, True, 0, 5, (0, 5)),  # joined mid-stream: recover what came before
    (None, True, 1, 1, None),  # at the first seq: nothing missing
    (None, True, 1, 0, None),
    (None, False, 0, 5, None),  # the store has history: its GAP judgement decides
    (None, True, None, 5, None),  # any baseline accepted (after an operator's resync)
    ("history_lost", True, 0, 5, None),  # forced across anyway
])
def test_join_gap(force: str | None, baseline_unknown: bool, expect_from: int | None, seq: int,
                  want: tuple[int, int] | None) -> None:
    assert S.join_gap(force, baseline_unknown, expect_from, seq) == want


@pytest.mark.parametrize(("outcome", "want"), [
    (Outcome.APPLIED, After.DONE), (Outcome.DUPLICATE, After.DONE), (Outcome.GAP, After.FILL_GAP),
    (Outcome.BEHIND, After.RESYNC), (Outcome.STALE, After.ADOPT),
])
def test_after(outcome: Outcome, want: After) -> None:
    assert S.after(outcome) is want


def test_after_covers_every_outcome() -> None:
    assert {S.after(o) for o in Outcome} == set(After)


@pytest.mark.parametrize(("stored", "first_seq", "want"), [
    (Position(4, 0), 0, 5), (Position(None, 1), 0, 0), (Position(None, 1), 1, 1), (Position(9, 2), 1, 10),
])
def test_gap_start(stored: Position, first_seq: int, want: int) -> None:
    assert S.gap_start(stored, first_seq) == want


@pytest.mark.parametrize(("stale_run", "want"), [
    (1, True), (2, False), (S.LIFE_CHECK_EVERY, False), (S.LIFE_CHECK_EVERY + 1, True),
    (2 * S.LIFE_CHECK_EVERY + 1, True),
])
def test_check_life_is_spaced(stale_run: int, want: bool) -> None:
    assert S.check_life(stale_run) is want


@pytest.mark.parametrize(("stored", "seq", "want"), [
    (None, 3, Seed.TRUST),  # nothing stored
    (Position(None, 2), 3, Seed.TRUST),  # stored, but no history since its restart
    (Position(5, 0), None, Seed.TRUST),  # no batch to check (a logged re-apply)
    (Position(5, 0), 6, Seed.CHECK_LIFE),  # ahead of the store
    (Position(5, 0), 5, Seed.CHECK_LIFE_AND_HISTORY),  # at or behind the store
    (Position(5, 0), 0, Seed.CHECK_LIFE_AND_HISTORY),
])
def test_seed(stored: Position | None, seq: int | None, want: Seed) -> None:
    assert S.seed(stored, seq) is want


@pytest.mark.parametrize(("after_restart", "epoch", "want"), [
    (Position(None, 1), 0, True),  # this replica's restart cleared it
    (Position(None, 2), 0, False),  # another restart came between
    (Position(3, 1), 0, False),  # another replica cleared it and applied since
    (Position(None, 0), 0, False),
])
def test_first_to_clear(after_restart: Position, epoch: int, want: bool) -> None:
    assert S.first_to_clear(after_restart, epoch) is want


@pytest.mark.parametrize(("last_seq", "expect_from", "baseline_unknown", "seq", "want"), [
    (4, 0, False, 5, (None, False)),  # in order
    (4, 0, False, 7, ("history_lost", True)),  # the gap it was
    (None, 0, True, 0, (None, False)),  # from the first seq
    (None, 0, True, 3, ("history_lost", False)),  # joined mid-stream, no history to fill it
    (None, 0, False, 3, (None, False)),  # the store has the history
    (None, None, True, 3, (None, False)),  # any baseline accepted
])
def test_logged(last_seq: int | None, expect_from: int | None, baseline_unknown: bool, seq: int,
                want: tuple[str | None, bool]) -> None:
    assert S.logged(last_seq, expect_from, baseline_unknown, seq) == want


def f(seq: int, payload: bytes = P, topic: str = "t") -> Frame:
    return Frame(topic, seq, payload)


@pytest.mark.parametrize(("frames", "complete", "want"), [
    ([f(5)], True, True),  # the engine holds these very bytes at seq 5
    ([f(5), f(6)], False, True),
    ([f(5, b"other")], True, False),  # other bytes there: another life
    ([], True, False),  # its history stops before seq 5
    ([], False, None),  # cannot tell
    ([f(6)], True, None),  # its history no longer reaches seq 5
    ([f(5, topic="other")], True, False),  # another topic's frames are not this stream's
    ([f(5, topic="")], True, True),  # the old replay shape has no topic: the caller's stream
])
def test_life_of(frames: list[Frame], complete: bool, want: bool | None) -> None:
    assert S.life_of(frames, complete, "t", 5, P) is want
    assert S.same_life(frames, complete, "t", 5, CRC) is want  # the same rule, from a saved CRC


@pytest.mark.parametrize(("frames", "complete", "want"), [
    ([f(5)], True, None),  # a batch is there, but without the watermark's CRC it cannot be compared
    ([], True, False),  # the history stops before the watermark: a new life, CRC or not
    ([], False, None),
    ([f(6)], True, None),
])
def test_same_life_without_the_watermark_digest(frames: list[Frame], complete: bool, want: bool | None) -> None:
    assert S.same_life(frames, complete, "t", 5, None) is want


@pytest.mark.parametrize(("last_seq", "last_digest", "want"), [(None, None, False), (5, None, False), (None, CRC, False),
                                                            (5, CRC, True)])
def test_restored_life_needs_the_watermark_and_its_digest(last_seq: int | None, last_digest: int | None, want: bool) -> None:
    assert S.restored_life(last_seq, last_digest) is want


def test_stream_remembers_the_recent_digests_of_its_life() -> None:
    st = new_stream(EngineConfig(endpoint="tcp://127.0.0.1:1"), "kv@p@m", 0, Metrics(CollectorRegistry()))
    for n in range(S.RECENT_DIGESTS + 10):
        st.handled(n, n * 7)
    assert len(st.recent) == S.RECENT_DIGESTS and min(st.recent) == 10 and st.last_digest == (S.RECENT_DIGESTS + 9) * 7
    st.reset(Position(None, 1), 0)  # a new life: nothing of the old one is remembered
    assert st.recent == {} and st.last_digest is None
    st.restore({"last_seq": 9, "last_digest": 123})
    assert st.recent == {9: 123} and st.last_digest == 123
    older = new_stream(EngineConfig(endpoint="tcp://127.0.0.1:1"), "kv@p@m", 0, Metrics(CollectorRegistry()))
    older.restore({"last_seq": 9, "last_crc": 123})  # an older snapshot's CRC-32: not a digest, not read
    assert older.recent == {} and older.last_digest is None and not S.restored_life(older.last_seq, older.last_digest)


def test_the_payload_digest_is_xxh3_64() -> None:
    """Saved in snapshots: changing the function would make every restored watermark a new life."""
    assert S.payload_digest(b"") == 0x2D06800538D394C2 and S.payload_digest(P) == xxhash.xxh3_64_intdigest(P)


@pytest.mark.parametrize(("frames", "complete", "want"), [
    ([], True, True), ([], False, False), ([f(9)], True, False), ([f(9, topic="x")], True, True),
])
def test_history_ends_before(frames: list[Frame], complete: bool, want: bool) -> None:
    assert S.history_ends_before(frames, complete, "t") is want


def walk(frames: list[Frame], start: int, stop: int | None, fails: AbstractSet[int] = frozenset(),
         ended: bool = True) -> tuple[list[int], Recovered, int]:
    """Drive a ``ReplayWalk`` as the replay client does: (seqs applied, verdict, next expected)."""
    w, applied = ReplayWalk("t", start, stop), []
    for frame in frames:
        step = w.step(frame)
        if step is Walk.SKIP:
            continue
        if step is not Walk.APPLY:
            break
        if frame.seq in fails:
            w.failed()
            break
        applied.append(frame.seq)
        w.applied()
    return applied, w.verdict(ended), w.expected


@pytest.mark.parametrize(("frames", "start", "stop", "fails", "ended", "want"), [
    # a gap [3, 6): filled
    ([f(3), f(4), f(5), f(6)], 3, 6, set(), True, ([3, 4, 5], Recovered.COMPLETE, 6)),
    # older frames and other topics are skipped
    ([f(1), f(2, topic="x"), f(3), f(4), f(5)], 3, 5, set(), True, ([3, 4], Recovered.COMPLETE, 5)),
    # the engine no longer holds seq 3
    ([f(4), f(5)], 3, 6, set(), True, ([], Recovered.HISTORY_LOST, 3)),
    # a hole in the middle
    ([f(3), f(5)], 3, 6, set(), True, ([3], Recovered.HISTORY_LOST, 4)),
    # a batch that does not apply in order (undecodable, or the store's GAP)
    ([f(3), f(4), f(5)], 3, 6, {4}, True, ([3], Recovered.HISTORY_LOST, 4)),
    # the answer ended early, but stop - 1 was never published in this life: not this life
    ([f(3)], 3, 6, set(), True, ([3], Recovered.NOT_THIS_LIFE, 4)),
    ([], 3, 6, set(), True, ([], Recovered.HISTORY_LOST, 3)),  # nothing of this topic: cannot tell
    # ... unless the answer was cut short (no end marker)
    ([f(3)], 3, 6, set(), False, ([3], Recovered.HISTORY_LOST, 4)),
    # the whole history from start (stop None): complete when the end marker came
    ([f(0), f(1), f(2)], 0, None, set(), True, ([0, 1, 2], Recovered.COMPLETE, 3)),
    ([f(0), f(1)], 0, None, set(), False, ([0, 1], Recovered.HISTORY_LOST, 2)),
    ([f(1)], 0, None, set(), True, ([], Recovered.HISTORY_LOST, 0)),
])
def test_replay_walk(frames: list[Frame], start: int, stop: int | None, fails: set[int], ended: bool,
                     want: tuple[list[int], Recovered, int]) -> None:
    assert walk(frames, start, stop, fails, ended) == want


def test_walk_stops_at_the_end_of_the_range() -> None:
    w = ReplayWalk("t", 3, 4)
    assert w.step(f(3)) is Walk.APPLY
    w.applied()
    assert w.step(f(4)) is Walk.STOP
    assert w.verdict(True) is Recovered.COMPLETE


def test_walk_marks_a_hole_broken() -> None:
    w = ReplayWalk("t", 3, None)
    assert w.step(f(5)) is Walk.BROKEN
    assert w.verdict(True) is Recovered.HISTORY_LOST
