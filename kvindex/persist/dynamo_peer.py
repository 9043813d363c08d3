"""``--peer`` from a Dynamo standalone indexer: its ``/dump`` (``kvindex.dynamo_dump``) as a state.

A Dynamo indexer has no ``/v1/state`` (``kvindex.persist.restore`` asks for it first); its dump
holds blocks only (no approximate index, no streams, no registrations), so a daemon restored from
it knows what each worker held and catches up from its engines as after any peer recovery. Its
blocks' local hashes are kept (``State.lineage``): kvindex's own ``/dump`` places them again.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from kvindex import dynamo_dump
from kvindex.persist.snapshot import State, StateError

log = logging.getLogger("kvindex.persist.dynamo_peer")


async def load_dynamo_dump(session: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> State:
    """The peer's ``/dump`` as a ``State``; ``StateError`` (one line) when it cannot be used."""
    async with session.get(base + "/dump", headers=headers) as r:
        if r.status != 200:
            raise StateError(f"has no /v1/state, and /dump answered HTTP {r.status}: {(await r.text())[:200]}")
        data = await r.read()
    try:
        doc = await asyncio.to_thread(json.loads, data)
        if not dynamo_dump.is_dynamo_dump(doc):
            raise ValueError("not a Dynamo /dump")
        sizes, entries, lineage = await asyncio.to_thread(dynamo_dump.entries_from_dump, doc)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateError(f"has no /v1/state, and its /dump cannot be read: {exc}") from None
    log.info("peer %s: no /v1/state; loaded its Dynamo /dump: %d blocks", base, len(entries))
    return State(block_sizes=sizes, entries=entries, lineage=lineage)
