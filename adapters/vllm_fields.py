"""The value rules of one vLLM KV event's fields, shared by the decoder's typed and tolerant paths.

Invariants:
- A field that cannot be used raises ``Skip(reason)`` (the reason is a metric label): the event,
  or only that field, is skipped and named in ``EventBatch.skipped``; nothing else is raised.
- A hash given as bytes is read as vLLM does (the last 8 bytes, big-endian: ``last8_be``) or as
  SGLang does (the first 8, signed: ``first8_signed``), as an unsigned 64-bit int.
- A medium is upper-cased, nil or "" being the device's (``GPU``).
"""

from __future__ import annotations

from array import array
from typing import Any

from kvindex.events import GPU

MASK64 = (1 << 64) - 1


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
