"""An engine's replay endpoint, as a lane uses it: recover a missing range in order, and ask
which life of the engine a batch belongs to.

Invariants:
- Every request is one replay answer (a fresh DEALER) within its bounds: ``timeout`` seconds of
  waiting for the engine, ``max_bytes`` bytes (``transport.ReplayAnswer``); a failed request is
  logged and never raises (ZeroMQ and replay errors become an answer: "unknown" or an unsynced
  reason).
- ``recover`` feeds the range's batches to the caller's ``offer`` as they arrive, strictly in seq
  order from its start, and stops reading at the range's end or the first batch it cannot apply
  in order (memory: one batch at a time); the walk and its verdict are the sequencer's
  (``ReplayWalk``). An answer cut short by a bound leaves the stream unsynced with the bound's
  name (``replay_timeout``, ``replay_too_large``, ``replay_too_many_frames``). It yields to the
  event loop every ``YIELD_EVERY`` batches applied. Batches applied ahead of the live socket
  (``stop`` None) are remembered by CRC in ``Stream.replayed`` so their live copies are dropped.
- Metrics: ``kvindex_replays_total{pod, result}`` per recovery (``ok``, ``history_lost``,
  ``failed``, or the bound that cut it).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from kvindex.events import Frame
from kvindex.ingest import sequencer
from kvindex.ingest.sequencer import NOT_THIS_LIFE, Recovered, ReplayWalk, Walk
from kvindex.ingest.streams import Stream
from kvindex.ingest.transport import (
    MAX_REPLAY_BYTES,
    YIELD_EVERY,
    ReplayError,
    ReplayResult,
    fetch_replay,
    open_replay,
)
from kvindex.metrics import Metrics

log = logging.getLogger("kvindex.ingest.lane")  # every line about a lane under the lane's name

Offer = Callable[[Stream, Frame], Awaitable[bool]]  # decode and apply one batch; False: not in order


class Replay:
    """One engine's replay endpoint (``endpoint`` None: the engine has none)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str | None, timeout: float, metrics: Metrics,
                 max_bytes: int = MAX_REPLAY_BYTES) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._metrics = metrics

    async def peek(self, st: Stream, seq: int, max_frames: int) -> ReplayResult | None:
        """Up to ``max_frames`` of the engine's history from ``seq``; None without a replay endpoint
        or when the replay fails (logged)."""
        if not self.endpoint:
            return None
        try:
            return await fetch_replay(self._ctx, self.endpoint, seq, timeout=self._timeout, max_frames=max_frames,
                                      max_bytes=self._max_bytes)
        except (ReplayError, zmq.ZMQError) as exc:
            log.warning("pod %s: replay from %s failed: %s", st.pod, self.endpoint, exc)
            return None

    async def life_of(self, st: Stream, seq: int, payload: bytes) -> bool | None:
        """Whether batch ``seq`` is of the engine's current life (``sequencer.life_of``); None also
        without a replay endpoint or when the replay failed."""
        result = await self.peek(st, seq, 64)
        if result is None:
            return None
        return sequencer.life_of(result.frames, result.complete, st.topic, seq, payload)

    async def same_life(self, st: Stream, seq: int, crc: int) -> bool | None:
        """Whether the engine still holds, at ``seq``, the batch with payload CRC ``crc``
        (``sequencer.same_life``); None also without a replay endpoint or when the replay failed."""
        result = await self.peek(st, seq, 64)
        if result is None:
            return None
        return sequencer.same_life(result.frames, result.complete, st.topic, seq, crc)

    async def history_ends_before(self, st: Stream, seq: int) -> bool:
        """Whether the engine's replay history stops before ``seq`` (so the store holds batches of
        an earlier life of the engine); False when it cannot tell."""
        result = await self.peek(st, seq, 1)
        return result is not None and sequencer.history_ends_before(result.frames, result.complete, st.topic)

    async def recover(self, st: Stream, start: int, stop: int | None, offer: Offer) -> str | None:
        """Apply the engine's batches [start, stop) through ``offer``; None when complete, else why
        not (the reason the stream is unsynced with, or ``NOT_THIS_LIFE``)."""
        if not self.endpoint:
            return unsynced(st, "gap_no_replay_endpoint", start, stop)
        st.replays += 1
        walk = ReplayWalk(st.topic, start, stop)
        try:
            async with open_replay(self._ctx, self.endpoint, start, timeout=self._timeout,
                                   max_bytes=self._max_bytes) as answer:
                applied = 0
                async for frame in answer:
                    step = walk.step(frame)
                    if step is Walk.SKIP:
                        continue
                    if step is not Walk.APPLY:
                        break  # the range's end, or a hole: nothing more to read
                    if not await offer(st, frame):
                        walk.failed()
                        break
                    if stop is None:  # ahead of the live socket: its copies of these batches are duplicates
                        st.replayed[frame.seq] = zlib.crc32(frame.payload)
                    walk.applied()
                    applied += 1
                    if applied % YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # applying is CPU only: other lanes and HTTP get their turn
                ended, cut = answer.complete, answer.cut
        except (ReplayError, zmq.ZMQError) as exc:
            self._metrics.replays.labels(st.pod, "failed").inc()
            log.warning("pod %s: replay from %s failed: %s", st.pod, self.endpoint, exc)
            return unsynced(st, "replay_failed", walk.expected, stop)
        verdict = walk.verdict(ended)
        if verdict is Recovered.NOT_THIS_LIFE:
            self._metrics.replays.labels(st.pod, "ok").inc()
            return NOT_THIS_LIFE  # the engine never published stop - 1 in its current life
        if verdict is Recovered.COMPLETE:
            self._metrics.replays.labels(st.pod, "ok").inc()
            return None
        reason = cut or "history_lost"
        self._metrics.replays.labels(st.pod, reason).inc()
        if cut is not None:
            log.warning("pod %s: the replay from %s was cut short (%s, bounds: %gs of waiting, %d bytes)",
                        st.pod, self.endpoint, cut, self._timeout, self._max_bytes)
        return unsynced(st, reason, walk.expected, stop)


def unsynced(st: Stream, reason: str, start: int, stop: int | None) -> str:
    log.warning("pod %s: UNSYNCED (%s): batches %d..%s are missing; its index may lack blocks until "
                "AllBlocksCleared, an engine restart or POST /v1/pods/%s/resync",
                st.pod, reason, start, "" if stop is None else stop - 1, st.pod)
    return reason
