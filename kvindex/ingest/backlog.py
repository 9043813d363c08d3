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
  wake-up awaited), which count as backlog whether it is behind or not. When no subscriber is
  behind any more and at least ``after_bytes`` (``TRIM_AFTER_BYTES``) of backlog were handled
  since the last trim, memory is trimmed once, and logged with the RSS before and after. Steady
  traffic (one message per wake-up) never trims; traffic that queues a little trims once per
  ``after_bytes`` of it, and a trim with little to give back costs microseconds.
- Only where glibc's ``malloc_trim`` exists (``trimmer()``); elsewhere ``handled`` only counts.
- One per process (``ingest.intake``), shared by its subscribers; the event loop's thread only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("kvindex.ingest.transport")

TRIM_AFTER_BYTES = 16 << 20  # backlog handled before a trim: ~10 ms to give back ~100 MB (64 engines)


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

    def __init__(self, trim: Callable[[], object] | None, after_bytes: int = TRIM_AFTER_BYTES) -> None:
        self._trim = trim
        self._after_bytes = after_bytes
        self._behind: set[object] = set()
        self.backlog_bytes = 0  # payload bytes of queued messages handled since the last trim
        self.trims = 0

    def handled(self, source: object, behind: bool, nbytes: int) -> None:
        """A burst of ``source`` handled, ``nbytes`` of its payloads had been queued; ``behind``:
        more are queued still."""
        self.backlog_bytes += nbytes
        if behind:
            self._behind.add(source)
            return
        self._behind.discard(source)
        if not self._behind and self.backlog_bytes >= self._after_bytes:
            self._release()

    def forget(self, source: object) -> None:
        """The subscriber closed (its lane stopped): it is behind no more."""
        self._behind.discard(source)

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
