"""Request body -> prompt -> block hashes, per personality: what an approximate router hashes.

Kthena main hashes the rendered prompt string (``kvindex.approx.kthena``), GIE v1.5.0 the bytes
of its typed rendering (``kvindex.approx.gie``). The approximate index stores and matches these
hashes; it never renders or hashes a request itself.

Invariants:
- Pure functions of (model, body, settings); no I/O, no state. Deterministic across processes
  and replicas (XXH64, no per-process seed), so every replica and router agrees on each hash.
- ``settings`` is a model's ``kvindex.settings.ApproxSettings`` (the vocabulary); this module
  depends on no layer above ``kvindex.approx``.
- Every body the router would not hash raises ``RenderError`` (one line, names the problem).
- The Kthena chain is written once here (``kthena_chain``); ``kvindex._keys.kthena_chain`` is
  its C twin (XXH64 of ``kvindex/kx_xxh64.h``), used when built; tests hold the two equal.
"""

from __future__ import annotations

from typing import Any, Protocol

import xxhash

from kvindex import native
from kvindex.approx.gie import render_gie
from kvindex.approx.gojson import go_utf8
from kvindex.approx.kthena import render_kthena
from kvindex.settings import GIE_V1_5, ApproxSettings

_C = native.load("kvindex._keys")


class PerModel(Protocol):
    """Settings per model (the config layer's ``ApproxConfig``)."""

    def for_model(self, model: str) -> ApproxSettings: ...


def kthena_hashes(model: str, rendered: str, settings: ApproxSettings, cache_salt: str = "") -> list[int]:
    """Kthena's block hashes: ``h_i = XXH64(decimal(h_{i-1}) || block_i)``, ``h_0 = XXH64(model)``.

    Blocks are byte slices of the UTF-8 prompt (a character may straddle two blocks); the last
    may be short; at most ``max_blocks_to_match``; an empty prompt gives ``[]``.
    kvindex's one extension: a non-empty ``cache_salt`` is mixed into the seed
    (``h_0 = XXH64(model || 0x00 || salt)``) so salted tenants never match each other; Kthena
    ignores the salt, and an unsalted request hashes exactly as Kthena does.
    """
    size = settings.block_size_to_hash
    # only the first max_blocks_to_match blocks are hashed: as many characters give at least as
    # many bytes (each is 1-4), so the bytes hashed, and the count, are those of the whole prompt
    data = go_utf8(rendered[:size * settings.max_blocks_to_match])
    count = min(-(-len(data) // size), settings.max_blocks_to_match)
    seed = go_utf8(model) + (b"\x00" + go_utf8(cache_salt) if cache_salt else b"")
    first = xxhash.xxh64_intdigest(seed)
    chain = _C.kthena_chain if _C is not None else kthena_chain
    result: list[int] = chain(data, first, size, count)
    return result


def kthena_chain(data: bytes, prev: int, size: int, count: int) -> list[int]:
    """``count`` blocks of ``size`` bytes of ``data`` (the last may be short), chained:
    ``h_i = XXH64(decimal(h_{i-1}) || block_i)`` from ``h_{-1} = prev``."""
    out: list[int] = []
    for start in range(0, count * size, size):
        prev = xxhash.xxh64_intdigest(b"%d" % prev + data[start : start + size])
        out.append(prev)
    return out


def gie_hashes(model: str, data: bytes, settings: ApproxSettings, cache_salt: str = "") -> list[int]:
    """GIE v1.5.0's block hashes: ``h_i = XXH64(block_i || le64(h_{i-1}))``.

    ``h_0 = XXH64(model || cache_salt)``. Input under one block gives ``[]``; input is truncated
    to ``block_size * max_blocks`` bytes and a trailing partial block is dropped.
    """
    size = settings.block_size_to_hash
    if len(data) < size:
        return []
    data = data[: size * settings.max_blocks_to_match]
    prev = xxhash.xxh64_intdigest(go_utf8(model) + go_utf8(cache_salt))
    out: list[int] = []
    for start in range(0, len(data) - size + 1, size):
        prev = xxhash.xxh64_intdigest(data[start : start + size] + prev.to_bytes(8, "little"))
        out.append(prev)
    return out


def render_request(settings: ApproxSettings, body: dict[str, Any]) -> str:
    """The prompt text ``settings``' personality hashes (GIE's bytes shown as UTF-8 text)."""
    if settings.personality == GIE_V1_5:
        return render_gie(body).decode("utf-8", "replace")
    return render_kthena(body)


def hash_body(model: str, body: dict[str, Any], settings: ApproxSettings) -> list[int]:
    """Render ``body`` per ``settings``' personality and hash it. Raises ``RenderError``.

    Both personalities seed with ``body["cache_salt"]`` when it is a string (GIE does; for
    Kthena it is kvindex's extension, see ``kthena_hashes``).
    """
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    salt = salt if isinstance(salt, str) else ""
    if settings.personality == GIE_V1_5:
        return gie_hashes(model, render_gie(body), settings, salt)
    return kthena_hashes(model, render_kthena(body), settings, salt)


def hash_request(config: PerModel, model: str, body: dict[str, Any]) -> list[int]:
    """``hash_body`` with ``model``'s settings in ``config``."""
    return hash_body(model, body, config.for_model(model))
