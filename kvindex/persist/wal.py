"""The write-ahead log: what changed the indexes since the last snapshot, in the order it happened.

Format: a directory of segments ``wal-<n:08d>.log``; each is a sequence of records
``[length: u32 big-endian][crc32 of the body: u32 big-endian][body: msgpack array]``. A body is one
of the ``Record`` union: frozen, tagged, array-like ``msgspec.Struct``s, so on disk the tag is the
array's first element (the same bytes the untyped lists of earlier releases were: their segments
read as these records):
- ``Batch``    ``["b", lane_key, topic, seq, payload]`` an engine batch as applied (raw payload bytes);
- ``Resync``   ``["r", lane_key, pod]`` an operator's resync of a pod (the batches it replayed follow);
- ``Decision`` ``["d", pod, model, [hash, ...]]`` a decision recorded into the approximate index;
- ``PodRemoved`` ``["x", pod]`` a pod removed from both indexes (``DELETE /v1/pods/{pod}``, last unregister);
- ``RegistrationChange`` ``["g", "add" | "remove", registration]`` a ``/register`` or ``/unregister``.

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
- An intact record (its CRC holds, its body is a msgpack array) that is not one of ``Record`` (a
  kind this release does not know, a field of the wrong type) is read as ``Unknown``: the replay
  counts it as skipped and goes on. Damage is different:
- Reading never stops at a bad record (short, too long, failing its CRC or not a record): the
  reader reports it with the bytes it skipped and resynchronises on the next valid record. First
  it trusts the bad record's own length (the usual case: a flipped bit in a body, which skips
  exactly that record, engine payload included); if no valid record starts there (the length
  itself is damaged) it scans forward for the next position whose body starts like a record
  (a msgpack array of 2-5 whose first element is a one-letter kind, ``[\x92-\x95]\xa1[bdgrx]``),
  whose announced length fits, whose CRC holds and whose body decodes as a ``Record``. A false
  resync needs a CRC-32 collision on top of that prefix (about 2^-32 per candidate); the one
  residual risk is a damaged length field in front of an engine payload that itself contains a
  well-formed record, which needs both disk corruption and a crafted payload. Records after a skipped stretch are
  safe to apply: a batch after a missing one is a seq gap and marks its stream unsynced.
- Segments only grow; ``rotate()`` starts the next one; a snapshot that covers segments < n lets
  ``drop_before(n)`` delete them.
"""

from __future__ import annotations

import logging
import os
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

from kvindex.logs import BurstLog
from kvindex.settings import FSYNC_POLICIES

log = logging.getLogger("kvindex.persist.wal")

MAX_RECORD = 256 << 20
_SEGMENT = re.compile(r"^wal-(\d{8})\.log$")
_HEAD = 8
# how every record body starts: a msgpack fixarray of 2-5 elements, then the kind as a 1-char str
_BODY_START = re.compile(rb"[\x92-\x95]\xa1[bdgrx]")


def segment_path(directory: Path, n: int) -> Path:
    return directory / f"wal-{n:08d}.log"


def segments(directory: Path) -> list[int]:
    """Segment numbers present, ascending."""
    out = []
    for p in directory.iterdir() if directory.is_dir() else ():
        m = _SEGMENT.match(p.name)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


class Batch(msgspec.Struct, frozen=True, tag="b", array_like=True):
    lane_key: str
    topic: str
    seq: int
    payload: bytes


class Resync(msgspec.Struct, frozen=True, tag="r", array_like=True):
    lane_key: str
    pod: str


class Decision(msgspec.Struct, frozen=True, tag="d", array_like=True):
    pod: str
    model: str
    hashes: tuple[int, ...]


class PodRemoved(msgspec.Struct, frozen=True, tag="x", array_like=True):
    pod: str


class RegistrationChange(msgspec.Struct, frozen=True, tag="g", array_like=True):
    change: Literal["add", "remove"]
    registration: dict[str, Any]  # ``Registration.to_json()``


Record = Batch | Resync | Decision | PodRemoved | RegistrationChange
"""Every kind of record: the closed union a segment holds."""


class Unknown(msgspec.Struct, frozen=True):
    why: str  # what the reader yields for an intact record that is not a ``Record`` (never written)


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Record] = msgspec.msgpack.Decoder(Record)  # type: ignore[arg-type]


def encode_record(record: Record) -> bytes:
    data = _encoder.encode(record)
    return len(data).to_bytes(4, "big") + zlib.crc32(data).to_bytes(4, "big") + data


def _record_at(data: bytes, pos: int) -> tuple[Record | Unknown | None, int, str]:
    """The record at ``pos``: (record, its size, "") or (None, 0, why it is not one)."""
    if len(data) - pos < _HEAD:
        return None, 0, f"torn record header at byte {pos}"
    n = int.from_bytes(data[pos:pos + 4], "big")
    crc = int.from_bytes(data[pos + 4:pos + 8], "big")
    body = data[pos + _HEAD:pos + _HEAD + n]
    if n > MAX_RECORD or len(body) != n:
        return None, 0, f"torn record at byte {pos} ({n} bytes announced, {len(body)} present)"
    if zlib.crc32(body) != crc:
        return None, 0, f"record at byte {pos} fails its CRC"
    try:
        return _decoder.decode(body), _HEAD + n, ""
    except msgspec.DecodeError as exc:
        why = str(exc)
    try:
        rec = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return None, 0, f"record at byte {pos} is not msgpack"
    if not isinstance(rec, list) or not rec:
        return None, 0, f"record at byte {pos} is not a record"
    return Unknown(f"record at byte {pos}: {why}"), _HEAD + n, ""


def _resync(data: bytes, pos: int) -> int | None:
    """Where the next valid record after the bad one at ``pos`` starts; None: none does."""
    if len(data) - pos >= _HEAD:  # first trust the bad record's own length
        n = int.from_bytes(data[pos:pos + 4], "big")
        nxt = pos + _HEAD + n
        if n <= MAX_RECORD and nxt < len(data) and _record_at(data, nxt)[0] is not None:
            return nxt
    for m in _BODY_START.finditer(data, pos + 1 + _HEAD):
        candidate = m.start() - _HEAD
        if isinstance(_record_at(data, candidate)[0], Record):  # scanning, only a known record counts
            return candidate
    return None


def read_segment(path: Path) -> tuple[list[Record | Unknown], str | None]:
    """Every intact record of one segment, and what was skipped (None: the segment is clean).
    A bad record does not end reading: the reader skips to the next valid record (see the module
    docstring) and the problem names each bad record and how many bytes were skipped."""
    data = path.read_bytes()
    out: list[Record | Unknown] = []
    problems: list[str] = []
    pos = 0
    while pos < len(data):
        rec, size, why = _record_at(data, pos)
        if rec is not None:
            out.append(rec)
            pos += size
            continue
        nxt = _resync(data, pos)
        if nxt is None:
            problems.append(f"{why}: skipped the last {len(data) - pos} bytes")
            break
        problems.append(f"{why}: skipped {nxt - pos} bytes, resynchronised at byte {nxt}")
        pos = nxt
    return out, "; ".join(problems) or None


def read_from(directory: Path, first: int) -> Iterator[Record | Unknown]:
    """Every intact record of segments >= ``first``, in order. Damage is skipped with a warning
    that says how many bytes were skipped; the records after it are still read."""
    for n in segments(directory):
        if n < first:
            continue
        records, problem = read_segment(segment_path(directory, n))
        if problem:
            log.warning("write-ahead log %s: %s (%d records kept)", segment_path(directory, n).name, problem,
                        len(records))
        yield from records


class WriteAheadLog:
    """Appends records to the current segment of ``directory``. ``on_error(op)`` is called for
    every failure (``append``, ``open``, ``close``) after it was handled, e.g. to count it."""

    def __init__(self, directory: Path, *, fsync: str = "interval", segment: int | None = None,
                 on_error: Callable[[str], None] | None = None, burst: BurstLog | None = None) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}")
        self.directory = directory
        self.fsync = fsync
        directory.mkdir(parents=True, exist_ok=True)
        existing = segments(directory)
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
        self._open()  # the first open raises: a state dir that cannot be written is a startup error

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
        fd = os.open(segment_path(self.directory, self.segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._size = os.lseek(fd, 0, os.SEEK_END)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self.records = 0
        _fsync_dir(self.directory)

    def _failed(self, op: str, exc: BaseException | str) -> None:
        self.errors += 1
        self._burst.warning(("wal", op, str(self.directory)),
                            "write-ahead log %s: %s failed: %s (kvindex keeps serving; until the next snapshot a "
                            "restart loses what was not logged)", segment_path(self.directory, self.segment).name,
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
            if len(data) - _HEAD > MAX_RECORD:
                raise ValueError(f"record of {len(data) - _HEAD} bytes exceeds the {MAX_RECORD}-byte limit")
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
        for old in segments(self.directory):
            if old < n:
                try:
                    segment_path(self.directory, old).unlink()
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


def fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
