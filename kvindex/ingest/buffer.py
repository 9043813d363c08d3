"""The store-outage buffer of a lane: the batches held while the store is unreachable, the
streams that owe a resync, and the retry loop that applies them once it answers.

Invariants:
- Batches are held in arrival order, at most ``bound`` of them (``--store-buffer``); the gauge
  ``kvindex_store_buffered_batches`` counts what is held. A batch of a stream that owes a resync
  is not held but counted ``dropped`` (the resync replays the engine's history, that batch
  included).
- Past the bound the buffer is dropped (each batch counted ``dropped``) and every stream of the
  lane owes a resync (``store_unavailable``); ``lost`` (the store lost its state) does the same
  with ``store_lost``. A stream owing a resync reads unsynced with that reason until it is done.
- One retry task per lane at most; it takes the lane's lock for each attempt (so it never runs
  beside a live batch), retries with capped doubling backoff (``RETRY_FIRST`` .. ``RETRY_CAP``)
  and ends when an attempt (the lane's ``drain_once``) completes.
- ``behind(model)`` is false at the cost of two truth tests while nothing is held or owed (it is
  asked on every query).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from kvindex.events import EventBatch
from kvindex.index.protocol import StoreUnavailable
from kvindex.ingest.streams import Stream
from kvindex.metrics import Metrics

log = logging.getLogger("kvindex.ingest.lane")  # every line about a lane under the lane's name
RETRY_FIRST, RETRY_CAP = 0.05, 2.0  # seconds between attempts to reach the store (doubling)

Held = tuple[Stream, int, EventBatch, bytes]  # stream, seq, decoded batch, payload


class StoreBuffer:
    """What one lane holds for the store. ``held`` is read on the hot path (empty: nothing waits)."""

    def __init__(self, engine: str, streams: dict[str, Stream], bound: int, metrics: Metrics, lock: asyncio.Lock,
                 drain_once: Callable[[], Awaitable[None]]) -> None:
        self.held: deque[Held] = deque()
        self.resyncs_due = 0  # streams whose needs_resync is set
        self._engine = engine
        self._streams = streams
        self._bound = bound
        self._metrics = metrics
        self._lock = lock
        self._drain_once = drain_once  # one attempt: resync what is owed, apply what is held
        self._drainer: asyncio.Task[None] | None = None

    def behind(self, model: str) -> bool:
        """Whether a stream of ``model`` waits for the store (buffered batches or a resync due)."""
        if not self.held and not self.resyncs_due:  # the common case, checked on every query
            return False
        return any(st.model == model and (st.held or st.needs_resync is not None) for st in self._streams.values())

    def hold(self, st: Stream, seq: int, batch: EventBatch, payload: bytes, name: str) -> None:
        """Keep a batch the store could not take (or that must wait behind others); retry."""
        if st.needs_resync is not None:
            st.counters.dropped.inc()  # its resync replays the engine's history, this batch included
        elif len(self.held) >= self._bound:
            self._overflow()
            st.counters.dropped.inc()
        else:
            self.held.append((st, seq, batch, payload))
            st.held += 1
            self._metrics.store_buffered.inc()
        self.start(name)

    def _overflow(self) -> None:
        log.error("engine %s: %d batches wait for the store, the bound (--store-buffer): dropping them; its "
                  "streams are UNSYNCED (store_unavailable) until the store answers and they are replayed",
                  self._engine, len(self.held))
        self.drop()
        for st in self._streams.values():
            self.needs_resync(st, "store_unavailable")

    def drop(self) -> None:
        for st, *_ in self.held:
            st.held -= 1
            st.counters.dropped.inc()
        self._metrics.store_buffered.dec(len(self.held))
        self.held.clear()

    def lost(self, name: str) -> None:
        """The store lost its state: every stream resynchronises once the store answers."""
        self.drop()
        for st in self._streams.values():
            self.needs_resync(st, "store_lost")
        if self._streams:
            self.start(name)

    def needs_resync(self, st: Stream, why: str) -> None:
        if st.needs_resync is None:
            st.needs_resync = why
            st.synced, st.unsynced_reason = False, why
            self.resyncs_due += 1

    def resync_done(self, st: Stream) -> None:
        if st.needs_resync is not None:
            st.needs_resync = None
            self.resyncs_due -= 1

    def first(self) -> Held | None:
        return self.held[0] if self.held else None

    def done(self, item: Held) -> None:
        """``item`` (the first) was applied or dropped by its resync; a loss meanwhile may have
        dropped the buffer, and then there is nothing to take off."""
        if self.held and self.held[0] is item:
            self.held.popleft()
            item[0].held -= 1
            self._metrics.store_buffered.dec()

    # -- the retry task ------------------------------------------------------------------------
    def start(self, name: str) -> None:
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name=f"store retry {name}")

    def stop(self) -> asyncio.Task[None] | None:
        """Cancel the retry task; it is returned for the caller to await."""
        drainer, self._drainer = self._drainer, None
        if drainer is not None:
            drainer.cancel()
        return drainer

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
                    log.exception("engine %s: applying the buffered batches failed; retrying", self._engine)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_CAP)
