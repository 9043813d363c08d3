"""Ingest: one ordered lane per engine, from frames to the precise index, with seq tracking.

Invariants:
- A lane owns one SUB socket and processes its messages strictly in order, one at a time; while
  it fetches a replay, live messages wait in the socket (they are held, not dropped).
- A payload is decoded before its seq is looked at: garbage never moves a watermark, never
  triggers a restart, and changes nothing held; it is counted by reason.
- Per stream (topic): seq == last+1 applies; seq > last+1 is a gap, recovered through the
  engine's replay endpoint (replayed batches strictly inside the gap, then the live one); seq <=
  last means the engine restarted: the pod is cleared first. A stream's first message with a seq
  past the dialect's first seq means kvindex joined mid-stream: recovered the same way.
- A pod is *unsynced* when a gap could not be filled (no replay endpoint, history gone, replay
  failed). It becomes synced again on AllBlocksCleared, an engine restart, or an explicit resync.
- Restored state (snapshot, write-ahead log, peer) enters only before ``run()``: ``restore_streams``
  seeds the seq state, ``apply_logged``/``resync_logged`` re-apply logged changes through the same
  decode and apply (no network); ``run()`` first asks the replay endpoint for everything after
  each restored watermark, then subscribes. Every applied batch goes to ``journal`` when set.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kvindex.config import EngineConfig
from kvindex.events import DecodeError, Decoder, EventBatch, Frame
from kvindex.logs import BurstLog
from kvindex.metrics import Metrics
from kvindex.precise import Applied, PreciseIndex
from kvindex.transport import Malformed, ReplayError, Subscriber, fetch_replay

log = logging.getLogger("kvindex.ingest")
MAX_TOPICS = 1024  # streams per publisher; more is garbage or misconfiguration


class StreamCounters:
    """A stream's labelled metric children, resolved once: the hot path only adds numbers."""

    def __init__(self, m: Metrics, pod: str) -> None:
        self.stored_events = m.events_applied.labels(pod, "BlockStored")
        self.removed_events = m.events_applied.labels(pod, "BlockRemoved")
        self.cleared_events = m.events_applied.labels(pod, "AllBlocksCleared")
        self.stored = m.blocks_stored.labels(pod)
        self.removed = m.blocks_removed.labels(pod)
        self.orphans = m.orphan_blocks.labels(pod)
        self.unknown = m.unknown_removals.labels(pod)
        self.lag = m.lag_seconds.labels(pod)

    def add(self, done: Applied) -> None:
        for counter, n in ((self.stored_events, done.stored_events), (self.removed_events, done.removed_events),
                           (self.cleared_events, done.cleared), (self.stored, done.stored),
                           (self.removed, done.removed), (self.orphans, done.orphans),
                           (self.unknown, done.unknown_removals)):
            if n:
                counter.inc(n)


@dataclass(slots=True)
class Stream:
    """Seq state of one topic of one engine, and what it tells about its pod."""

    topic: str
    pod: str
    model: str
    counters: StreamCounters
    last_seq: int | None = None
    expect_from: int | None = 0  # seq a complete history starts at; None: accept any baseline
    synced: bool = True
    unsynced_reason: str | None = None
    gaps: int = 0
    replays: int = 0
    restarts: int = 0
    batches: int = 0
    last_applied: float | None = None  # wall clock
    ranks: set[int] = field(default_factory=set)  # dp ranks this stream's batches carried
    replayed: dict[int, int] = field(default_factory=dict)  # seq -> CRC of batches a replay applied
                                                             # ahead of the live socket


@dataclass(frozen=True, slots=True)
class LaneSettings:
    replay_timeout: float = 2.0
    rcvhwm: int = 1_000_000


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


class EngineLane:
    """Everything about one engine publisher: its socket, its streams, their seq state."""

    def __init__(
        self,
        engine: EngineConfig,
        *,
        ctx: zmq.asyncio.Context,
        decoder: Decoder,
        first_seq: int,
        index: PreciseIndex,
        metrics: Metrics,
        settings: LaneSettings,
        burst: BurstLog,
    ) -> None:
        self.engine = engine
        self.state = LaneState()
        self._ctx = ctx
        self._decoder = decoder
        self._first_seq = first_seq
        self._index = index
        self._metrics = metrics
        self._settings = settings
        self._burst = burst
        self._lock = asyncio.Lock()
        self._restored: set[str] = set()
        self.key = engine.name  # the fleet's key for this lane (set by Fleet.add)
        # the write-ahead log: .batch(lane key, topic, seq, payload) after each applied batch,
        # .resync(lane key, pod) when an operator's resync clears a pod
        self.journal: Any = None
        if engine.model and engine.block_size:
            index.set_block_size(engine.model, engine.block_size)

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        e = self.engine
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
            await asyncio.gather(monitor, return_exceptions=True)
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
        await self._sequence(stream, msg.seq, batch, msg.payload)

    async def resync(self, pod: str) -> bool:
        """Operator's resync: clear the pod, replay the engine's history if it can, mark synced."""
        async with self._lock:
            streams = [s for s in self.state.streams.values() if s.pod == pod]
            if not streams:
                return False
            self._resync_reset(pod, streams)
            if self.journal is not None:
                self.journal.resync(self.key, pod)
            for st in streams:
                if self.engine.replay:
                    await self._recover(st, self._first_seq, None)
                self._mark_synced(st, "resync requested")
            return True

    def _clear_stream(self, st: Stream) -> None:
        """Forget the blocks of the dp ranks this stream feeds (other ranks have their own streams);
        a stream that has not applied a batch since it was restored clears the whole pod."""
        if not st.ranks:
            self._index.clear_pod(st.pod)
        for rank in st.ranks:
            self._index.clear_pod(st.pod, rank)
        st.replayed.clear()

    def _resync_reset(self, pod: str, streams: list[Stream]) -> None:
        for st in streams:
            self._clear_stream(st)
            st.last_seq = None
            st.expect_from = None  # without a replay, the next batch is the new baseline

    # -- restored state (snapshot, write-ahead log, peer) ----------------------------------------
    def restore_streams(self, saved: list[dict[str, Any]]) -> None:
        """Before ``run()``: seed streams with saved seq state (``topic``, ``last_seq``,
        ``expect_from``, ``synced``, ``unsynced_reason`` and the counters); ``run()`` then asks
        the replay endpoint for everything after each restored watermark before subscribing."""
        for d in saved:
            st = self._stream(str(d["topic"]))
            for name in ("last_seq", "expect_from", "synced", "unsynced_reason", "gaps", "replays", "restarts", "batches"):
                if name in d:
                    setattr(st, name, d[name])
            self._restored.add(st.topic)

    def apply_logged(self, topic: str, seq: int, payload: bytes) -> None:
        """Re-apply a batch this lane applied before (write-ahead log replay, no network): the same
        decode and apply; a seq that went back is the restart it was; a gap is the unsynced
        stretch it was (the live lane could not fill it either)."""
        st = self._stream(topic)
        batch = self._decode(st.pod, Frame(topic, seq, payload))
        if batch is None:
            return
        if st.last_seq is not None and seq <= st.last_seq:
            self._restarted(st, seq)
        if st.last_seq is None:
            if st.expect_from is not None and seq > st.expect_from:
                self._mark_unsynced(st, "history_lost", st.expect_from, seq)
        elif seq > st.last_seq + 1:
            st.gaps += 1
            self._mark_unsynced(st, "history_lost", st.last_seq + 1, seq)
        self._apply(st, seq, batch, payload)

    def resync_logged(self, pod: str) -> None:
        """Re-apply an operator's resync from the write-ahead log (the batches it replayed follow)."""
        streams = [s for s in self.state.streams.values() if s.pod == pod]
        self._resync_reset(pod, streams)
        for st in streams:
            self._mark_synced(st, "resync requested")

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
                    await self._recover(st, st.last_seq + 1, None)

    # -- seq -----------------------------------------------------------------------------------
    async def _sequence(self, st: Stream, seq: int, batch: EventBatch, payload: bytes) -> None:
        if st.replayed:
            if st.replayed.get(seq) == zlib.crc32(payload):
                return  # already applied from the replay that ran ahead of the socket
            if st.last_seq is not None and seq > st.last_seq:
                st.replayed.clear()  # live again
        if st.last_seq is not None and seq <= st.last_seq:
            if not batch.events:  # nothing usable: not evidence enough to drop a pod's state
                self._reject(st.pod, "backward_seq_without_events", f"seq {seq} went back but carries no usable event")
                return
            self._restarted(st, seq)
        if st.last_seq is None:
            if st.expect_from is not None and seq > st.expect_from:
                await self._recover(st, st.expect_from, seq)
        elif seq > st.last_seq + 1:
            st.gaps += 1
            self._metrics.seq_gaps.labels(st.pod).inc()
            log.warning("pod %s: seq gap, expected %d got %d", st.pod, st.last_seq + 1, seq)
            await self._recover(st, st.last_seq + 1, seq)
        self._apply(st, seq, batch, payload)

    def _restarted(self, st: Stream, seq: int) -> None:
        st.restarts += 1
        self._metrics.restarts.labels(st.pod).inc()
        log.warning("pod %s: seq went back from %d to %d: engine restarted, clearing its blocks",
                    st.pod, st.last_seq, seq)
        self._clear_stream(st)
        st.last_seq = None
        st.expect_from = self._first_seq
        self._mark_synced(st, "engine restarted")

    async def _recover(self, st: Stream, start: int, stop: int | None) -> None:
        """Apply the engine's batches [start, stop) from its replay endpoint, or mark unsynced."""
        if not self.engine.replay:
            self._mark_unsynced(st, "gap_no_replay_endpoint", start, stop)
            return
        st.replays += 1
        try:
            result = await fetch_replay(self._ctx, self.engine.replay, start, timeout=self._settings.replay_timeout)
        except (ReplayError, zmq.ZMQError) as exc:
            self._metrics.replays.labels(st.pod, "failed").inc()
            log.warning("pod %s: replay from %s failed: %s", st.pod, self.engine.replay, exc)
            self._mark_unsynced(st, "replay_failed", start, stop)
            return
        expected, broken = start, False
        for frame in result.frames:
            if frame.topic not in ("", st.topic) or frame.seq < expected:
                continue
            if stop is not None and frame.seq >= stop:
                break
            batch = self._decode(st.pod, frame) if frame.seq == expected else None
            if batch is None:
                broken = True
                break
            self._apply(st, frame.seq, batch, frame.payload)
            if stop is None:  # ahead of the live socket: its copies of these batches are duplicates
                st.replayed[frame.seq] = zlib.crc32(frame.payload)
            expected += 1
        complete = not broken and (expected == stop if stop is not None else result.complete)
        self._metrics.replays.labels(st.pod, "ok" if complete else "history_lost").inc()
        if not complete:
            self._mark_unsynced(st, "history_lost", expected, stop)

    # -- applying ------------------------------------------------------------------------------
    def _decode(self, label: str, frame: Frame) -> EventBatch | None:
        try:
            return self._decoder.decode(frame.payload)
        except DecodeError as exc:
            self._reject(label, exc.reason, f"undecodable payload (seq {frame.seq})")
            return None

    def _apply(self, st: Stream, seq: int, batch: EventBatch, payload: bytes) -> None:
        rank = self.engine.dp_rank if self.engine.dp_rank is not None else batch.dp_rank
        st.ranks.add(rank)
        for reason in batch.skipped:
            self._reject(st.pod, reason, "skipped an event or field")
        done = self._index.apply_batch(st.pod, st.model, rank, batch.events)
        st.counters.add(done)
        if done.block_size_mismatch:
            self._reject(st.pod, "block_size_mismatch", "block size differs from the model's")
        if done.cleared:
            self._mark_synced(st, "AllBlocksCleared")
        st.last_seq = seq
        st.batches += 1
        now = time.time()
        st.last_applied = now
        st.counters.lag.set(max(0.0, now - batch.ts))
        if self.journal is not None:
            self.journal.batch(self.key, st.topic, seq, payload)

    def _stream(self, topic: str) -> Stream:
        st = self.state.streams.get(topic)
        if st is None:
            pod, model = split_topic(topic)
            pod_id = self.engine.pod or pod or self.engine.endpoint
            st = Stream(topic=topic, pod=pod_id, model=self.engine.model or model or "unknown",
                        expect_from=self._first_seq, counters=StreamCounters(self._metrics, pod_id))
            if self.engine.block_size:
                self._index.set_block_size(st.model, self.engine.block_size)
            self.state.streams[topic] = st
            log.info("engine %s: new stream topic=%r -> pod %s, model %s", self.engine.name, topic, st.pod, st.model)
        return st

    def _reject(self, pod: str, reason: str, what: str) -> None:
        self._metrics.decode_errors.labels(pod, reason).inc()
        self._burst.warning((pod, reason), "pod %s: %s: %s", pod, what, reason)

    def _mark_unsynced(self, st: Stream, reason: str, start: int, stop: int | None) -> None:
        st.synced = False
        st.unsynced_reason = reason
        log.warning("pod %s: UNSYNCED (%s): batches %d..%s are missing; its index may lack blocks until "
                    "AllBlocksCleared, an engine restart or POST /v1/pods/%s/resync",
                    st.pod, reason, start, "" if stop is None else stop - 1, st.pod)

    @staticmethod
    def _mark_synced(st: Stream, why: str) -> None:
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
        return lane

    def lanes(self) -> dict[str, EngineLane]:
        return {k: lane for k, (lane, _) in self._lanes.items()}

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
