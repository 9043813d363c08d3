"""The closed vocabulary of KV-cache events, as kvindex sees them after decoding.

Invariants:
- Nothing here knows about bytes on the wire: adapters turn one engine dialect into these types,
  and everything downstream (ingest, indexes) sees only these.
- Engine block hashes are unsigned 64-bit ints (adapters normalise signed ints and byte digests).
- ``parent_hash is None`` means "the run starts at the first block of the prompt".
- Events are frozen; a batch is applied in order, as one unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

GPU = "GPU"
"""The device tier; the only tier whose blocks count as a prefix-cache hit."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One ZeroMQ message as an engine publishes it: ``[topic, seq (u64 big-endian), payload]``."""

    topic: str
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = GPU
    lora_name: str | None = None
    cache_salt: str | None = None
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str = GPU
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One decoded payload. ``skipped`` names (by reason) the events the decoder had to skip."""

    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int = 0
    skipped: tuple[str, ...] = ()


class DecodeError(ValueError):
    """A payload that cannot be decoded at all. ``reason`` is a short fixed label for metrics."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class Decoder(Protocol):
    """Decodes one payload of one engine dialect. Raises ``DecodeError``; never anything else."""

    def decode(self, payload: bytes) -> EventBatch: ...
