"""A lane's inbox: the messages read off its engine's socket and not yet applied, bounded in bytes.

Invariants:
- The receiver (``ingest.receiver``) puts a burst in, then waits (``taken``) until the lane has
  taken every burst put (``get``) before it reads the next one off the socket: kvindex reads no
  faster than it applies, at most one burst waits here beside the one being applied, and a
  backlog stays in ZeroMQ's own queues, bounded by their high-water marks (the SUB socket's
  ``rcvhwm``, then the engine's PUB, which drops past its own: a seq gap the lane sees, replays or
  reports unsynced). It reads on only while the burst being applied holds at most half of
  ``max_bytes``: a burst of big messages is applied before the next is read. The lane takes
  bursts in order, one at a time, and says when it has applied one (``done``). Nothing is
  reordered, so nothing is applied out of order.
- The bytes held (``held_bytes``: as the transport counts them: ``Subscriber.burst_bytes``) never pass
  ``max_bytes`` (with the receiver waiting, only bursts of huge messages come near it): a burst that
  would pass it is dropped whole, and so is every burst after it until
  the lane has drained the inbox to half the budget (one gap per episode, not one per message).
  The dropped batches are a seq gap the lane fills from the engine's replay (or marks unsynced,
  ``history_lost``), exactly as a batch ZeroMQ dropped.
- A *loss* (bursts dropped here, or the connection dropped: ``lost``) makes every stream of the
  lane unsynced (``problem``) from that moment until the lane has applied a burst received after
  it: the seq of that burst shows the gap, and the lane's gap rule (replay, or unsynced with the
  reason) decides from there.
- The lag is measured on kvindex's own clock (``time.monotonic()``), never from the engine's
  ``ts``: the longer of the age of the oldest burst read and not yet applied, and how long the
  socket has had more messages queued at every read (``reading``: from the first full burst
  to the first that was not, or to the socket found empty (``caught_up``), i.e. how long kvindex
  has been behind its engine). Past ``max_lag``
  the lane is *lagging*: its streams say unsynced with the lag, and ``/readyz`` says so, until
  it has caught up.
- A failure of the receiver (the socket could not be opened again) is handed to the lane through
  ``get``, which raises it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any
from time import monotonic

@dataclass(frozen=True, slots=True)
class Burst:
    """Messages read off the socket together (``Frame``, or ``Malformed``), when, and their size."""

    messages: list[Any]
    nbytes: int
    received: float  # time.monotonic() when read
    number: int  # bursts put before it (the inbox's count)


class Inbox:
    def __init__(self, max_bytes: int, max_lag: float) -> None:
        self.max_bytes = max_bytes
        self.max_lag = max_lag
        self.held_bytes = 0
        self.dropped_batches = 0  # in all (the lane's metric reads the increments)
        self.dropped_bytes = 0
        self._bursts: deque[Burst] = deque()
        self._ready = asyncio.Event()
        self._taken = asyncio.Event()  # the receiver's wake-up: set as the lane takes or finishes a burst
        self._taken.set()
        self._behind_since: float | None = None  # the socket had more queued at every read since then
        self._put = 0  # bursts accepted so far
        self._dropping = False
        self._loss: tuple[str, int] | None = None  # (why, the first burst number that can show the gap)
        self._applying: Burst | None = None
        self._failure: BaseException | None = None

    # -- the receiver's side -----------------------------------------------------------------------
    def put(self, messages: list[Any], nbytes: int, received: float | None = None) -> bool:
        """Queue a burst; False when it was dropped (the budget: see the module's invariants)."""
        if self._dropping and self.held_bytes <= self.max_bytes // 2:
            self._dropping = False
        if self._dropping or self.held_bytes + nbytes > self.max_bytes:
            self._dropping = True
            self.dropped_batches += len(messages)
            self.dropped_bytes += nbytes
            self.lost("receive_buffer_full")
            return False
        self._bursts.append(Burst(messages, nbytes, monotonic() if received is None else received, self._put))
        self._put += 1
        self.held_bytes += nbytes
        self._ready.set()
        self._taken.clear()
        return True

    def reading(self, full: bool, now: float | None = None) -> None:
        """A burst was read; ``full``: it was as large as a read takes (the socket may hold more)."""
        if not full:  # fewer than a read takes: the socket is empty now
            self.caught_up()
        elif self._behind_since is None:
            self._behind_since = monotonic() if now is None else now

    def caught_up(self) -> None:
        """The socket was found empty: kvindex is not behind its engine (whatever the last read was)."""
        self._behind_since = None

    async def taken(self) -> None:
        """Until the lane has taken every burst put and holds at most half the budget (the burst it
        applies), or the inbox failed: when the receiver may read on."""
        while self._failure is None and not (self._taken.is_set() and self.held_bytes <= self.max_bytes // 2):
            self._taken.clear()
            await self._taken.wait()

    def lost(self, why: str) -> None:
        """Batches may be missing from here on (dropped here, or with the connection): unsynced until
        a burst received after now is applied."""
        self._loss = (why, self._put)

    def fail(self, exc: BaseException) -> None:
        self._failure = exc
        self._ready.set()
        self._taken.set()

    # -- the lane's side ---------------------------------------------------------------------------
    async def get(self) -> Burst:
        while not self._bursts:
            if self._failure is not None:
                raise self._failure
            self._ready.clear()
            await self._ready.wait()
        burst = self._applying = self._bursts.popleft()
        if not self._bursts:
            self._taken.set()
        return burst

    def done(self, burst: Burst) -> None:
        """``burst`` was applied: its bytes are free, and a loss before it is judged (its seq)."""
        self.held_bytes -= burst.nbytes
        self._applying = None
        if not self._bursts:
            self._taken.set()
        if self._loss is not None and burst.number >= self._loss[1]:
            self._loss = None

    # -- what the pods view reads ------------------------------------------------------------------
    def lag(self, now: float | None = None) -> float:
        """Seconds kvindex is behind: the oldest burst not yet applied has waited, or the socket has had
        more queued at every read (0.0: neither)."""
        now = monotonic() if now is None else now
        oldest = self._applying or (self._bursts[0] if self._bursts else None)
        waited = 0.0 if oldest is None else max(0.0, now - oldest.received)
        return max(waited, 0.0 if self._behind_since is None else now - self._behind_since)

    def problem(self) -> str | None:
        """Why the lane's streams cannot be trusted now (None: nothing here says so)."""
        if self._loss is not None:
            why = self._loss[0]
            if why == "receive_buffer_full":
                return (f"receive_buffer_full: batches dropped past the inbox's {self.max_bytes} bytes; "
                        "the gap is recovered from the engine's replay when the lane catches up")
            return f"{why}: batches may have been lost with the connection; judged at the next batch"
        lag = self.lag()
        if lag > self.max_lag:
            return (f"lagging: {lag:.1f} s behind the engine (its batches wait in ZeroMQ's queues; {self.held_bytes} "
                    "bytes received, not yet applied)")
        return None

