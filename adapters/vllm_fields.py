"""The value rules of one vLLM KV event's fields, shared by the decoder's typed and tolerant paths.

Invariants:
- A field that cannot be used raises ``Skip(reason)`` (the reason is a metric label): the event,
  or only that field, is skipped and named in ``EventBatch.skipped``; nothing else is raised.
- A hash given as bytes is read as vLLM does (the last 8 bytes, big-endian: ``last8_be``) or as
  SGLang does (the first 8, signed: ``first8_signed``), as an unsigned 64-bit int.
- A medium is upper-cased, nil or "" being the device's (``GPU``).
- A label (``LABELS``: locality, ownership, session_id) is nil or a string, else dropped alone;
  ``lookahead_token_ids`` is nil or one entry per hash (``lookahead_of``), else the event is skipped.
"""

from __future__ import annotations

from array import array
from typing import Any

from kvindex.events import GPU

MASK64 = (1 << 64) - 1

# An array event's fields by position after its tag (vLLM's declaration order, docs/vllm-versions.md)
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx", "unread_kind", "unread_sliding_window",  # arrays carry no kind (vllm_groups)
                 "locality", "ownership", "session_id", "lookahead_token_ids")  # docs/vllm-versions.md
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")  # then locality, ownership: not used (hash-keyed)
LABELS = ("locality", "ownership", "session_id")


class Skip(Exception):
    """One event (or one field of it) that cannot be used; ``reason`` is a metric label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def last8_be(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


def first8_signed(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True) & MASK64


def token_array(value: Any, skipped: list[str]) -> array:
    """Token ids as u32s; anything else (SGLang bigram pairs, junk) keeps the event keyless."""
    if isinstance(value, list) and all(type(t) is int for t in value):
        try:
            return array("I", value)
        except OverflowError:
            pass
    if value is not None:
        skipped.append("unsupported_token_ids")
    return array("I")


def is_tier_placeholder(block_size: int, medium: str, token_ids: Any) -> bool:
    """A lower tier's copy of a device block as vLLM's offloading connector announces it by
    default: block size 0, no token ids, a medium other than the device's (the index keys it
    through the device copy of the same hash). Block size 0 on the device is bad_block_size."""
    return block_size == 0 and medium != GPU and not token_ids


def medium_of(value: Any) -> str:
    """Upper-cased medium; nil or "" is the device tier (both decoder paths use this)."""
    if value is None or value == "":
        return GPU
    if not isinstance(value, str) or not value:
        raise Skip("bad_medium")
    return value.upper()


def small_int(value: Any, default: int) -> int:
    if value is None:
        return default
    if type(value) is not int:
        raise Skip("bad_field_type")
    return value


def cache_salt_of(extra_keys: Any, lora_name: str | None) -> str | None:
    """vLLM's cache_salt, by position in the first block's extra keys: vLLM writes the LoRA
    adapter's name first (when the event names one), then the multimodal entries (``[identifier,
    offset]`` pairs), then the salt (a string), then the prompt-embeds digest (bytes). So the salt
    is the last string after position 0 when position 0 is the adapter's name, of all of them
    otherwise: never judged by comparing values (a salt equal to the adapter's name is a salt)."""
    if not isinstance(extra_keys, list) or not extra_keys:
        return None
    first = extra_keys[0]
    if isinstance(first, dict):  # SGLang's {"cache_salt": ...}
        salt = first.get("cache_salt")
        return salt if isinstance(salt, str) else None
    if not isinstance(first, list):
        return None
    rest = first[1:] if lora_name is not None and first and first[0] == lora_name else first
    strings = [k for k in rest if isinstance(k, str)]
    return strings[-1] if strings else None


def lookahead_of(value: Any, hashes: int, block_size: int) -> tuple[array | None, ...] | None:
    """vLLM 0.34's ``lookahead_token_ids``: nil (not sent), or one entry per block hash, each nil or
    at most ``block_size`` u32 token ids (the tokens after the block its engine hash also covers;
    kvindex.index.lookahead's rule relies on their fitting in the next block). Anything else makes
    the event unusable: ``bad_lookahead_token_ids`` (its matched length could not be judged)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != hashes:
        raise Skip("bad_lookahead_token_ids")
    out: list[array | None] = []
    for entry in value:
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, list) or len(entry) > block_size or not all(type(t) is int for t in entry):
            raise Skip("bad_lookahead_token_ids")
        try:
            out.append(array("I", entry))
        except OverflowError:
            raise Skip("bad_lookahead_token_ids") from None
    return tuple(out)


def label_of(value: Any, skipped: list[str]) -> str | None:
    """A string label vLLM may attach (``locality``, ``ownership``, ``session_id``): nil or a
    string; anything else is dropped alone (``bad_label``), the event kept."""
    if value is None or isinstance(value, str):
        return value
    skipped.append("bad_label")
    return None


def tag_and_fields(raw: Any) -> tuple[str, dict[str, Any]]:
    """An event's tag and its fields by name (an array's by position: ``STORED_FIELDS``)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise Skip("bad_event")
        return tag, raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS
        return tag, dict(zip(names, raw[1:]))
    raise Skip("bad_event")
