"""Redis Cluster plumbing shared by both Redis stores: the client, and what a script must know to
trust the node it runs on (``lua/cluster_guard.lua`` is the other side).

Invariants:
- ``cluster_client`` is redis-py's ``RedisCluster``: it follows ``MOVED`` and ``ASK`` and refreshes
  its slot map itself. It retries nothing: a node that cannot be reached (a master killed, until
  its replica is promoted) is ``StoreUnavailable`` at once, a 503; the stores retry what is safe.
- At ``open()`` every master's replication id is read (``master_guard``), with its eviction
  policy (asked of every master: an ``allkeys-*`` one anywhere is refused, as on one Redis) and,
  where CONFIG is refused, its ``evicted_keys``. The stores send ``@ <replid>=<evicted or ''> ...``
  after their generation to every script, which then refuses to run, before reading or writing
  anything, on a node whose replication id is not among them (``lost``: a replica promoted since
  open, which may lack writes the old master acknowledged; a master restarted; a node added),
  or that evicted keys since (``lost``), or whose slot is migrating (``moving``: the slot's keys
  are split over two nodes, and a script reaches keys it does not declare). ``lost`` is
  ``StoreLost`` (every lane resynchronises, then answers are exact again); ``moving`` is
  ``StoreUnavailable`` (a 503; the lane keeps its batches and retries).
- The global, untagged keys (generation, model ids, pods) are read with plain commands; the
  operations that trust them first check ``masters_unchanged``: the same replication ids.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvindex.index.protocol import StoreMisconfigured, StoreUnavailable
from kvindex.index.redis_keys import text
from kvindex.storeurl import cluster_seeds

log = logging.getLogger("kvindex.store")
Call = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]


async def redis_call(make: Callable[[], Awaitable[Any]], url: str, *, idempotent: bool = True) -> Any:
    """Await ``make()``, its failures as the contract's errors (one Redis or a cluster): a dropped
    connection is retried once when the call is idempotent (a pooled connection that died with its
    server fails first); a timed-out one is not (the server is there but not answering: a retry
    would only double the wait for the caller's 503); a cluster that is down, a slot not covered
    or moved too often are unavailable; a reply refused by the server is ``... refused: <why>``."""
    for attempt in (0, 1):
        try:
            return await make()
        except rex.ConnectionError as exc:
            timed_out = isinstance(exc.__cause__, (rex.TimeoutError, TimeoutError))
            if attempt or not idempotent or timed_out:
                raise _unavailable(url, exc) from None
        except (rex.TimeoutError, TimeoutError, OSError, rex.RedisClusterException, rex.ClusterError) as exc:
            raise _unavailable(url, exc) from None
        except rex.ResponseError as exc:
            raise StoreUnavailable(f"redis at {url}: refused: {exc}".splitlines()[0]) from None


def _unavailable(url: str, exc: Exception) -> StoreUnavailable:
    return StoreUnavailable(f"redis at {url}: {type(exc).__name__}: {exc}".splitlines()[0])


def cluster_client(url: str, *, socket_timeout: float, connect_timeout: float) -> RedisCluster:
    """A client of the cluster named by ``url`` (not connected yet: no I/O)."""
    seeds = cluster_seeds(url)
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in seeds.nodes],
                        username=seeds.username, password=seeds.password, ssl=seeds.tls,
                        socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                        retry=Retry(NoBackoff(), 0), require_full_coverage=True)


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def cluster_url(client: Any) -> str:
    """The client's nodes as a store URL (for errors: no password)."""
    nodes = client.get_nodes() or client.nodes_manager.startup_nodes.values()
    return "redis+cluster://" + ",".join(sorted(n.name for n in nodes))


def eviction_policy(reply: Any, url: str, whose: str = "") -> str | None:
    """The ``maxmemory-policy`` in one server's CONFIG GET reply (None: not in it);
    ``StoreMisconfigured`` when it may evict kvindex's keys (``allkeys-*``: kvindex sets no TTL, so
    ``volatile-*`` never does)."""
    policy = text({text(k): v for k, v in dict(reply or {}).items()}.get("maxmemory-policy"))
    if not isinstance(policy, str):
        return None
    if policy.startswith("allkeys-"):
        raise StoreMisconfigured(f"redis at {url}: {whose}maxmemory-policy is {policy}, which may evict kvindex's "
                                 "keys (answers would silently lose blocks): set it to noeviction")
    return policy


async def _each_master(client: RedisCluster, call: Call, command: Callable[..., Awaitable[Any]],
                       *args: Any) -> list[Any]:
    """``command(*args)`` asked of every master (as the client's slot map knows them), one reply each."""
    await call(client.initialize)
    masters = client.get_primaries()
    if not masters:
        raise StoreUnavailable(f"redis at {cluster_url(client)}: the cluster has no master")
    def ask(node: ClusterNode) -> Callable[[], Awaitable[Any]]:
        return lambda: command(*args, target_nodes=node)
    return [await call(ask(node)) for node in masters]


async def _policies(client: RedisCluster, url: str, call: Call) -> bool:
    """True when every master's policy is known not to evict kvindex's keys; StoreMisconfigured
    when one may; False when CONFIG is refused (then evictions are watched)."""
    try:
        replies = await _each_master(client, call, client.config_get, "maxmemory-policy")
    except StoreUnavailable as exc:
        if ": refused: " not in str(exc):
            raise
        log.warning("store %s: cannot read maxmemory-policy (%s): it must be noeviction or volatile-* on every "
                    "master; keys evicted make queries answer 503 until the engines are resynchronised", url, exc)
        return False
    for reply in replies:
        eviction_policy(reply, url, "a master's ")
    return True


async def master_guard(client: Any, url: str, call: Call) -> str:
    """``@ <replid>=<evicted keys, or '' when the policy cannot evict> ...`` of every master now."""
    known = await _policies(client, url, call)
    infos = await _each_master(client, call, client.info, "replication")
    stats = [{}] * len(infos) if known else await _each_master(client, call, client.info, "stats")
    if len(stats) != len(infos):
        raise StoreUnavailable(f"redis at {url}: the masters changed while being read")
    parts = [f" {info['master_replid']}={'' if known else int(st.get('evicted_keys', 0))}"
             for info, st in zip(infos, stats)]
    return "@" + "".join(sorted(parts))


async def masters_unchanged(client: aioredis.Redis | RedisCluster, guard: str, call: Call) -> bool:
    """True on one Redis; on a cluster, True when every master now is one ``guard`` names."""
    if not is_cluster(client) or not guard.startswith("@"):
        return True
    assert isinstance(client, RedisCluster)
    infos = await _each_master(client, call, client.info, "replication")
    return all(f" {info['master_replid']}=" in guard for info in infos)
