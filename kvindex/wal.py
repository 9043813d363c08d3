"""The write-ahead log: what changed the indexes since the last snapshot, in the order it happened.

Format: a directory of segments ``wal-<n:08d>.log``; each is a sequence of records
``[length: u32 big-endian][crc32 of the body: u32 big-endian][body: msgpack array]``. Bodies:
- ``["b", lane_key, topic, seq, payload]`` an engine batch as applied (raw payload bytes);
- ``["r", lane_key, pod]`` an operator's resync of a pod (the batches it replayed follow);
- ``["d", pod, model, [hash, ...]]`` a decision recorded into the approximate index;
- ``["x", pod]`` a pod removed from both indexes (``DELETE /v1/pods/{pod}``, last unregister);
- ``["g", "add" | "remove", registration]`` a ``/register`` or ``/unregister``.

Invariants:
- A record is handed to the OS (one ``write``) before the call that logs it returns, so a SIGKILL
  loses nothing logged; the fsync policy decides what survives a power loss: ``always`` (fsync per
  record), ``interval`` (the daemon calls ``sync()`` every second; up to ~1 s lost), ``never``.
- Reading stops at the first record that is short, too long or fails its CRC (a torn tail from a
  crash mid-write): everything before it is returned, the rest is ignored and reported.
- Segments only grow; ``rotate()`` starts the next one; a snapshot that covers segments < n lets
  ``drop_before(n)`` delete them.
"""

from __future__ import annotations

import logging
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

log = logging.getLogger("kvindex.wal")

FSYNC_POLICIES = ("always", "interval", "never")
MAX_RECORD = 256 << 20
_SEGMENT = re.compile(r"^wal-(\d{8})\.log$")
_HEAD = 8


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


def encode_record(body: list[Any]) -> bytes:
    data = msgpack.packb(body, use_bin_type=True)
    return len(data).to_bytes(4, "big") + zlib.crc32(data).to_bytes(4, "big") + data


def read_segment(path: Path) -> tuple[list[list[Any]], str | None]:
    """Every intact record of one segment, and why reading stopped early (None: clean end)."""
    data = path.read_bytes()
    out: list[list[Any]] = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < _HEAD:
            return out, f"torn record header at byte {pos}"
        n = int.from_bytes(data[pos:pos + 4], "big")
        crc = int.from_bytes(data[pos + 4:pos + 8], "big")
        body = data[pos + _HEAD:pos + _HEAD + n]
        if n > MAX_RECORD or len(body) != n:
            return out, f"torn record at byte {pos} ({n} bytes announced, {len(body)} present)"
        if zlib.crc32(body) != crc:
            return out, f"record at byte {pos} fails its CRC"
        try:
            rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception:
            return out, f"record at byte {pos} is not msgpack"
        if not isinstance(rec, list) or not rec:
            return out, f"record at byte {pos} is not a record"
        out.append(rec)
        pos += _HEAD + n
    return out, None


def read_from(directory: Path, first: int) -> Iterator[list[Any]]:
    """Every intact record of segments >= ``first``, in order. A damaged segment's tail is skipped
    with a warning (later segments are still read: a torn tail only happens at a crash, after which
    a new segment is started)."""
    for n in segments(directory):
        if n < first:
            continue
        records, problem = read_segment(segment_path(directory, n))
        if problem:
            log.warning("write-ahead log %s: %s; ignoring the rest of this segment (%d records kept)",
                        segment_path(directory, n).name, problem, len(records))
        yield from records


class WriteAheadLog:
    """Appends records to the current segment of ``directory``."""

    def __init__(self, directory: Path, *, fsync: str = "interval", segment: int | None = None) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}")
        self.directory = directory
        self.fsync = fsync
        directory.mkdir(parents=True, exist_ok=True)
        existing = segments(directory)
        self.segment = segment if segment is not None else (existing[-1] + 1 if existing else 1)
        self._fd: int | None = None
        self._dirty = False
        self.records = 0  # in the current segment
        self._open()

    def _open(self) -> None:
        self._fd = os.open(segment_path(self.directory, self.segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.records = 0
        _fsync_dir(self.directory)

    def append(self, body: list[Any]) -> None:
        if self._fd is None:
            return
        data = encode_record(body)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self.records += 1
        if self.fsync == "always":
            os.fsync(self._fd)
        else:
            self._dirty = True

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
        self._dirty = False
        return os.dup(self._fd)

    def rotate(self) -> int:
        """Close the current segment and start the next; returns the new segment's number."""
        self.close()
        self.segment += 1
        self._open()
        return self.segment

    def drop_before(self, n: int) -> None:
        for old in segments(self.directory):
            if old < n:
                try:
                    segment_path(self.directory, old).unlink()
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        if self._fd is not None:
            if self.fsync != "never":
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            self._dirty = False


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
