"""Snapshot rows: one (pod, dp_rank, medium) table's entries as packed bytes; exported entries
(``Entry`` or plain ``EntryRow`` tuples) packed into tables (pure functions: a thread can pack a
big snapshot's entries while the event loop serves).

Format, per entry, 24 bytes little-endian: ``hash u64, key u64, copies u64`` with bit 63 of the
third word set when the entry is keyless (the key field then 0); copies are in [1, 2**63). Written and read in one linear pass by the native core
(``kvindex/index/_core.c``: ``Core.export`` / ``Core.load``, ``rows`` / ``pack``); the functions
here are the format's definition in Python, and the C twins must agree with them
(tests/test_core.py).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from itertools import groupby
from operator import itemgetter
from typing import Union

from kvindex import native
from kvindex.events import MAX_DP_RANK
from kvindex.types import EntryRow

ROW = struct.Struct("<QQQ")
KEYLESS = 1 << 63
_C = native.load("kvindex.index._core")
Where = tuple[str, int, str]  # (pod, dp_rank, medium)
Rows = Union[bytes, memoryview]  # snapshot rows, or a slice of them
Table = tuple[str, int, str, Rows]  # (pod, dp_rank, medium, snapshot rows)
TABLE_OF = itemgetter(0, 1, 2)  # an entry's Where
ROW_OF = itemgetter(3, 4, 5)  # an entry's (hash, key or None, copies)


def check_where(where: Where) -> None:
    """ValueError unless a table's (pod, dp_rank, medium) is one the live path makes: a pod id (a
    non-empty string), a dp_rank in [0, MAX_DP_RANK], a medium as the adapters name it (non-empty,
    upper-case). What a snapshot, a peer or a Dynamo peer hands kvindex is held to it."""
    pod, rank, medium = where
    if type(pod) is not str or not pod:
        raise ValueError(f"a table's pod must be a non-empty string, got {pod!r}")
    if type(rank) is not int or not 0 <= rank <= MAX_DP_RANK:
        raise ValueError(f"a table's dp_rank must be an integer from 0 to {MAX_DP_RANK}, got {rank!r}")
    if type(medium) is not str or not medium or medium != medium.upper():
        raise ValueError(f"a table's medium must be a non-empty upper-case name, got {medium!r}")


def py_pack_rows(rows: Iterable[tuple[int, int | None, int]]) -> bytes:
    """``(hash, key or None, copies)`` rows as bytes."""
    out = bytearray()
    for h, key, copies in rows:
        if type(copies) is not int or not 1 <= copies < KEYLESS:
            raise ValueError("copies must be in [1, 2**63)")
        if not 0 <= h < 1 << 64 or not (key is None or 0 <= key < 1 << 64):
            raise OverflowError("a hash or key must be a u64 (0 <= x < 2**64)")
        out += ROW.pack(h, 0 if key is None else key, copies | (KEYLESS if key is None else 0))
    return bytes(out)


def py_unpack_rows(data: Rows) -> list[tuple[int, int | None, int]]:
    """The ``(hash, key or None, copies)`` rows of ``data``."""
    if len(data) % ROW.size:
        raise ValueError(f"snapshot rows must be a multiple of {ROW.size} bytes, got {len(data)}")
    rows = []
    for h, key, meta in ROW.iter_unpack(data):
        if not meta & ~KEYLESS:
            raise ValueError("a snapshot row with 0 copies")
        if meta & KEYLESS and key:
            raise ValueError("a keyless snapshot row with a key")
        rows.append((h, None if meta & KEYLESS else key, meta & ~KEYLESS))
    return rows


def check_rows(data: Rows) -> int:
    """The number of rows in ``data``; ValueError unless every row is well formed (a multiple of
    24 bytes, copies in [1, 2**63), a keyless row's key field 0)."""
    return _C.check(data) if _C is not None else len(py_unpack_rows(data))


def pack_rows(rows: Iterable[tuple[int, int | None, int]]) -> bytes:
    return _C.pack(list(rows)) if _C is not None else py_pack_rows(rows)


def unpack_rows(data: Rows) -> list[tuple[int, int | None, int]]:
    return _C.rows(data) if _C is not None else py_unpack_rows(data)


def tables_of(entries: Iterable[EntryRow]) -> list[Table]:
    """The entries of each table packed as rows, tables in first-seen order (an export's)."""
    runs: dict[Where, list[tuple[int, int | None, int]]] = {}
    for where, run in groupby(entries, TABLE_OF):
        if where not in runs:
            check_where(where)
        runs.setdefault(where, []).extend(map(ROW_OF, run))
    return [(*where, pack_rows(rows)) for where, rows in runs.items()]
