"""The write-ahead log's records on disk: the record types, their encoding, reading segments back.

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
  well-formed record, which needs both disk corruption and a crafted payload.
- Segments are listed and read through the state dir's descriptor, never through a symlink; a
  segment that cannot be read (a link at its name, EACCES, EIO) is one ``Damage``, like a stretch
  of bad bytes.
- ``read_marked`` yields a ``Damage`` marker where a stretch was skipped, so the replay knows which
  records lie after damage: a stream whose logged seq jumps across a ``Damage`` lost its batches
  to the disk, not to the engine, and they are asked of the engine again (``kvindex.persist.logreplay``).
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

from kvindex.persist.statedir import StateDir, as_state_dir

log = logging.getLogger("kvindex.persist.wal")

MAX_RECORD = 256 << 20
_SEGMENT = re.compile(r"^wal-(\d{8})\.log$")
HEAD = 8
# how every record body starts: a msgpack fixarray of 2-5 elements, then the kind as a 1-char str
_BODY_START = re.compile(rb"[\x92-\x95]\xa1[bdgrx]")


def segment_path(directory: Path, n: int) -> Path:
    return directory / segment_name(n)


def segments(directory: Path | StateDir) -> list[int]:
    """Segment numbers present, ascending (none in a directory that does not exist)."""
    if isinstance(directory, StateDir):
        names = directory.names()
    else:
        names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
    return sorted(int(m.group(1)) for m in map(_SEGMENT.match, names) if m)


def segment_name(n: int) -> str:
    return f"wal-{n:08d}.log"


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


class Damage(msgspec.Struct, frozen=True):
    why: str  # where ``read_marked`` skipped damaged bytes (never written)


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Record] = msgspec.msgpack.Decoder(Record)  # type: ignore[arg-type]


def encode_record(record: Record) -> bytes:
    data = _encoder.encode(record)
    return len(data).to_bytes(4, "big") + zlib.crc32(data).to_bytes(4, "big") + data


def _record_at(data: bytes, pos: int) -> tuple[Record | Unknown | None, int, str]:
    """The record at ``pos``: (record, its size, "") or (None, 0, why it is not one)."""
    if len(data) - pos < HEAD:
        return None, 0, f"torn record header at byte {pos}"
    n = int.from_bytes(data[pos:pos + 4], "big")
    crc = int.from_bytes(data[pos + 4:pos + 8], "big")
    body = data[pos + HEAD:pos + HEAD + n]
    if n > MAX_RECORD or len(body) != n:
        return None, 0, f"torn record at byte {pos} ({n} bytes announced, {len(body)} present)"
    if zlib.crc32(body) != crc:
        return None, 0, f"record at byte {pos} fails its CRC"
    try:
        return _decoder.decode(body), HEAD + n, ""
    except msgspec.DecodeError as exc:
        why = str(exc)
    try:
        rec = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return None, 0, f"record at byte {pos} is not msgpack"
    if not isinstance(rec, list) or not rec:
        return None, 0, f"record at byte {pos} is not a record"
    return Unknown(f"record at byte {pos}: {why}"), HEAD + n, ""


def _resync(data: bytes, pos: int) -> int | None:
    """Where the next valid record after the bad one at ``pos`` starts; None: none does."""
    if len(data) - pos >= HEAD:  # first trust the bad record's own length
        n = int.from_bytes(data[pos:pos + 4], "big")
        nxt = pos + HEAD + n
        if n <= MAX_RECORD and nxt < len(data) and _record_at(data, nxt)[0] is not None:
            return nxt
    for m in _BODY_START.finditer(data, pos + 1 + HEAD):
        candidate = m.start() - HEAD
        if isinstance(_record_at(data, candidate)[0], Record):  # scanning, only a known record counts
            return candidate
    return None


def read_segment(path: Path) -> tuple[list[Record | Unknown], str | None]:
    """Every intact record of one segment, and what was skipped (None: the segment is clean).
    A bad record does not end reading: the reader skips to the next valid record (see the module
    docstring) and the problem names each bad record and how many bytes were skipped."""
    marked = _read_marked_segment(path.read_bytes())
    problems = [r.why for r in marked if isinstance(r, Damage)]
    return [r for r in marked if not isinstance(r, Damage)], "; ".join(problems) or None


def _read_marked_segment(data: bytes) -> list[Record | Unknown | Damage]:
    out: list[Record | Unknown | Damage] = []
    pos = 0
    while pos < len(data):
        rec, size, why = _record_at(data, pos)
        if rec is not None:
            out.append(rec)
            pos += size
            continue
        nxt = _resync(data, pos)
        if nxt is None:
            out.append(Damage(f"{why}: skipped the last {len(data) - pos} bytes"))
            break
        out.append(Damage(f"{why}: skipped {nxt - pos} bytes, resynchronised at byte {nxt}"))
        pos = nxt
    return out


def read_marked(directory: Path | StateDir, first: int) -> Iterator[Record | Unknown | Damage]:
    """Every intact record of segments >= ``first``, in order, with a ``Damage`` where bytes were
    skipped (each logged as a warning saying how many). Read through the state dir's descriptor,
    never through a symlink (a path: opened and checked as a state dir; none there: no record)."""
    if not isinstance(directory, StateDir) and not directory.is_dir():
        return
    state, opened = as_state_dir(directory)
    try:
        for n in segments(state):
            if n < first:
                continue
            marked = _read_segment_in(state, n)
            problems = [r.why for r in marked if isinstance(r, Damage)]
            if problems:
                log.warning("write-ahead log %s: %s (%d records kept)", segment_name(n), "; ".join(problems),
                            len(marked) - len(problems))
            yield from marked
    finally:
        if opened:
            state.close()


def _read_segment_in(state: StateDir, n: int) -> list[Record | Unknown | Damage]:
    """Segment ``n``'s records; one ``Damage`` when it cannot be read (a symlink at its name is
    never followed: ELOOP, like EACCES or EIO, loses the segment, not the restore)."""
    try:
        data = state.read(segment_name(n))
    except OSError as exc:
        return [Damage(f"cannot read the segment ({exc.strerror}): skipped it whole")]
    return _read_marked_segment(data or b"")


def read_from(directory: Path | StateDir, first: int) -> Iterator[Record | Unknown]:
    """Every intact record of segments >= ``first``, in order. Damage is skipped with a warning
    that says how many bytes were skipped; the records after it are still read."""
    return (r for r in read_marked(directory, first) if not isinstance(r, Damage))
