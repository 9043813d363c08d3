"""What one process's lanes share to take engine messages in, and the SUB sockets made with it.

Invariants:
- One ``Intake`` per process (the daemon's, a worker's; ``Intake.for_process``): the ZeroMQ
  context every lane's SUB and replay DEALER sockets come from (``transport.ingest_context``),
  the reader of a socket's queued messages (``kvindex.ingest.libzmq``: native where it can be,
  else pyzmq's calls) and the ``BacklogRelease`` all its subscribers report their bursts to.
- ``Intake(ctx)`` alone (tests) reads through pyzmq and never trims.
- The owner closes it (``close``: a pending trim cancelled, ``ctx`` terminated) after its lanes
  stopped.
"""

from __future__ import annotations

import zmq.asyncio

from kvindex.ingest.backlog import BacklogRelease, trimmer
from kvindex.ingest.libzmq import Reader, native_queued
from kvindex.ingest.transport import Subscriber, ingest_context


class Intake:
    def __init__(self, ctx: zmq.asyncio.Context, reader: Reader | None = None,
                 backlog: BacklogRelease | None = None) -> None:
        self.ctx = ctx
        self.backlog = backlog or BacklogRelease(None)
        self._reader = reader

    @classmethod
    def for_process(cls, max_message_bytes: int) -> Intake:
        """The process's context (``max_message_bytes`` per message), the native reader if it
        can be used, and memory trimmed after a backlog where glibc can."""
        return cls(ingest_context(max_message_bytes), native_queued(), BacklogRelease(trimmer()))

    def close(self) -> None:
        self.backlog.close()
        self.ctx.term()

    def subscriber(self, endpoint: str, *, bind: bool, rcvhwm: int) -> Subscriber:
        return Subscriber(self.ctx, endpoint, bind=bind, rcvhwm=rcvhwm, reader=self._reader, backlog=self.backlog)
