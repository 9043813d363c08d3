"""What one process's lanes share to take engine messages in, and the SUB sockets made with it.

Invariants:
- One ``Intake`` per process (the daemon's, a worker's; ``Intake.for_process``): the ZeroMQ
  context every lane's SUB and replay DEALER sockets come from (``transport.ingest_context``),
  the reader of a socket's queued messages, parsed (``kvindex.ingest.libzmq.native_bursts``: native
  where it can be, else ``transport.queued_bursts`` on pyzmq's calls) and the ``BacklogRelease``
  all its subscribers report their bursts to.
- ``Intake(ctx)`` alone (tests) reads through pyzmq and never trims.
- The owner closes it (``close``: a pending trim cancelled, ``ctx`` terminated) after its lanes
  stopped.
"""

from __future__ import annotations

import zmq.asyncio

from kvindex.ingest.backlog import BacklogRelease, trimmer
from kvindex.ingest.libzmq import BurstReader, native_bursts
from kvindex.ingest.transport import MESSAGE_OVERHEAD, Subscriber, ingest_context, parse_message


class Intake:
    def __init__(self, ctx: zmq.asyncio.Context, reader: BurstReader | None = None,
                 backlog: BacklogRelease | None = None) -> None:
        self.ctx = ctx
        self.backlog = backlog or BacklogRelease(None)
        self._reader = reader

    @classmethod
    def for_process(cls, max_message_bytes: int) -> Intake:
        """The process's context (``max_message_bytes`` per message), the native reader if it
        can be used, and memory trimmed after a backlog where glibc can."""
        return cls(ingest_context(max_message_bytes), native_bursts(parse_message, MESSAGE_OVERHEAD),
                   BacklogRelease(trimmer()))

    def close(self) -> None:
        self.backlog.close()
        self.ctx.term()

    def subscriber(self, endpoint: str, *, bind: bool, rcvhwm: int) -> Subscriber:
        return Subscriber(self.ctx, endpoint, bind=bind, rcvhwm=rcvhwm, reader=self._reader, backlog=self.backlog)
