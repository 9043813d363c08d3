"""A lane's streams: one ``Stream`` per topic of an engine publisher, and its metric counters.

Invariants:
- A ``Stream`` is this replica's view of one topic (the store holds the shared ``Position``):
  what it received (``last_seq``, for restart detection), the gaps and replays it saw, the epoch
  it offers batches at, and what the store last answered (``stored``). Only the lane that owns
  it changes it, and only after the store answered.
- A stream's name in the store (``StreamRef``) is the same on every replica: its topic and which
  publisher of the pod (the dp rank when configured, else the endpoint).
- ``StreamCounters``: the hot path keeps each batch's ``Applied`` (never changed once returned;
  at most ``PENDING_BATCHES`` kept); ``flush`` sums them into the Prometheus children before every
  scrape (a child's ``inc`` takes a lock).
- No I/O here beyond log lines.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvindex.config import MAX_BLOCKS_PER_POD, MAX_LAG_SECONDS, RCVHWM, RECEIVE_BUFFER_BYTES
from kvindex.ingest.inbox import Inbox
from kvindex.ingest.sequencer import RECENT_DIGESTS
from kvindex.sequence import Position, StreamRef

if TYPE_CHECKING:  # annotations only: a stream's state is the vocabulary's
    from kvindex.config import Config, EngineConfig
    from kvindex.metrics import Metrics
    from kvindex.types import Applied

log = logging.getLogger("kvindex.ingest.lane")  # every line about a lane under the lane's name
MAX_TOPICS = 1024  # streams per publisher; more is garbage or misconfiguration
PENDING_BATCHES = 256  # applied batches a stream's counters keep before summing them (``StreamCounters``)


class StreamCounters:
    """A stream's labelled metric children, resolved once. The hot path only keeps each batch's
    ``Applied`` (``add``: one list append) and sets ``lag_seconds``; ``flush`` sums them into the
    children, before every scrape and at the latest every ``PENDING_BATCHES`` batches (a Prometheus
    child's ``inc`` takes a lock: four of them per batch cost ~15% of ingest; eight plain adds per
    batch cost ~1 µs more than keeping the value for later)."""

    def __init__(self, m: Metrics, pod: str) -> None:
        self._children = (m.events_applied.labels(pod, "BlockStored"), m.events_applied.labels(pod, "BlockRemoved"),
                          m.events_applied.labels(pod, "AllBlocksCleared"), m.blocks_stored.labels(pod),
                          m.blocks_removed.labels(pod), m.orphan_blocks.labels(pod), m.unknown_removals.labels(pod),
                          m.blocks_reannounced.labels(pod))
        self._pending: list[Applied] = []
        self._sums = [0] * len(self._children)
        self.lag = m.lag_seconds.labels(pod)
        self.lag_seconds: float | None = None  # behind at the last batch applied, not yet in ``lag``
        self.duplicate = m.batches_skipped.labels(pod, "duplicate")
        self.stale = m.batches_skipped.labels(pod, "stale")
        self.dropped = m.batches_skipped.labels(pod, "dropped")

    def add(self, done: Applied) -> None:
        pending = self._pending
        pending.append(done)
        if len(pending) >= PENDING_BATCHES:
            self._sum()

    def _sum(self) -> None:
        p = self._sums
        for done in self._pending:
            p[0] += done.stored_events
            p[1] += done.removed_events
            p[2] += done.cleared
            p[3] += done.stored
            p[4] += done.removed
            p[5] += done.orphans
            p[6] += done.unknown_removals
            p[7] += done.reannounced
        self._pending = []

    def flush(self) -> None:
        self._sum()
        for child, n in zip(self._children, self._sums):
            if n:
                child.inc(n)
        self._sums = [0] * len(self._children)
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
    last_event: float | None = None  # time.monotonic() of the last batch received (/v1/pods' age)
    ranks: set[int] = field(default_factory=set)  # dp ranks this stream's batches carried
    replayed: dict[int, int] = field(default_factory=dict)  # seq -> payload digest of batches a replay applied
                                                             # ahead of the live socket
    stored: Position | None = None  # the stream's position as the store last answered
    seeded: bool = False  # the stored position has been read since the stream appeared
    force: str | None = None  # the next batch applies across a gap with this reason (history gone)
    needs_resync: str | None = None  # why the stream must be resynchronised before it applies again
    held: int = 0  # batches of this stream waiting in the lane's buffer
    model_told: bool = False  # its model told to on_lora as a base model (kvindex.ingest.writer, once)
    stale_run: int = 0  # STALE batches in a row (replay checks of their engine life are spaced)
    last_digest: int | None = None  # payload digest of the batch at last_seq (saved with it: the engine's life)
    recent: dict[int, int] = field(default_factory=dict)  # seq -> payload digest, the last RECENT_DIGESTS
                                                           # batches of this life (duplicates)
    life_check: tuple[int | None, int | None, float, bool | None] | None = None  # (last_seq, last_digest,
    # when, the replay's answer) of the last check of the watermark's engine life (``recheck_life``)

    @property
    def baseline_unknown(self) -> bool:
        return self.stored is None or self.stored.last_seq is None

    def handled(self, seq: int, digest: int) -> None:
        """Batch ``seq`` (payload digest ``digest``) of the engine's current life was applied or judged
        a duplicate: remembered, the oldest forgotten past ``RECENT_DIGESTS``."""
        self.last_digest = digest
        recent = self.recent
        recent[seq] = digest
        if len(recent) > RECENT_DIGESTS:
            del recent[next(iter(recent))]

    def sorted_ranks(self) -> list[int] | None:
        """The ranks a restart of the stream clears (None: all of them)."""
        return sorted(self.ranks) or None

    def observe(self, pos: Position) -> None:
        """Mirror the store's answer (for logs, snapshots and the hot path's baseline check)."""
        self.stored = pos
        if self.needs_resync is not None:
            return
        if pos.synced and not self.synced:
            log.info("pod %s: synced again", self.pod)
        self.synced, self.unsynced_reason = pos.synced, pos.reason

    def reset(self, pos: Position, expect_from: int | None) -> None:
        """The stream starts over at the store's ``pos`` (after a restart or a clear)."""
        self.epoch = pos.epoch
        self.last_seq = None
        self.expect_from = expect_from
        self.replayed.clear()
        self.recent.clear()
        self.last_digest = None
        self.life_check = None
        self.force = None
        self.observe(pos)

    def mark_synced(self, why: str) -> None:
        if not self.synced:
            log.info("pod %s: synced again (%s)", self.pod, why)
        self.synced = True
        self.unsynced_reason = None

    def restore(self, saved: dict[str, Any]) -> Position:
        """Seed from a snapshot's or a log replay's saved state; the position it stood at."""
        for name in ("last_seq", "expect_from", "epoch", "synced", "unsynced_reason", "gaps", "replays",
                     "restarts", "batches"):
            if name in saved:
                setattr(self, name, saved[name])
        digest = saved.get("last_digest")  # older snapshots have none (theirs, last_crc, was a CRC-32)
        if type(digest) is int and self.last_seq is not None:
            self.last_digest = digest
            self.recent = {self.last_seq: digest}
        self.seeded = True
        return Position(self.last_seq, self.epoch, self.synced, self.unsynced_reason)


@dataclass(frozen=True, slots=True)
class LaneSettings:
    replay_timeout: float = 2.0  # seconds an engine has to deliver one replay answer
    replay_max_bytes: int = 128 << 20  # bytes one replay answer may hold
    rcvhwm: int = RCVHWM  # messages the SUB socket queues: where a backlog waits (ingest.receiver)
    store_buffer: int = 10_000  # batches a lane keeps while the store is unreachable
    max_blocks_per_pod: int = MAX_BLOCKS_PER_POD
    silent_seconds: float = 10.0  # an engine not connected / silent this long is warned about (ingest.watch)
    receive_buffer_bytes: int = RECEIVE_BUFFER_BYTES  # bytes received and not yet applied, at most (ingest.inbox)
    max_lag_seconds: float = MAX_LAG_SECONDS  # behind by more (kvindex's own clock: ingest.inbox): lagging, unsynced
    max_message_bytes: int | None = None  # ZeroMQ MAXMSGSIZE in force (for the log of a dropped connection)

    @classmethod
    def of(cls, config: Config) -> LaneSettings:
        """A lane's settings from the daemon's configuration."""
        return cls(replay_timeout=config.replay_timeout, rcvhwm=config.receive_queue_messages, store_buffer=config.store_buffer,
                   replay_max_bytes=config.replay_max_bytes, max_blocks_per_pod=config.max_blocks_per_pod,
                   silent_seconds=config.engine_silent_seconds, receive_buffer_bytes=config.receive_buffer_bytes,
                   max_lag_seconds=config.max_lag_seconds, max_message_bytes=config.max_message_bytes)


@dataclass(slots=True)
class LaneState:
    inbox: Inbox = field(default_factory=lambda: Inbox(RECEIVE_BUFFER_BYTES, MAX_LAG_SECONDS))
    connected_peers: int = 0
    frames: int = 0
    streams: dict[str, Stream] = field(default_factory=dict)

    def receiving_problem(self) -> str | None:
        """Why every stream of the lane is unsynced now, whatever the store says (``Inbox.problem``)."""
        return self.inbox.problem()


def split_topic(topic: str) -> tuple[str | None, str | None]:
    """``kv@<pod>@<model>`` (llm-d convention; the pod part may hold ``ip:port``)."""
    parts = topic.split("@")
    if len(parts) == 3 and parts[0] == "kv" and parts[1]:
        return parts[1], parts[2] or None
    return None, None


def new_stream(engine: EngineConfig, topic: str, first_seq: int, metrics: Metrics) -> Stream:
    """The stream of ``topic`` on ``engine``'s publisher: pod and model from the engine's
    configuration, else from the topic; its name in the store the same on every replica (the
    topic and which publisher of the pod: ranks of one pod publish the same topic on endpoints
    of their own)."""
    pod, model = split_topic(topic)
    pod_id = engine.pod or pod or engine.endpoint
    model_id = engine.model or model or "unknown"
    metrics.known(pod_id, model_id)  # an engine's ids are label values (kvindex.metrics.KnownNames)
    name = f"{topic}|dp{engine.dp_rank}" if engine.dp_rank is not None else f"{topic}|{engine.endpoint}"
    st = Stream(topic=topic, pod=pod_id, model=model_id, expect_from=first_seq,
                counters=StreamCounters(metrics, pod_id), ref=StreamRef.of(pod_id, name, model_id))
    log.info("engine %s: new stream topic=%r -> pod %s, model %s", engine.name, topic, st.pod, st.model)
    return st
