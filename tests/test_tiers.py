"""CPU (and disk) tiers end to end: real frames over real ZeroMQ into a running daemon, answered
over its HTTP API.

- The recorded ``offload_cpu`` capture (vLLM 0.32's OffloadingConnector, placeholder CPU events):
  for every request, sent in order, ``/v1/score``'s ``total_tokens`` equals the engine's own
  ``cached_tokens``, and every probe of the prompt (its own identity, the other one, a salt nobody
  uses) answers what an independent replay of the raw frames says that identity holds: a salted
  block never answers another identity on any tier.
- A ``self_describing_kv_events`` stream (no capture exists: frames built as the capture README
  states vLLM sends them: CPU stores with token ids, block size 32 and a parent, but no extra_keys):
  a salted prefix's CPU copy never answers an unsalted query.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvindex.config import Config
from kvindex.settings import TierWeights
from kvindex.tools.capture import Captured, load_capture
from tests.conftest import CONFIGS, engine_config, ipc_endpoint

OFFLOAD = CONFIGS / "offload_cpu"
BS = 32


class IndependentTiers:
    """What each identity (cache salt) holds on any tier, from the raw frames alone (plain msgpack,
    hashlib; no kvindex code). A device store keys its blocks by identity and token prefix; a
    lower-tier store is a copy of the device block with the same engine hash (its identity and
    prefix), or of nothing when the device holds no such hash."""

    def __init__(self) -> None:
        self.media: dict[str, dict[int, tuple[bytes | None, int]]] = {}  # medium -> hash -> (key, copies)

    def apply(self, payload: bytes) -> None:
        _ts, events, *_ = msgpack.unpackb(payload, raw=False)
        for ev in events:
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                self.media.clear()
            elif kind == "BlockRemoved":
                held = self.media.get(ev.get("medium") or "GPU", {})
                for h in ev["block_hashes"]:
                    if h not in held:
                        continue
                    key, copies = held[h]
                    if copies == 1:
                        del held[h]
                    else:
                        held[h] = (key, copies - 1)
            else:
                self._store(ev)

    def _store(self, ev: dict[str, Any]) -> None:
        medium = ev.get("medium") or "GPU"
        held = self.media.setdefault(medium, {})
        gpu = self.media.setdefault("GPU", {})
        if medium != "GPU":
            keys = [gpu.get(h, (None, 0))[0] for h in ev["block_hashes"]]
        else:
            parent = ev.get("parent_block_hash")
            extra = ev.get("extra_keys") or [None]
            salt = extra[0][-1] if extra[0] else None
            key = root(salt) if parent is None else self.key_of(parent)
            tokens = ev["token_ids"]
            keys = []
            for i in range(len(ev["block_hashes"])):
                key = chained(key, tokens[i * BS:(i + 1) * BS])
                keys.append(key)
        for h, key in zip(ev["block_hashes"], keys):
            old = held.get(h)
            held[h] = (key, 1) if old is None else (old[0], old[1] + 1)

    def key_of(self, h: int) -> bytes | None:
        for medium in ("GPU", *self.media):
            if h in self.media.get(medium, {}):
                return self.media[medium][h][0]
        return None

    def depth(self, token_ids: list[int], salt: str | None) -> int:
        """Blocks of the prompt (those that may be served) held, block by block, on any tier."""
        held = {key for tier in self.media.values() for key, _ in tier.values()}
        key, n = root(salt), 0
        for i in range((len(token_ids) - 1) // BS):
            key = chained(key, token_ids[i * BS:(i + 1) * BS])
            if key not in held:
                break
            n += 1
        return n


def root(salt: str | None) -> bytes:
    return hashlib.sha256(json.dumps(["root", salt]).encode()).digest()


def chained(parent: bytes | None, tokens: list[int]) -> bytes | None:
    return None if parent is None else hashlib.sha256(parent + array("I", tokens).tobytes()).digest()


async def start(make_harness: Any, make_engine: Any, tmp_path: Path, **config: Any) -> tuple[Any, Any]:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),), **config))
    await h.wait_connected()
    return engine, h


async def publish(engine: Any, h: Any, frames: list[bytes]) -> None:
    await engine.publish(frames)
    await h.wait_seq(frames[0].decode().split("@")[1], int.from_bytes(frames[1], "big"))


async def precise(h: Any, pod: str, token_ids: list[int], salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "token_ids": token_ids, "pods": [pod]}
    if salt is not None:
        body["cache_salt"] = salt
    status, s = await h.post("/v1/score", body)
    assert status == 200, s
    return s["pods"][pod]["precise"]


def self_describing(captured: list[Captured]) -> list[Captured]:
    """The capture as ``self_describing_kv_events`` would send it (the README's facts): each CPU
    store carries its device block's token ids, block size 32 and parent, and no extra_keys."""
    device: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, the block's tokens)
    out = []
    for c in captured:
        ts, events, rank = msgpack.unpackb(c.frames[2], raw=False)
        for i, ev in enumerate(events):
            if ev["type"] == "BlockStored" and (ev.get("medium") or "GPU") == "GPU":
                parent = ev.get("parent_block_hash")
                for j, h in enumerate(ev["block_hashes"]):
                    device[h], parent = (parent, ev["token_ids"][j * BS:(j + 1) * BS]), h
            elif ev["type"] == "BlockStored":
                parent, tokens = device[ev["block_hashes"][0]]
                events[i] = {**ev, "token_ids": tokens, "block_size": BS, "parent_block_hash": parent}
        out.append(Captured(c.t, (c.frames[0], c.frames[1], msgpack.packb([ts, events, rank]))))
    return out


@pytest.mark.parametrize("variant", ["placeholders", "self_describing"])
async def test_offload_cpu_total_depth_is_the_engines_cached_tokens_and_identities_stay_apart(
        variant: str, make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """``placeholders``: the capture as recorded; ``self_describing``: the same stream as vLLM sends
    it with ``self_describing_kv_events`` (before the fix 3 unsalted probes of the 17 salted
    prompts matched the salted prefix's CPU copies)."""
    captured: list[Captured] = load_capture(OFFLOAD / "events.jsonl")
    if variant == "self_describing":
        captured = self_describing(captured)
    requests = sorted(json.loads((OFFLOAD / "meta.json").read_text())["requests"], key=lambda r: r["t_sent"])
    engine, h = await start(make_harness, make_engine, tmp_path)
    truth = IndependentTiers()
    pos, equal, device_only, host_hits, probes = 0, 0, 0, 0, 0
    for r in requests:
        while pos < len(captured) and captured[pos].t < r["t_sent"]:
            await publish(engine, h, captured[pos].frames)
            truth.apply(captured[pos].frames[2])
            pos += 1
        pod, tokens, own = r["server"].split("//")[1], r["prompt_token_ids"], r.get("cache_salt")
        got = await precise(h, pod, tokens, own)
        assert got["total_tokens"] == r["cached_tokens"], (r["i"], got, r["cached_tokens"])
        assert got["total_tokens"] == got["total_blocks"] * BS == truth.depth(tokens, own) * BS
        blocks = got["tier_blocks"]
        assert blocks["device"] == got["blocks"] and sum(blocks.values()) == got["total_blocks"]
        assert got["tier_score"] == blocks["device"] + 0.75 * blocks["host"] + 0.25 * blocks["disk"]
        equal += 1
        device_only += got["tokens"] == r["cached_tokens"]
        host_hits += blocks["host"] > 0
        for salt in {None, "salt-T3", "salt-nobody"} - {own}:  # the other identities, on every tier
            other = await precise(h, pod, tokens, salt)
            assert other["total_blocks"] == truth.depth(tokens, salt), (r["i"], salt, other)
            assert other["blocks"] <= other["total_blocks"]
            probes += 1
        assert (await precise(h, pod, tokens, "salt-nobody"))["total_blocks"] == 0
    assert (equal, probes) == (150, 300)
    assert sum(r.get("cache_salt") is not None for r in requests) == 17
    assert host_hits > 20 and device_only < 140  # the capture does exercise the CPU tier
    status, text = await h.get("/metrics")
    assert 'reason="bad_block_size"' not in text.decode()


def frame(topic: str, seq: int, *events: dict[str, Any]) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), msgpack.packb([1.0, list(events), 0])]


def gpu_store(hashes: list[int], parent: int | None, tokens: list[int], salt: str | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [[salt] if salt else None] + [None] * (len(hashes) - 1), "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}


def self_describing_cpu_store(h: int, parent: int | None, tokens: list[int]) -> dict[str, Any]:
    """As vLLM sends a CPU store with ``self_describing_kv_events``: tokens, block size, parent; no extra_keys."""
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "medium": "CPU", "group_idx": 0}


async def test_a_self_describing_cpu_copy_of_a_salted_prefix_never_answers_an_unsalted_query(
        make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    engine, h = await start(make_harness, make_engine, tmp_path, tiers=TierWeights(1.0, 0.5, 0.0))  # [tiers]
    topic, pod = "kv@sd:8000@tiny", "sd:8000"
    prompt = list(range(1000, 1000 + 3 * BS + 5))
    a1, a2, a3, stray = 11, 12, 13, 99
    batches = [
        (gpu_store([a1, a2, a3], None, prompt[:3 * BS], salt="salt-T3"),),
        tuple(self_describing_cpu_store(hh, p, prompt[i * BS:(i + 1) * BS])
              for i, (hh, p) in enumerate(((a1, None), (a2, a1), (a3, a2)))),
        ({"type": "BlockRemoved", "block_hashes": [a3, a2, a1], "medium": "GPU", "group_idx": 0},),  # evicted from the device
        (self_describing_cpu_store(stray, None, prompt[:BS]),),  # a copy of a hash the device never held
    ]
    for seq, events in enumerate(batches):
        await publish(engine, h, frame(topic, seq, *events))
    plain = await precise(h, pod, prompt, None)
    assert (plain["blocks"], plain["total_blocks"], plain["tier_score"]) == (0, 0, 0)
    assert "cpu_tokens" not in plain
    salted = await precise(h, pod, prompt, "salt-T3")
    assert (salted["blocks"], salted["total_blocks"], salted["total_tokens"]) == (0, 3, 3 * BS)
    assert salted["tier_blocks"] == {"device": 0, "host": 3, "disk": 0} and salted["tier_score"] == 1.5
    status, pods = await h.get(f"/v1/pods/{pod}")
    assert status == 200 and pods["blocks"]["cpu"] == 4 and pods["blocks"]["orphans"] == 1
    status, text = await h.get("/metrics")
    assert f'kvindex_decode_errors_total{{pod="{pod}",reason="tier_unkeyed"}} 1.0' in text.decode()
