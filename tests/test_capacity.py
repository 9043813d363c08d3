"""A pod that only stores (issue 13 class 20): past ``--max-blocks-per-pod`` its new blocks are
refused and counted, the blocks it holds are kept, it is unsynced (``over_capacity``) with one
warning per crossing; removals and clears still apply, and once back under its stores do too."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from kvindex.config import Config, ConfigError
from kvindex.configfile import config_from_toml, with_overrides
from kvindex.tools.engine_sim import block_stored, encode_batch
from tests.conftest import engine_config, ipc_endpoint

CAP, PER_BATCH, BS = 3000, 200, 4


def only_stores(n: int, first_hash: int = 1, seq: int = 0) -> list[tuple[bytes, bytes, bytes]]:
    """``n`` batches, each storing PER_BATCH new blocks (one chain per batch) and removing nothing."""
    out = []
    for i in range(n):
        h0 = first_hash + i * PER_BATCH
        tokens = [(h0 + t) % 50_000 for t in range(PER_BATCH * BS)]
        ev = block_stored(list(range(h0, h0 + PER_BATCH)), None, tokens, BS)
        out.append((b"kv@p0@m", (seq + i).to_bytes(8, "big"), encode_batch([ev], time.time())))
    return out


def gauge(h: Any, name: str, pod: str = "p0") -> float:
    return h.daemon.registry.get_sample_value(name, {"pod": pod}) or 0.0


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_pod_that_only_stores_is_capped(backend: str, make_harness: Any, make_engine: Any, tmp_path: Path,
                                                caplog: Any, request: Any) -> None:
    store = request.getfixturevalue("redis_url") if backend == "redis" else "memory://"
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    h = await make_harness(Config(engines=(engine_config(engine),), max_blocks_per_pod=CAP, replay_timeout=0.5,
                                  store=store))
    await h.wait_connected()
    with caplog.at_level(logging.INFO, "kvindex.ingest.lane"):
        for f in only_stores(40):  # 8000 blocks offered
            await engine.publish(f)
        await h.wait_seq("p0", 39, timeout=20)
        held = (await h.daemon.store.blocks_held("p0"))["gpu"]
        assert CAP < held <= CAP + PER_BATCH  # the batch that crossed applied; none after it
        assert gauge(h, "kvindex_blocks_refused_total") == 40 * PER_BATCH - held
        assert gauge(h, "kvindex_pod_over_capacity") == 1
        st = h.stream("p0")
        assert not st.synced and st.unsynced_reason == "over_capacity"
        _, pods = await h.get("/v1/pods")
        entry = next(p for p in pods["pods"] if p["pod"] == "p0")
        assert entry["synced"] is False and entry["unsynced_reason"] == "over_capacity", entry
        assert caplog.text.count("over --max-blocks-per-pod") == 1  # one warning per crossing, not per batch
        status, body = await h.post("/query", {"model_name": "m", "token_ids": list(range(1, 1 + 8 * BS))})
        assert status == 200 and body["scores"]["p0"]  # the blocks it holds still answer
        # the engine clears its cache: it shrinks, is back under, and synced; its stores apply again
        clear = (b"kv@p0@m", (40).to_bytes(8, "big"), encode_batch([{"type": "AllBlocksCleared"}], time.time()))
        await engine.publish(clear)
        for f in only_stores(5, first_hash=100_000, seq=41):
            await engine.publish(f)
        await h.wait_seq("p0", 45, timeout=20)
        assert (await h.daemon.store.blocks_held("p0"))["gpu"] == 5 * PER_BATCH
        assert gauge(h, "kvindex_pod_over_capacity") == 0 and h.stream("p0").synced
        for f in only_stores(20, first_hash=200_000, seq=46):  # crossing again: warned again, once
            await engine.publish(f)
        await h.wait_seq("p0", 65, timeout=20)
        assert gauge(h, "kvindex_pod_over_capacity") == 1
        assert caplog.text.count("over --max-blocks-per-pod") == 2


def test_the_cap_is_configurable_and_checked() -> None:
    assert Config().max_blocks_per_pod == 4 << 20
    assert config_from_toml({"server": {"max_blocks_per_pod": 10}}).max_blocks_per_pod == 10
    assert with_overrides(Config(), host=None, port=None, engines=[], max_blocks_per_pod=7).max_blocks_per_pod == 7
    for bad in (0, -1, "x"):
        with pytest.raises(ConfigError, match="max_blocks_per_pod"):
            config_from_toml({"server": {"max_blocks_per_pod": bad}})


# -- a pod emptied without an AllBlocksCleared event is not refused forever ------------------------
async def over_the_cap(h: Any, engine: Any, first_seq: int = 0) -> None:
    for f in only_stores(40, seq=first_seq):
        await engine.publish(f)
    await h.wait_seq("p0", first_seq + 39, timeout=20)
    assert gauge(h, "kvindex_pod_over_capacity") == 1 and h.stream("p0").unsynced_reason == "over_capacity"


async def stores_again_synced(h: Any, engine: Any, seq: int, blocks_before: int = 0) -> None:
    """Five more batches of new blocks: every one applies, and the pod is synced in /v1/pods."""
    for f in only_stores(5, first_hash=500_000 + seq * PER_BATCH, seq=seq):
        await engine.publish(f)
    await h.wait_seq("p0", seq + 4, timeout=20)
    assert (await h.daemon.store.blocks_held("p0"))["gpu"] == blocks_before + 5 * PER_BATCH
    assert gauge(h, "kvindex_pod_over_capacity") == 0
    _, pods = await h.get("/v1/pods")
    (entry,) = [p for p in pods["pods"] if p["pod"] == "p0"]
    assert entry["synced"] is True, entry


async def test_an_engine_restart_of_a_pod_over_the_cap_lets_it_store_again(make_harness: Any, make_engine: Any,
                                                                           tmp_path: Path) -> None:
    """Over the cap, the engine restarts (seq back to 0, new bytes, no AllBlocksCleared): the pod
    is cleared, and its new life's blocks apply; it is synced (before: refused forever)."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    h = await make_harness(Config(engines=(engine_config(engine),), max_blocks_per_pod=CAP, replay_timeout=0.5))
    await h.wait_connected()
    await over_the_cap(h, engine)
    engine.clear_buffer()  # the new life's history starts again
    await stores_again_synced(h, engine, 0)
    assert h.stream("p0").restarts == 1


async def test_a_resync_of_a_pod_over_the_cap_lets_it_store_again(make_harness: Any, make_engine: Any,
                                                                  tmp_path: Path) -> None:
    """Over the cap, an operator's resync (an engine without replay: the pod is cleared, the next
    batch the new baseline): its stores apply again."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"))
    h = await make_harness(Config(engines=(engine_config(engine),), max_blocks_per_pod=CAP))
    await h.wait_connected()
    await over_the_cap(h, engine)
    status, _ = await h.post("/v1/pods/p0/resync", {})
    assert status == 200
    await stores_again_synced(h, engine, 40)


async def test_a_pod_deleted_over_the_cap_stores_again(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """``DELETE /v1/pods/{pod}`` empties the pod behind the lane's back: while over, the lane reads
    the count again every OVER_CHECK_EVERY refused batches, so the pod stores again after at most
    that many."""
    from kvindex.ingest.capacity import OVER_CHECK_EVERY

    engine = await make_engine(ipc_endpoint(tmp_path, "pub"))
    h = await make_harness(Config(engines=(engine_config(engine),), max_blocks_per_pod=CAP))
    await h.wait_connected()
    await over_the_cap(h, engine)
    status, _ = await delete(h, "/v1/pods/p0")
    assert status == 200
    n = OVER_CHECK_EVERY + 4
    for f in only_stores(n, first_hash=300_000, seq=40):
        await engine.publish(f)
    await h.wait_seq("p0", 40 + n - 1, timeout=20)
    held = (await h.daemon.store.blocks_held("p0"))["gpu"]
    assert held >= 4 * PER_BATCH and gauge(h, "kvindex_pod_over_capacity") == 0, held


async def delete(h: Any, path: str) -> tuple[int, Any]:
    async with h.session.delete(h.url + path) as r:
        return r.status, await r.read()
