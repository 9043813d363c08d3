"""kvindex on a real Redis Cluster (``--store redis+cluster://``): Debian's redis-server in cluster
mode, created with ``redis-cli --cluster create`` (tests/redis_server.py). Nothing mocked.

- exact answers across the cluster: many models, their slots spread over the masters (asserted),
  every answer equal to the memory index fed the same batches;
- a slot migrated while serving (``CLUSTER SETSLOT ... MIGRATING/IMPORTING``, ``MIGRATE``, then
  ``SETSLOT ... NODE``): calls in the middle are ``StoreUnavailable`` (``ASK`` followed to a node
  that refuses a half-moved slot), never a wrong answer; after it, ``MOVED`` is followed and the
  answers are exact, with no loss declared;
- a master killed (SIGKILL) with its replica promoted, the replica stopped (SIGSTOP, its link cut)
  while the master acknowledged the second half of the batches, so it is promoted without them, and the engine idle
  after (no later batch shows a gap): the daemon answers 503 during the move and exactly the memory
  daemon's answers after it (a failover is a loss: every lane resynchronises through the engine's
  replay);
- two kvindex replicas on one cluster apply every batch once and agree.
"""

from __future__ import annotations

import asyncio
import random
from array import array
from pathlib import Path
from typing import Any

import pytest

from kvindex import keys as K
from kvindex.config import ConfigError, Config
from kvindex.events import BlockRemoved, BlockStored
from kvindex.index.memory import MemoryPreciseStore
from kvindex.index.protocol import StoreLost, StoreUnavailable
from kvindex.index.redis_cluster import cluster_client
from kvindex.index.redis_precise import RedisPreciseStore
from kvindex.sequence import Outcome, StreamRef
from kvindex.storeurl import cluster_seeds, describe
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, independent_holdings
from tests.redis_server import RedisClusterServers, cli
from tests.test_precise_fixtures import requests_in_order
from tests.test_store_daemon import (
    POD,
    compare_while,
    engine_and_daemons,
    precise_answer,
    publish_until,
    wait_until_answering,
)

BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_hash=parent, token_ids=array("I", tokens), block_size=BS)


async def open_store(url: str, clients: list[Any]) -> RedisPreciseStore:
    client = cluster_client(url, socket_timeout=5, connect_timeout=5)
    clients.append(client)
    store = RedisPreciseStore(client)
    await store.open()
    return store


async def model_slot_key(store: RedisPreciseStore, model: str) -> str:
    """The name of the model's generation copy (its slot is the model's)."""
    mid = await store._client.hget("kvi:mid", model)
    return f"kvi:{{{int(mid)}}}:gen"


def test_cluster_urls_and_their_refusals() -> None:
    seeds = cluster_seeds("rediss+cluster://app:s%40cret@10.0.0.1:7000,10.0.0.2:7001")
    assert seeds.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001)) and seeds.tls and seeds.password == "s@cret"
    assert describe("rediss+cluster://app:s%40cret@h:1,h:2") == "rediss+cluster://app:***@h:1,h:2"
    assert Config(store="redis+cluster://127.0.0.1:7000").store == "redis+cluster://127.0.0.1:7000"
    for url, message in (("redis+cluster://127.0.0.1", "each cluster node is host:port"),
                         ("redis+cluster://h:1/2", "database 0 only"),
                         ("redis+cluster://h:1,h:x", "each cluster node is host:port")):
        with pytest.raises(ConfigError, match=message) as info:
            Config(store=url)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="the state lives in Redis"):
        Config(store="redis+cluster://h:1", state_dir=Path("/tmp/x"))


async def test_answers_across_the_cluster_equal_memory(redis_cluster: RedisClusterServers,
                                                       redis_cluster_url: str) -> None:
    """Six models, three pods, random stores and removals: every answer of two cluster clients is
    the memory index's, and the models' slots are on at least two masters."""
    rng = random.Random(39)
    memory, clients = MemoryPreciseStore(), []
    try:
        a, b = await open_store(redis_cluster_url, clients), await open_store(redis_cluster_url, clients)
        models = [f"model-{i}" for i in range(6)]
        for m in models:
            for s in (memory, a, b):
                await s.set_block_size(m, BS)
        seqs: dict[str, int] = {}
        prompts = {m: [[rng.randrange(50) for _ in range(16)] for _ in range(4)] for m in models}
        for step in range(120):
            m, pod = rng.choice(models), rng.choice(["p0", "p1", "p2"])
            tokens = rng.choice(prompts[m])
            hashes = [rng.randrange(1, 1 << 63) for _ in range(4)]
            event = stored(hashes, None, tokens) if rng.random() < 0.8 else BlockRemoved(tuple(hashes[:2]))
            stream = StreamRef(f"{pod}|{m}", pod, m)
            seq = seqs[stream.id] = seqs.get(stream.id, -1) + 1
            want = await memory.apply(stream, seq, 0, 0, [event])
            got = await (a if step % 2 else b).apply(stream, seq, 0, 0, [event])
            assert got.outcome is want.outcome is Outcome.APPLIED and got.applied == want.applied
        for m in models:
            for tokens in prompts[m]:
                keys = K.prompt_keys(K.root_key(m, None, None), tokens, BS)
                expected = await memory.match(keys, model=m)
                assert await a.match(keys, model=m) == await b.match(keys, model=m) == expected, m
                assert await a.match(keys) == await memory.match(keys)  # every model walked
        for pod in ("p0", "p1", "p2"):
            assert await a.blocks_held(pod) == await memory.blocks_held(pod)
        assert sorted(await b.pods()) == sorted(await memory.pods())
        owners = {redis_cluster.owner_of(await model_slot_key(a, m)).port for m in models}
        assert len(owners) >= 2, owners
        held = [n for n in redis_cluster.keys_per_master().values() if n > 0]
        assert len(held) >= 2, redis_cluster.keys_per_master()
    finally:
        for c in clients:
            await c.aclose()


def migrate_slot(cluster: RedisClusterServers, key: str, last: list[bytes], pause: Any) -> tuple[int, int]:
    """Move ``key``'s slot to another master the way ``redis-cli --cluster reshard`` does, its keys
    in two halves, ``last`` in the second; ``pause()`` is called after each half, while the slot is
    MIGRATING on its node and IMPORTING on the other. Returns (from port, to port)."""
    import redis

    src = cluster.owner_of(key)
    dst = next(n for n in cluster.live_masters() if n.port != src.port)
    slot = int(cli(src.port, "CLUSTER", "KEYSLOT", key).strip())
    with redis.Redis(port=src.port) as s, redis.Redis(port=dst.port) as d:
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.node_id())
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.node_id())
        names = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100000)
        first = [k for k in names if k not in last]
        assert len(first) > 4 and set(last) <= set(names)
        for part in (first, last):
            s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *part)
            pause()
    for n in cluster.live_masters():
        cli(n.port, "CLUSTER", "SETSLOT", str(slot), "NODE", dst.node_id())
    return src.port, dst.port


async def test_a_slot_migrated_while_serving_is_503_then_exact(redis_cluster: RedisClusterServers,
                                                               redis_cluster_url: str) -> None:
    memory, clients = MemoryPreciseStore(), []
    try:
        red = await open_store(redis_cluster_url, clients)
        stream, tokens = StreamRef("p|0", "p", "m"), list(range(100, 116))
        keys = K.prompt_keys(K.root_key("m", None, None), tokens, BS)
        for s in (memory, red):
            await s.set_block_size("m", BS)
            for seq, hs in enumerate(([1, 2], [3, 4])):
                parent = None if seq == 0 else 2
                assert (await s.apply(stream, seq, 0, 0, [stored(hs, parent, tokens[seq * 8:seq * 8 + 8])])).outcome \
                    is Outcome.APPLIED
        gen_key = await model_slot_key(red, "m")
        # the migration runs in a thread; at each pause this loop probes the store while the slot's
        # keys are split: first the declared keys still on the old node (the script runs there and
        # its guard refuses: 'moving'), then all of them on the new one (ASK followed; refused too)
        loop = asyncio.get_running_loop()
        paused, resume = asyncio.Queue[None](), asyncio.Queue[None]()

        def pause() -> None:
            loop.call_soon_threadsafe(paused.put_nowait, None)
            asyncio.run_coroutine_threadsafe(resume.get(), loop).result(30)

        last = [gen_key.encode(), gen_key[:-3].encode() + b"s:p|0"]
        moving = loop.run_in_executor(None, lambda: migrate_slot(redis_cluster, gen_key, last, pause))
        for _ in range(2):
            waiting = asyncio.ensure_future(paused.get())
            await asyncio.wait([moving, waiting], timeout=30, return_when=asyncio.FIRST_COMPLETED)
            assert waiting.done() and not moving.done()
            for call in (lambda: red.match(keys, model="m"), lambda: red.apply(stream, 2, 0, 0, [BlockRemoved((4,))])):
                with pytest.raises(StoreUnavailable) as info:
                    await call()
                assert not isinstance(info.value, StoreLost), info.value  # nothing was lost: it moves
            assert "a slot is migrating" in str(info.value)  # the apply reached its script: the guard refused
            resume.put_nowait(None)
        src, dst = await moving
        assert redis_cluster.owner_of(gen_key).port == dst != src
        assert await red.match(keys, model="m") == await memory.match(keys, model="m")  # MOVED followed
        for s in (memory, red):
            assert (await s.apply(stream, 2, 0, 0, [BlockRemoved((4,))])).outcome is Outcome.APPLIED
        assert await red.match(keys, model="m") == await memory.match(keys, model="m")
        other = await open_store(redis_cluster_url, clients)  # a fresh client finds the slot where it is
        assert await other.match(keys, model="m") == await memory.match(keys, model="m")
    finally:
        for c in clients:
            await c.aclose()


async def test_master_killed_replica_promoted_503_then_exact(make_harness: Any, make_engine: Any,
                                                             tmp_path: Path) -> None:
    cluster = RedisClusterServers(tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=1000).start()
    try:
        captured = load_capture(FIXTURES / "small" / "events.jsonl")
        requests = requests_in_order("small")
        engine, (red, memory) = await engine_and_daemons(make_engine, make_harness, tmp_path, [cluster.url, "memory://"])
        half = len(captured) // 2
        pos = await publish_until(engine, [red, memory], captured, 0, captured[half].t)
        assert set(await compare_while(red, memory, requests)) == {200}
        store = red.daemon.store
        mid = int(cli(cluster.nodes[0].port, "-c", "HGET", "kvi:mid", "tiny").strip())
        victim = cluster.owner_of(f"kvi:{{{mid}}}:gen")
        replica = cluster.replica_of(victim)
        replica.pause(True)  # stopped, and its link cut: what the master acknowledges now never reaches it
        cli(victim.port, "CLIENT", "KILL", "TYPE", "replica")
        try:
            pos = await publish_until(engine, [red, memory], captured, pos, float("inf"))
            assert set(await compare_while(red, memory, requests)) == {200} and pos == len(captured)
            victim.kill()
        finally:
            replica.pause(False)
        # the engine is idle from here on: no later batch shows a gap; the promoted replica lacks the
        # second half's writes, and only the failover's detection can tell kvindex so
        during = await compare_while(red, memory, requests)  # 503 (unavailable, resynchronising) or exact
        assert 503 in during, during
        status, ready = await red.get("/readyz")
        assert status == 503, ready
        assert await wait_until_answering(red, memory, requests, timeout=30.0) == len(requests)
        promoted = cluster.owner_of(f"kvi:{{{mid}}}:gen")
        assert promoted.port == replica.port
        assert red.daemon.guard.losses >= 1  # the failover was treated as a loss: the lanes resynchronised
        expected = independent_holdings(captured)[POD]
        status, pods = await red.get("/v1/pods")
        assert status == 200 and pods["pods"][0]["blocks"]["gpu"] == sum(expected.values())
        assert pods["pods"][0]["synced"] is True
        status, ready = await red.get("/readyz")
        assert status == 200, ready
        assert store is red.daemon.store
    finally:
        cluster.stop()


async def test_two_replicas_on_one_cluster_apply_every_batch_once(make_harness: Any, make_engine: Any,
                                                                  tmp_path: Path, redis_cluster_url: str) -> None:
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    requests = requests_in_order("small")
    engine, (a, b) = await engine_and_daemons(make_engine, make_harness, tmp_path, [redis_cluster_url] * 2)
    pos = checked = 0
    for r in requests:
        pos = await publish_until(engine, [a, b], captured, pos, r["t_sent"])
        assert await precise_answer(a, r) == await precise_answer(b, r) == (200, r["cached_tokens"]), r["i"]
        checked += 1
    pos = await publish_until(engine, [a, b], captured, pos, float("inf"))
    assert checked == len(requests) >= 20 and pos == len(captured)
    sa, sb = a.stream(POD), b.stream(POD)
    assert sa.batches + sb.batches == len(captured) == sa.skipped + sb.skipped  # each applied once, skipped once
    for h in (a, b):
        status, metrics = await h.get("/metrics")
        assert status == 200 and b"kvindex_store_up 1.0" in metrics
