"""Where the indexes live: ``--store URL`` -> the backends of both contracts (``memory``, ``redis``).

``--store URL`` picks the backend: ``memory://`` (the default: this process) or a Redis server
shared by every kvindex replica: ``redis://host:port/db``, ``rediss://host:port/db`` (TLS) or
``unix:///path/to/redis.sock?db=N``; or a Redis Cluster, ``redis+cluster://host:port,host:port,...``
(``kvindex.index.redis_cluster``: the same two stores, each script on one slot).

Invariants: the URL is validated by ``kvindex.storeurl.check_store_url`` (config time, one-line
errors); the Redis client library and backends are imported only when a Redis URL is used; one
Redis client is shared by both stores and closed by ``Stores.close``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvindex.index.approx import ApproxIndex
from kvindex.index.memory import MemoryApproxStore, MemoryPreciseStore, new_precise_index
from kvindex.index.protocol import Stores
from kvindex.settings import ApproxConfig
from kvindex.storeurl import check_store_url, is_cluster, is_memory

SOCKET_TIMEOUT = 2.0  # seconds a Redis call may take before the store counts as unavailable
CONNECT_TIMEOUT = 1.0


def build_stores(url: str, approx_config: ApproxConfig, on_evict: Callable[[str], None] | None, *,
                 lineage: bool = False) -> Stores:
    """The stores for ``url``, not opened yet (no I/O); ``lineage``: the memory index keeps what
    Dynamo's ``/dump`` needs (``--dynamo-dump``)."""
    check_store_url(url)
    if is_memory(url):
        return Stores(url, MemoryPreciseStore(new_precise_index(lineage=lineage)),
                      MemoryApproxStore(ApproxIndex(approx_config, on_evict=on_evict)))
    from redis.asyncio import Redis
    from redis.backoff import NoBackoff
    from redis.asyncio.retry import Retry

    from kvindex.index.redis_approx import RedisApproxStore
    from kvindex.index.redis_cluster import cluster_client
    from kvindex.index.redis_precise import RedisPreciseStore

    client: Any
    if is_cluster(url):
        client = cluster_client(url, socket_timeout=SOCKET_TIMEOUT, connect_timeout=CONNECT_TIMEOUT)
    else:
        client = Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=CONNECT_TIMEOUT,
                                retry=Retry(NoBackoff(), 0))  # the stores retry what is safe to retry
    return Stores(url, RedisPreciseStore(client), RedisApproxStore(client, approx_config, on_evict=on_evict), client)

