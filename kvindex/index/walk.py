"""The precise index's read side: from per-tier holder masks to each pod's longest held prefix.

Job: ``match`` turns ``holders`` (tier -> key -> bitmask of the worker slots holding the key) and
a prompt's keys into ``PodMatch`` per pod. It reads masks only; it never changes the index.

Invariants:
- A slot's depth in a tier is the length of the longest prefix of ``keys`` whose every key the
  slot holds in that tier or a faster one (tiers are cumulative through the device: cpu counts
  gpu holdings, disk counts both). Only slots in ``allowed`` answer.
- A pod's ``PodMatch`` takes the deepest of its ranks per tier; ``dp`` lists each rank with a
  match >= 1 in some tier, with its gpu depth. Pods without a match are not listed.
- ``walk`` is the Python twin of ``kvindex._walk.walk`` (the device tier, when built); tests
  compare the two (tests/test_native.py).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, repeat, takewhile
from operator import and_, neg
from typing import Any

from kvindex import native
from kvindex.types import PodMatch, merged

WALK = native.load("kvindex._walk")  # the C twin of ``walk`` for the device tier, when built
_tuple_new = tuple.__new__


def match(keys: Sequence[int], holders: dict[str, dict[int, int]], allowed: int,
          members: Callable[[int], list[tuple[str, int]]], slots: Sequence[Any]) -> dict[str, PodMatch]:
    """Each pod's longest held prefix of ``keys``. ``members(mask)``: (pod, rank) of each set bit,
    lowest slot first; ``slots[i].pod`` / ``.rank``: the worker of slot i."""
    gpu_holders = holders["gpu"]
    gpu = WALK.walk(keys, gpu_holders, allowed) if WALK else walk(keys, gpu_holders, None, allowed)
    if not holders["cpu"] and not holders["disk"]:
        return _per_pod_gpu(gpu, members)
    cpu = walk(keys, gpu_holders, [holders["cpu"]], allowed)
    disk = walk(keys, gpu_holders, [holders["cpu"], holders["disk"]], allowed)
    return _per_pod(depths(gpu), depths(cpu), depths(disk), slots)


def _per_pod_gpu(groups: list[tuple[int, int]], members: Callable[[int], list[tuple[str, int]]]) -> dict[str, PodMatch]:
    """Groups come deepest first, so a pod's first worker seen has its deepest match."""
    out: dict[str, PodMatch] = {}
    new, get = _tuple_new, out.get
    for g, mask in groups:
        for pod, rank in members(mask):
            prev = get(pod)
            if prev is None:
                out[pod] = new(PodMatch, (g, g, g, {rank: g}))  # PodMatch(...) minus its Python __new__
            else:
                prev.dp[rank] = g
    return out


def _per_pod(gpu: dict[int, int], cpu: dict[int, int], disk: dict[int, int], slots: Sequence[Any]) -> dict[str, PodMatch]:
    out: dict[str, PodMatch] = {}
    for slot, d in disk.items():
        w = slots[slot]
        g = gpu.get(slot, 0)
        out[w.pod] = merged(out.get(w.pod), PodMatch(g, cpu.get(slot, 0), d, {w.rank: g}))
    return out


def walk(keys: Sequence[int], gpu: dict[int, int], others: list[dict[int, int]] | None,
          allowed: int) -> list[tuple[int, int]]:
    """(depth, mask of the worker slots whose longest held prefix is that deep), deepest first,
    for depths ≥ 1.

    ``acc[i]`` is the mask of slots holding the first i keys: one C-level pass. Each step only
    clears bits, so ``acc`` is non-increasing as integers and the places where it changes are
    found by bisection: the Python work is O(distinct depths × log n), not O(n)."""
    if others:
        masks: Iterable[int] = [_union(k, gpu, others) for k in keys]
    else:
        masks = map(gpu.get, keys, repeat(0))
    acc = list(takewhile(bool, accumulate(masks, and_, initial=allowed)))  # stops when nobody is left
    groups: list[tuple[int, int]] = []
    hi, seen = len(acc), 0
    while hi > 1:
        value = acc[hi - 1]
        groups.append((hi - 1, value & ~seen))
        seen = value
        hi = bisect_left(acc, -value, 0, hi, key=neg)
    return groups


def depths(groups: list[tuple[int, int]]) -> dict[int, int]:
    """Slot -> depth, deepest first."""
    return {slot: d for d, mask in groups for slot in bits(mask)}


def _union(key: int, gpu: dict[int, int], others: list[dict[int, int]]) -> int:
    held = gpu.get(key, 0)
    for t in others:
        held |= t.get(key, 0)
    return held


def bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
