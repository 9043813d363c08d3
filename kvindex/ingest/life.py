"""Which life of an engine a batch belongs to, as a lane asks it of the store and the engine's
replay: a stream's first batch, a STALE batch, a seq that went back (a duplicate or a restart),
and a restored watermark (a restart kvindex could not see). The rules are the sequencer's
(``ingest.sequencer``); this module carries them out.

Invariants:
- A seq that went back past what the stream remembers (``Live.CHECK_LIFE``) is a duplicate when
  the engine's replay still holds the stream's watermark batch (same seq, same payload digest), a
  restart when it holds other bytes there or its history stops before it (or the engine has no
  replay endpoint). When the replay cannot tell (it failed, timed out, was cut, no longer reaches
  the watermark) the batch is rejected (``kvindex_decode_errors_total{reason="life_unknown"}``)
  and the stream unsynced (``life_unknown``) until an answer says the watermark is still the
  engine's (synced again) or not (the restart). One watermark is asked about at most once per
  ``LIFE_CHECK_SECONDS``; in between the last answer holds (``sequencer.recheck_life``).
- A restored stream's watermark (``last_seq`` and the digest of the batch there, saved together) is
  checked against the engine's replay before catching up: other bytes at that seq, or a history
  that stops before it, mean the engine restarted while kvindex was down. The stream is then
  restarted (its pod cleared) and replayed from the first seq, unsynced (``RESTARTED_UNSEEN``)
  until that replay completes, unsynced with the replay's reason when it cannot.
- Logs under the lane's name; no state of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from kvindex.events import EventBatch
from kvindex.index.protocol import ApplyResult
from kvindex.ingest import sequencer as seqr
from kvindex.ingest.sequencer import LIFE_UNKNOWN, RESTARTED_UNSEEN, Live, Seed
from kvindex.ingest.streams import Stream
from kvindex.sequence import Outcome, Position

log = logging.getLogger("kvindex.ingest.lane")  # every line about a lane under the lane's name
RecoverFrom = Callable[[Stream, int, "int | None"], Awaitable["str | None"]]  # the lane's replay of a range


# what of ``ingest.replay.Replay`` and ``ingest.writer.StreamWriter`` this module uses (as
# protocols: importing them here would lengthen the deepest import chain)
class EngineReplay(Protocol):
    endpoint: str | None

    async def life_of(self, st: Stream, seq: int, payload: bytes) -> bool | None: ...

    async def same_life(self, st: Stream, seq: int, digest: int | None) -> bool | None: ...

    async def history_ends_before(self, st: Stream, seq: int) -> bool: ...


class StoreCalls(Protocol):
    async def seed(self, st: Stream) -> Position | None: ...

    async def restart_unseen(self, st: Stream, pos: Position, why: str = ...) -> Position: ...

    async def apply(self, st: Stream, seq: int, batch: EventBatch, payload: bytes,
                    force: str | None) -> ApplyResult: ...

    async def mark(self, st: Stream, reason: str | None) -> None: ...

    def reject(self, pod: str, reason: str, what: str) -> None: ...


class Lives:
    """One lane's questions about its engine's lives (``writer``: the lane's store calls)."""

    def __init__(self, writer: StoreCalls, replay: EngineReplay, first_seq: int) -> None:
        self._writer = writer
        self._replay = replay
        self._first_seq = first_seq

    async def seed(self, st: Stream, seq: int | None = None, payload: bytes = b"") -> bool:
        """Read the stream's stored position: another replica may be ahead (its batches then come
        back DUPLICATE) or the engine may have restarted (a later epoch, adopted). When the store
        has history and the engine a replay endpoint, the first batch must be of the engine's
        current life (it may have been queued before a restart other replicas applied): False
        when it is not (skipped; the next batch seeds)."""
        pos = await self._writer.seed(st)
        check = seqr.seed(pos, seq)
        if check is not Seed.TRUST:
            assert pos is not None and pos.last_seq is not None and seq is not None
            if await self._replay.life_of(st, seq, payload) is False:
                return False
            if check is Seed.CHECK_LIFE_AND_HISTORY and await self._replay.history_ends_before(st, pos.last_seq):
                pos = await self._writer.restart_unseen(st, pos)
        if pos is not None:
            st.epoch = pos.epoch
            st.observe(pos)
        st.seeded = True
        return True

    async def adopt(self, st: Stream, seq: int, batch: EventBatch, payload: bytes, pos: Position) -> ApplyResult:
        """STALE: another replica announced an engine restart this one has not seen (yet). Either
        this batch is of the ended life (this replica lags: its seq will go back soon), or this
        replica missed the restart. The engine's replay decides: when it holds this very batch
        (same seq, same bytes), the batch is of the current life and the store's epoch is
        adopted. Checks are spaced (every ``LIFE_CHECK_EVERY`` STALE batches in a row)."""
        st.stale_run += 1
        if not seqr.check_life(st.stale_run) or not await self._replay.life_of(st, seq, payload):
            st.last_seq, st.last_digest = seq, None  # handled, not applied: no digest of this life's batch there
            return ApplyResult(Outcome.STALE, pos)
        log.info("pod %s: the store is at epoch %d (another replica saw the engine restart): adopting it",
                 st.pod, pos.epoch)
        st.epoch = pos.epoch
        st.expect_from = self._first_seq
        return await self._writer.apply(st, seq, batch, payload, None)

    async def went_back(self, st: Stream, seq: int) -> Live:
        """``Live.CHECK_LIFE``: the seq went back past what the stream remembers; DUPLICATE when
        the engine still holds the watermark batch, RESTART when it does not (or has no replay
        endpoint), LIFE_UNKNOWN (the batch rejected here, the stream unsynced) when it cannot tell."""
        if not self._replay.endpoint:
            return seqr.went_back_to(None, False)
        now, last = time.monotonic(), st.life_check
        if last is not None and last[:2] == (st.last_seq, st.last_digest) and not seqr.recheck_life(last[2], now):
            same = last[3]  # asked about this watermark a moment ago: the answer holds
        else:
            assert st.last_seq is not None
            same = await self._replay.same_life(st, st.last_seq, st.last_digest)
            st.life_check = (st.last_seq, st.last_digest, now, same)
        step = seqr.went_back_to(same, True)
        if step is Live.LIFE_UNKNOWN:
            self._writer.reject(st.pod, LIFE_UNKNOWN, f"seq {seq} went back past seq {st.last_seq} and the engine's "
                                "replay cannot tell a duplicate from a restart: rejected, the pod unsynced")
            if st.synced:
                await self._writer.mark(st, LIFE_UNKNOWN)
        elif step is Live.DUPLICATE and not st.synced and st.unsynced_reason == LIFE_UNKNOWN:
            await self._writer.mark(st, None)  # the watermark is the engine's: what was rejected were duplicates
        return step

    async def restarted_unseen(self, st: Stream) -> bool:
        """Whether a restored stream's watermark is of an earlier life of the engine (its replay
        holds other bytes at that seq, or its history stops before it)."""
        if not seqr.restored_life(st.last_seq, st.last_digest):
            return False
        assert st.last_seq is not None and st.last_digest is not None
        return await self._replay.same_life(st, st.last_seq, st.last_digest) is False

    async def restart_restored(self, st: Stream, replay_from: RecoverFrom) -> str | None:
        """The engine restarted while kvindex was down: clear the stream, replay the engine's
        history from its first seq; unsynced meanwhile, and after with the reason when the
        replay cannot rebuild it. The reason, or None (synced)."""
        pos = await self._writer.restart_unseen(st, st.stored or Position(st.last_seq, st.epoch),
                                                "the engine's replay holds other bytes there (or nothing)")
        st.reset(pos, self._first_seq)
        await self._writer.mark(st, RESTARTED_UNSEEN)
        reason = await replay_from(st, self._first_seq, None)
        await self._writer.mark(st, reason)
        return reason
