"""Decisions reported after the request was served are judged by the prediction made before it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvindex.config import Config
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, engine_config, ipc_endpoint

POD = "127.0.0.1:8000"


def body(r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "tiny"}
    out.update({"prompt": r["prompt"]} if "prompt" in r else {"messages": r["messages"]})
    return out


async def test_decision_uses_the_score_time_prediction(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    meta = json.loads((FIXTURES / "small" / "meta.json").read_text())
    reqs = sorted(meta["requests"], key=lambda r: r["t_sent"])
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),)))
    await h.wait_connected()
    pos = 0

    async def publish_until(t: float) -> None:
        nonlocal pos
        while pos < len(captured) and captured[pos].t < t:
            await engine.publish(captured[pos].frames)
            await h.wait_seq(POD, int.from_bytes(captured[pos].frames[1], "big"))
            pos += 1

    from_score = from_decision = 0
    for i, r in enumerate(reqs):
        await publish_until(r["t_sent"])
        scored = i % 2 == 0  # every other request is scored first, as a router would
        if scored:
            status, s = await h.post("/v1/score", {**body(r), "token_ids": r["prompt_token_ids"], "pods": [POD]})
            assert status == 200 and s["pods"][POD]["precise"]["tokens"] == r["cached_tokens"]
        await publish_until(r["t_done"] + 0.001)  # the engine publishes this request's own blocks first
        status, d = await h.post("/v1/decisions", {"pod": POD, "request": body(r), "token_ids": r["prompt_token_ids"],
                                                   "cached_tokens": r["cached_tokens"]})
        assert status == 200, d
        if scored:
            assert d["precise_from"] == "score"
            assert d["precise"]["tokens"] == r["cached_tokens"] and d["errors"]["precise"] == 0
            from_score += 1
        else:
            assert d["precise_from"] == "decision"
            from_decision += 1
    assert from_score == from_decision == 10
