"""Replica-safe ingest, lane by lane: several ``EngineLane``s (one per "replica") over ONE store,
fed the same engine batches in different interleavings. The store's stream position is the shared
truth: every batch is applied once, an engine restart clears once, a replica that missed the
restart adopts the store's epoch, a store behind the replica (it lost writes) is resynchronised
through the engine's replay. Real lanes, the real memory store, a real replay endpoint (ZeroMQ)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import zmq.asyncio
from prometheus_client import CollectorRegistry

from adapters.dialects import DIALECTS
from kvindex.config import EngineConfig
from kvindex.events import Frame
from kvindex.index.memory import MemoryPreciseStore
from kvindex.ingest.intake import Intake
from kvindex.ingest.lane import EngineLane
from kvindex.ingest.streams import LaneSettings
from kvindex.logs import BurstLog
from kvindex.metrics import Metrics
from kvindex.sequence import Position
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, independent_holdings, ipc_endpoint

POD, TOPIC, BS = "p0", "kv@p0@m", 4


def batch(seq: int, life_start: int = 0, ts: float = 1.0) -> Frame:
    """Engine batch ``seq``: stores block ``1000 + seq`` chained on the previous one of its life
    (``ts``: its timestamp; an engine's next life publishes other bytes at the same seqs)."""
    parent = None if seq == life_start else 1000 + seq - 1
    ev = {"type": "BlockStored", "block_hashes": [1000 + seq], "parent_block_hash": parent,
          "token_ids": [seq * BS + i for i in range(BS)], "block_size": BS}
    return Frame(TOPIC, seq, msgpack.packb([ts, [ev], 0]))


def _other(f: Frame) -> Frame:
    """The same seq with other bytes (another life's batch)."""
    ev = {"type": "BlockStored", "block_hashes": [1000 + f.seq], "parent_block_hash": None,
          "token_ids": [f.seq * BS + i for i in range(BS)], "block_size": BS, "medium": "GPU"}
    return Frame(f.topic, f.seq, msgpack.packb([2.0, [ev], 0]))


def _rebased(f: Frame, base: int) -> Frame:
    """The same seq storing block ``base + seq`` (chained on ``base + seq - 1``, or on 1000 at seq 1)."""
    parent = 1000 if f.seq == 1 else base + f.seq - 1
    ev = {"type": "BlockStored", "block_hashes": [base + f.seq], "parent_block_hash": parent,
          "token_ids": [7 + f.seq * BS + i for i in range(BS)], "block_size": BS}
    return Frame(f.topic, f.seq, msgpack.packb([3.0, [ev], 0]))


def lanes(store: MemoryPreciseStore, n: int, ctx: zmq.asyncio.Context, *, replay: str | None = None,
          endpoint: str = "tcp://127.0.0.1:1") -> list[EngineLane]:
    import logging

    dialect = DIALECTS["vllm"]
    return [EngineLane(EngineConfig(endpoint=endpoint, replay=replay), intake=Intake(ctx), decoder=dialect.decoder(),
                       first_seq=dialect.first_seq, store=store, metrics=Metrics(CollectorRegistry()),
                       settings=LaneSettings(replay_timeout=2.0), burst=BurstLog(logging.getLogger("test")))
            for _ in range(n)]


def held(store: MemoryPreciseStore, pod: str = POD) -> set[int]:
    return {h for blocks in store.index.engine_hashes(pod).values() for h in blocks}


async def test_every_interleaving_applies_each_capture_batch_once(tmp_path: Path, make_engine: Any) -> None:
    captured = load_capture(FIXTURES / "reset_restart" / "events.jsonl")
    frames = [Frame(c.frames[0].decode(), int.from_bytes(c.frames[1], "big"), c.frames[2]) for c in captured]
    (pod, counts), = independent_holdings(captured).items()
    ctx = zmq.asyncio.Context()
    try:
        for lag in (0, 1, 3, 40, len(frames)):  # replica b handles each batch `lag` batches after replica a
            engine = await make_engine(ipc_endpoint(tmp_path / str(lag), "pub"),
                                       replay_endpoint=ipc_endpoint(tmp_path / str(lag), "replay"))
            store = MemoryPreciseStore()
            a, b = lanes(store, 2, ctx, replay=engine.replay_address)
            for i in range(len(frames) + lag):
                if i < len(frames):  # the engine publishes batch i (its history restarts with it)
                    if i and frames[i].seq <= frames[i - 1].seq:
                        engine.clear_buffer()
                    await engine.publish(list(captured[i].frames), replay_only=True)
                    await a.handle(frames[i])
                if i >= lag:
                    await b.handle(frames[i - lag])
            sa, sb = a.state.streams[frames[0].topic], b.state.streams[frames[0].topic]
            assert sa.batches + sb.batches == len(frames), lag
            assert sa.skipped + sb.skipped == len(frames), lag
            assert sa.epoch == sb.epoch == 1 and sa.restarts == 1, lag
            position = await store.position(sa.ref)
            assert position is not None and position.epoch == 1 and position.synced, lag
            assert position.last_seq == frames[-1].seq, lag
            assert store.index.blocks_held(pod)["gpu"] == sum(counts.values()), lag
    finally:
        ctx.term()


async def publish(engine: Any, f: Frame) -> None:
    await engine.publish([f.topic.encode(), f.seq.to_bytes(8, "big"), f.payload], replay_only=True)


async def test_a_replica_that_missed_the_restart_adopts_the_stores_epoch(tmp_path: Path, make_engine: Any) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    ctx = zmq.asyncio.Context()
    try:
        store = MemoryPreciseStore()
        a, b = lanes(store, 2, ctx, replay=engine.replay_address)
        for seq in range(10):  # the engine's first life: both replicas see it
            await a.handle(batch(seq))
            await b.handle(batch(seq))
        engine.clear_buffer()
        for seq in range(20):  # it restarts (new bytes: another prompt); only a sees the first batches
            await publish(engine, batch(seq, life_start=0) if seq else _other(batch(0)))
        for seq in range(15):
            await a.handle(batch(seq) if seq else _other(batch(0)))
        sb = b.state.streams[TOPIC]
        for seq in range(11, 15):  # b's socket dropped 0..10: its seq never went back
            await b.handle(batch(seq))
        assert sb.epoch == 1 and sb.restarts == 0 and sb.batches == 0
        for seq in range(15, 20):  # a is gone; b carries on alone
            await b.handle(batch(seq))
        assert sb.batches == 5
        assert (await store.position(sb.ref)) == Position(19, 1, True, None)
        assert held(store) == {1000 + s for s in range(20)}  # the new life only, complete
    finally:
        ctx.term()


async def test_a_late_replica_fills_the_gap_to_the_store_and_the_first_one_then_skips(tmp_path: Path,
                                                                                      make_engine: Any) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    ctx = zmq.asyncio.Context()
    try:
        store = MemoryPreciseStore()
        a, b = lanes(store, 2, ctx, replay=engine.replay_address)
        for seq in range(13):
            await publish(engine, batch(seq))
        for seq in range(10):
            await a.handle(batch(seq))
        await b.handle(batch(12))  # b starts late: the store is at 9, so 10 and 11 come from the replay
        sa, sb = a.state.streams[TOPIC], b.state.streams[TOPIC]
        assert sb.gaps == 1 and sb.batches == 3 and engine.replays_served == 2  # its life checked, then the gap
        for seq in (10, 11, 12):
            await a.handle(batch(seq))
        assert sa.batches == 10 and sa.skipped == 3 and sa.gaps == 0
        assert (await store.position(sa.ref)) == Position(12, 0, True, None)
        assert held(store) == {1000 + s for s in range(13)}
    finally:
        ctx.term()


async def test_a_store_behind_the_replica_is_resynchronised_from_the_replay(tmp_path: Path, make_engine: Any) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    ctx = zmq.asyncio.Context()
    try:
        store = MemoryPreciseStore()
        (a,) = lanes(store, 1, ctx, replay=engine.replay_address)
        for seq in range(6):
            await a.handle(batch(seq))
        engine.clear_buffer()  # the engine restarts: its history starts again (other timestamps)
        for seq in range(8):
            f = batch(seq, ts=2.0)
            await publish(engine, f)
            if seq < 7:
                await a.handle(f)
        st = a.state.streams[TOPIC]
        assert st.epoch == 1 and st.restarts == 1
        # the store lost writes: it is back at the first life (epoch 0) with that life's blocks
        await store.set_position(st.ref, Position(5, 0, True, None))
        store.index.apply_batch(POD, "m", 0, DIALECTS["vllm"].decoder().decode(batch(5, life_start=5).payload).events)
        await a.handle(batch(7, ts=2.0))  # BEHIND: cleared, the engine's history replayed, then 7 is a duplicate
        assert (await store.position(st.ref)) == Position(7, 1, True, None) and st.epoch == 1
        assert held(store) == {1000 + s for s in range(8)}
        assert engine.replays_served == 1
    finally:
        ctx.term()


async def test_an_engine_restart_while_no_replica_ran_is_seen_by_the_next_one(tmp_path: Path, make_engine: Any) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    ctx = zmq.asyncio.Context()
    try:
        store = MemoryPreciseStore()
        (a,) = lanes(store, 1, ctx, replay=engine.replay_address)
        for seq in range(10):
            await publish(engine, batch(seq))
            await a.handle(batch(seq))
        engine.clear_buffer()  # a is gone; the engine restarts and serves another prompt
        new_life = [_other(batch(0))] + [_rebased(batch(seq), 5000) for seq in range(1, 5)]
        for f in new_life:
            await publish(engine, f)
        (c,) = lanes(store, 1, ctx, replay=engine.replay_address)  # a new replica starts
        for f in new_life[2:]:  # it joins at seq 2: 0 and 1 come from the replay
            await c.handle(f)
        st = c.state.streams[TOPIC]
        assert st.restarts == 1 and st.epoch == 1 and st.batches == 5
        assert (await store.position(st.ref)) == Position(4, 1, True, None)
        assert held(store) == {1000} | {5000 + s for s in range(1, 5)}  # the first life is gone
    finally:
        ctx.term()
