"""What a Redis server must be for kvindex to trust its answers, checked when a store opens.

Invariants:
- kvindex sets no TTL on any key, so ``noeviction`` and ``volatile-*`` never drop its keys; an
  ``allkeys-*`` policy would, silently: such a server is refused (``StoreMisconfigured``; at
  start kvindex exits 2 with one line; a re-open after a loss checks again). A server that
  refuses CONFIG (renamed, ACLs) is used with a warning, and watched: every script then compares
  the server's ``evicted_keys`` with its count at open, in the same atomic step as its read or
  write, so a key evicted makes the next call ``StoreLost`` (503, lanes resynchronise), never a
  partial answer. On a Redis Cluster every master is asked (``kvindex.index.redis_cluster``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from kvindex.index.protocol import StoreMisconfigured, StoreUnavailable
from kvindex.index.redis_cluster import eviction_policy, is_cluster, master_guard

log = logging.getLogger("kvindex.store")


async def check_eviction_policy(client: aioredis.Redis, url: str,
                                call: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]) -> str | None:
    """The server's ``maxmemory-policy`` (None when CONFIG is refused); ``StoreMisconfigured``
    when it can evict kvindex's keys. ``call`` is the store's own (its errors as StoreUnavailable)."""
    try:
        reply = await call(lambda: client.config_get("maxmemory-policy"))
    except StoreMisconfigured:
        raise
    except StoreUnavailable as exc:
        if ": refused: " not in str(exc):
            raise
        log.warning("store %s: cannot read maxmemory-policy (%s): it must be noeviction or volatile-*; keys "
                    "evicted make queries answer 503 until the engines are resynchronised", url, exc)
        return None
    return eviction_policy(reply, url)


async def watch_evictions(client: aioredis.Redis, url: str,
                          call: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]) -> str:
    """``""`` when the policy is known not to evict kvindex's keys; else (CONFIG refused)
    ``"|<evicted_keys now>"``, the suffix the scripts' generation argument carries to watch. On a
    cluster, every master's (``redis_cluster.master_guard``: ``"@ <replid>=<evicted or ''> ..."``)."""
    if is_cluster(client):
        return await master_guard(client, url, call)
    if await check_eviction_policy(client, url, call) is not None:
        return ""
    try:
        stats = await call(lambda: client.info("stats"))
    except StoreUnavailable as exc:
        if ": refused: " not in str(exc):
            raise
        log.warning("store %s: cannot read INFO stats either (%s): evictions cannot be watched", url, exc)
        return ""
    return f"|{int(stats.get('evicted_keys', 0))}"
