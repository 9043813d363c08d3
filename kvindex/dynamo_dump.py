"""Dynamo's ``/dump`` shape, both ways: kvindex's held blocks as Dynamo ``RouterEvent``s, and a
Dynamo indexer's dump as kvindex entries (``--peer`` recovery).

Shape (verified against ``ai-dynamo-runtime`` 1.6.1's ``python -m dynamo.indexer``):
``{"<model>:<group>": {"block_size": n, "events": [{"worker_id": u64, "storage_tier": "device",
"residency_domain": "worker", "event": {"event_id": i, "data": {"stored": {"parent_hash": h|null,
"start_position": null, "blocks": [{"block_hash": h, "tokens_hash": local, "mm_extra_info":
null}]}}, "dp_rank": r}}]}}``. ``block_hash`` is the engine's hash, ``tokens_hash`` the block's
local hash (``kvindex.keys.local_hash``); a child's ``parent_hash`` names a block of the same
worker and rank, emitted before it.

Worker ids: a pod id that is a decimal u64 (``/register``'s ``instance_id``) is that number; any
other pod id maps to ``worker_number(pod)``: the first 8 bytes of SHA-256 of its UTF-8, top bit
cleared, so the same pod has the same number in every process and restart. Each event also
carries ``"pod"`` (kvindex's id) and each block ``"kvindex_key"`` (kvindex's key): Dynamo ignores
fields it does not know. Read back, a Dynamo worker id
``n`` is the pod ``str(n)``, as ``/register`` names it.

Blocks kvindex cannot place in Dynamo's tree (loaded from a snapshot or peer, so their local hash
was never seen; under a LoRA or salted root; or under a parent the worker no longer holds) are
listed apart, in the group's ``"kvindex_unplaced"`` (``[pod, dp_rank, engine hash, key]``), which
Dynamo ignores: they are not part of its tree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from kvindex import keys as K
from kvindex.types import Entry

U64 = (1 << 64) - 1


def worker_number(pod: str) -> int:
    """Dynamo's numeric worker id for a kvindex pod id (see the module docstring)."""
    if pod.isascii() and pod.isdigit() and int(pod) <= U64:
        return int(pod)
    return int.from_bytes(hashlib.sha256(pod.encode()).digest()[:8], "big") >> 1


def worker_events(pod: str, rank: int, blocks: dict[int, int | None], root: int,
                  lineage: Callable[[int], tuple[int, int] | None], first_id: int) -> tuple[list[dict[str, Any]], dict[int, int | None]]:
    """One worker's held blocks (engine hash -> key) under ``root`` as Dynamo stored events,
    parents first; and the blocks it could not place there."""
    by_key = {k: h for h, k in blocks.items() if k is not None}
    depth: dict[int, int] = {}  # key -> depth from the root (1 = first block); -1: not placeable

    def place(key: int) -> int:
        path = []
        while key not in depth:
            rec = lineage(key)
            if rec is None or key not in by_key:
                depth[key] = -1
                break
            path.append(key)
            key = rec[0]
            if key == root:
                depth[key] = 0
                break
        d = depth[key]
        for k in reversed(path):
            d = depth[k] = d + 1 if d >= 0 else -1
        return d

    placed = sorted((d, k) for k in by_key if (d := place(k)) > 0)
    wid, events = worker_number(pod), []
    for i, (_, k) in enumerate(placed):
        parent, local = lineage(k) or (root, 0)  # placed: recorded
        events.append({"worker_id": wid, "pod": pod, "storage_tier": "device", "residency_domain": "worker", "event": {
            "event_id": first_id + i, "dp_rank": rank, "data": {"stored": {
                "parent_hash": None if parent == root else by_key[parent], "start_position": None,
                "blocks": [{"block_hash": by_key[k], "tokens_hash": local, "mm_extra_info": None, "kvindex_key": k}]}}}})
    return events, {h: key for h, key in blocks.items() if key is None or depth.get(key, -1) <= 0}


def is_dynamo_dump(data: Any) -> bool:
    """Whether a JSON document is a Dynamo ``/dump`` (``{"m:g": {"block_size", "events"}}``)."""
    return isinstance(data, dict) and all(
        isinstance(v, dict) and isinstance(v.get("block_size"), int) and isinstance(v.get("events"), list)
        for v in data.values())


Lineage = list[tuple[int, list[int], list[int]]]  # (parent key, local hashes, keys): Lineage.add's arguments


def entries_from_dump(data: dict[str, Any], medium: str = "GPU") -> tuple[dict[str, int], list[Entry], Lineage]:
    """A Dynamo dump as kvindex's (block sizes, entries, lineage): each stored block's key chains
    from its parent's key (or the model's root), per worker and rank, in the dump's order. Events
    whose parent is unknown, and removals or clears (a dump has none), are skipped.
    Raises ``ValueError`` on a malformed dump."""
    sizes: dict[str, int] = {}
    entries: list[Entry] = []
    lineage: Lineage = []
    for name, group in data.items():
        model = name.rsplit(":", 1)[0] if ":" in name else name
        sizes[model] = int(group["block_size"])
        root = K.root_key(model)
        keys: dict[tuple[int, int, int], int] = {}  # (worker, rank, engine hash) -> key
        for ev in group["events"]:
            inner = ev["event"]
            stored = inner.get("data", {}).get("stored")
            if stored is None or ev.get("storage_tier", "device") != "device":
                continue
            wid, rank = int(ev["worker_id"]), int(inner.get("dp_rank", ev.get("dp_rank", 0)))
            ph = stored.get("parent_hash")
            parent = root if ph is None else keys.get((wid, rank, int(ph) & U64))
            if parent is None:
                continue
            for b in stored["blocks"]:
                h, local = int(b["block_hash"]) & U64, int(b["tokens_hash"]) & U64
                key = K.chain(parent, local)
                lineage.append((parent, [local], [key]))
                parent = key
                if (wid, rank, h) not in keys:
                    keys[(wid, rank, h)] = key
                    entries.append(Entry(str(wid), rank, medium, h, key, 1))
    return sizes, entries, lineage


def dump_groups(groups: Iterable[tuple[str, int]]) -> dict[str, Any]:
    """Empty groups for each (name, block size)."""
    return {name: {"block_size": bs, "events": [], "kvindex_unplaced": []} for name, bs in groups}
