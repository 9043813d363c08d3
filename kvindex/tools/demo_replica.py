"""One simulated engine of ``kvindex demo``: a ``SimulatedCache`` (vLLM's prefix-cache
semantics, block size 16) whose admissions' events are encoded in vLLM's map dialect and published
by a ``FakeEngine`` (PUB plus a ROUTER replay endpoint) on ``tcp://127.0.0.1:<free port>``, topic
``kv@sim-<i>@<model>``, seq counting from 0, one batch per admission that produced events."""

from __future__ import annotations

import time

import zmq.asyncio

from kvindex.tools.engine_sim import Admission, SimulatedCache, encode_batch
from kvindex.tools.fake_engine import FakeEngine

BLOCK_SIZE = 16


class Replica:
    """One simulated engine: its block cache and its KV-event publisher."""

    def __init__(self, i: int, model: str, cache_blocks: int, ctx: zmq.asyncio.Context) -> None:
        self.pod = f"sim-{i}"
        self.topic = f"kv@{self.pod}@{model}".encode()
        self.cache = SimulatedCache(cache_blocks, BLOCK_SIZE)
        self.engine = FakeEngine("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", context=ctx)
        self.seq = 0
        self.stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "stored": 0, "evicted": 0, "batches": 0,
                      "held": 0}

    def admit(self, token_ids: tuple[int, ...]) -> Admission:
        """Prefill the prompt (the engine's answer carries ``cached_tokens``); events are held until ``publish``."""
        adm = self.cache.admit(token_ids)
        s = self.stats
        s["requests"] += 1
        s["prompt_tokens"] += adm.prompt_tokens
        s["cached_tokens"] += adm.cached_tokens
        for ev in adm.events:
            s["evicted" if ev["type"] == "BlockRemoved" else "stored"] += len(ev.get("block_hashes", ()))
        s["held"] = self.cache.physical_blocks()
        return adm

    async def publish(self, adm: Admission) -> None:
        """Publish one admission's events as one vLLM batch (nothing when it produced none)."""
        if adm.events:
            payload = encode_batch(adm.events, time.time())
            await self.engine.publish((self.topic, self.seq.to_bytes(8, "big"), payload))
            self.seq += 1
            self.stats["batches"] += 1
