"""A recorder: a SUB socket writing every message it receives to a capture file (``kvindex record``).

Invariants:
- ``Recorder.run()`` returns after ``max_messages`` messages or ``duration`` seconds (whichever
  first); cancellation propagates, and every message received before it is already on disk
  (``CaptureWriter`` flushes per line).
- Its socket is closed with linger 0; a context it created is terminated by ``close()``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import zmq
import zmq.asyncio

from kvindex.tools.capture import CaptureWriter
from kvindex.tools.fake_engine import attach

log = logging.getLogger("kvindex.tools.recorder")


class Recorder:
    """A SUB socket subscribed to every topic that writes each message to a ``CaptureWriter``.

    Invariant: ``run()`` returns after ``max_messages`` messages or ``duration`` seconds (whichever
    first; None = no limit); cancellation propagates, and every message received before it is
    already on disk.
    """

    def __init__(
        self,
        endpoint: str,
        writer: CaptureWriter,
        *,
        bind: bool = False,
        max_messages: int | None = None,
        duration: float | None = None,
        rcvhwm: int = 100_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._writer = writer
        self._bind = bind
        self._max = max_messages
        self._duration = duration
        self._rcvhwm = rcvhwm
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._closed = False
        self.count = 0

    def start(self) -> None:
        """Open, subscribe, bind/connect the SUB socket; ``endpoint`` becomes the resolved one."""
        if self._sub is not None or self._closed:
            raise RuntimeError("Recorder.start() called twice or after close()")
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.endpoint = attach(self._sub, self.endpoint, self._bind)

    async def _loop(self) -> None:
        """Receive and write until ``max_messages`` is reached."""
        sub = self._sub
        assert sub is not None
        while self._max is None or self.count < self._max:
            frames = await sub.recv_multipart()
            self._writer.write(frames)
            self.count += 1

    async def run(self) -> int:
        """Record until a limit is reached (see class docstring); return messages recorded."""
        if self._sub is None:
            self.start()
        try:
            async with asyncio.timeout(self._duration):
                await self._loop()
        except TimeoutError:
            pass
        return self.count

    def close(self) -> None:
        """Close the socket with linger 0 and terminate an owned context (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._sub is not None:
            self._sub.close(linger=0)
        if self._own_ctx:
            self._ctx.term()


async def record_main(
    endpoint: str,
    out: Path,
    *,
    bind: bool,
    duration: float | None,
    max_messages: int | None,
) -> int:
    """Body of ``kvindex record ENDPOINT -o FILE``: record until a limit or cancellation; exit code.

    Returns 0 after a limit is reached, 1 if the socket cannot be opened. Cancellation (Ctrl-C)
    propagates after logging the count; the file is complete up to the last message received.
    """
    try:
        writer = CaptureWriter(out)
    except OSError as exc:
        log.error("cannot write %s: %s", out, exc)
        return 1
    with writer:
        recorder = Recorder(
            endpoint, writer, bind=bind, max_messages=max_messages, duration=duration
        )
        try:
            recorder.start()
            mode = "bind" if bind else "connect"
            log.info("recording %s (%s) to %s", recorder.endpoint, mode, out)
            await recorder.run()
        except zmq.ZMQError as exc:
            log.error("cannot %s %s: %s", "bind" if bind else "connect", endpoint, exc)
            return 1
        finally:
            recorder.close()
            log.info("recorded %d messages to %s", recorder.count, out)
    return 0
