"""Which KV-cache group of a vLLM stream kvindex indexes (hybrid models), event by event.

vLLM (0.32: ``vllm/distributed/kv_events.py``; ``KVCacheManager.take_events`` annotates) tags each
BlockStored with ``group_idx`` and ``kv_cache_spec_kind`` ("full_attention", "sliding_window",
"mamba", ...; omitted when None); a BlockRemoved carries ``group_idx`` alone. A hybrid model has
one group per kind of layer and publishes a store, and later a removal, per group for the same
block hashes: a sliding window's or a Mamba state's blocks are no prefix of the prompt, and if
applied they would add and take copies of the full-attention blocks with the same hashes.

The rule, once (adapters/vllm.py applies it on both of its paths, adapters/_vllm.c in C, held
equal by tests/test_native_decoder.py and tests/test_hybrid_groups.py):
- A *full-attention kind* is one of ``FULL_ATTENTION_KINDS`` (vLLM's ``FullAttentionSpec`` and its
  subclasses), or no kind at all (engines that do not say: SGLang, older vLLM, and the array
  dialect, whose fields past ``group_idx`` are ignored).
- A stream's *prefix group* is the group of its first BlockStored of a full-attention kind that is
  accepted (decoded into an event; a store skipped for what is wrong with it, e.g.
  ``bad_block_size``, teaches nothing) (vLLM looks prefix hits up in its first full-attention
  group, ``full_attention_group_id``), looked for first in the batch being decoded, then kept by
  the decoder for the following batches. While none is known, a store is skipped only for what
  is wrong with it, or as ``NON_PREFIX_GROUP`` when its kind is not full attention.
- The prefix group is the engine process's (vLLM builds its group layout once per process, from
  the model): it is forgotten when the engine restarts (``VllmDecoder.new_life``, called by
  ``kvindex.ingest.writer`` on a restart, seen or unseen; the batch that showed the restart is
  decoded again in the new life). An AllBlocksCleared does NOT forget it: it empties the cache
  of the same process, whose layout is unchanged, and learning again after it could pick a
  sliding window's group in the array dialect, which carries no kind.
- Only the prefix group's events reach the index: a store of any other group, or of a kind that
  is not full attention, and a removal of any other group are skipped as ``NON_PREFIX_GROUP``
  (counted by kvindex in ``kvindex_events_skipped_total{pod,reason}``, never an error). While no
  prefix group is known, removals are applied (a stream without hybrid groups must not lose
  them): a removal of another group can then only take a copy kvindex holds for that hash.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvindex.events import NON_PREFIX_GROUP

FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})

__all__ = ["FULL_ATTENTION_KINDS", "NON_PREFIX_GROUP", "first_prefix_group", "is_full_attention", "stored_indexed", "removed_indexed"]


def is_full_attention(kind: Any) -> bool:
    """A kind that is not a string (garbage) is no full-attention kind."""
    return kind is None or type(kind) is str and kind in FULL_ATTENTION_KINDS


def first_prefix_group(stores: Iterable[tuple[int, Any]]) -> int | None:
    """The group of the first (group, kind) store of a full-attention kind, if any."""
    return next((group for group, kind in stores if is_full_attention(kind)), None)


def stored_indexed(prefix: int | None, group: int, kind: Any) -> bool:
    """Whether a BlockStored of ``group`` and ``kind`` reaches the index (``prefix`` None: no store of
    the batch decodes, this one is then skipped for what is wrong with it)."""
    return (prefix is None or group == prefix) and is_full_attention(kind)


def removed_indexed(prefix: int | None, group: int) -> bool:
    """Whether a BlockRemoved of ``group`` reaches the index."""
    return prefix is None or group == prefix
