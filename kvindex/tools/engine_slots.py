"""A simulated engine's run slots: at most ``max_running`` requests run at once, the rest wait in
FIFO order (their number is what the engine reports as ``vllm:num_requests_waiting``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class Slots:
    """``max_running`` run slots granted in FIFO order; ``paused`` grants none.

    Invariants: ``running <= max_running``; every future in the queue is pending; a granted
    future resolves True (the slot is the waiter's, already counted in ``running``), a refused
    one False; a waiter cancelled after its grant passes the slot on."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self.running = 0
        self.paused = False
        self.closed = False
        self._queue: deque[asyncio.Future[bool]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def _free(self) -> bool:
        return not self.paused and self.running < self.max_running

    async def acquire(self) -> bool:
        """Wait for a slot; False if the engine closed first."""
        if self.closed:
            return False
        if self._free() and not self._queue:
            self.running += 1
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            self._abandon(fut)
            raise

    def _abandon(self, fut: asyncio.Future[bool]) -> None:
        """A waiter was cancelled: pass on a slot it was granted, or leave the queue."""
        if fut.done() and not fut.cancelled():
            if fut.result():
                self.release()
        else:
            with contextlib.suppress(ValueError):
                self._queue.remove(fut)

    def release(self) -> None:
        self.running -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self._queue and self._free():
            self.running += 1
            self._queue.popleft().set_result(True)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._dispatch()

    def close(self) -> None:
        """Refuse every queued waiter and any later one."""
        self.closed = True
        while self._queue:
            self._queue.popleft().set_result(False)
