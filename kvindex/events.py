"""The closed vocabulary of KV-cache events, as kvindex sees them after decoding.

Invariants:
- Nothing here knows about bytes on the wire: adapters turn one engine dialect into these types,
  and everything downstream (ingest, indexes) sees only these.
- Engine block hashes are unsigned 64-bit ints (adapters normalise signed ints and byte digests).
- ``parent_hash is None`` means "the run starts at the first block of the prompt".
- Events are frozen; a batch is applied in order, as one unit.
- ``token_ids`` is a packed ``array("I")`` (u32 per token): one C-level conversion in the adapter,
  and the bytes kvindex hashes, without a Python object per token.
- ``block_hashes`` is a packed ``array("Q")`` as the adapters make it: one object per event, not
  one Python int per block; the index core reads its buffer as it is. Every index also takes any
  sequence of u64 ints (events built by hand: tests, tools).
- The types are frozen ``msgspec.Struct``s, as in vLLM's ``kv_events.py``: constructed millions of
  times a second on the ingest path, where a frozen dataclass costs several times more.
- ``lookahead_token_ids`` (vLLM 0.34, EAGLE/MTP lookahead-aware hashing): None when the event does
  not carry the field, else one entry per block hash: the tokens after the block that the engine's
  hash also covers (``array("I")``, at most ``block_size`` of them), or None for a block whose
  engine hash covers none (kvindex then treats its lookahead as unknown). A block's *key* never
  depends on them (kvindex.keys: the block's own tokens); matching judges them
  (kvindex.index.lookahead). ``locality``/``ownership``/``session_id`` are carried as sent
  (None when absent): labels, no part of any key (docs/vllm-versions.md).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

import msgspec

GPU = "GPU"
"""The device tier; the only tier whose blocks count as a prefix-cache hit."""

# The ranges every integer is checked against where it enters (wire, HTTP, configuration):
MAX_BLOCK_SIZE = 1 << 16  # tokens per block (engines use 16-256); more is garbage
MAX_DP_RANK = (1 << 16) - 1  # data-parallel ranks of one engine
MAX_SEQ = (1 << 64) - 2  # a stream's seq is a u64; all ones is the replay protocol's end marker, never a batch


class Frame(msgspec.Struct, frozen=True, gc=False):
    """One ZeroMQ message as an engine publishes it: ``[topic, seq (u64 big-endian), payload]``."""

    topic: str
    seq: int
    payload: bytes


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    block_hashes: Sequence[int]  # array("Q") from the adapters
    parent_hash: int | None
    token_ids: array  # array("I"); empty when the engine sent none (offload tiers)
    block_size: int
    medium: str = GPU
    lora_name: str | None = None
    cache_salt: str | None = None
    group_idx: int = 0
    lookahead_token_ids: tuple[array | None, ...] | None = None  # one per hash (vLLM 0.34), see above
    locality: str | None = None  # "LOCAL" / "REMOTE" relative to the publisher (vLLM #48281)
    ownership: str | None = None  # the secondary offloading tier that generated it (vLLM #52067)
    session_id: str | None = None  # the request's session that stored or reused it (vLLM #51381)


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    block_hashes: Sequence[int]  # array("Q") from the adapters
    medium: str = GPU
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


NON_PREFIX_GROUP = "non_prefix_group"
"""``EventBatch.skipped``'s reason for an event of a KV-cache group that is no prefix identity (a
hybrid model's sliding-window or Mamba group: adapters/vllm_groups.py). Not an error."""


class EventBatch(msgspec.Struct, frozen=True):
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

    def new_life(self) -> None:
        """The engine restarted: forget what was learned of its previous process (a hybrid
        model's prefix group, ``adapters/vllm_groups.py``)."""
        ...

    def decode_as_new_life(self, payload: bytes) -> EventBatch:
        """The payload decoded as the first batch of a new engine process would be (nothing
        learned applies), the decoder's state unchanged: a restart's evidence."""
        ...
