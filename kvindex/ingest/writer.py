"""A lane's side of the precise store: decode a payload, offer one batch to the store, restart or
clear a stream, and count what each did.

Invariants:
- One store call per method (``apply``, ``restart``, ``restart_unseen``, ``clear``); the stream's
  local state moves only after the store answered, from its answer (``Stream.observe``), so a
  re-run after ``StoreUnavailable`` is safe.
- An APPLIED batch adds its rank to the stream, moves ``last_seq``, is counted (events, blocks,
  lag: from ``received``, kvindex's own receive time) and goes to ``journal`` when set; DUPLICATE and STALE are counted skipped, and a
  DUPLICATE moves ``last_seq`` (another replica applied it: this one has handled it).
- An engine restart (``restart``, ``restart_unseen``) is a new process: the decoder forgets what it
  learned of the previous one (``Decoder.new_life``: a hybrid model's prefix group).
- A pod over ``--max-blocks-per-pod`` has its stores refused and its streams unsynced
  (``kvindex.ingest.capacity``).
- Garbage (``decode`` failing, a skipped event or field, a block size mismatch) is counted by
  reason in ``kvindex_decode_errors_total`` and logged at most once per burst.
- ``on_lora`` (set by the daemon: ``kvindex.lora.LoraAdapters.learn_from_events``) hears the
  ``lora_name``s of an APPLIED or DUPLICATE batch's BlockStored events (a replica sharing a Redis
  store whose peers applied every batch still learns) with the stream's pod and model: a
  ``lora_name`` on a stream of model M is an adapter of M. It hears a stream's first such batch
  even without ``lora_name``s (once per stream, not per batch): the stream's model is a base model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import msgspec

from kvindex.config import MAX_BLOCKS_PER_POD, EngineConfig
from kvindex.events import GPU, NON_PREFIX_GROUP, BlockStored, DecodeError, Decoder, EventBatch, Frame
from kvindex.index.lookahead import LookaheadBook
from kvindex.index.protocol import ApplyResult, PreciseStore
from kvindex.ingest import sequencer as seqr
from kvindex.ingest.sequencer import payload_digest
from kvindex.ingest.capacity import OVER_CAPACITY, PodCapacity
from kvindex.ingest.streams import Stream, new_stream
from kvindex.logs import BurstLog
from kvindex.metrics import Metrics
from kvindex.sequence import Outcome, Position
from kvindex.types import Applied
from kvindex.views import Journal

log = logging.getLogger("kvindex.ingest.lane")  # every line about a lane under the lane's name
# enum members as module globals for the per-batch path (a lookup through the class costs ~150 ns on 3.11)
APPLIED, DUPLICATE, STALE = Outcome.APPLIED, Outcome.DUPLICATE, Outcome.STALE


def _plain(events: Sequence[object]) -> bool:
    """No BlockStored of the batch names a ``lora_name`` or carries ``lookahead_token_ids``: then
    ``_heard`` hears nothing new of a stream it told already and ``LookaheadBook.apply`` changes
    nothing for a worker not in lookahead mode."""
    for ev in events:
        if type(ev) is BlockStored and (ev.lora_name is not None or ev.lookahead_token_ids is not None):
            return False
    return True


class StreamWriter:
    """One lane's store calls and their counting; ``streams`` is the lane's table of streams."""

    def __init__(self, engine: EngineConfig, streams: dict[str, Stream], *, decoder: Decoder, first_seq: int,
                 store: PreciseStore, metrics: Metrics, burst: BurstLog, max_blocks_per_pod: int = MAX_BLOCKS_PER_POD) -> None:
        self._engine = engine
        self._streams = streams
        self._decoder = decoder
        self._first_seq = first_seq
        self._store = store
        self._metrics = metrics
        self._burst = burst
        self.key = engine.name  # the lane's key in the fleet (the journal's records name it)
        self._capacity = PodCapacity(max_blocks_per_pod, store, metrics)
        self.journal: Journal | None = None
        self.on_lora: Callable[[str, str, Iterable[str]], None] | None = None  # (pod, model, lora names)
        self.received = time.monotonic()  # when the burst being applied was read off the socket (the lane sets it)
        self.lookahead = LookaheadBook()  # the daemon hands every lane its query service's book
        self._waiting: dict[str, str] = {}  # topic -> the reason its stream was marked unsynced while waiting

    def stream(self, topic: str) -> Stream:
        st = self._streams.get(topic)
        if st is None:
            st = self._streams[topic] = new_stream(self._engine, topic, self._first_seq, self._metrics)
        return st

    def decode_again(self, st: Stream, seq: int, batch: EventBatch, payload: bytes) -> EventBatch:
        """The batch that showed an engine restart, decoded before it, decoded in the new life
        (``restart`` and ``restart_unseen`` make the decoder forget the previous process)."""
        return self.decode(st.pod, Frame(st.topic, seq, payload)) or batch

    def new_life_evidence(self, batch: EventBatch, payload: bytes) -> bool:
        """Whether a batch whose seq went back carries a usable event, as the new life it may be of
        would decode it (what the old life learned may skip all of it: a hybrid model's prefix group)."""
        if batch.events or NON_PREFIX_GROUP not in batch.skipped:
            return bool(batch.events)
        try:
            return bool(self._decoder.decode_as_new_life(payload).events)
        except DecodeError:
            return False

    def decode(self, label: str, frame: Frame) -> EventBatch | None:
        try:
            return self._decoder.decode(frame.payload)
        except DecodeError as exc:
            self.reject(label, exc.reason, f"undecodable payload (seq {frame.seq})")
            return None

    def reject(self, pod: str, reason: str, what: str) -> None:
        self._metrics.decode_errors.labels(pod, reason).inc()
        self._burst.warning((pod, reason), "pod %s: %s: %s", pod, what, reason)

    async def apply(self, st: Stream, seq: int, batch: EventBatch, payload: bytes, force: str | None) -> ApplyResult:
        """Offer one batch to the store (one await); count what it did."""
        rank = self._engine.dp_rank
        if rank is None:
            rank = batch.dp_rank
        events = self._capacity.admit(st.pod, batch.events)
        result = await self._store.apply(st.ref, seq, st.epoch, rank, events, force=force)
        outcome = result.outcome
        st.observe(result.position)
        if outcome is APPLIED or outcome is DUPLICATE:
            plain = _plain(events)  # the common batch: one pass tells that neither below has work
            if not plain or not st.model_told:
                self._heard(st, batch)
            if not plain or self.lookahead.watching(st.pod, rank):
                self.lookahead.apply(st.pod, st.model, rank, events)  # held by the store: what engines serve
        if outcome is APPLIED:
            done = result.applied
            st.ranks.add(rank)
            self._applied(st, seq, batch, payload, done)
            if done is not None and done.block_size_mismatch:
                await self._mismatch(st, events, done.block_size_mismatch)
            st.handled(seq, payload_digest(payload))
            cap = self._capacity
            if cap.counted(st.pod, done):
                await cap.recount(st.pod)
            if cap.over(st.pod) and result.position.synced:
                pos = result.position
                pos = Position(pos.last_seq, pos.epoch, False, OVER_CAPACITY)
                await self._store.set_position(st.ref, pos)  # it lacks the blocks refused
                st.observe(pos)
                result = ApplyResult(outcome, pos, result.applied)
        elif outcome is DUPLICATE or outcome is STALE:
            st.skipped += 1
            (st.counters.duplicate if outcome is DUPLICATE else st.counters.stale).inc()
            if outcome is DUPLICATE:
                st.ranks.add(rank)
                st.last_seq = seq
                st.handled(seq, payload_digest(payload))
        return result

    def duplicate(self, st: Stream, seq: int) -> None:
        """A live batch this life delivered already (same seq, same bytes): dropped, counted."""
        st.skipped += 1
        st.counters.duplicate.inc()
        self._burst.warning((st.pod, "duplicate"), "pod %s: seq %d delivered again (a batch of this engine life "
                         "handled already): a duplicate, dropped", st.pod, seq)

    async def mark(self, st: Stream, reason: str | None) -> None:
        """The stream's history is complete (``reason`` None) or not, with the reason, in the store
        (what /v1/pods, /readyz and kvindex_pod_synced report) and here."""
        pos = st.stored or Position(st.last_seq, st.epoch)
        pos = Position(pos.last_seq, pos.epoch, reason is None, reason)
        await self._store.set_position(st.ref, pos)
        st.observe(pos)

    def _applied(self, st: Stream, seq: int, batch: EventBatch, payload: bytes, done: Applied | None) -> None:
        if batch.skipped:
            self._skipped(st.pod, batch.skipped)
        if done is not None:
            st.counters.add(done)
            if done.tier_unkeyed:  # lower-tier copies of hashes held keyed nowhere: never matched
                self._metrics.decode_errors.labels(st.pod, "tier_unkeyed").inc(done.tier_unkeyed)
                self._burst.warning((st.pod, "tier_unkeyed"), "pod %s: %d lower-tier block cop(ies) of hashes the pod "
                                    "holds on no device: kept without identity, never matched: tier_unkeyed",
                                    st.pod, done.tier_unkeyed)
        st.last_seq = seq
        st.batches += 1
        st.last_applied = time.time()
        st.counters.lag_seconds = max(0.0, time.monotonic() - self.received)  # kvindex's clock, not the engine's ts
        if self.journal is not None:
            self.journal.batch(self.key, st.topic, seq, payload)

    def _heard(self, st: Stream, batch: EventBatch) -> None:
        """The ``lora_name``s of the batch's stores, to ``on_lora``; the stream's first batch told even
        without any (its model is then known as a base model)."""
        if self.on_lora is not None:
            names = {ev.lora_name for ev in batch.events if type(ev) is BlockStored and ev.lora_name is not None}
            if names or not st.model_told:
                st.model_told = True
                self.on_lora(st.pod, st.model, names)

    def _skipped(self, pod: str, reasons: tuple[str, ...]) -> None:
        """Events the decoder skipped: those of a non-prefix group are counted (no error, no log
        line: a hybrid model sends them in every batch), every other reason is rejected."""
        if n := reasons.count(NON_PREFIX_GROUP):
            self._metrics.events_skipped.labels(pod, NON_PREFIX_GROUP).inc(n)
        for reason in reasons:
            if reason != NON_PREFIX_GROUP:
                self.reject(pod, reason, "skipped an event or field")

    async def _mismatch(self, st: Stream, events: Sequence[object], n: int) -> None:
        """BlockStored events whose block size is not the model's: counted, and a warning naming both."""
        model_size = await self._store.block_size(st.model)
        sizes = sorted({ev.block_size for ev in events  # (lower tiers' stores carry no size of their own)
                        if isinstance(ev, BlockStored) and ev.medium == GPU and ev.block_size != model_size})
        self._metrics.decode_errors.labels(st.pod, "block_size_mismatch").inc()
        self._burst.warning((st.pod, "block_size_mismatch"), "pod %s: %d BlockStored event(s) with block size %s, "
                            "but model %s's block size is %s: their blocks are held as orphans (no prompt matches them) "
                            "(set the engine's block_size or [models.\"%s\"] block_size to what the engine runs "
                            "with): block_size_mismatch", st.pod, n, "/".join(map(str, sizes)) or "?", st.model,
                            model_size, st.model)

    async def seed(self, st: Stream) -> Position | None:
        """The stream's stored position (and the model's block size into the store first)."""
        if self._engine.block_size:
            await self._store.set_block_size(st.model, self._engine.block_size)
        return await self._store.position(st.ref)

    async def restart(self, st: Stream, seq: int) -> None:
        """Seq went back to ``seq``: the engine restarted; the store clears the stream's ranks once
        (whichever replica comes first) and this replica adopts the epoch it answers."""
        pos = await self._store.restart(st.ref, st.epoch, st.sorted_ranks())
        self._capacity.forget(st.pod)  # emptied: its count is read again
        self._decoder.new_life()  # a new engine process: its hybrid prefix group is learned again
        self.lookahead.forget(st.pod, st.sorted_ranks())  # and may hash without lookahead
        st.restarts += 1
        self._metrics.restarts.labels(st.pod).inc()
        if seqr.first_to_clear(pos, st.epoch):
            log.warning("pod %s: seq went back from %d to %d: engine restarted, clearing its blocks",
                        st.pod, st.last_seq, seq)
        else:
            log.info("pod %s: seq went back from %d to %d: engine restarted (another replica cleared it already)",
                     st.pod, st.last_seq, seq)
        st.reset(pos, self._first_seq)
        st.mark_synced("engine restarted")

    async def restart_unseen(self, st: Stream, pos: Position,
                             why: str = "the engine's history ends before it") -> Position:
        """The engine restarted while no replica was watching: the store holds its earlier life."""
        log.warning("pod %s: the store is at seq %s but %s: the engine restarted while no replica watched; "
                    "clearing its blocks", st.pod, pos.last_seq, why)
        st.restarts += 1
        self._metrics.restarts.labels(st.pod).inc()
        ranks = None if self._engine.dp_rank is None else [self._engine.dp_rank]  # a rank's own publisher: its rank
        after = await self._store.restart(st.ref, pos.epoch, ranks)
        self._capacity.forget(st.pod)
        self._decoder.new_life()
        self.lookahead.forget(st.pod, ranks)
        st.expect_from = self._first_seq
        return after

    async def waiting(self, st: Stream, reason: str | None, waiting: bool = True) -> None:
        """The stream's replay waits (``waiting``: shown unsynced with ``reason``, if it was synced)
        or no longer does, with its outcome (``reason`` None: it recovered, synced again; else
        unsynced with that reason), if the stream is still unsynced for the wait alone."""
        pos = await self._store.position(st.ref) or Position()
        if waiting:
            if not pos.synced:
                return
            assert reason is not None
            self._waiting[st.topic] = reason
            pos = msgspec.structs.replace(pos, synced=False, reason=reason)
        else:
            marked = self._waiting.pop(st.topic, None)
            if marked is None or pos.synced or pos.reason != marked:
                return
            pos = msgspec.structs.replace(pos, synced=reason is None, reason=reason)
        await self._store.set_position(st.ref, pos)
        st.observe(pos)

    async def clear(self, st: Stream, seen_epoch: int, expect_from: int | None) -> Position:
        """Clear the stream in the store (once, whichever replica comes first); it starts over."""
        pos = await self._store.restart(st.ref, seen_epoch, st.sorted_ranks())
        self._capacity.forget(st.pod)
        st.reset(pos, expect_from)
        return pos

    def skip_stale(self, st: Stream, seq: int) -> ApplyResult:
        """A batch of an engine life that has ended (the engine's history ends before it): skipped,
        and it does not move this replica's seq (its own restart is still to come)."""
        st.skipped += 1
        st.counters.stale.inc()
        self._burst.warning((st.pod, "ended_life"), "pod %s: seq %d is of an engine life that has ended (another "
                            "replica applied the restart): skipped", st.pod, seq)
        return ApplyResult(Outcome.STALE, st.stored or Position(epoch=st.epoch))
