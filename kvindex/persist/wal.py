"""The write-ahead log: what changed the indexes since the last snapshot, in the order it happened.

The format of a segment and how it is read back: ``kvindex.persist.records`` (re-exported here).

Invariants:
- A record is handed to the OS (one ``write``) before the call that logs it returns, so a SIGKILL
  loses nothing logged; the fsync policy decides what survives a power loss: ``always`` (fsync per
  record), ``interval`` (the daemon calls ``sync()`` every second; up to ~1 s lost), ``never``.
- A failed append (disk full, EIO, a record over ``MAX_RECORD``) never raises: the segment is
  truncated back to where the record started (if even that fails, the segment is closed and the
  next append starts a new one), the error is counted (``errors``, ``on_error``) and logged at
  most once per 10 s per kind, and the log is ``degraded`` until a snapshot written after the
  failure covers it (``covered(n)``): the lost record's change is in memory but would not survive
  a restart. The daemon keeps serving.
- A log whose first segment cannot be opened at start (disk full, EIO) does not raise: the failure
  is counted like any other, the daemon starts and serves, and each append retries the open (a
  record that cannot be logged makes the log ``degraded``, as a failed append does).
- Every segment is opened, listed and unlinked through the state dir's descriptor
  (``kvindex.persist.statedir``), never through a symlink: a link at a segment's name is an open
  error, counted and logged like any other.
- Segments only grow; ``rotate()`` starts the next one; a snapshot that covers segments < n lets
  ``drop_before(n)`` delete them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvindex.logs import BurstLog
from kvindex.persist.records import (
    HEAD,
    MAX_RECORD,
    Batch,
    Decision,
    PodRemoved,
    Record,
    RegistrationChange,
    Resync,
    Unknown,
    encode_record,
    read_from,
    read_segment,
    segment_name,
    segment_path,
    segments,
)
from kvindex.persist.statedir import StateDir, as_state_dir
from kvindex.settings import FSYNC_POLICIES

__all__ = ["MAX_RECORD", "Batch", "Decision", "PodRemoved", "Record", "RegistrationChange", "Resync", "Unknown",
           "WriteAheadLog", "encode_record", "fsync_and_close", "read_from", "read_segment", "segment_path", "segments"]

log = logging.getLogger("kvindex.persist.wal")


class WriteAheadLog:
    """Appends records to the current segment of ``directory``. ``on_error(op)`` is called for
    every failure (``append``, ``open``, ``close``) after it was handled, e.g. to count it."""

    def __init__(self, directory: Path | StateDir, *, fsync: str = "interval", segment: int | None = None,
                 on_error: Callable[[str], None] | None = None, burst: BurstLog | None = None) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}")
        self._dir, self._own_dir = as_state_dir(directory)  # a path: opened (and closed) here
        self.directory = self._dir.path
        self.fsync = fsync
        existing = segments(self._dir)
        self.segment = segment if segment is not None else (existing[-1] + 1 if existing else 1)
        self._fd: int | None = None
        self._size = 0  # bytes in the current segment: where the next record starts
        self._dirty = False
        self._closed = False
        self.records = 0  # in the current segment
        self.errors = 0  # failures since the log was opened
        self.lost = 0  # records that could not be appended
        self._lost_in: int | None = None  # first segment a record was lost from since the last snapshot
        self._on_error = on_error
        self._burst = burst if burst is not None else BurstLog(log)
        try:
            self._open()
        except OSError as exc:  # disk full, EIO at start: serve; every append retries the open
            self._failed("open", exc)
            self.segment -= 1  # the next append opens this segment's number again

    @property
    def degraded(self) -> bool:
        """True while a record the indexes applied is missing from the log and no snapshot written
        since covers it: a restart now would lose that change."""
        return self._lost_in is not None

    def covered(self, first: int) -> None:
        """A snapshot now holds everything logged (or lost) in segments < ``first``."""
        if self._lost_in is not None and self._lost_in < first:
            self._lost_in = None

    def _open(self) -> None:
        # O_NOFOLLOW: a symlink at a segment's name is an open error (counted, logged), never followed
        fd = self._dir.file(segment_name(self.segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            self._size = os.lseek(fd, 0, os.SEEK_END)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self.records = 0
        try:
            self._dir.sync()
        except OSError:
            pass

    def _failed(self, op: str, exc: BaseException | str) -> None:
        self.errors += 1
        self._burst.warning(("wal", op, str(self.directory)),
                            "write-ahead log %s: %s failed: %s (kvindex keeps serving; until the next snapshot a "
                            "restart loses what was not logged)", segment_name(self.segment),
                            op, exc)
        if self._on_error is not None:
            try:
                self._on_error(op)
            except Exception:  # a metrics hook must not turn a handled failure into a raised one
                log.exception("write-ahead log error hook failed")

    def append(self, record: Record) -> bool:
        """Log one record; False when it could not be (the failure is handled here, never raised)."""
        if self._closed:
            return False
        target = self.segment if self._fd is not None else self.segment + 1  # where this record goes
        try:
            data = encode_record(record)
            if len(data) - HEAD > MAX_RECORD:
                raise ValueError(f"record of {len(data) - HEAD} bytes exceeds the {MAX_RECORD}-byte limit")
        except (ValueError, TypeError, OverflowError, msgspec.EncodeError) as exc:
            self._lose(target)
            self._failed("append", exc)
            return False
        if self._fd is None:  # a previous failure closed the segment: start the next one
            try:
                self.segment += 1
                self._open()
            except OSError as exc:
                self.segment -= 1
                self._lose(target)
                self._failed("open", exc)
                return False
        fd, start = self._fd, self._size
        assert fd is not None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if self.fsync == "always":
                os.fsync(fd)
        except OSError as exc:
            self._undo(fd, start)
            self._lose(target)
            self._failed("append", exc)
            return False
        self._size = start + len(data)
        self.records += 1
        if self.fsync != "always":
            self._dirty = True
        return True

    def _lose(self, segment: int) -> None:
        """A record meant for ``segment`` is not in the log: only a snapshot taken at a later
        rotation (``covered(n)`` with n > segment) holds its change."""
        self.lost += 1
        if self._lost_in is None:
            self._lost_in = segment

    def _undo(self, fd: int, start: int) -> None:
        """Cut a partly written record off the segment; if that fails too, abandon the segment
        (a torn record can only be its last one) and let the next append start a new one."""
        try:
            os.ftruncate(fd, start)
            return
        except OSError as exc:
            self._failed("truncate", exc)
        self._fd = None
        self._dirty = False
        try:
            os.close(fd)
        except OSError:
            pass

    def sync(self) -> None:
        """fsync if anything was written since the last one (the ``interval`` policy's tick)."""
        fd = self.begin_sync()
        if fd is not None:
            fsync_and_close(fd)

    def begin_sync(self) -> int | None:
        """A duplicate of the segment's fd to fsync (and close) off the event loop, or None when
        nothing needs it; a rotation meanwhile cannot pull the file out from under the fsync."""
        if self._fd is None or not self._dirty or self.fsync == "never":
            return None
        try:
            fd = os.dup(self._fd)
        except OSError as exc:
            self._failed("fsync", exc)
            return None
        self._dirty = False
        return fd

    def sync_failed(self, exc: BaseException) -> None:
        """The daemon's off-loop fsync of ``begin_sync``'s fd failed: what it covered may be lost at
        a power loss (not at a crash: the kernel has it)."""
        self._failed("fsync", exc)

    def rotate(self) -> int:
        """Close the current segment and start the next; returns the new segment's number. Never
        raises: if the new segment cannot be opened, the next append tries again."""
        self._close_fd()
        self.segment += 1
        try:
            self._open()
        except OSError as exc:
            self._failed("open", exc)
            self.segment -= 1  # the next append opens segment + 1 again
        return self.segment + (self._fd is None)

    def drop_before(self, n: int) -> None:
        for old in segments(self._dir):
            if old < n:
                try:
                    self._dir.unlink(segment_name(old))
                except FileNotFoundError:
                    pass

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        self._dirty = False
        if fd is None:
            return
        try:
            if self.fsync != "never":
                os.fsync(fd)
        except OSError as exc:
            self._failed("close", exc)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._close_fd()
        self._closed = True
        if self._own_dir:
            self._dir.close()


def fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
