"""Decoder for the msgpack KV-event payload of vLLM, which SGLang and llm-d-inference-sim reuse.

Wire format (reference: vllm/distributed/kv_events.py):
- payload = ``[ts: float, events: list, data_parallel_rank: int | nil]`` (2 elements before
  vLLM 0.9.1; a map ``{"ts", "events", "data_parallel_rank"}`` is tolerated too);
- an event is a tagged array ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]`` (vLLM <= 0.23, SGLang
  before 2026-09; missing trailing fields are nil, extra ones ignored) or a map with ``"type"``
  (vLLM >= 0.26): ``{"type": "BlockStored", "block_hashes": [...], ...}``; vLLM 0.34's fields
  (locality, ownership, session_id, lookahead_token_ids) are read from both, an array's by
  position (vllm_fields.STORED_FIELDS; docs/vllm-versions.md has the version matrix);
- a hash is a u64, a negative i64 (two's complement) or bytes (vLLM: the last 8 bytes, big-endian;
  SGLang: the first 8); a parent of nil or 0 (llm-d-inference-sim arrays) means "no parent".

Invariants: ``decode`` raises only ``DecodeError``; an event it cannot read is skipped and named in
``EventBatch.skipped`` (one reason per skipped event or field), never fatal for the batch.
Adjacent BlockRemoved events of one medium and group are merged into one (vLLM sends one hash per
event; applied in order, the effect is the same). A BlockStored's block size is 1..MAX_BLOCK_SIZE,
or 0 for a tier placeholder (``is_tier_placeholder``: not on GPU, no token ids), else bad_block_size.
Only the prefix group's events are kept (adapters/vllm_groups.py: ``groups``, the prefix group
learned, shared with the C twin).

Three paths, one result: the C twin of the typed path (``adapters/_vllm.c``: token ids straight
into an ``array("I")``, no Python int per token) takes the batches engines really send; a typed msgspec decoder (the structs below state the wire format; C-level
validation, no Python object per token) handles well-formed batches; anything it refuses goes
through the tolerant generic path, which knows how to skip and name what is wrong.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import msgspec

from adapters import vllm_groups as G
from adapters.vllm_fields import (
    MASK64,
    Skip,
    cache_salt_of,
    LABELS,
    STORED_FIELDS as STORED_FIELDS,
    is_tier_placeholder,
    label_of,
    last8_be,
    lookahead_of,
    medium_of,
    small_int,
    tag_and_fields,
    token_array,
)
from kvindex import native
from kvindex.events import (
    GPU,
    MAX_BLOCK_SIZE,
    MAX_DP_RANK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    KVEvent,
)



Hash = int | bytes


class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: list[int] = []
    block_size: int = -1  # absent: refused (0 is a tier placeholder's)
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int] | None] | None = None


class _MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _ArrayStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: list[int] = []
    block_size: int = -1  # absent: refused (0 is a tier placeholder's)
    lora_id: Any = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    unread_kind: Any = None  # kv_cache_spec_kind and its window: not read from arrays (vllm_groups)
    unread_sliding_window: Any = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int] | None] | None = None  # later fields ignored, as msgspec ignores them


class _ArrayRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _MapBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: int | None = None


_STORES = (_MapStored, _ArrayStored)
_TYPED: tuple[msgspec.msgpack.Decoder[Any], ...] = (msgspec.msgpack.Decoder(_MapBatch), msgspec.msgpack.Decoder(_ArrayBatch))
_KINDS = (BlockStored, BlockRemoved, AllBlocksCleared, EventBatch, array("I", [0]), array("Q", [0]), GPU,
          G.NON_PREFIX_GROUP)  # what adapters._vllm builds (token ids and hashes: repeats of the arrays)


class VllmDecoder:
    """Decodes one payload. ``bytes_hash`` maps a byte digest to a u64."""

    def __init__(self, bytes_hash: Callable[[bytes], int] = last8_be, fast: Any = native.load("adapters._vllm")) -> None:
        self._bytes_hash = bytes_hash
        self._typed = list(_TYPED)  # the dialect that worked last is tried first
        self._fast = fast  # the C twin of the typed path (None: not built, or pure Python)
        self.groups: list[int | None] = [None]  # the stream's prefix group, once known (vllm_groups)

    def new_life(self) -> None:
        """The engine restarted (a new process, maybe another model): its prefix group is learned again."""
        self.groups[0] = None

    def decode_as_new_life(self, payload: bytes) -> EventBatch:
        """The payload as a new process's first batch decodes (no prefix group known); state kept."""
        known = self.groups[0]
        self.groups[0] = None
        try:
            return self.decode(payload)
        finally:
            self.groups[0] = known

    def decode(self, payload: bytes) -> EventBatch:
        if self._fast is not None and (batch := self._fast.decode(payload, _KINDS, self.groups)) is not None:
            return batch
        return self.decode_python(payload)

    def decode_python(self, payload: bytes) -> EventBatch:
        """The reference: the typed msgspec path, then the tolerant one."""
        for i, typed in enumerate(self._typed):
            try:
                wire = typed.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            batch = self._from_typed(wire)
            if batch is not None:
                if i:
                    self._typed.reverse()
                return batch
        return self._decode_generic(payload)

    def _from_typed(self, wire: _MapBatch | _ArrayBatch) -> EventBatch | None:
        """Typed structs to kvindex events; None when a value needs the generic path's care."""
        rank = wire.data_parallel_rank or 0
        if not 0 <= rank <= MAX_DP_RANK:
            return None
        events: list[KVEvent] = []
        removed: list[Any] = []  # a run of removals of one (medium, group), merged into one event
        where: tuple[str, int] = (GPU, 0)
        raw_where: tuple[Any, Any] | None = None  # (medium, group_idx) as sent, for ``where``
        prefix, skipped = self.groups[0], []
        if prefix is None:  # the first full-attention store: decoded below (``_typed_stored``), or None, the
            # batch then the generic path's, which learns from the first store that decodes
            prefix = G.first_prefix_group((w.group_idx or 0, getattr(w, "kv_cache_spec_kind", None))
                                          for w in wire.events if isinstance(w, _STORES))
        for w in wire.events:
            if type(w) is _MapRemoved or type(w) is _ArrayRemoved:  # vLLM: one event per block
                if not w.block_hashes:
                    return None
                if not G.removed_indexed(prefix, w.group_idx or 0):
                    skipped.append(G.NON_PREFIX_GROUP)
                    continue
                raw = (w.medium, w.group_idx)
                if raw != raw_where:
                    here = (medium_of(w.medium), w.group_idx or 0)
                    if removed and here != where:
                        if (hashes := _plain_hashes(removed)) is None:
                            return None
                        events.append(BlockRemoved(hashes, *where))
                        removed = []
                    where, raw_where = here, raw
                removed.extend(w.block_hashes)  # checked once per run, below
                continue
            stored = type(w) in _STORES
            if stored and not G.stored_indexed(prefix, w.group_idx or 0,  # type: ignore[union-attr]
                                               getattr(w, "kv_cache_spec_kind", None)):
                skipped.append(G.NON_PREFIX_GROUP)
                continue
            if removed:
                if (hashes := _plain_hashes(removed)) is None:
                    return None
                events.append(BlockRemoved(hashes, *where))
                removed = []
            ev = _typed_stored(w) if stored else AllBlocksCleared()  # type: ignore[arg-type]
            if ev is None:
                return None
            events.append(ev)
        if removed:
            if (hashes := _plain_hashes(removed)) is None:
                return None
            events.append(BlockRemoved(hashes, *where))
        self.groups[0] = prefix
        return EventBatch(ts=wire.ts, events=tuple(events), dp_rank=rank, skipped=tuple(skipped))

    def _decode_generic(self, payload: bytes) -> EventBatch:
        try:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises many types for bad input; all mean the same
            raise DecodeError("msgpack", type(exc).__name__) from None
        ts, raw_events, rank = _batch_parts(obj)
        events: list[KVEvent] = []
        skipped: list[str] = []
        prefix = self.groups[0] if self.groups[0] is not None else self._first_accepted_group(raw_events)
        for raw in raw_events:
            try:
                events.append(self._event(raw, skipped, prefix))
            except Skip as skip:
                skipped.append(skip.reason)
        self.groups[0] = prefix
        return EventBatch(ts=ts, events=tuple(events), dp_rank=rank, skipped=tuple(skipped))

    def _first_accepted_group(self, raw_events: list[Any]) -> int | None:
        """The prefix group's look-ahead (vllm_groups): the group of the batch's first BlockStored
        of a full-attention kind that decodes into an event; a store skipped teaches nothing."""
        return G.first_prefix_group(_accepted_stores(raw_events, self._stored))

    def _event(self, raw: Any, skipped: list[str], prefix: int | None) -> KVEvent:
        tag, fields = tag_and_fields(raw)
        if tag == "BlockStored":
            if not G.stored_indexed(prefix, small_int(fields.get("group_idx"), 0), fields.get("kv_cache_spec_kind")):
                raise Skip(G.NON_PREFIX_GROUP)
            return self._stored(fields, skipped)
        if tag == "BlockRemoved":
            if not G.removed_indexed(prefix, group := small_int(fields.get("group_idx"), 0)):
                raise Skip(G.NON_PREFIX_GROUP)
            return BlockRemoved(self._hashes(fields.get("block_hashes")), medium_of(fields.get("medium")), group)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        raise Skip("unknown_event_type")

    def _stored(self, f: dict[str, Any], skipped: list[str]) -> BlockStored:
        hashes = self._hashes(f.get("block_hashes"))
        parent = f.get("parent_block_hash")
        parent_hash = None if parent is None or parent == 0 else self._hash(parent)
        block_size = f.get("block_size")
        medium = medium_of(f.get("medium"))
        if type(block_size) is not int or not 0 < block_size <= MAX_BLOCK_SIZE \
                and not is_tier_placeholder(block_size, medium, f.get("token_ids")):
            raise Skip("bad_block_size")
        lora_name = f.get("lora_name")
        extra = f.get("extra_keys")
        if isinstance(lora_name, dict):  # SGLang arrays carry {"cache_salt": ...} in this slot
            lora_name, extra = None, [lora_name]
        if lora_name is not None and not isinstance(lora_name, str):
            raise Skip("bad_lora_name")
        tokens = token_array(f.get("token_ids"), skipped)
        lookahead = lookahead_of(f.get("lookahead_token_ids"), len(hashes), block_size)
        return BlockStored(
            block_hashes=hashes,
            parent_hash=parent_hash,
            token_ids=tokens,
            block_size=block_size,
            medium=medium,
            lora_name=lora_name,
            cache_salt=cache_salt_of(extra, lora_name),
            group_idx=small_int(f.get("group_idx"), 0),
            lookahead_token_ids=lookahead,
            **{name: label_of(f.get(name), skipped) for name in LABELS},
        )

    def _hashes(self, value: Any) -> array:
        if not isinstance(value, list) or not value:
            raise Skip("bad_block_hashes")
        return array("Q", [self._hash(h) for h in value])

    def _hash(self, value: Any) -> int:
        if type(value) is int:
            if -(1 << 63) <= value <= MASK64:
                return value & MASK64
        elif isinstance(value, bytes) and value:
            return self._bytes_hash(value)
        raise Skip("bad_hash")


def _accepted_stores(raw_events: list[Any], decode_stored: Callable[[dict[str, Any], list[str]], Any]
                     ) -> Iterable[tuple[int, Any]]:
    """(group, kind) of each BlockStored of a batch that ``decode_stored`` decodes (one it skips,
    ``Skip``, is left out), for the prefix group's look-ahead."""
    for raw in raw_events:
        try:
            tag, f = tag_and_fields(raw)
            if tag == "BlockStored":
                group, kind = small_int(f.get("group_idx"), 0), f.get("kv_cache_spec_kind")
                if G.is_full_attention(kind):  # only a candidate is decoded, and only while no group is known
                    decode_stored(f, [])
                yield group, kind
        except Skip:
            pass


def _plain_hashes(values: list[Any]) -> array | None:
    """Hashes that are already u64 ints (the common case), packed and checked in C; else None."""
    try:
        return array("Q", values)
    except (OverflowError, TypeError):
        return None


def _typed_stored(w: _MapStored | _ArrayStored) -> BlockStored | None:
    hashes = _plain_hashes(w.block_hashes)
    parent = w.parent_block_hash
    if not hashes or not (parent is None or type(parent) is int and 0 <= parent <= MASK64):
        return None
    medium = medium_of(w.medium)
    if not 0 < w.block_size <= MAX_BLOCK_SIZE and not is_tier_placeholder(w.block_size, medium, w.token_ids):
        return None
    try:
        tokens = array("I", w.token_ids)
    except OverflowError:
        return None
    extra = w.extra_keys
    try:
        lookahead = lookahead_of(w.lookahead_token_ids, len(hashes), w.block_size)
    except Skip:
        return None  # the generic path names it
    return BlockStored(
        block_hashes=hashes,
        parent_hash=parent or None,
        token_ids=tokens,
        block_size=w.block_size,
        medium=medium,
        lora_name=w.lora_name,
        cache_salt=cache_salt_of(extra, w.lora_name) if extra else None,
        group_idx=w.group_idx or 0,
        lookahead_token_ids=lookahead,
        locality=w.locality,
        ownership=w.ownership,
        session_id=w.session_id,
    )


def _batch_parts(obj: Any) -> tuple[float, list[Any], int]:
    if isinstance(obj, list) and len(obj) in (2, 3):
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) == 3 else None
    elif isinstance(obj, dict):
        ts, events = obj.get("ts"), obj.get("events")
        rank = obj.get("data_parallel_rank", obj.get("dp_rank"))
    else:
        raise DecodeError("bad_batch", f"expected [ts, events, dp_rank], got {type(obj).__name__}")
    if type(ts) not in (int, float):
        raise DecodeError("bad_batch", "ts is not a number")
    if not isinstance(events, list):
        raise DecodeError("bad_batch", "events is not an array")
    if rank is None:
        rank = 0
    if type(rank) is not int or not 0 <= rank <= MAX_DP_RANK:
        raise DecodeError("bad_batch", "data_parallel_rank is not a small int")
    return float(ts), events, rank
