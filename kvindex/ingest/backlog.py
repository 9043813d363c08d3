"""After a backlog: the memory its queued messages took goes back to the operating system.

While ingest runs behind its engines (a start against full replay buffers, a burst of restarts,
a stall), ZeroMQ queues their messages in this process: hundreds of MB of batches, allocated by
libzmq's I/O thread. Once applied they are freed, but glibc keeps freed memory mapped (in that
thread's arena), so the process's RSS stays at the backlog's peak: what a Kubernetes memory limit
sees. ``BacklogRelease`` calls glibc's ``malloc_trim(0)`` when the process has caught up after one.

Invariants:
- Each subscriber (``transport.Subscriber``) reports every burst once its lane handled it
  (``handled``): whether it is still behind (more messages were already queued after the burst),
  and the payload bytes of the burst's messages that had waited in ZeroMQ's queue (all but one a
  wake-up awaited), which count as backlog whether it is behind or not.
- The backlog is over when no subscriber is behind and no message was found queued for
  ``quiet_seconds`` (``QUIET_SECONDS``): hundreds of lanes under a burst each catch up often, yet
  their messages go on queueing. Then, if at least ``after_bytes`` (``TRIM_AFTER_BYTES``) of
  backlog were handled since the last trim, memory is trimmed once, and logged with the RSS before
  and after. Traffic that never queues never trims; traffic that queues a little trims once per
  ``after_bytes`` of it, and a trim with little to give back costs microseconds.
- At most one timer is pending (armed on the event loop when a subscriber catches up past
  ``after_bytes``; it re-arms itself while messages still queue); ``close`` cancels it.
- Only where glibc's ``malloc_trim`` exists (``trimmer()``); elsewhere ``handled`` only counts.
- One per process (``ingest.intake``), shared by its subscribers; the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("kvindex.ingest.transport")

TRIM_AFTER_BYTES = 16 << 20  # backlog handled before a trim: ~10 ms to give back ~100 MB (64 engines)
QUIET_SECONDS = 0.05  # no message found queued for this long, no subscriber behind: the backlog is over


def trimmer() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return lambda: trim(0)


def rss_mb() -> float | None:
    """This process's resident set size in MB (None without ``/proc``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class BacklogRelease:
    """Which subscribers are behind, and the backlog handled since the last trim."""

    def __init__(self, trim: Callable[[], object] | None, after_bytes: int = TRIM_AFTER_BYTES,
                 quiet_seconds: float = QUIET_SECONDS) -> None:
        self._trim = trim
        self._after_bytes = after_bytes
        self._quiet = quiet_seconds
        self._behind: set[object] = set()
        self._last_queued = 0.0  # time.monotonic() of the last burst that found messages queued
        self._timer: asyncio.TimerHandle | None = None
        self.backlog_bytes = 0  # payload bytes of queued messages handled since the last trim
        self.trims = 0

    def handled(self, source: object, behind: bool, nbytes: int) -> None:
        """A burst of ``source`` handled, ``nbytes`` of its payloads had been queued; ``behind``:
        more are queued still."""
        if nbytes:
            self.backlog_bytes += nbytes
            self._last_queued = time.monotonic()
        if behind:
            self._behind.add(source)
            return
        self._behind.discard(source)
        if self._timer is None and not self._behind and self.backlog_bytes >= self._after_bytes:
            self._timer = asyncio.get_running_loop().call_later(self._quiet, self._when_quiet)

    def forget(self, source: object) -> None:
        """The subscriber closed (its lane stopped): it is behind no more."""
        self._behind.discard(source)

    def close(self) -> None:
        """Cancels a pending trim (the process is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _when_quiet(self) -> None:
        self._timer = None
        if self._behind:
            return  # behind again: its catch-up arms the timer anew
        if (wait := self._last_queued + self._quiet - time.monotonic()) > 0:  # still queueing
            self._timer = asyncio.get_running_loop().call_later(wait, self._when_quiet)
            return
        self._release()

    def _release(self) -> None:
        backlog, self.backlog_bytes = self.backlog_bytes, 0
        if self._trim is None:
            return
        before = rss_mb()
        self._trim()
        self.trims += 1
        after = rss_mb()
        log.info("caught up after a backlog of %.0f MB of engine batches: freed memory returned to the OS "
                 "(RSS %s MB -> %s MB)", backlog / (1 << 20), f"{before:.0f}" if before else "?",
                 f"{after:.0f}" if after else "?")
