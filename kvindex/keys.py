"""kvindex's own block identity: chained keys computed from token ids.

Invariants:
- ``local_hash(tokens)`` is XXH3-64 (seed 1337) over the block's tokens as u32 little-endian:
  the per-block hash of the Dynamo KV indexer (``compute_block_hash_for_seq``, ``/query_by_hash``).
- ``key_i = XXH3-64(LE64(key_{i-1}) || LE64(local_i))``; ``key_{-1}`` is the root, derived from
  (model, lora_name, cache_salt), so different models, adapters and salted tenants never share keys.
- Only full blocks have keys. Engine hashes never enter a key: engines may hash differently.
- Keys and local hashes come as one packed ``array("Q")`` (no Python int per block: the index core
  reads the buffer as it is).
- The functions here are the reference. ``prompt_keys``, ``local_hashes`` and ``chain_keys`` run
  on their C twins (``kvindex/_keys.c``) when built; ``py_*`` are the Python definitions, always
  available, and the tests hold the two equal.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Sequence
from functools import lru_cache

import xxhash

from kvindex import native

LOCAL_SEED = 1337
MASK64 = (1 << 64) - 1
_PAIR = struct.Struct("<QQ")
_xxh3 = xxhash.xxh3_64_intdigest
_C = native.load("kvindex._keys")


def local_hash(tokens: Sequence[int]) -> int:
    """Dynamo's per-block hash of one block of token ids (each must fit in u32)."""
    return _xxh3(array("I", tokens).tobytes(), LOCAL_SEED)


def chain(parent_key: int, local: int) -> int:
    return _xxh3(_PAIR.pack(parent_key, local))


ROOT_CACHE_ENTRIES = 4096
ROOT_CACHE_CHARS = 1024  # roots of longer (model, lora, salt) ids are computed each time, never cached


def root_key(model: str, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The key a prompt's first block chains from. Fields are length-prefixed: no ambiguity.

    Cached for ids up to ``ROOT_CACHE_CHARS`` in all: the cache retains at most
    ``ROOT_CACHE_ENTRIES`` x ~``ROOT_CACHE_CHARS`` x 4 bytes (~16 MiB at the very worst, all
    four-byte characters), whatever the requests name."""
    if len(model) + len(lora_name or "") + len(cache_salt or "") <= ROOT_CACHE_CHARS:
        return _cached_root(model, lora_name, cache_salt)
    return _root(model, lora_name, cache_salt)


def _root(model: str, lora_name: str | None, cache_salt: str | None) -> int:
    parts = [model, lora_name or "", cache_salt or ""]
    data = b"kvindex-root-v1" + b"".join(
        struct.pack("<I", len(p.encode())) + p.encode() for p in parts
    )
    return _xxh3(data)


_cached_root = lru_cache(maxsize=ROOT_CACHE_ENTRIES)(_root)


def _u32(token_ids: Sequence[int]) -> array:
    return token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else array("I", token_ids)


def packed(token_ids: Sequence[int]) -> memoryview:
    """Token ids as u32 little-endian bytes (no copy when they already are an ``array("I")``)."""
    return memoryview(_u32(token_ids)).cast("B")


def py_local_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> array:
    """Per-block local hashes of the full blocks of ``token_ids`` (at most ``limit`` blocks)."""
    data = packed(token_ids)
    width = 4 * block_size
    n = len(data) // width if limit is None else min(limit, len(data) // width)
    return array("Q", [_xxh3(data[i : i + width], LOCAL_SEED) for i in range(0, n * width, width)])


def py_chain_keys(root: int, locals_: Sequence[int]) -> array:
    keys = array("Q")
    key = root
    for local in locals_:
        key = _xxh3(_PAIR.pack(key, local))
        keys.append(key)
    return keys


def py_prompt_keys(root: int, token_ids: Sequence[int], block_size: int, limit: int | None = None) -> array:
    """Chained keys of the full blocks of a prompt (at most ``limit`` blocks).

    ``py_chain_keys(root, py_local_hashes(...))`` in one comprehension: no list of local hashes, no
    per-block method call (the ingest path computes one key per stored block)."""
    data = _u32(token_ids).tobytes()  # one copy; slicing bytes is cheaper than slicing a memoryview
    width = 4 * block_size
    n = len(data) // width if limit is None else min(limit, len(data) // width)
    key, pack = root, _PAIR.pack
    return array("Q", [key := _xxh3(pack(key, _xxh3(data[i : i + width], LOCAL_SEED)))
                       for i in range(0, n * width, width)])


if _C is None:
    local_hashes, chain_keys, prompt_keys = py_local_hashes, py_chain_keys, py_prompt_keys
else:
    _c_local, _c_chain, _c_prompt = _C.local_hashes, _C.chain_keys, _C.prompt_keys

    def local_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> array:
        return _c_local(_u32(token_ids), block_size, -1 if limit is None else limit)

    def chain_keys(root: int, locals_: Sequence[int]) -> array:
        return _c_chain(root, locals_)

    def prompt_keys(root: int, token_ids: Sequence[int], block_size: int, limit: int | None = None) -> array:
        return _c_prompt(root, _u32(token_ids), block_size, -1 if limit is None else limit)


def recorded_keys(root: int, token_ids: Sequence[int], block_size: int, limit: int,
                  record: Callable[[int, array, array], array] | None) -> array:
    """``prompt_keys``; with ``record`` (a lineage's ``add``: ``--dynamo-dump``) through the blocks'
    local hashes, handed to it with the keys (parent, locals, keys) -> the keys."""
    if record is None:
        return prompt_keys(root, token_ids, block_size, limit=limit)
    locals_ = local_hashes(token_ids, block_size, limit=limit)
    return record(root, locals_, chain_keys(root, locals_))
