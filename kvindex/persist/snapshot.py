"""Snapshots: both indexes, every stream's seq watermark and the registrations, in one file.

Format (also what ``GET /v1/state`` streams): ``[header length: u32 big-endian][header: msgpack
map][body: msgpack map]``. The header is ``{"format": "kvindex-state", "version": 2, "created":
<unix time>, "wal_from": <first write-ahead log segment not covered>, "body_len": n, "body_crc":
<crc32 of the body>}``. The body (version 2; version 1 had no ``tables``, and is still read)::

    {"precise": {"block_sizes": {model: n}, "entries": [[pod, dp_rank, medium, hash, key|nil, copies], ...],
                 "tables": [[pod, dp_rank, medium, <bin: snapshot rows, kvindex.index.rows>], ...]},
     "approx": <ApproxIndex.export_state()>,
     "streams": {lane_key: [{"topic", "pod", "last_seq", "expect_from", "synced", "unsynced_reason",
                             "gaps", "replays", "restarts", "batches", "epoch", "last_digest"}, ...]},
     "registrations": [{"instance_id", "model", "group", "block_size", "dp_rank", "endpoint", "replay"}, ...]}

``last_digest`` is the XXH3-64 of the watermark batch's payload (``ingest.sequencer.payload_digest``);
snapshots before it saved a CRC-32 as ``last_crc``, which is not read (such a stream restores
without its watermark's digest, as one whose snapshot saved none).

Invariants:
- ``decode`` refuses (``StateError``, one clear line) anything that is not a complete snapshot of a
  version it knows: foreign bytes, a future version, a truncated or corrupted body. Nothing is
  loaded from a refused snapshot; the caller starts empty. ``declared_length`` judges one by its
  first bytes (a peer's answer is refused there, or past the length they declare).
- ``State.release`` frees a decoded state's Python rows in parts: a thread doing it lets go of the
  GIL between them.
- ``write_atomic_in`` writes a temp file in the state dir (through its descriptor, created
  exclusively, ``O_NOFOLLOW``: a symlink planted at its name is never followed), fsyncs it, renames it over the old
  snapshot and fsyncs the directory: a reader sees the old snapshot or the new one, never half.
  A failed write removes its temp file; one left by a killed process is removed at the next start
  (``remove_stale_temps``, under the state dir's lock).
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from dataclasses import dataclass, field
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import msgpack
import msgspec

from kvindex.persist.statedir import StateDir
from kvindex.index.rows import Table, check_rows, check_where, tables_of, unpack_rows
from kvindex.types import Entry, EntryRow

FORMAT = "kvindex-state"
VERSION = 2
READS = (1, 2)  # the versions decode accepts
SNAPSHOT_NAME = "state.snap"
RELEASE_PART = 16_384  # rows freed per call by State.release
STREAM_FIELDS = ("topic", "pod", "last_seq", "expect_from", "synced", "unsynced_reason", "gaps", "replays",
                 "restarts", "batches", "epoch", "last_digest")


class StateError(ValueError):
    """A snapshot that cannot be used; the message says why in one line."""


@dataclass(slots=True)
class State:
    block_sizes: dict[str, int] = field(default_factory=dict)
    entries: Sequence[EntryRow] = field(default_factory=list)  # Entry objects or plain rows (a Dynamo peer's)
    tables: Sequence[Table] = field(default_factory=list)  # (pod, dp_rank, medium, rows): an index's export_tables
    approx: dict[str, Any] = field(default_factory=dict)
    streams: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    registrations: list[dict[str, Any]] = field(default_factory=list)
    wal_from: int = 0
    created: float = 0.0
    lineage: list[Any] = field(default_factory=list)  # a Dynamo peer's (never saved): kvindex.dynamo_dump

    def release(self) -> None:
        """Drop the entries and lineage (a Dynamo peer's millions of Python rows) ``RELEASE_PART`` at
        a time, so that a thread doing it lets go of the GIL between parts (one ``del`` of 819k rows
        held it 0.3 s)."""
        for rows in (self.entries, self.lineage):
            if isinstance(rows, list):
                drop_in_parts(rows)

    def all_entries(self) -> list[Entry]:
        """Every precise entry held: ``entries`` and the tables' rows, as ``Entry`` objects."""
        return [Entry(*e) for e in self.entries] + [Entry(pod, rank, medium, h, key, copies) for pod, rank, medium, rows
                                                    in self.tables for h, key, copies in unpack_rows(rows)]


def drop_in_parts(items: list[Any], part: int = RELEASE_PART) -> None:
    """Empty ``items`` from its end, ``part`` at a time (each ``del`` one call holding the GIL)."""
    while items:
        del items[-part:]


def stream_state(st: Any) -> dict[str, Any]:
    """The saved part of an ``ingest.Stream``."""
    return {name: getattr(st, name) for name in STREAM_FIELDS}


ENCODE_CHUNK = 8192  # entries packed per msgpack call: encode runs in a thread, and each C-level
# pack call holds the GIL (one call for a million entries would stall the event loop for it)


def encode(state: State) -> bytes:
    """The snapshot bytes; the same as one ``packb`` of the body map, but the entries are packed in
    chunks so the GIL (and the event loop) gets turns while a thread encodes a big index."""
    p = msgpack.Packer(use_bin_type=True)
    entries = state.entries
    parts = [p.pack_map_header(4), p.pack("precise"), p.pack_map_header(3), p.pack("tables"),
             p.pack([list(t) for t in state.tables]), p.pack("block_sizes"),
             p.pack(state.block_sizes), p.pack("entries"), p.pack_array_header(len(entries))]
    for i in range(0, len(entries), ENCODE_CHUNK):
        chunk = [list(e) for e in entries[i:i + ENCODE_CHUNK]]
        packed = p.pack(chunk)
        parts.append(packed[len(p.pack_array_header(len(chunk))):])  # the elements, without their array header
    parts += [p.pack("approx"), p.pack(state.approx), p.pack("streams"), p.pack(state.streams),
              p.pack("registrations"), p.pack(state.registrations)]
    body = b"".join(parts)
    header = msgpack.packb({"format": FORMAT, "version": VERSION, "created": state.created or time.time(),
                            "wal_from": state.wal_from, "body_len": len(body), "body_crc": zlib.crc32(body)})
    return len(header).to_bytes(4, "big") + header + body


def read_header(data: bytes) -> tuple[dict[str, Any], int]:
    """The header and the body's offset; ``StateError`` unless this is a kvindex snapshot we can read."""
    if len(data) < 4:
        raise StateError(f"not a kvindex snapshot ({len(data)} bytes)")
    n = int.from_bytes(data[:4], "big")
    if n > 4096 or len(data) < 4 + n:
        raise StateError("not a kvindex snapshot (no valid header)")
    try:
        header = msgpack.unpackb(data[4:4 + n], raw=False)
    except Exception:
        raise StateError("not a kvindex snapshot (header is not msgpack)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise StateError(f"not a kvindex snapshot (format {header.get('format') if isinstance(header, dict) else None!r})")
    version = header.get("version")
    if version not in READS:
        raise StateError(f"snapshot version {version!r} is not supported (this kvindex reads versions "
                         f"{', '.join(map(str, READS))})")
    for k in ("body_len", "body_crc", "wal_from"):
        if type(header.get(k)) is not int:
            raise StateError(f"snapshot header lacks {k}")
    return header, 4 + n


def declared_length(prefix: bytes | bytearray) -> int | None:
    """The whole snapshot's length as its first bytes declare it (header and ``body_len``); None
    while ``prefix`` is shorter than the header; ``StateError`` unless a kvindex snapshot starts so."""
    n = int.from_bytes(prefix[:4], "big") if len(prefix) >= 4 else 0
    if len(prefix) < 4 or (n <= 4096 and len(prefix) < 4 + n):
        return None
    header, at = read_header(bytes(prefix[:4 + n]))
    return at + header["body_len"]


class _Precise(msgspec.Struct):
    block_sizes: dict[str, int]
    entries: list[tuple[str, int, str, int, int | None, Annotated[int, msgspec.Meta(ge=1)]]]
    tables: list[tuple[str, int, str, bytes]] = []


class _Body(msgspec.Struct):
    """The body's shape, checked by msgspec in C as it decodes (a big index is millions of entries:
    a Python check per entry would be most of a restore's time)."""

    precise: _Precise
    approx: dict[Any, Any]
    streams: dict[str, list[dict[str, Any]]]
    registrations: list[dict[str, Any]]


_body_decoder = msgspec.msgpack.Decoder(_Body)


def decode(data: bytes) -> State:
    """The snapshot in ``data`` (``StateError`` when it cannot be used). Its precise entries come
    back as ``tables``: version 1's rows are packed here (a row that is not in the format, e.g. a
    hash outside u64, refuses the snapshot), version 2's tables are checked row by row; a table
    whose pod, dp_rank or medium the live path could not make (``check_where``) refuses it too."""
    header, at = read_header(data)
    body_bytes = memoryview(data)[at:]
    if len(body_bytes) != header["body_len"]:
        raise StateError(f"snapshot is truncated or padded: body has {len(body_bytes)} bytes, header says "
                         f"{header['body_len']}")
    if zlib.crc32(body_bytes) != header["body_crc"]:
        raise StateError("snapshot body fails its CRC (corrupted)")
    try:
        body = _body_decoder.decode(body_bytes)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StateError(f"snapshot body is malformed: {str(exc).splitlines()[0]}") from None
    streams = {k: [_stream(d) for d in v] for k, v in body.streams.items()}
    for pod, rank, medium, packed in body.precise.tables:
        try:
            check_where((pod, rank, medium))
            check_rows(packed)
        except ValueError as exc:
            raise StateError(f"snapshot table ({pod!r}, {rank}, {medium!r}): {exc}") from None
    try:
        tables = [*body.precise.tables, *tables_of(body.precise.entries)]
    except (ValueError, OverflowError, TypeError, struct.error) as exc:
        raise StateError(f"snapshot entries are not in the row format: {exc}") from None
    return State(body.precise.block_sizes, [], tables, body.approx, streams, body.registrations,
                 header["wal_from"], float(header.get("created", 0)))


def _stream(d: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(d.get("topic"), str):
        raise StateError("snapshot stream without a topic")
    return {k: d[k] for k in STREAM_FIELDS if k in d}


def temp_path(path: Path) -> Path:
    return path.with_name(temp_name(path.name))


def temp_name(name: str) -> str:
    return f".{name}.{os.getpid()}.tmp"


NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL  # (StateDir.file adds O_NOFOLLOW)


def _create(state: StateDir, tmp: str) -> int:
    """A new temp file, created exclusively and never through a symlink: whatever is at its name
    (a file or link left there, or planted) is unlinked, never followed, and creation retried once."""
    try:
        return state.file(tmp, NEW_FILE)
    except FileExistsError:
        state.unlink(tmp)  # removes a symlink itself, not what it points to
        return state.file(tmp, NEW_FILE)


def write_atomic(path: Path, data: bytes) -> None:
    """``write_atomic_in`` the directory of ``path`` (opened and checked as a state dir)."""
    with StateDir.open(path.parent, create=False) as state:
        write_atomic_in(state, path.name, data)


def write_atomic_in(state: StateDir, name: str, data: bytes) -> None:
    """Write ``data`` as ``name`` in ``state`` atomically; on any failure (disk full, EIO,
    interrupted) the temp file is removed before the error propagates and the old file is untouched."""
    tmp = temp_name(name)
    try:
        fd = _create(state, tmp)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        state.replace(tmp, name)
    except BaseException:
        try:
            state.unlink(tmp)
        except OSError:
            pass
        raise
    state.sync()


def remove_stale_temps(state: StateDir, name: str) -> list[str]:
    """Delete the temp files of earlier processes' interrupted ``write_atomic``s of ``name`` (a
    SIGKILL mid-write leaves one); call with the state dir locked. Returns the names removed."""
    removed = []
    for entry in state.names():
        if entry.startswith(f".{name}.") and entry.endswith(".tmp"):
            try:
                state.unlink(entry)
                removed.append(entry)
            except OSError:
                pass
    return removed


def read_in(state: StateDir, name: str) -> State | None:
    """The snapshot ``name`` in ``state``; None when there is none; ``StateError`` when it cannot be used."""
    try:
        data = state.read(name)
    except OSError as exc:
        raise StateError(f"cannot read {state.path / name}: {exc.strerror}") from None
    return None if data is None else decode(data)


def read_file(path: Path) -> State | None:
    """The snapshot at ``path``; None when there is none; ``StateError`` when it cannot be used."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror}") from None
    return decode(data)
