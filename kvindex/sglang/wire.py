"""The protobuf wire format of SGLang's ``kv_indexer.v1.KVIndexer`` messages, read and written by hand
(``kv_indexer.proto`` beside this module states the schema; no generated code, no protobuf package).

Invariants:
- Decoding is total: any byte string gives a request value or raises ``WireError`` with a short
  fixed ``reason`` (a metric label), never another exception. Reasons: ``truncated`` (a varint,
  length or fixed field running past the end), ``bad_varint`` (over 10 bytes), ``bad_wire_type``
  (a group, wire type 6/7, or a field number 0), ``wrong_wire_type`` (a known field sent with a
  wire type its schema type cannot have), ``bad_utf8`` (a string field that is not UTF-8),
  ``bad_packed`` (a packed ``sfixed64`` run not a multiple of 8 bytes).
- Unknown fields are skipped, as proto3 says; a repeated scalar is accepted packed or unpacked;
  the last value of a scalar field wins.
- Block hashes travel as ``sfixed64`` (8 bytes, little-endian, two's complement). Here they are
  u64 (``array("Q")``, the same bits), as every kvindex hash is: ``-1`` on the wire is
  ``2**64 - 1`` here, and written back as ``-1``.
- Encoding writes proto3's canonical form: zero scalars and empty strings left out, repeated
  scalars packed.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
MASK64 = (1 << 64) - 1
_BIG_ENDIAN = sys.byteorder == "big"


class WireError(ValueError):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"malformed protobuf ({reason}{': ' + detail if detail else ''})")
        self.reason = reason


# -- reading ---------------------------------------------------------------------------------
def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(pos + 10, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value & MASK64, i + 1
        shift += 7
    raise WireError("bad_varint" if len(data) - pos >= 10 else "truncated")


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field: an int for varint / fixed, bytes for length."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0 or wire not in (VARINT, FIXED64, LENGTH, FIXED32):
            raise WireError("bad_wire_type", f"field {number} wire type {wire}")
        value: int | bytes
        if wire == VARINT:
            value, pos = _varint(data, pos)
        elif wire == LENGTH:
            n, pos = _varint(data, pos)
            if pos + n > end:
                raise WireError("truncated")
            value, pos = data[pos:pos + n], pos + n
        else:
            size = 8 if wire == FIXED64 else 4
            if pos + size > end:
                raise WireError("truncated")
            value, pos = int.from_bytes(data[pos:pos + size], "little"), pos + size
        yield number, wire, value


def _want(wire: int, allowed: tuple[int, ...], number: int) -> None:
    if wire not in allowed:
        raise WireError("wrong_wire_type", f"field {number}")


def _text(value: int | bytes, wire: int, number: int) -> str:
    _want(wire, (LENGTH,), number)
    try:
        return bytes(value).decode("utf-8")  # type: ignore[arg-type]
    except UnicodeDecodeError:
        raise WireError("bad_utf8", f"field {number}") from None


def _int(value: int | bytes, wire: int, number: int) -> int:
    _want(wire, (VARINT,), number)
    return value  # type: ignore[return-value]


def _add_hashes(out: array, value: int | bytes, wire: int, number: int) -> None:
    """Repeated sfixed64: one unpacked value, or a packed run."""
    _want(wire, (FIXED64, LENGTH), number)
    if wire == FIXED64:
        out.append(value)  # type: ignore[arg-type]
        return
    if len(value) % 8:  # type: ignore[arg-type]
        raise WireError("bad_packed", f"field {number}")
    run = array("Q", value)  # type: ignore[arg-type]
    if _BIG_ENDIAN:
        run.byteswap()
    out.extend(run)


def _add_varints(out: list[int], value: int | bytes, wire: int, number: int) -> None:
    """Repeated uint32 (or an enum): one unpacked value, or a packed run of varints."""
    _want(wire, (VARINT, LENGTH), number)
    if wire == VARINT:
        out.append(value)  # type: ignore[arg-type]
        return
    data, pos = bytes(value), 0  # type: ignore[arg-type]
    while pos < len(data):
        v, pos = _varint(data, pos)
        out.append(v)


@dataclass(frozen=True, slots=True)
class Action:
    """``ExternalKvAction``: ``type`` 1 REPORT, 2 REVOKE, 3 CLEAR_ALL_AT_TIER; ``tier`` 1 HBM, 2 DRAM, 3 SSD."""

    type: int
    tier: int
    hashes: array
    component_masks: tuple[int, ...]
    block_sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ApplyBatch:
    """``ApplyExternalKvBatchRequest`` (``cache_spec``, field 6, is read past: see the docs)."""

    worker_id: str
    seq: int
    actions: tuple[Action, ...]
    worker_address: str
    worker_epoch: str
    enforce_sequence: bool


@dataclass(frozen=True, slots=True)
class HashQuery:
    """``MatchExternalKvRequest`` (``flag``: count_as_hit), ``MatchExternalKvPrefixRequest``
    (``limit``: max_blocks) and ``GetExternalKvHitCountsRequest`` (hashes only) alike."""

    hashes: array
    flag: bool = False
    limit: int = 0


def _enum(value: int) -> int:
    """An int32 enum off the wire (a negative one comes as a 10-byte varint)."""
    return value - (1 << 64) if value >> 63 else value


def decode_action(data: bytes) -> Action:
    kind = tier = 0
    hashes, masks, sizes = array("Q"), list[int](), list[int]()
    for number, wire, value in fields(data):
        if number == 1:
            kind = _enum(_int(value, wire, number))
        elif number == 2:
            tier = _enum(_int(value, wire, number))
        elif number == 3:
            _add_hashes(hashes, value, wire, number)
        elif number == 4:
            _add_varints(masks, value, wire, number)
        elif number == 5:
            _add_varints(sizes, value, wire, number)
    return Action(kind, tier, hashes, tuple(masks), tuple(sizes))


def decode_apply(data: bytes) -> ApplyBatch:
    worker_id = address = epoch = ""
    seq, enforce, actions = 0, False, []
    for number, wire, value in fields(data):
        if number == 1:
            worker_id = _text(value, wire, number)
        elif number == 2:
            seq = _int(value, wire, number)
        elif number == 3:
            _want(wire, (LENGTH,), number)
            actions.append(decode_action(value))  # type: ignore[arg-type]
        elif number == 4:
            address = _text(value, wire, number)
        elif number == 6:
            _want(wire, (LENGTH,), number)
            list(fields(value))  # type: ignore[arg-type]  # well-formed, or the request is refused
        elif number == 7:
            epoch = _text(value, wire, number)
        elif number == 8:
            enforce = bool(_int(value, wire, number))
    return ApplyBatch(worker_id, seq, tuple(actions), address, epoch, enforce)


def decode_query(data: bytes) -> HashQuery:
    """Field 1 the hashes, field 2 a bool or uint32 (count_as_hit / max_blocks)."""
    hashes, second = array("Q"), 0
    for number, wire, value in fields(data):
        if number == 1:
            _add_hashes(hashes, value, wire, number)
        elif number == 2:
            second = _int(value, wire, number)
    return HashQuery(hashes, bool(second), second & 0xFFFFFFFF)


# -- writing ---------------------------------------------------------------------------------
def varint(value: int) -> bytes:
    value &= MASK64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def uint_field(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value) if value else b""


def bytes_field(number: int, value: bytes) -> bytes:
    return varint(number << 3 | LENGTH) + varint(len(value)) + value if value else b""


def text_field(number: int, value: str) -> bytes:
    return bytes_field(number, value.encode())


def hashes_field(number: int, hashes: Iterable[int]) -> bytes:
    """A packed repeated sfixed64 of u64 hashes."""
    run = array("Q", hashes)
    if _BIG_ENDIAN:
        run.byteswap()
    return bytes_field(number, run.tobytes())


def messages_field(number: int, messages: Iterable[bytes]) -> bytes:
    """A repeated message field (an empty message is still one element)."""
    return b"".join(varint(number << 3 | LENGTH) + varint(len(m)) + m for m in messages)


def tier_hashes(tier: int, hashes: Iterable[int]) -> bytes:
    """``TierHashes`` (no component detail: kvindex holds whole blocks)."""
    return uint_field(1, tier) + hashes_field(2, hashes)


def node_match(worker_id: str, address: str, tiers: Iterable[bytes]) -> bytes:
    """``ExternalKvNodeMatch``."""
    return text_field(1, worker_id) + text_field(2, address) + messages_field(3, tiers)


def prefix_match(address: str, blocks: int, worker_id: str) -> bytes:
    """``ExternalKvPrefixMatch``."""
    return text_field(1, address) + uint_field(2, blocks) + text_field(3, worker_id)


def prefix_response(matches: Iterable[bytes], best: int, blocks_read: int) -> bytes:
    """``MatchExternalKvPrefixResponse``."""
    return messages_field(1, matches) + uint_field(2, best) + uint_field(3, blocks_read)


def hit_entry(h: int, count: int) -> bytes:
    """``HitCountEntry``: hash (sfixed64, field 1), hit_count_total (field 2)."""
    return varint(1 << 3 | FIXED64) + (h & MASK64).to_bytes(8, "little") + uint_field(2, count)
