"""A lane's receiver: reads its engine's SUB socket into the lane's inbox, and re-dials when
libzmq has given the connection up.

Invariants:
- A burst the inbox drops is counted (``DropLog``) and logged without flooding.
- One receiver per lane, one task (the lane owns it, cancels and awaits it). It reads a burst off
  the socket into the ``Inbox``, then waits until the lane has taken it (``Inbox.taken``) before
  it reads the next: kvindex reads no faster than it applies, so a backlog waits in ZeroMQ's own
  queues (the SUB's receive high-water mark, ``rcvhwm``, then the engine's PUB), never in
  kvindex's heap; a publisher that drops past its own mark shows as a seq gap the lane replays, or
  reports unsynced. It tells the inbox whether each burst was a full read (``Inbox.reading``: the
  socket had more queued), which is how long kvindex is behind its engine, and that it has caught
  up whenever the socket is found empty (``Inbox.caught_up``: a last read of exactly ``DRAIN_BURST``
  messages before the engine goes quiet leaves no lag behind).
- Its socket's monitor (``Subscriber.watch_peers``) feeds ``on_peers`` (the lane's connection
  watch: peer counts, logs). A plain disconnect is the engine's to mend (libzmq re-dials; the lane
  shows it as not connected, and the next batch's seq shows a gap, as ever).
- When libzmq abandons a connecting socket (a message over ``max_message_bytes``: a protocol
  error, never re-dialled), the receiver says so in the log, drops the socket and opens a new
  one after ``REDIAL_SECONDS``; the batch that was too big is the seq gap the lane then fills
  from the engine's replay, or marks unsynced. A socket that cannot be opened again fails the
  lane (``Inbox.fail``), as a socket that cannot be opened at start does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvindex.ingest.inbox import Inbox
from kvindex.ingest.transport import Subscriber
from kvindex.logs import BurstLog

log = logging.getLogger("kvindex.ingest.lane")  # every line about a lane under the lane's name
REDIAL_SECONDS = 0.1


@dataclass(frozen=True, slots=True)
class DropLog:
    """Where batches the inbox dropped are counted (``kvindex_receive_dropped_batches_total{engine}``)
    and said (once per burst of log lines)."""

    counter: Any  # the engine's child of Metrics.receive_dropped
    burst: BurstLog


class Receiver:
    """``on_peers`` hears each new peer count (the lane's ``ConnectionWatch.peers``); ``name`` is the
    engine's, for the log."""

    def __init__(self, open_socket: Callable[[], Subscriber], inbox: Inbox, on_peers: Callable[[int], None],
                 name: str, max_message_bytes: int | None = None, dropped: DropLog | None = None) -> None:
        self._open = open_socket
        self._inbox = inbox
        self._on_peers = on_peers
        self._name = name
        self._max_message_bytes = max_message_bytes
        self._peers = 0
        self._dropped = dropped
        self.redials = 0

    def open(self) -> Subscriber:
        return self._open()

    async def run(self, sub: Subscriber) -> None:
        """Read ``sub`` (opened by the lane, so that its errors are the lane's), then each socket
        opened after an abandoned one; until cancelled."""
        try:
            while True:
                await self._read(sub)
                sub.close()
                self.redials += 1
                self._inbox.lost("connection_dropped")  # the batch that was too big, at least
                endpoint = sub.endpoint
                self._peer_count(0)
                log.warning("engine %s: ZeroMQ dropped the connection to %s and will not re-dial it (a message "
                            "over max_message_bytes%s, or another protocol error): opening a new connection; its "
                            "pods are unsynced until the engine's replay closes the gap", self._name, endpoint,
                            f" = {self._max_message_bytes}" if self._max_message_bytes else "")
                await asyncio.sleep(REDIAL_SECONDS)
                sub = self._open()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._inbox.fail(exc)
            raise
        finally:
            sub.close()

    async def _read(self, sub: Subscriber) -> None:
        """Until the socket's connection is abandoned: its bursts into the inbox, its peers to the watch."""
        reading = asyncio.create_task(self._fill(sub), name=f"receive {sub.endpoint}")
        try:
            await sub.watch_peers(self._peer_count)
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    async def _fill(self, sub: Subscriber) -> None:
        inbox = self._inbox
        async for burst in sub.bursts(drained=inbox.caught_up):
            inbox.reading(sub.burst_full)
            if not inbox.put(burst, sub.burst_bytes) and self._dropped is not None:
                self._dropped.counter.inc(len(burst))
                self._dropped.burst.warning((self._name, "receive_buffer_full"), "engine %s: batches dropped: more "
                                            "than %d bytes received and not yet applied (receive_buffer_bytes); the "
                                            "gap is replayed from the engine once kvindex has caught up",
                                            self._name, inbox.max_bytes)
            await inbox.taken()  # the next burst stays in ZeroMQ's queue until the lane has taken this one

    def _peer_count(self, n: int) -> None:
        if n != self._peers:
            self._peers = n
            self._on_peers(n)
