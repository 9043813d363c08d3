"""A simulated engine block cache with vLLM's (V1) prefix-caching semantics.

Pure and deterministic: no sockets, no asyncio, no clocks, no global state. The same sequence of
calls on a ``SimulatedCache`` built with the same arguments always yields the same events.

Model (mirrors vLLM ``BlockPool`` / ``KVCacheManager``, see wire-format.md §1.4):

- The cache owns ``num_blocks`` physical blocks (vLLM's reserved null block is not modelled).
  Every block is either *referenced* (only during ``admit``) or sits in the *free queue*, an LRU
  list whose head is evicted first. Initially every block is free and empty, in id order.
- Block hashes are computed for FULL blocks only, as a chain: ``h_i = xxh3_64(LE64(h_{i-1}) ||
  tokens_i as u32 LE, seed=hash_seed)`` with ``h_{-1} = 0``. Hashes are unsigned 64-bit ints.
  A hash identifies the whole prefix up to and including its block.
- A hit is the longest prefix of the prompt's block hashes that are all cached, but the block
  holding the LAST prompt token is never a hit: ``hit blocks <= (len(prompt) - 1) // block_size``.
- ``admit`` touches the hit blocks (removing them from the free queue), then takes one block per
  remaining full prompt block from the HEAD of the free queue. Taking a block that still carries
  a hash evicts it: one ``BlockRemoved`` event per evicted block, in eviction order. The new
  blocks then get their hashes and ONE ``BlockStored`` event covers them all (parent = hash of
  the last hit block, ``None`` iff the run starts at block 0). Events of one admit come in the
  order vLLM emits them in one step: removals first, then the store.
- No dedup (as in vLLM): if a hash is already cached (the last-token rule forces the block to be
  recomputed) a second physical copy is stored, with its own ``BlockStored``; each copy is later
  evicted with its own ``BlockRemoved``. ``held()`` reports distinct hashes.
- The request finishes immediately: its blocks (hits and new) are appended to the TAIL of the free
  queue in reverse order (vLLM frees tail-first), so children are evicted before their parents
  and the request's blocks become the most recently used ones.
- The partial last block and generated tokens are not modelled (they carry no hash and would be
  reused first, emitting nothing).
- Capacity: if the prompt needs more new blocks than are free (i.e. more than ``num_blocks`` minus
  its hits), only the leading blocks that fit are stored (vLLM would refuse to schedule it).
- ``reset()`` forgets every hash (one ``AllBlocksCleared`` event, no per-block removals); the
  free-queue order is kept, as in vLLM's ``reset_prefix_cache``.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

GPU = "GPU"
FULL_ATTENTION = "full_attention"

_BLOCK_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
"""vLLM <= 0.23 positional field order of BlockStored (wire-format.md §1.3)."""

_BLOCK_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
"""vLLM <= 0.23 positional field order of BlockRemoved."""


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of admitting one prompt.

    Invariants: ``cached_tokens`` is a multiple of the block size and ``< prompt_tokens`` (or 0);
    ``events`` holds zero or more BlockRemoved events followed by at most one BlockStored.
    """

    cached_tokens: int
    prompt_tokens: int
    events: list[dict]


def block_hashes(token_ids: Sequence[int], block_size: int, hash_seed: int = 0) -> list[int]:
    """Chained u64 hashes of the full blocks of ``token_ids`` (token ids must fit in u32)."""
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    words = array("I", token_ids[: n_full * block_size])
    if sys.byteorder == "big":
        words.byteswap()
    raw = words.tobytes()
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    parent = 0
    out: list[int] = []
    for start in range(0, n_full * step, step):
        parent = digest(parent.to_bytes(8, "little") + raw[start : start + step], hash_seed)
        out.append(parent)
    return out


def block_removed(block_hash: int) -> dict:
    """A vLLM map-dialect BlockRemoved event for one hash."""
    return {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": GPU, "group_idx": 0}


def block_stored(
    hashes: list[int], parent: int | None, token_ids: list[int], block_size: int
) -> dict:
    """A vLLM map-dialect BlockStored event (the field set of vLLM's map era, GPU tier)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": GPU,
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": FULL_ATTENTION,
    }


def to_array_event(event: dict) -> list:
    """Convert one map-dialect event to vLLM <= 0.23 tagged-array form (missing fields = None)."""
    tag = event["type"]
    fields: tuple[str, ...]
    if tag == "BlockStored":
        fields = _BLOCK_STORED_FIELDS
    elif tag == "BlockRemoved":
        fields = _BLOCK_REMOVED_FIELDS
    elif tag == "AllBlocksCleared":
        fields = ()
    else:
        raise ValueError(f"unknown event type {tag!r}")
    return [tag, *(event.get(name) for name in fields)]


def encode_batch(events: list[dict], ts: float, dp_rank: int = 0, dialect: str = "map") -> bytes:
    """msgpack ``[ts, events, dp_rank]`` as vLLM publishes it; ``dialect`` is "map" or "array".

    Floats are float64, ints take msgpack's smallest width (u64 hashes >= 2**32 become 0xcf).
    """
    wire: list[Any] = events
    if dialect == "array":
        wire = [to_array_event(e) for e in events]
    elif dialect != "map":
        raise ValueError(f"unknown dialect {dialect!r}")
    return msgpack.packb([float(ts), wire, dp_rank], use_bin_type=True)


class SimulatedCache:
    """One engine replica's GPU prefix cache; see the module docstring for the semantics.

    Invariants between calls: every block is in the free queue (nothing is running); a block id
    is in ``_copies[h]`` (oldest copy first) iff ``_hash_of[id] == h``; ``_copies`` has no empty
    entries.
    """

    def __init__(self, num_blocks: int, block_size: int, hash_seed: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: list[int | None] = [None] * num_blocks
        self._copies: dict[int, list[int]] = {}

    encode_batch = staticmethod(encode_batch)

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        """This cache's chained hashes of the full blocks of ``token_ids``."""
        return block_hashes(token_ids, self.block_size, self.hash_seed)

    def _max_hit_blocks(self, n_tokens: int) -> int:
        return (n_tokens - 1) // self.block_size if n_tokens > 0 else 0

    def _hit_blocks(self, hashes: list[int], limit: int) -> list[int]:
        """Block ids of the longest cached prefix (first copy of each hash), at most ``limit``."""
        hits: list[int] = []
        copies = self._copies
        for h in hashes[:limit]:
            ids = copies.get(h)
            if ids is None:
                break
            hits.append(ids[0])
        return hits

    def lookup(self, token_ids: Sequence[int]) -> int:
        """Tokens a request with this prompt would find cached now (no side effects)."""
        limit = self._max_hit_blocks(len(token_ids))
        hashes = block_hashes(token_ids[: limit * self.block_size], self.block_size, self.hash_seed)
        return len(self._hit_blocks(hashes, limit)) * self.block_size

    def prefix_blocks(self, token_ids: Sequence[int]) -> int:
        """Leading full blocks of ``token_ids`` held now, WITHOUT the last-token rule.

        This is what a precise index should report as the match depth for the prompt.
        """
        hashes = self.hashes(token_ids)
        return len(self._hit_blocks(hashes, len(hashes)))

    def held_prefix(self, hashes: Sequence[int]) -> int:
        """Leading entries of ``hashes`` (this cache's chain of a prompt) held now, no side effects."""
        return len(self._hit_blocks(hashes, len(hashes)))  # type: ignore[arg-type]

    def held(self) -> set[int]:
        """The distinct block hashes currently cached."""
        return set(self._copies)

    def physical_blocks(self) -> int:
        """Number of physical blocks carrying a hash (counts duplicate copies)."""
        return sum(len(ids) for ids in self._copies.values())

    def _evict_head(self, count: int, events: list[dict]) -> list[int]:
        """Pop ``count`` blocks from the free-queue head, evicting their hashes (in order)."""
        taken: list[int] = []
        free, hash_of, copies = self._free, self._hash_of, self._copies
        for _ in range(count):
            block, _ = free.popitem(last=False)
            old = hash_of[block]
            if old is not None:
                ids = copies[old]
                if len(ids) == 1:
                    del copies[old]
                else:
                    ids.remove(block)
                hash_of[block] = None
                events.append(block_removed(old))
            taken.append(block)
        return taken

    def _store(self, blocks: list[int], hashes: list[int]) -> None:
        for block, h in zip(blocks, hashes):
            self._hash_of[block] = h
            ids = self._copies.get(h)
            if ids is None:
                self._copies[h] = [block]
            else:
                ids.append(block)

    def admit(self, token_ids: Sequence[int], hashes: list[int] | None = None) -> Admission:
        """Run one request's prefill and finish it; return its hit and the events of the step.

        ``hashes``, when given, must be ``self.hashes(token_ids)`` (a caller that already has them
        saves computing the chain twice)."""
        bs = self.block_size
        hashes = self.hashes(token_ids) if hashes is None else hashes
        hits = self._hit_blocks(hashes, self._max_hit_blocks(len(token_ids)))
        free = self._free
        for block in hits:  # touch: referenced blocks leave the free queue
            del free[block]
        n_hit = len(hits)
        n_new = min(len(hashes) - n_hit, len(free))
        events: list[dict] = []
        new = self._evict_head(n_new, events)
        stored = hashes[n_hit : n_hit + n_new]
        self._store(new, stored)
        if stored:
            parent = hashes[n_hit - 1] if n_hit else None
            tokens = list(token_ids[n_hit * bs : (n_hit + n_new) * bs])
            events.append(block_stored(stored, parent, tokens, bs))
        for block in reversed(hits + new):  # finish: freed tail-first, appended at the MRU end
            free[block] = None
        return Admission(n_hit * bs, len(token_ids), events)

    def reset(self) -> list[dict]:
        """Forget every cached hash (vLLM ``reset_prefix_cache``); the free order is kept."""
        self._copies.clear()
        self._hash_of = [None] * self.num_blocks
        return [{"type": "AllBlocksCleared"}]
