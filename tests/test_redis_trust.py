"""A Redis whose answers kvindex could not trust (issue 13 class 5): an eviction policy that can
drop kvindex's keys is refused at start; a server whose policy cannot be read is watched, and
every read checks the store's state in the same atomic step (503, never a partial 200)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from kvindex.index.protocol import StoreLost, StoreMisconfigured
from kvindex.index.redis_precise import RedisPreciseStore
from tests.redis_server import RedisServer
from tests.test_store_contract import ONE, TOKENS, A, keys_of


@pytest.fixture
async def server(tmp_path: Path) -> Any:
    s = RedisServer(tmp_path / "redis").start()
    admin = aioredis.Redis(unix_socket_path=str(s.socket))
    yield s, admin
    await admin.aclose()
    s.stop()


def test_serve_refuses_a_redis_that_evicts_any_key(server: Any, tmp_path: Path) -> None:
    s, _ = server
    subprocess.run(["redis-cli", "-s", str(s.socket), "config", "set", "maxmemory-policy", "allkeys-lru"],
                   check=True, capture_output=True)
    subprocess.run(["redis-cli", "-s", str(s.socket), "config", "set", "maxmemory", "2mb"], check=True,
                   capture_output=True)
    r = subprocess.run([sys.executable, "-m", "kvindex", "serve", "--port", "0", "--store", s.url],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("kvindex: ")]
    assert "Traceback" not in r.stderr and len(errors) == 1, r.stderr
    assert "maxmemory-policy is allkeys-lru" in errors[0] and "noeviction" in errors[0], r.stderr


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru", "volatile-ttl"])
async def test_policies_that_never_evict_kvindex_keys_are_accepted(server: Any, policy: str) -> None:
    _, admin = server
    await admin.config_set("maxmemory-policy", policy)
    store = RedisPreciseStore(admin)
    await store.open()
    await store.set_block_size("m", 4)
    await store.apply(A, 0, 0, 0, ONE)
    assert (await store.match(keys_of(TOKENS), model="m"))["a"].gpu == 1
    assert await admin.ttl(b"kvi:gen") == -1  # kvindex sets no TTL: volatile-* never picks its keys
    assert all([await admin.ttl(k) == -1 async for k in admin.scan_iter()])


async def test_allkeys_policies_are_refused(server: Any) -> None:
    _, admin = server
    for policy in ("allkeys-lru", "allkeys-lfu", "allkeys-random"):
        await admin.config_set("maxmemory-policy", policy)
        with pytest.raises(StoreMisconfigured, match=f"maxmemory-policy is {policy}"):
            await RedisPreciseStore(admin).open()


async def test_a_redis_without_config_is_watched_and_evictions_answer_503(server: Any, caplog: Any) -> None:
    """CONFIG refused (an ACL): kvindex warns, then every script compares the server's evictions
    with its count at open. An LRU eviction under memory pressure makes the next read StoreLost
    (the old code answered the evicted state as the truth: a partial 200)."""
    s, admin = server
    await admin.execute_command("ACL", "SETUSER", "kvi", "on", ">pw", "~*", "&*", "+@all", "-config")
    client = aioredis.Redis(unix_socket_path=str(s.socket), username="kvi", password="pw")
    try:
        store = RedisPreciseStore(client)
        await store.open()
        assert "cannot read maxmemory-policy" in caplog.text
        await store.set_block_size("m", 4)
        for seq in range(20):
            await store.apply(A, seq, 0, 0, ONE)
        assert (await store.match(keys_of(TOKENS), model="m"))["a"].gpu == 1
        used = int((await admin.info("memory"))["used_memory"])
        await admin.config_set("maxmemory", str(used + (512 << 10)))
        await admin.config_set("maxmemory-policy", "allkeys-lfu")
        slot_gen = [k async for k in admin.scan_iter(match="kvi:{*}:gen")]
        pipe = admin.pipeline(transaction=False)
        for _ in range(2000):  # the generations are the hottest keys (every script reads them)
            pipe.get(b"kvi:gen").get(slot_gen[0])
        await pipe.execute()
        for i in range(200):  # other data pushes kvindex's colder keys out
            await admin.set(f"junk:{i}", b"x" * 4096)
        assert int((await admin.info("stats"))["evicted_keys"]) > 0
        assert await admin.exists(b"kvi:gen", slot_gen[0]) == 2  # what the generation check alone cannot see
        for call in (store.match(keys_of(TOKENS), model="m"), store.blocks_held("a"), store.position(A),
                     store.apply(A, 20, 0, 0, ONE)):
            with pytest.raises(StoreLost):
                await call
    finally:
        await client.aclose()
