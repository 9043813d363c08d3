"""Ingest: one ordered lane per engine, from frames to the precise store, replica-safe.

Invariants:
- A lane owns one SUB socket and processes its messages strictly in order, one at a time; while
  it fetches a replay, live messages wait in the socket (they are held, not dropped).
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
- A seq that goes back means the engine restarted: ``store.restart(stream, epoch, ranks)`` clears
  the stream's ranks once (the first replica to announce it); the epoch it returns is adopted, so
  a later replica's copies of what the first one applied come back DUPLICATE. A stream's first
  batch with a seq past the dialect's first seq and no stored history means kvindex joined
  mid-stream: recovered the same way. Whether a batch belongs to the engine's current life is
  asked of its replay endpoint where the store alone cannot tell (a replica's first batch, a
  STALE batch, a gap the engine's history does not reach): a lagging replica never applies a
  batch of an ended life, and a restart while no replica ran is seen by the next one.
- The store unreachable (``StoreUnavailable``): the lane keeps the batches it cannot apply, in
  order, up to ``store_buffer`` batches, retrying with capped backoff while live messages keep
  arriving; past the bound the buffer is dropped and every stream of the lane is locally unsynced
  (``store_unavailable``) until the store answers and the stream is resynchronised through the
  engine's replay (clear + replay from the first seq; history gone: the next batch is
  force-applied and the stream stays unsynced with the reason). After ``StoreLost`` every stream
  of every lane resynchronises the same way. ``behind(model)`` is true meanwhile, and queries for
  that model answer 503 rather than a partial answer.
- Every re-run of a batch after a failed store call is safe: the store's apply and restart are
  idempotent, and local state moves only after the store answered.
- Restored state (snapshot, write-ahead log, peer; memory store only) enters only before
  ``run()``: ``restore_streams`` seeds the seq state, ``apply_logged``/``resync_logged`` re-apply
  logged changes through the same decode and apply (no network); ``run()`` first asks the replay
  endpoint for everything after each restored watermark, then subscribes. Every applied batch goes
  to ``journal`` when set.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kvindex.config import EngineConfig
from kvindex.events import DecodeError, Decoder, EventBatch, Frame
from kvindex.index.protocol import Applied, ApplyResult, PreciseStore, StoreUnavailable
from kvindex.ingest.transport import (
    Malformed,
    ReplayError,
    ReplayResult,
    Subscriber,
    fetch_replay,
)
from kvindex.logs import BurstLog
from kvindex.metrics import Metrics
from kvindex.sequence import Outcome, Position, StreamRef

log = logging.getLogger("kvindex.ingest.lane")
MAX_TOPICS = 1024  # streams per publisher; more is garbage or misconfiguration
RETRY_FIRST, RETRY_CAP = 0.05, 2.0  # seconds between attempts to reach the store (doubling)
NOT_THIS_LIFE = "not_this_life"  # a recovery's verdict: the engine's history ends before the batch
LIFE_CHECK_EVERY = 64  # STALE batches in a row between two replay checks of the batch's engine life


class StreamCounters:
    """A stream's labelled metric children, resolved once. The hot path only adds plain ints
    (``add``, ``lag_seconds``); ``flush`` hands them to the children, before every scrape (a
    Prometheus child's ``inc`` takes a lock: four of them per batch cost ~15% of ingest)."""

    def __init__(self, m: Metrics, pod: str) -> None:
        self._children = (m.events_applied.labels(pod, "BlockStored"), m.events_applied.labels(pod, "BlockRemoved"),
                          m.events_applied.labels(pod, "AllBlocksCleared"), m.blocks_stored.labels(pod),
                          m.blocks_removed.labels(pod), m.orphan_blocks.labels(pod), m.unknown_removals.labels(pod))
        self._pending = [0] * len(self._children)
        self.lag = m.lag_seconds.labels(pod)
        self.lag_seconds: float | None = None  # behind at the last batch applied, not yet in ``lag``
        self.duplicate = m.batches_skipped.labels(pod, "duplicate")
        self.stale = m.batches_skipped.labels(pod, "stale")
        self.dropped = m.batches_skipped.labels(pod, "dropped")

    def add(self, done: Applied) -> None:
        p = self._pending
        p[0] += done.stored_events
        p[1] += done.removed_events
        p[2] += done.cleared
        p[3] += done.stored
        p[4] += done.removed
        p[5] += done.orphans
        p[6] += done.unknown_removals

    def flush(self) -> None:
        for child, n in zip(self._children, self._pending):
            if n:
                child.inc(n)
        self._pending = [0] * len(self._children)
        if self.lag_seconds is not None:
            self.lag.set(self.lag_seconds)
            self.lag_seconds = None


@dataclass(slots=True)
class Stream:
    """One topic of one engine: this replica's view of it (the store holds the shared position)."""

    topic: str
    pod: str
    model: str
    counters: StreamCounters
    ref: StreamRef
    last_seq: int | None = None  # the last seq this replica handled (in its epoch)
    expect_from: int | None = 0  # seq a complete history starts at; None: accept any baseline
    epoch: int = 0  # the epoch this replica offers batches at (adopted from the store)
    synced: bool = True  # as the store last said
    unsynced_reason: str | None = None
    gaps: int = 0
    replays: int = 0
    restarts: int = 0
    batches: int = 0  # batches this replica applied
    skipped: int = 0  # batches the store judged duplicate or stale
    last_applied: float | None = None  # wall clock
    ranks: set[int] = field(default_factory=set)  # dp ranks this stream's batches carried
    replayed: dict[int, int] = field(default_factory=dict)  # seq -> CRC of batches a replay applied
                                                             # ahead of the live socket
    stored: Position | None = None  # the stream's position as the store last answered
    seeded: bool = False  # the stored position has been read since the stream appeared
    force: str | None = None  # the next batch applies across a gap with this reason (history gone)
    needs_resync: str | None = None  # why the stream must be resynchronised before it applies again
    held: int = 0  # batches of this stream waiting in the lane's buffer
    stale_run: int = 0  # STALE batches in a row (replay checks of their engine life are spaced)

    @property
    def baseline_unknown(self) -> bool:
        return self.stored is None or self.stored.last_seq is None


@dataclass(frozen=True, slots=True)
class LaneSettings:
    replay_timeout: float = 2.0
    rcvhwm: int = 1_000_000
    store_buffer: int = 10_000  # batches a lane keeps while the store is unreachable


@dataclass(slots=True)
class LaneState:
    connected_peers: int = 0
    frames: int = 0
    streams: dict[str, Stream] = field(default_factory=dict)


def split_topic(topic: str) -> tuple[str | None, str | None]:
    """``kv@<pod>@<model>`` (llm-d convention; the pod part may hold ``ip:port``)."""
    parts = topic.split("@")
    if len(parts) == 3 and parts[0] == "kv" and parts[1]:
        return parts[1], parts[2] or None
    return None, None


async def _always_open() -> None:
    return None


class EngineLane:
    """Everything about one engine publisher: its socket, its streams, their seq state."""

    def __init__(
        self,
        engine: EngineConfig,
        *,
        ctx: zmq.asyncio.Context,
        decoder: Decoder,
        first_seq: int,
        store: PreciseStore,
        metrics: Metrics,
        settings: LaneSettings,
        burst: BurstLog,
        ensure_open: Callable[[], Awaitable[None]] = _always_open,
    ) -> None:
        self.engine = engine
        self.state = LaneState()
        self._ctx = ctx
        self._decoder = decoder
        self._first_seq = first_seq
        self._store = store
        self._metrics = metrics
        self._settings = settings
        self._burst = burst
        self._ensure_open = ensure_open  # re-opens the stores after a loss (the guard's)
        self._lock = asyncio.Lock()
        self._restored: set[str] = set()
        self._restored_positions: dict[str, Position] = {}
        self._held: deque[tuple[Stream, int, EventBatch, bytes]] = deque()
        self._resyncs_due = 0  # streams whose needs_resync is set
        self._drainer: asyncio.Task[None] | None = None
        self.key = engine.name  # the fleet's key for this lane (set by Fleet.add)
        # the write-ahead log: .batch(lane key, topic, seq, payload) after each applied batch,
        # .resync(lane key, pod) when an operator's resync clears a pod
        self.journal: Any = None

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        e = self.engine
        await self.install_restored()
        await self._catch_up()
        sub = Subscriber(self._ctx, e.endpoint, bind=e.bind, rcvhwm=self._settings.rcvhwm)
        monitor = asyncio.create_task(self._monitor(sub), name=f"monitor {e.endpoint}")
        log.info("engine %s: %s %s (dialect %s, replay %s)", e.name, "bound" if e.bind else "connected to",
                 e.endpoint, e.dialect, e.replay or "none")
        try:
            async for msg in sub.messages():
                async with self._lock:
                    await self.handle(msg)
        finally:
            monitor.cancel()
            drainer, self._drainer = self._drainer, None
            if drainer is not None:
                drainer.cancel()
            await asyncio.gather(monitor, *([drainer] if drainer else []), return_exceptions=True)
            sub.close()

    async def _monitor(self, sub: Subscriber) -> None:
        """Track connected peers from the socket's monitor events (for /v1/pods and /readyz)."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            ev = parse_monitor_message(await sub.monitor.recv_multipart())
            kind = ev["event"]
            if kind in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.state.connected_peers += 1
            elif kind == zmq.EVENT_DISCONNECTED:
                self.state.connected_peers = max(0, self.state.connected_peers - 1)

    async def handle(self, msg: Frame | Malformed) -> None:
        self.state.frames += 1
        if isinstance(msg, Malformed):
            self._reject(self.engine.name, msg.reason, "malformed message")
            return
        stream = self.state.streams.get(msg.topic)
        batch = self._decode(stream.pod if stream else self.engine.name, msg)
        if batch is None:
            return  # garbage creates no stream, no pod, no metric series
        if stream is None:
            if len(self.state.streams) >= MAX_TOPICS:
                self._reject(self.engine.name, "too_many_topics", f"more than {MAX_TOPICS} topics on one publisher")
                return
            stream = self._stream(msg.topic)
        if self._held or stream.needs_resync is not None:
            self._hold(stream, msg.seq, batch, msg.payload)
            return
        try:
            await self._sequence(stream, msg.seq, batch, msg.payload)
        except StoreUnavailable:
            self._hold(stream, msg.seq, batch, msg.payload)

    def behind(self, model: str) -> bool:
        """Whether a stream of ``model`` waits for the store (buffered batches or a resync due):
        the store's answers for the model may then lack what the engine published."""
        if not self._held and not self._resyncs_due:  # the common case, checked on every query
            return False
        return any(st.model == model and (st.held or st.needs_resync is not None)
                   for st in self.state.streams.values())

    # -- the store is unreachable: hold, retry, resynchronise ------------------------------------
    def _hold(self, st: Stream, seq: int, batch: EventBatch, payload: bytes) -> None:
        if st.needs_resync is not None:
            st.counters.dropped.inc()  # its resync replays the engine's history, this batch included
        elif len(self._held) >= self._settings.store_buffer:
            self._overflow()
            st.counters.dropped.inc()
        else:
            self._held.append((st, seq, batch, payload))
            st.held += 1
            self._metrics.store_buffered.inc()
        self._start_drainer()

    def _overflow(self) -> None:
        log.error("engine %s: %d batches wait for the store, the bound (--store-buffer): dropping them; its "
                  "streams are UNSYNCED (store_unavailable) until the store answers and they are replayed",
                  self.engine.name, len(self._held))
        self._drop_held()
        for st in self.state.streams.values():
            self._needs_resync(st, "store_unavailable")

    def _drop_held(self) -> None:
        for st, *_ in self._held:
            st.held -= 1
            st.counters.dropped.inc()
        self._metrics.store_buffered.dec(len(self._held))
        self._held.clear()

    def _needs_resync(self, st: Stream, why: str) -> None:
        if st.needs_resync is None:
            st.needs_resync = why
            st.synced, st.unsynced_reason = False, why
            self._resyncs_due += 1

    def _resync_done(self, st: Stream) -> None:
        if st.needs_resync is not None:
            st.needs_resync = None
            self._resyncs_due -= 1

    def store_lost(self) -> None:
        """The store lost its state: every stream resynchronises once the store answers."""
        self._drop_held()
        for st in self.state.streams.values():
            self._needs_resync(st, "store_lost")
        if self.state.streams:
            self._start_drainer()

    def _start_drainer(self) -> None:
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name=f"store retry {self.key}")

    async def _drain(self) -> None:
        """Until the buffer is applied and every due resync is done, retrying with capped backoff."""
        delay = RETRY_FIRST
        while True:
            async with self._lock:
                try:
                    await self._drain_once()
                    return
                except StoreUnavailable:
                    pass  # counted and logged by the guard
                except Exception:  # a bug must not leave the lane's streams waiting forever
                    log.exception("engine %s: applying the buffered batches failed; retrying", self.engine.name)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_CAP)

    async def _drain_once(self) -> None:
        await self._ensure_open()
        for st in list(self.state.streams.values()):
            if st.needs_resync is not None:
                await self._resync_stream(st, st.epoch)
        while self._held:
            item = self._held[0]
            st, seq, batch, payload = item
            if st.needs_resync is None:
                await self._sequence(st, seq, batch, payload)
            if self._held and self._held[0] is item:  # a loss meanwhile may have dropped the buffer
                self._held.popleft()
                st.held -= 1
                self._metrics.store_buffered.dec()
        log.info("engine %s: the store answers; buffered batches applied", self.engine.name)

    async def _resync_stream(self, st: Stream, seen_epoch: int) -> None:
        """Clear the stream in the store (once, whichever replica comes first) and replay the
        engine's history from its first seq; history gone: the next batch is force-applied."""
        why = st.needs_resync or "store_behind"
        pos = await self._store.restart(st.ref, seen_epoch, sorted(st.ranks) or None)
        self._reset(st, pos, self._first_seq)
        reason = await self._recover(st, self._first_seq, None) if self.engine.replay else "gap_no_replay_endpoint"
        if reason is not None and st.baseline_unknown:
            st.force = reason
        self._resync_done(st)
        self._observe(st, st.stored or pos)
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
                for st in streams:
                    if self.engine.replay:
                        await self._recover(st, self._first_seq, None)
                    self._log_synced(st, "resync requested")
            except StoreUnavailable:
                for st in streams:
                    self._needs_resync(st, "store_unavailable")
                self._start_drainer()
                raise
            return True

    async def _resync_reset(self, streams: list[Stream]) -> None:
        for st in streams:
            pos = await self._store.restart(st.ref, st.epoch, sorted(st.ranks) or None)
            self._reset(st, pos, None)  # without a replay, the next batch is the new baseline
            self._resync_done(st)

    def _reset(self, st: Stream, pos: Position, expect_from: int | None) -> None:
        """The stream starts over at the store's ``pos`` (after a restart or a clear)."""
        st.epoch = pos.epoch
        st.last_seq = None
        st.expect_from = expect_from
        st.replayed.clear()
        st.force = None
        self._observe(st, pos)

    # -- restored state (snapshot, write-ahead log, peer) ----------------------------------------
    def restore_streams(self, saved: list[dict[str, Any]]) -> None:
        """Before ``run()``: seed streams with saved seq state (``topic``, ``last_seq``,
        ``expect_from``, ``epoch``, ``synced``, ``unsynced_reason`` and the counters);
        ``install_restored`` writes their positions to the store; ``run()`` then asks the replay
        endpoint for everything after each restored watermark before subscribing."""
        for d in saved:
            st = self._stream(str(d["topic"]))
            for name in ("last_seq", "expect_from", "epoch", "synced", "unsynced_reason", "gaps", "replays",
                         "restarts", "batches"):
                if name in d:
                    setattr(st, name, d[name])
            st.seeded = True
            self._restored.add(st.topic)
            self._restored_positions[st.topic] = Position(st.last_seq, st.epoch, st.synced, st.unsynced_reason)

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
        st = self._stream(topic)
        if not st.seeded:
            await self._seed(st)
        batch = self._decode(st.pod, Frame(topic, seq, payload))
        if batch is None:
            return
        if st.last_seq is not None and seq <= st.last_seq:
            await self._restarted(st, seq)
        force = None
        if st.last_seq is None:
            if st.expect_from is not None and seq > st.expect_from and st.baseline_unknown:
                force = "history_lost"
        elif seq > st.last_seq + 1:
            st.gaps += 1
            force = "history_lost"
        await self._apply(st, seq, batch, payload, force)

    async def resync_logged(self, pod: str) -> None:
        """Re-apply an operator's resync from the write-ahead log (the batches it replayed follow)."""
        streams = [s for s in self.state.streams.values() if s.pod == pod]
        await self._resync_reset(streams)
        for st in streams:
            self._log_synced(st, "resync requested")

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
                    reason = await self._recover(st, st.last_seq + 1, None)
                    if reason is not None:
                        st.force = reason

    # -- seq -----------------------------------------------------------------------------------
    async def _sequence(self, st: Stream, seq: int, batch: EventBatch, payload: bytes) -> None:
        """One live batch, from the stream's seq state to the store; safe to re-run after a
        failed store call (the buffer does)."""
        if not st.seeded and not await self._seed(st, seq, payload):
            self._skip_stale(st, seq)
            return
        if st.replayed:
            if st.replayed.get(seq) == zlib.crc32(payload):
                return  # already applied from the replay that ran ahead of the socket
            if st.last_seq is not None and seq > st.last_seq:
                st.replayed.clear()  # live again
        if st.last_seq is not None and seq <= st.last_seq:
            if not batch.events:  # nothing usable: not evidence enough to drop a pod's state
                self._reject(st.pod, "backward_seq_without_events", f"seq {seq} went back but carries no usable event")
                return
            await self._restarted(st, seq)
        force = st.force
        if force is None and st.baseline_unknown and st.expect_from is not None and seq > st.expect_from:
            force = await self._recover(st, st.expect_from, seq)
            if force == NOT_THIS_LIFE:
                self._skip_stale(st, seq)
                return
        result = await self._apply(st, seq, batch, payload, force)
        if result.outcome is Outcome.GAP:
            result = await self._fill_gap(st, seq, batch, payload, result.position)
        elif result.outcome is Outcome.BEHIND:
            log.warning("pod %s: the store is at epoch %d, this replica at %d: the store lost writes; "
                        "resynchronising the stream", st.pod, result.position.epoch, st.epoch)
            await self._resync_stream(st, result.position.epoch)
            result = await self._apply(st, seq, batch, payload, st.force)
        elif result.outcome is Outcome.STALE:
            result = await self._adopt(st, seq, batch, payload, result.position)
        if result.outcome is Outcome.APPLIED:
            st.force = None
        if result.outcome is not Outcome.STALE:
            st.stale_run = 0

    async def _seed(self, st: Stream, seq: int | None = None, payload: bytes = b"") -> bool:
        """Read the stream's stored position: another replica may be ahead (its batches then come
        back DUPLICATE) or the engine may have restarted (a later epoch, adopted). When the store
        has history and the engine a replay endpoint, the first batch must be of the engine's
        current life (it may have been queued before a restart other replicas applied): False
        when it is not (skipped; the next batch seeds)."""
        if self.engine.block_size:
            await self._store.set_block_size(st.model, self.engine.block_size)
        pos = await self._store.position(st.ref)
        if pos is not None and pos.last_seq is not None and seq is not None:
            if await self._life_of(st, seq, payload) is False:
                return False
            if seq <= pos.last_seq and await self._history_ends_before(st, pos.last_seq):
                pos = await self._restarted_unseen(st, pos)
        if pos is not None:
            st.epoch = pos.epoch
            self._observe(st, pos)
        st.seeded = True
        return True

    async def _fill_gap(self, st: Stream, seq: int, batch: EventBatch, payload: bytes, pos: Position) -> ApplyResult:
        start = (pos.last_seq if pos.last_seq is not None else self._first_seq - 1) + 1
        st.gaps += 1
        self._metrics.seq_gaps.labels(st.pod).inc()
        log.warning("pod %s: seq gap, expected %d got %d", st.pod, start, seq)
        reason = await self._recover(st, start, seq)
        if reason == NOT_THIS_LIFE:  # queued before an engine restart another replica applied
            return self._skip_stale(st, seq)
        result = await self._apply(st, seq, batch, payload, reason)
        if result.outcome is Outcome.GAP:  # the store moved meanwhile: apply across what is left
            result = await self._apply(st, seq, batch, payload, "history_lost")
        return result

    async def _adopt(self, st: Stream, seq: int, batch: EventBatch, payload: bytes, pos: Position) -> ApplyResult:
        """STALE: another replica announced an engine restart this one has not seen (yet). Either
        this batch is of the ended life (this replica lags: its seq will go back soon), or this
        replica missed the restart. The engine's replay decides: when it holds this very batch
        (same seq, same bytes), the batch is of the current life and the store's epoch is
        adopted. Checks are spaced (every ``LIFE_CHECK_EVERY`` STALE batches in a row)."""
        st.stale_run += 1
        if (st.stale_run - 1) % LIFE_CHECK_EVERY or not await self._life_of(st, seq, payload):
            st.last_seq = seq
            return ApplyResult(Outcome.STALE, pos)
        log.info("pod %s: the store is at epoch %d (another replica saw the engine restart): adopting it",
                 st.pod, pos.epoch)
        st.epoch = pos.epoch
        st.expect_from = self._first_seq
        return await self._apply(st, seq, batch, payload, None)

    async def _life_of(self, st: Stream, seq: int, payload: bytes) -> bool | None:
        """Whether batch ``seq`` is of the engine's current life, by its replay: True (it holds
        these very bytes at ``seq``), False (other bytes there, or its history stops before),
        None (no replay endpoint, the replay failed, or its history no longer reaches ``seq``)."""
        result = await self._peek_replay(st, seq, 64)
        if result is None:
            return None
        mine = [f for f in result.frames if f.topic in ("", st.topic)]
        at = next((f for f in mine if f.seq == seq), None)
        if at is not None:
            return zlib.crc32(at.payload) == zlib.crc32(payload)
        return False if not mine and result.complete else None

    async def _history_ends_before(self, st: Stream, seq: int) -> bool:
        """Whether the engine's replay history stops before ``seq`` (so the store holds batches of
        an earlier life of the engine); False when it cannot tell."""
        result = await self._peek_replay(st, seq, 1)
        return result is not None and result.complete and not any(f.topic in ("", st.topic) for f in result.frames)

    async def _peek_replay(self, st: Stream, seq: int, max_frames: int) -> ReplayResult | None:
        """Up to ``max_frames`` of the engine's history from ``seq``; None without a replay endpoint
        or when the replay fails (logged)."""
        if not self.engine.replay:
            return None
        try:
            return await fetch_replay(self._ctx, self.engine.replay, seq, timeout=self._settings.replay_timeout,
                                      max_frames=max_frames)
        except (ReplayError, zmq.ZMQError) as exc:
            log.warning("pod %s: replay from %s failed: %s", st.pod, self.engine.replay, exc)
            return None

    async def _restarted_unseen(self, st: Stream, pos: Position) -> Position:
        """The engine restarted while no replica was watching: the store holds its earlier life."""
        log.warning("pod %s: the store is at seq %d but the engine's history ends before it: the engine restarted "
                    "while no replica watched; clearing its blocks", st.pod, pos.last_seq)
        st.restarts += 1
        self._metrics.restarts.labels(st.pod).inc()
        after = await self._store.restart(st.ref, pos.epoch, None)
        st.expect_from = self._first_seq
        return after

    def _skip_stale(self, st: Stream, seq: int) -> ApplyResult:
        """A batch of an engine life that has ended (the engine's history ends before it): skipped,
        and it does not move this replica's seq (its own restart is still to come)."""
        st.skipped += 1
        st.counters.stale.inc()
        self._burst.warning((st.pod, "ended_life"), "pod %s: seq %d is of an engine life that has ended (another "
                            "replica applied the restart): skipped", st.pod, seq)
        return ApplyResult(Outcome.STALE, st.stored or Position(epoch=st.epoch))

    async def _restarted(self, st: Stream, seq: int) -> None:
        pos = await self._store.restart(st.ref, st.epoch, sorted(st.ranks) or None)
        st.restarts += 1
        self._metrics.restarts.labels(st.pod).inc()
        if pos.epoch == st.epoch + 1 and pos.last_seq is None:
            log.warning("pod %s: seq went back from %d to %d: engine restarted, clearing its blocks",
                        st.pod, st.last_seq, seq)
        else:
            log.info("pod %s: seq went back from %d to %d: engine restarted (another replica cleared it already)",
                     st.pod, st.last_seq, seq)
        self._reset(st, pos, self._first_seq)
        self._log_synced(st, "engine restarted")

    async def _recover(self, st: Stream, start: int, stop: int | None) -> str | None:
        """Apply the engine's batches [start, stop) from its replay endpoint; None when complete,
        else why not (the reason the stream is unsynced with)."""
        if not self.engine.replay:
            return self._unsynced(st, "gap_no_replay_endpoint", start, stop)
        st.replays += 1
        try:
            result = await fetch_replay(self._ctx, self.engine.replay, start, timeout=self._settings.replay_timeout)
        except (ReplayError, zmq.ZMQError) as exc:
            self._metrics.replays.labels(st.pod, "failed").inc()
            log.warning("pod %s: replay from %s failed: %s", st.pod, self.engine.replay, exc)
            return self._unsynced(st, "replay_failed", start, stop)
        expected, broken, newest = start, False, None
        for frame in result.frames:
            if frame.topic not in ("", st.topic):
                continue
            newest = frame.seq if newest is None else max(newest, frame.seq)
            if frame.seq < expected:
                continue
            if stop is not None and frame.seq >= stop:
                break
            batch = self._decode(st.pod, frame) if frame.seq == expected else None
            if batch is None or (await self._apply(st, frame.seq, batch, frame.payload, None)).outcome is Outcome.GAP:
                broken = True
                break
            if stop is None:  # ahead of the live socket: its copies of these batches are duplicates
                st.replayed[frame.seq] = zlib.crc32(frame.payload)
            expected += 1
        complete = not broken and (expected == stop if stop is not None else result.complete)
        if (not complete and not broken and result.complete and stop is not None and newest is not None
                and newest < stop - 1):
            self._metrics.replays.labels(st.pod, "ok").inc()
            return NOT_THIS_LIFE  # the engine never published stop - 1 in its current life
        self._metrics.replays.labels(st.pod, "ok" if complete else "history_lost").inc()
        return None if complete else self._unsynced(st, "history_lost", expected, stop)

    # -- applying ------------------------------------------------------------------------------
    def _decode(self, label: str, frame: Frame) -> EventBatch | None:
        try:
            return self._decoder.decode(frame.payload)
        except DecodeError as exc:
            self._reject(label, exc.reason, f"undecodable payload (seq {frame.seq})")
            return None

    async def _apply(self, st: Stream, seq: int, batch: EventBatch, payload: bytes, force: str | None) -> ApplyResult:
        """Offer one batch to the store (one await); count what it did."""
        rank = self.engine.dp_rank if self.engine.dp_rank is not None else batch.dp_rank
        result = await self._store.apply(st.ref, seq, st.epoch, rank, batch.events, force=force)
        outcome = result.outcome
        self._observe(st, result.position)
        if outcome is Outcome.APPLIED:
            st.ranks.add(rank)
            self._applied(st, seq, batch, payload, result.applied)
        elif outcome is Outcome.DUPLICATE or outcome is Outcome.STALE:
            st.skipped += 1
            (st.counters.duplicate if outcome is Outcome.DUPLICATE else st.counters.stale).inc()
            if outcome is Outcome.DUPLICATE:
                st.ranks.add(rank)
                st.last_seq = seq
        return result

    def _applied(self, st: Stream, seq: int, batch: EventBatch, payload: bytes, done: Applied | None) -> None:
        for reason in batch.skipped:
            self._reject(st.pod, reason, "skipped an event or field")
        if done is not None:
            st.counters.add(done)
            if done.block_size_mismatch:
                self._reject(st.pod, "block_size_mismatch", "block size differs from the model's")
        st.last_seq = seq
        st.batches += 1
        now = time.time()
        st.last_applied = now
        st.counters.lag_seconds = max(0.0, now - batch.ts)
        if self.journal is not None:
            self.journal.batch(self.key, st.topic, seq, payload)

    def _observe(self, st: Stream, pos: Position) -> None:
        """Mirror the store's answer (for logs, snapshots and the hot path's baseline check)."""
        st.stored = pos
        if st.needs_resync is not None:
            return
        if pos.synced and not st.synced:
            log.info("pod %s: synced again", st.pod)
        st.synced, st.unsynced_reason = pos.synced, pos.reason

    def _stream(self, topic: str) -> Stream:
        st = self.state.streams.get(topic)
        if st is None:
            pod, model = split_topic(topic)
            pod_id = self.engine.pod or pod or self.engine.endpoint
            model_id = self.engine.model or model or "unknown"
            st = Stream(topic=topic, pod=pod_id, model=model_id, expect_from=self._first_seq,
                        counters=StreamCounters(self._metrics, pod_id), ref=StreamRef.of(pod_id, self._stream_name(topic), model_id))
            self.state.streams[topic] = st
            log.info("engine %s: new stream topic=%r -> pod %s, model %s", self.engine.name, topic, st.pod, st.model)
        return st

    def _stream_name(self, topic: str) -> str:
        """The stream's name in the store, the same on every replica: its topic and which publisher
        of the pod (ranks of one pod publish the same topic on endpoints of their own)."""
        e = self.engine
        return f"{topic}|dp{e.dp_rank}" if e.dp_rank is not None else f"{topic}|{e.endpoint}"

    def _reject(self, pod: str, reason: str, what: str) -> None:
        self._metrics.decode_errors.labels(pod, reason).inc()
        self._burst.warning((pod, reason), "pod %s: %s: %s", pod, what, reason)

    @staticmethod
    def _unsynced(st: Stream, reason: str, start: int, stop: int | None) -> str:
        log.warning("pod %s: UNSYNCED (%s): batches %d..%s are missing; its index may lack blocks until "
                    "AllBlocksCleared, an engine restart or POST /v1/pods/%s/resync",
                    st.pod, reason, start, "" if stop is None else stop - 1, st.pod)
        return reason

    @staticmethod
    def _log_synced(st: Stream, why: str) -> None:
        if not st.synced:
            log.info("pod %s: synced again (%s)", st.pod, why)
        st.synced = True
        st.unsynced_reason = None


class Fleet:
    """Owns the lanes: starts, stops and lists them. The only place lane tasks live."""

    def __init__(self, make_lane: Callable[[EngineConfig], EngineLane],
                 on_add: Callable[[str, EngineLane], None] | None = None) -> None:
        self._make_lane = make_lane
        self._on_add = on_add  # called before the lane's task starts (journal, restored streams)
        self._lanes: dict[str, tuple[EngineLane, asyncio.Task[None]]] = {}

    def add(self, key: str, engine: EngineConfig) -> EngineLane:
        if key in self._lanes:
            raise KeyError(key)
        lane = self._make_lane(engine)
        lane.key = key
        if self._on_add is not None:
            self._on_add(key, lane)
        task = asyncio.create_task(self._run(lane), name=f"lane {key}")
        self._lanes[key] = (lane, task)
        return lane

    @staticmethod
    async def _run(lane: EngineLane) -> None:
        try:
            await lane.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine %s: lane stopped", lane.engine.name)
            raise

    async def remove(self, key: str) -> EngineLane | None:
        entry = self._lanes.pop(key, None)
        if entry is None:
            return None
        lane, task = entry
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for st in lane.state.streams.values():  # what it applied still counts
            st.counters.flush()
        return lane

    def lanes(self) -> dict[str, EngineLane]:
        return {k: lane for k, (lane, _) in self._lanes.items()}

    def flush_metrics(self) -> None:
        """Every stream's pending counts into its metric children (before a scrape)."""
        for lane, _ in self._lanes.values():
            for st in lane.state.streams.values():
                st.counters.flush()

    def lane_task_failed(self, key: str) -> str | None:
        entry = self._lanes.get(key)
        if entry is None or not entry[1].done() or entry[1].cancelled():
            return None
        exc = entry[1].exception()
        return f"{type(exc).__name__}: {exc}" if exc else "stopped"

    async def resync(self, pod: str) -> bool:
        found = False
        for lane in self.lanes().values():
            found |= await lane.resync(pod)
        return found

    async def close(self) -> None:
        for key in list(self._lanes):
            await self.remove(key)
