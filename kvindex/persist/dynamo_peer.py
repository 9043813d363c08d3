"""``--peer`` from a Dynamo standalone indexer: its ``/dump`` (``kvindex.dynamo_dump``) as a state.

A Dynamo indexer has no ``/v1/state`` (``kvindex.persist.peer`` asks for it first); its dump
holds blocks only (no approximate index, no streams, no registrations), so a daemon restored from
it knows what each worker held and catches up from its engines as after any peer recovery. Its
blocks' local hashes are kept (``State.lineage``): kvindex's own ``/dump`` places them again.

Invariants:
- The dump's bytes were read within the peer's bounds (``kvindex.persist.peer``); decoding them is
  CPU only, run in a thread by the caller.
- That thread lets go of the GIL as it decodes: ``json.loads`` holds it for its whole call (a
  349 MB dump held the event loop 12 s from a thread), so the dump is decoded value by value down
  to each group's events (``loads_in_steps``), the same document ``json.loads`` makes, from text
  decoded in parts (``text_of``); the document is freed in parts too (``drop_in_parts``).
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

from kvindex import dynamo_dump
from kvindex.persist.snapshot import State, StateError, drop_in_parts

TEXT_PART = 4 << 20  # bytes decoded to text per call (one call on a GiB holds the GIL ~1 s)
EVENTS_PART = 512  # events (tens of objects each) freed per call
STEPS = 3  # levels decoded one value at a time: the groups, their members, each array's elements
_SPACE = re.compile(r"[ \t\n\r]*")
_decoder = json.JSONDecoder()


def state_of_dump(data: bytes | bytearray) -> State:
    """A Dynamo ``/dump``'s bytes as a ``State``; ``StateError`` (one line) when they cannot be used."""
    try:
        doc = loads_in_steps(text_of(data))
        if not dynamo_dump.is_dynamo_dump(doc):
            raise ValueError("not a Dynamo /dump")
        sizes, entries, lineage = dynamo_dump.entries_from_dump(doc)
        for group in doc.values():
            drop_in_parts(group["events"], EVENTS_PART)  # not one GIL-holding dealloc of them all
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateError(f"has no /v1/state, and its /dump cannot be read: {exc}") from None
    return State(block_sizes=sizes, entries=entries, lineage=lineage)


def text_of(data: bytes | bytearray) -> str:
    """``data`` as UTF-8 text, decoded ``TEXT_PART`` bytes at a time; ValueError when it is not."""
    decoder, view = codecs.getincrementaldecoder("utf-8")(), memoryview(data)
    parts = [decoder.decode(view[i:i + TEXT_PART]) for i in range(0, len(view), TEXT_PART)]
    return "".join([*parts, decoder.decode(b"", final=True)])


def loads_in_steps(text: str) -> Any:
    """``json.loads(text)``, its objects and arrays ``STEPS`` levels deep decoded member by member
    (each call into json's scanner is one value: the GIL is let go between them); ValueError."""
    value, at = _value(text, _skip(text, 0), STEPS)
    if _skip(text, at) != len(text):
        raise ValueError(f"extra data at character {at}")
    return value


def _skip(s: str, i: int) -> int:
    """Past the whitespace at ``i``."""
    m = _SPACE.match(s, i)
    return m.end() if m else i


def _value(s: str, i: int, depth: int) -> tuple[Any, int]:
    if depth and s.startswith("{", i):
        return _object(s, i + 1, depth - 1)
    if depth and s.startswith("[", i):
        return _array(s, i + 1, depth - 1)
    return _decoder.raw_decode(s, i)


def _object(s: str, i: int, depth: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    i = _skip(s, i)
    if s.startswith("}", i):
        return out, i + 1
    while True:
        if not s.startswith('"', i):
            raise ValueError(f"expecting a property name at character {i}")
        key, i = _decoder.raw_decode(s, i)
        i = _skip(s, i)
        if not s.startswith(":", i):
            raise ValueError(f"expecting ':' at character {i}")
        out[key], i = _value(s, _skip(s, i + 1), depth)
        i, done = _next(s, i, "}")
        if done:
            return out, i


def _array(s: str, i: int, depth: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    i = _skip(s, i)
    if s.startswith("]", i):
        return out, i + 1
    while True:
        item, i = _value(s, i, depth)
        out.append(item)
        i, done = _next(s, i, "]")
        if done:
            return out, i


def _next(s: str, i: int, close: str) -> tuple[int, bool]:
    """Past the separator after a member: (where the next one starts, False), or (past ``close``, True)."""
    i = _skip(s, i)
    if s.startswith(close, i):
        return i + 1, True
    if not s.startswith(",", i):
        raise ValueError(f"expecting ',' or {close!r} at character {i}")
    return _skip(s, i + 1), False
