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
  (``stop`` None) are remembered by digest in ``Stream.replayed`` so their live copies are dropped.
- Metrics: ``kvindex_replays_total{pod, result}`` per recovery (``ok``, ``history_lost``,
  ``failed``, or the bound that cut it).
- Out of file descriptors (the DEALER cannot be made: ``EMFILE``/``ENFILE``, or the request timed
  out while this process cannot open a socket) is not a failure of the engine: ``recover`` retries
  with backoff for up to ``DESCRIPTOR_WAIT_SECONDS`` while nothing was read, the stream shown
  unsynced meanwhile with reason ``NO_DESCRIPTORS`` (``on_wait``), and carries on once descriptors
  are back. The wait's mark is lifted with the recovery's outcome: synced again only when the
  range was recovered; the wait running out, a lost history or a cut answer leave the stream
  unsynced with that reason.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from kvindex.events import Frame
from kvindex.ingest import sequencer
from kvindex.ingest.sequencer import NOT_THIS_LIFE, Recovered, ReplayWalk, Walk, payload_digest
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


OnWait = Callable[[Stream, "str | None", bool], Awaitable[None]]  # (stream, reason, waiting): it waits with
# ``reason``, or (waiting False) no longer does, ``reason`` the recovery's outcome (None: complete)
NO_DESCRIPTORS = "replay_waiting_for_file_descriptors"
DESCRIPTOR_WAIT_SECONDS = 60.0
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


def out_of_descriptors(exc: BaseException) -> bool:
    """Whether ``exc`` (a failed replay request) is this process being out of descriptors: the
    socket could not be made, or (ZeroMQ connects in its own thread, and retries) the request
    timed out while no socket can be opened."""
    if isinstance(exc, zmq.ZMQError):
        return exc.errno in _OUT_OF_DESCRIPTORS
    try:
        a, b = socket.socketpair()  # the probe: two descriptors, closed at once
    except OSError as probe:
        return probe.errno in _OUT_OF_DESCRIPTORS
    a.close()
    b.close()
    return False


async def _no_wait(st: Stream, reason: str | None, waiting: bool) -> None:
    pass


class Replay:
    """One engine's replay endpoint (``endpoint`` None: the engine has none)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str | None, timeout: float, metrics: Metrics,
                 max_bytes: int = MAX_REPLAY_BYTES, on_wait: OnWait = _no_wait,
                 descriptor_wait: float = DESCRIPTOR_WAIT_SECONDS) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._metrics = metrics
        self._on_wait = on_wait
        self._descriptor_wait = descriptor_wait
        self._waited: set[str] = set()  # topics whose recovery waited for descriptors (marked unsynced)

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

    async def same_life(self, st: Stream, seq: int, digest: int | None) -> bool | None:
        """Whether the engine still holds, at ``seq``, the batch with payload digest ``digest``
        (``sequencer.same_life``); None also without a replay endpoint or when the replay failed."""
        result = await self.peek(st, seq, 64)
        if result is None:
            return None
        return sequencer.same_life(result.frames, result.complete, st.topic, seq, digest)

    async def history_ends_before(self, st: Stream, seq: int) -> bool:
        """Whether the engine's replay history stops before ``seq`` (so the store holds batches of
        an earlier life of the engine); False when it cannot tell."""
        result = await self.peek(st, seq, 1)
        return result is not None and sequencer.history_ends_before(result.frames, result.complete, st.topic)

    async def recover(self, st: Stream, start: int, stop: int | None, offer: Offer) -> str | None:
        """Apply the engine's batches [start, stop) through ``offer``; None when complete, else why
        not (the reason the stream is unsynced with, or ``NOT_THIS_LIFE``)."""
        try:
            reason = await self._recover(st, start, stop, offer)
        except BaseException:
            self._waited.discard(st.topic)  # the caller's failure path (resync, shutdown) marks it
            raise
        if st.topic in self._waited:
            self._waited.discard(st.topic)
            await self._on_wait(st, None if reason == NOT_THIS_LIFE else reason, False)
        return reason

    async def _recover(self, st: Stream, start: int, stop: int | None, offer: Offer) -> str | None:
        if not self.endpoint:
            return unsynced(st, "gap_no_replay_endpoint", start, stop)
        st.replays += 1
        walk = ReplayWalk(st.topic, start, stop)
        try:
            ended, cut = await self._stream_waiting(st, walk, offer)
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

    async def _stream(self, st: Stream, walk: ReplayWalk, offer: Offer) -> tuple[bool, str | None]:
        """One replay answer from ``walk``'s start, applied through ``offer`` as it arrives; whether
        it ended (the engine's end marker) and the bound that cut it, if one did."""
        assert self.endpoint is not None
        async with open_replay(self._ctx, self.endpoint, walk.expected, timeout=self._timeout,
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
                if walk.stop is None:  # ahead of the live socket: its copies of these batches are duplicates
                    st.replayed[frame.seq] = payload_digest(frame.payload)
                walk.applied()
                applied += 1
                if applied % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # applying is CPU only: other lanes and HTTP get their turn
            return answer.complete, answer.cut

    async def _stream_waiting(self, st: Stream, walk: ReplayWalk, offer: Offer) -> tuple[bool, str | None]:
        """``_stream``, retried with backoff while it fails for want of file descriptors before
        anything was applied (up to ``descriptor_wait`` seconds, the stream shown waiting)."""
        loop = asyncio.get_running_loop()
        t0, delay, start = loop.time(), 0.05, walk.expected
        while True:
            try:
                return await self._stream(st, walk, offer)
            except (ReplayError, zmq.ZMQError) as exc:
                if walk.expected != start or loop.time() - t0 >= self._descriptor_wait or not out_of_descriptors(exc):
                    raise
                if st.topic not in self._waited:
                    self._waited.add(st.topic)
                    log.warning("pod %s: replay from %s: out of file descriptors (%s); retrying until they are "
                                "back (up to %gs)", st.pod, self.endpoint, exc, self._descriptor_wait)
                    await self._on_wait(st, NO_DESCRIPTORS, True)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)


def unsynced(st: Stream, reason: str, start: int, stop: int | None) -> str:
    log.warning("pod %s: UNSYNCED (%s): batches %d..%s are missing; its index may lack blocks until "
                "AllBlocksCleared, an engine restart or POST /v1/pods/%s/resync",
                st.pod, reason, start, "" if stop is None else stop - 1, st.pod)
    return reason
