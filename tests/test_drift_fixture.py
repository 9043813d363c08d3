"""Drift on real data: the two_engines capture replayed into the daemon while every request of
its meta.json is posted as a routing decision for the engine that served it (request i → engine
i % 2). Predictions and stale / unseen counts are checked against an independent computation
written here from the definitions (plain xxhash, plain dicts; no kvindex code)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from kvindex.config import Config
from kvindex.settings import DriftSettings
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, engine_config, ipc_endpoint

CAPTURE = FIXTURES / "two_engines"
BS = 32
THRESHOLD = 0.5


class Independent:
    """The router's beliefs and the engines' holdings, from first principles."""

    def __init__(self) -> None:
        self.believed: dict[str, set[int]] = {}  # pod -> Kthena hashes recorded there (no eviction at this size)
        self.prefixes: dict[str, dict[int, tuple[int, ...]]] = {}  # pod -> engine hash -> token prefix
        self.last_seq: dict[str, int] = {}

    @staticmethod
    def rendered(r: dict[str, Any]) -> str:
        if "prompt" in r:
            return r["prompt"]
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in r["messages"])

    @staticmethod
    def hashes(model: str, text: str) -> list[int]:
        data, prev, out = text.encode(), xxhash.xxh64_intdigest(model.encode()), []
        for i in range(0, min(len(data), 64 * 128), 64):
            prev = xxhash.xxh64_intdigest(str(prev).encode() + data[i:i + 64])
            out.append(prev)
        return out

    def belief(self, pod: str, hs: list[int]) -> float:
        held = self.believed.get(pod, set())
        depth = max((i + 1 for i, h in enumerate(hs) if h in held), default=0)
        return depth / len(hs) if hs else 0.0

    def truth(self, pod: str, token_ids: list[int]) -> float:
        held = set(self.prefixes.get(pod, {}).values())
        cacheable = (len(token_ids) - 1) // BS
        depth = 0
        while depth < cacheable and tuple(token_ids[: (depth + 1) * BS]) in held:
            depth += 1
        return depth * BS / len(token_ids)

    def apply(self, frames: tuple[bytes, ...]) -> None:
        pod = frames[0].decode().split("@")[1]
        seq = int.from_bytes(frames[1], "big")
        if seq <= self.last_seq.get(pod, -1):
            self.prefixes[pod] = {}
        self.last_seq[pod] = seq
        held = self.prefixes.setdefault(pod, {})
        for ev in msgpack.unpackb(frames[2], raw=False)[1]:
            if ev["type"] == "BlockStored":
                parent = () if ev["parent_block_hash"] is None else held.get(ev["parent_block_hash"])
                for i, h in enumerate(ev["block_hashes"]):
                    if parent is not None:
                        parent = parent + tuple(ev["token_ids"][i * BS:(i + 1) * BS])
                        held[h] = parent
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    held.pop(h, None)  # this capture never holds two copies of one hash at once
            else:
                held.clear()


def request_body(r: dict[str, Any]) -> dict[str, Any]:
    body = {"model": "tiny"}
    body.update({"prompt": r["prompt"]} if "prompt" in r else {"messages": r["messages"]})
    return body


def overlaps(r: dict[str, Any], reqs: list[dict[str, Any]]) -> bool:
    """Another request to the same engine was in flight when r was sent (the capture runs two at
    a time per engine, so its blocks may be stored between r's send and r's scheduling)."""
    return any(o is not r and o["server"] == r["server"] and o["t_sent"] < r["t_sent"] < o["t_done"] for o in reqs)


async def test_drift_on_two_engines_equals_independent_computation(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    meta = json.loads((CAPTURE / "meta.json").read_text())
    reqs = sorted(meta["requests"], key=lambda r: r["t_sent"])
    captured = load_capture(CAPTURE / "events.jsonl")
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),), drift=DriftSettings(recheck_seconds=3600, threshold=THRESHOLD)))
    await h.wait_connected()
    ind = Independent()
    pos, exact = 0, 0
    for r in reqs:
        while pos < len(captured) and captured[pos].t < r["t_sent"]:
            frames = captured[pos].frames
            await engine.publish(frames)
            ind.apply(frames)
            await h.wait_seq(frames[0].decode().split("@")[1], int.from_bytes(frames[1], "big"))
            pos += 1
        pod = f"127.0.0.1:800{r['i'] % 2}"
        assert r["server"].endswith(pod)
        hs = Independent.hashes("tiny", Independent.rendered(r))
        status, d = await h.post("/v1/decisions", {"pod": pod, "request": request_body(r), "token_ids": r["prompt_token_ids"],
                                                   "cached_tokens": r["cached_tokens"], "prompt_tokens": r["prompt_tokens"]})
        assert status == 200, d
        b, t = ind.belief(pod, hs), ind.truth(pod, r["prompt_token_ids"])
        assert d["approx"]["blocks"] == round(b * len(hs)) and abs(d["approx"]["ratio"] - b) < 1e-6, r["i"]
        assert abs(d["precise"]["ratio"] - t) < 1e-6, r["i"]
        actual = r["cached_tokens"] / r["prompt_tokens"]
        assert abs(d["errors"]["approx"] - (b - actual)) < 1e-6 and abs(d["errors"]["precise"] - (t - actual)) < 1e-6
        if not overlaps(r, reqs):
            assert d["precise"]["tokens"] == r["cached_tokens"], r["i"]
            exact += 1
        ind.believed.setdefault(pod, set()).update(hs)
    assert exact >= 10
    for c in captured[pos:]:
        await engine.publish(c.frames)
        ind.apply(c.frames)
    for pod, seq in ind.last_seq.items():
        await h.wait_seq(pod, seq)

    status, drift = await h.get("/v1/drift?recheck=1&window=100000")
    assert status == 200
    expected_stale: dict[str, int] = {}
    expected_unseen: dict[str, int] = {}
    for r in reqs:
        pod = f"127.0.0.1:800{r['i'] % 2}"
        hs = Independent.hashes("tiny", Independent.rendered(r))
        if ind.belief(pod, hs) - ind.truth(pod, r["prompt_token_ids"]) >= THRESHOLD:
            expected_stale[pod] = expected_stale.get(pod, 0) + 1
        for q in ("127.0.0.1:8000", "127.0.0.1:8001"):
            if ind.truth(q, r["prompt_token_ids"]) - ind.belief(q, hs) >= THRESHOLD:
                expected_unseen[q] = expected_unseen.get(q, 0) + 1
    for pod in ("127.0.0.1:8000", "127.0.0.1:8001"):
        got = drift["pods"][pod]
        assert got["sampled"] == 60
        assert got["stale"] == expected_stale.get(pod, 0), (pod, got)
        assert got["unseen"] == expected_unseen.get(pod, 0), (pod, got)
        assert got["decisions"] == 60
    assert sum(expected_stale.values()) > 0  # the capture does evict: the check is not vacuous
    status, metrics = await h.get("/metrics")
    for pod in ("127.0.0.1:8000", "127.0.0.1:8001"):
        assert f'kvindex_drift_stale{{pod="{pod}"}} {float(expected_stale.get(pod, 0))}'.encode() in metrics
