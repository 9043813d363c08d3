"""Ingest: one ordered lane per engine, from frames to the precise store, replica-safe.

One frame, top to bottom: ``run`` (the socket loop) -> ``handle`` (decode, find its stream) ->
``_sequence`` (the seq rules: ``ingest.sequencer``, pure) -> ``StreamWriter.apply`` (the store
judges and applies; counted: ``ingest.writer``). Around it, this file wires the engine's replay
endpoint (``ingest.replay``), the store-outage buffer (``ingest.buffer``), the operator's resync
and the restored state.

Invariants:
- A lane's receiver (``ingest.receiver``) reads its SUB socket into its inbox (``ingest.inbox``,
  bounded in bytes); the lane applies the inbox's bursts strictly in order, a burst under its lock
  at once; while it fetches a replay, live messages wait in the inbox (past its budget: dropped,
  a gap). A loss or a lag past ``max_lag_seconds``: unsynced (``LaneState.receiving_problem``).
- A payload is decoded before its seq is looked at: garbage never moves a watermark, never
  triggers a restart, and changes nothing held; it is counted by reason.
- The store's ``Position`` of a stream (``StreamRef.of(pod, topic|publisher, model)``, the
  publisher being its dp rank when configured, else its endpoint) is the shared truth:
  whether a batch applies is judged by the store, atomically with the apply, so when several
  replicas offer the same batch exactly one applies it (the others count it ``duplicate``). A
  lane's ``Stream`` keeps this replica's view: what it received (``last_seq``, for restart
  detection), the gaps and replays it saw, and the epoch it offers batches at (seeded from the
  store when the stream first appears).
- Outcomes: APPLIED; DUPLICATE and STALE are skipped (``kvindex_batches_skipped_total``); GAP
  recovers ``[last_seq + 1, seq)`` from the engine's replay endpoint and then applies, with
  ``force=<reason>`` when history is gone (the stream is then unsynced in the store); BEHIND (the
  store lost writes) resynchronises the stream: clear, then replay the engine's history.
- A seq that goes back is a duplicate (the very bytes the stream had there: dropped, counted) or
  an engine restart (``store.restart`` clears the stream's ranks once, whichever replica is first);
  which one, and which engine life a batch is of where the store cannot tell, is ``ingest.life``'s
  rule (asked of the replay endpoint). A first batch past the first seq with no stored history is
  a join mid-stream: recovered as a gap.
- The store unreachable (``StoreUnavailable``): the lane keeps the batches it cannot apply, in
  order, up to ``store_buffer`` batches (``ingest.buffer``), retrying while live messages keep
  arriving; past the bound, or after ``StoreLost``, every stream of the lane is resynchronised
  through the engine's replay once the store answers (clear + replay from the first seq; history
  gone: the next batch is force-applied and the stream stays unsynced with the reason).
  ``behind(model)`` is true meanwhile, and queries for that model answer 503, not a partial answer.
- Every re-run of a batch after a failed store call is safe (idempotent store calls; local state
  moves only after the store answered).
- Restored state (snapshot, write-ahead log, peer; memory store only) enters only before
  ``run()``: ``restore_streams`` seeds the seq state, ``apply_logged``/``resync_logged`` re-apply
  logged changes through the same decode and apply (no network); ``run()`` first asks the replay
  endpoint for everything after each restored watermark, then subscribes; a watermark whose batch
  the engine no longer holds (other bytes at that seq, or a history that stops before it) is an
  engine restart kvindex did not see: the stream restarts and is replayed from the first seq,
  unsynced until that completes. Every applied batch goes to ``journal`` when set.
- An operator's resync clears the pod and replays the engine's history; a history that no longer
  reaches the first seq leaves the pod unsynced with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from time import monotonic
from typing import Any

from kvindex.config import EngineConfig
from kvindex.events import Decoder, EventBatch, Frame
from kvindex.index.protocol import ApplyResult, PreciseStore, StoreUnavailable
from kvindex.ingest import sequencer as seqr
from kvindex.ingest.buffer import StoreBuffer
from kvindex.ingest.intake import Intake
from kvindex.ingest.life import Lives
from kvindex.ingest.replay import Replay
from kvindex.ingest.sequencer import NOT_THIS_LIFE, After, Live
from kvindex.ingest.streams import MAX_TOPICS, LaneSettings, LaneState, Stream
from kvindex.ingest.inbox import Inbox
from kvindex.ingest.receiver import DropLog, Receiver
from kvindex.ingest.transport import Malformed
from kvindex.ingest.watch import ConnectionWatch
from kvindex.ingest.writer import StreamWriter
from kvindex.logs import BurstLog
from kvindex.metrics import Metrics
from kvindex.sequence import Outcome, Position
from kvindex.views import Journal

log = logging.getLogger("kvindex.ingest.lane")
TURN_SECONDS = 0.01  # a burst's batches applied at most this long before the loop gets a turn
# enum members as module globals for the per-batch path (a lookup through the class costs ~150 ns on 3.11)
OFFER, FILL_GAP, RESYNC, ADOPT, APPLIED, STALE = (Live.OFFER, After.FILL_GAP, After.RESYNC, After.ADOPT,
                                                  Outcome.APPLIED, Outcome.STALE)

async def _always_open() -> None:  # no store guard: nothing to re-open
    return None

class EngineLane:
    """Everything about one engine publisher: its socket, its streams, their seq state."""

    def __init__(
        self,
        engine: EngineConfig,
        *,
        intake: Intake,
        decoder: Decoder,
        first_seq: int,
        store: PreciseStore,
        metrics: Metrics,
        settings: LaneSettings,
        burst: BurstLog,
        ensure_open: Callable[[], Awaitable[None]] = _always_open,
    ) -> None:
        self.engine = engine
        self.state = LaneState(inbox=Inbox(settings.receive_buffer_bytes, settings.max_lag_seconds))
        self._intake = intake  # the process's ZeroMQ context and how its SUB sockets read
        self._first_seq = first_seq
        self._store = store
        self._metrics = metrics
        self._settings = settings
        self._burst_log = burst
        self._ensure_open = ensure_open  # re-opens the stores after a loss (the guard's)
        self._lock = asyncio.Lock()
        self.writer = StreamWriter(engine, self.state.streams, decoder=decoder, first_seq=first_seq, store=store,
                                   metrics=metrics, burst=burst, max_blocks_per_pod=settings.max_blocks_per_pod)
        self._replay = Replay(intake.ctx, engine.replay, settings.replay_timeout, metrics, settings.replay_max_bytes,
                              self.writer.waiting)
        self._lives = Lives(self.writer, self._replay, first_seq)  # which engine life a batch is of
        self._buffer = StoreBuffer(engine.name, self.state.streams, settings.store_buffer, metrics, self._lock,
                                   self._drain_once)
        self._restored: set[str] = set()
        self._restored_positions: dict[str, Position] = {}

    @property
    def key(self) -> str:  # the fleet's key for this lane (set by ``Fleet.add``; the engine's name until then)
        return self.writer.key

    @key.setter
    def key(self, key: str) -> None:
        self.writer.key = key

    @property
    def journal(self) -> Journal | None:  # the write-ahead log: each applied batch, each operator's resync
        return self.writer.journal

    @journal.setter
    def journal(self, journal: Journal | None) -> None:
        self.writer.journal = journal

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        e, s, inbox = self.engine, self._settings, self.state.inbox
        await self.install_restored()
        await self._catch_up()
        watch = ConnectionWatch(e, self.state, s.silent_seconds)  # logs: subscribing, connected
        drops = DropLog(self._metrics.receive_dropped.labels(e.name), self._burst_log)
        receiver = Receiver(partial(self._intake.subscriber, e.endpoint, bind=e.bind, rcvhwm=s.rcvhwm), inbox,
                            watch.peers, e.name, s.max_message_bytes, drops)
        sub = receiver.open()  # at start, a socket's failure is the lane's
        watch.starting()
        tasks = (asyncio.create_task(receiver.run(sub), name=f"receiver {e.endpoint}"),
                 asyncio.create_task(watch.warn_if_silent(), name=f"silence {e.endpoint}"))
        try:
            while True:
                burst = await inbox.get()
                async with self._lock:  # once per burst: a resync or a buffer drain waits for its end
                    self.writer.received, turn = burst.received, monotonic() + TURN_SECONDS
                    for msg in burst.messages:
                        await self.handle(msg)
                        if monotonic() > turn:  # the receiver, HTTP and other lanes get the loop
                            await asyncio.sleep(0)
                            turn = monotonic() + TURN_SECONDS
                inbox.done(burst)
        finally:
            for task in tasks:
                task.cancel()
            drainer = self._buffer.stop()
            await asyncio.gather(*tasks, *([drainer] if drainer else []), return_exceptions=True)

    async def handle(self, msg: Frame | Malformed) -> None:
        self.state.frames += 1
        if isinstance(msg, Malformed):
            self.writer.reject(self.engine.name, msg.reason, "malformed message")
            return
        stream = self.state.streams.get(msg.topic)
        batch = self.writer.decode(stream.pod if stream else self.engine.name, msg)
        if batch is None:
            return  # garbage creates no stream, no pod, no metric series
        if stream is None:
            if len(self.state.streams) >= MAX_TOPICS:
                self.writer.reject(self.engine.name, "too_many_topics",
                                   f"more than {MAX_TOPICS} topics on one publisher")
                return
            stream = self.writer.stream(msg.topic)
        stream.last_event = monotonic()
        if self._buffer.held or stream.needs_resync is not None:
            self._buffer.hold(stream, msg.seq, batch, msg.payload, self.key)
            return
        try:
            await self._sequence(stream, msg.seq, batch, msg.payload)
        except StoreUnavailable:
            self._buffer.hold(stream, msg.seq, batch, msg.payload, self.key)

    # -- seq -----------------------------------------------------------------------------------
    async def _sequence(self, st: Stream, seq: int, batch: EventBatch, payload: bytes) -> None:
        """One live batch, from the stream's seq state to the store; safe to re-run after a
        failed store call (the buffer does)."""
        restarts = st.restarts
        if not st.seeded and not await self._lives.seed(st, seq, payload):
            self.writer.skip_stale(st, seq)
            return
        evidence = bool(batch.events) or (seqr.went_back(st.last_seq, seq)  # judged as its new life decodes it
                                          and self.writer.new_life_evidence(batch, payload))
        step = seqr.live(st.last_seq, st.replayed, seq, payload, evidence, st.recent)
        if step is not OFFER:
            if step is Live.CHECK_LIFE:  # went back past what the stream remembers: the replay tells
                step = await self._lives.went_back(st, seq)
            if step is Live.REPLAYED or step is Live.LIFE_UNKNOWN:
                return  # applied already by a replay ahead of the socket; or rejected, counted (``ingest.life``)
            if step is Live.DUPLICATE:  # delivered twice: not a restart
                self.writer.duplicate(st, seq)
                return
            if step is Live.LIVE_AGAIN:
                st.replayed.clear()
            elif step is Live.NO_EVIDENCE:  # nothing usable: not evidence enough to drop a pod's state
                self.writer.reject(st.pod, "backward_seq_without_events",
                                   f"seq {seq} went back but carries no usable event")
                return
            else:
                await self.writer.restart(st, seq)
        if st.restarts != restarts:  # a new engine life: decoded before it, decoded again in it
            batch = self.writer.decode_again(st, seq, batch, payload)
        force = st.force
        missing = seqr.join_gap(force, st.baseline_unknown, st.expect_from, seq)
        if missing is not None:
            force = await self._recover(st, *missing)
            if force == NOT_THIS_LIFE:
                self.writer.skip_stale(st, seq)
                return
        result = await self.writer.apply(st, seq, batch, payload, force)
        if result.outcome is not APPLIED:
            then = seqr.after(result.outcome)
            if then is FILL_GAP:
                result = await self._fill_gap(st, seq, batch, payload, result.position)
            elif then is RESYNC:
                log.warning("pod %s: the store is at epoch %d, this replica at %d: the store lost writes; "
                            "resynchronising the stream", st.pod, result.position.epoch, st.epoch)
                await self._resync_stream(st, result.position.epoch)
                result = await self.writer.apply(st, seq, batch, payload, st.force)
            elif then is ADOPT:
                result = await self._lives.adopt(st, seq, batch, payload, result.position)
        outcome = result.outcome
        if outcome is APPLIED:
            st.force = None
        if outcome is not STALE:
            st.stale_run = 0

    async def _fill_gap(self, st: Stream, seq: int, batch: EventBatch, payload: bytes, pos: Position) -> ApplyResult:
        start = seqr.gap_start(pos, self._first_seq)
        st.gaps += 1
        self._metrics.seq_gaps.labels(st.pod).inc()
        log.warning("pod %s: seq gap, expected %d got %d", st.pod, start, seq)
        reason = await self._recover(st, start, seq)
        if reason == NOT_THIS_LIFE:  # queued before an engine restart another replica applied
            return self.writer.skip_stale(st, seq)
        result = await self.writer.apply(st, seq, batch, payload, reason)
        if result.outcome is Outcome.GAP:  # the store moved meanwhile: apply across what is left
            result = await self.writer.apply(st, seq, batch, payload, seqr.HISTORY_LOST)
        return result

    async def _recover(self, st: Stream, start: int, stop: int | None) -> str | None:
        """Apply the engine's batches [start, stop) from its replay; None when complete, else why not."""
        return await self._replay.recover(st, start, stop, self._offer_replayed)

    async def _offer_replayed(self, st: Stream, frame: Frame) -> bool:
        """A replayed batch: decoded and applied; False when it is not the next in order."""
        batch = self.writer.decode(st.pod, frame)
        return batch is not None and (await self.writer.apply(st, frame.seq, batch, frame.payload, None)).outcome \
            is not Outcome.GAP

    # -- the store is unreachable: hold, retry, resynchronise ------------------------------------
    def behind(self, model: str) -> bool:
        """Whether a stream of ``model`` waits for the store (its answers may lack what the engine sent)."""
        return self._buffer.behind(model)

    def store_lost(self) -> None:
        """The store lost its state: every stream resynchronises once the store answers."""
        self._buffer.lost(self.key)

    async def _drain_once(self) -> None:
        await self._ensure_open()
        for st in list(self.state.streams.values()):
            if st.needs_resync is not None:
                await self._resync_stream(st, st.epoch)
        buffer = self._buffer
        while (item := buffer.first()) is not None:
            st, seq, batch, payload = item
            if st.needs_resync is None:
                await self._sequence(st, seq, batch, payload)
            buffer.done(item)
        log.info("engine %s: the store answers; buffered batches applied", self.engine.name)

    async def _resync_stream(self, st: Stream, seen_epoch: int) -> None:
        """Clear the stream in the store (once, whichever replica comes first) and replay the
        engine's history from its first seq; history gone: the next batch is force-applied."""
        why = st.needs_resync or "store_behind"
        pos = await self.writer.clear(st, seen_epoch, self._first_seq)
        reason = await self._recover(st, self._first_seq, None) if self.engine.replay else "gap_no_replay_endpoint"
        if reason is not None and st.baseline_unknown:
            st.force = reason
        self._buffer.resync_done(st)
        st.observe(st.stored or pos)
        log.warning("pod %s: resynchronised after %s%s", st.pod, why,
                    f" ({reason}: the next batch is applied unsynced)" if st.force else " (history replayed)")

    # -- operator's resync ---------------------------------------------------------------------
    async def resync(self, pod: str) -> bool:
        """Operator's resync: clear the pod, replay the engine's history if it can, mark synced."""
        async with self._lock:
            streams = [s for s in self.state.streams.values() if s.pod == pod]
            if not streams:
                return False
            try:
                await self._resync_reset(streams)
                if self.journal is not None:
                    self.journal.resync(self.key, pod)
                for st in streams:  # history gone: unsynced with the reason, never an empty "synced" pod
                    reason = await self._recover(st, self._first_seq, None) if self.engine.replay else None
                    if reason is None:
                        st.mark_synced("resync requested")
                    else:
                        await self.writer.mark(st, reason)
            except StoreUnavailable:
                for st in streams:
                    self._buffer.needs_resync(st, "store_unavailable")
                self._buffer.start(self.key)
                raise
            return True

    async def _resync_reset(self, streams: list[Stream], expect_from: int | None = None) -> None:
        for st in streams:
            await self.writer.clear(st, st.epoch, expect_from)  # None: the next batch is the new baseline
            self._buffer.resync_done(st)

    # -- restored state (snapshot, write-ahead log, peer) ----------------------------------------
    def restore_streams(self, saved: list[dict[str, Any]]) -> None:
        """Before ``run()``: seed streams with saved seq state (``topic``, ``last_seq``,
        ``expect_from``, ``epoch``, ``synced``, ``unsynced_reason`` and the counters);
        ``install_restored`` writes their positions to the store; ``run()`` then asks the replay
        endpoint for everything after each restored watermark before subscribing."""
        for d in saved:
            st = self.writer.stream(str(d["topic"]))
            self._restored.add(st.topic)
            self._restored_positions[st.topic] = st.restore(d)

    async def install_restored(self) -> None:
        """The restored streams' positions into the store (the memory store of a restarted kvindex)."""
        restored, self._restored_positions = self._restored_positions, {}
        for topic, pos in restored.items():
            st = self.state.streams[topic]
            await self._store.set_position(st.ref, pos)
            st.stored = pos

    async def apply_logged(self, topic: str, seq: int, payload: bytes) -> None:
        """Re-apply a batch this lane applied before (write-ahead log replay, no network): the same
        decode and apply; a seq that went back is the restart it was; a gap is the unsynced
        stretch it was (the live lane could not fill it either)."""
        st = self.writer.stream(topic)
        if not st.seeded:
            await self._lives.seed(st)
        batch = self.writer.decode(st.pod, Frame(topic, seq, payload))
        if batch is None:
            return
        if seqr.went_back(st.last_seq, seq):
            await self.writer.restart(st, seq)
            batch = self.writer.decode_again(st, seq, batch, payload)
        force, gap = seqr.logged(st.last_seq, st.expect_from, st.baseline_unknown, seq)
        if gap:
            st.gaps += 1
        await self.writer.apply(st, seq, batch, payload, force)

    async def resync_logged(self, pod: str) -> None:
        """Re-apply an operator's resync from the write-ahead log (the batches it replayed follow:
        with a replay endpoint, from the first seq; a first logged batch past it is the history the
        resync could not rebuild, and the stream is unsynced again, as it was)."""
        streams = [s for s in self.state.streams.values() if s.pod == pod]
        await self._resync_reset(streams, self._first_seq if self.engine.replay else None)
        for st in streams:
            st.mark_synced("resync requested")

    async def _catch_up(self) -> None:
        """Restored streams: apply the engine's batches after the watermark (history gone:
        unsynced; seq gone back: the next live batch shows the restart)."""
        restored, self._restored = self._restored, set()
        if not self.engine.replay:
            return
        async with self._lock:
            for topic in restored:
                st = self.state.streams[topic]
                if st.last_seq is not None:
                    log.info("pod %s: restored at seq %d, asking %s for what followed", st.pod, st.last_seq,
                             self.engine.replay)
                    if await self._lives.restarted_unseen(st):  # the engine's life is not the one saved
                        reason = await self._lives.restart_restored(st, self._recover)
                    else:
                        reason = await self._recover(st, st.last_seq + 1, None)
                    if reason is not None:  # unsynced now, not only once a live batch comes
                        await self.writer.mark(st, reason)
                        st.force = reason
