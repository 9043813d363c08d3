"""A pod no engine publishes for any more is never synced (issue 37, item 6): the engine removed
from the configuration, and kvindex restarted on its state dir with the pod's blocks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from kvindex.config import Config
from tests.conftest import engine_config, ipc_endpoint
from tests.test_http import POD, meta_requests, publish_capture, raw
from tests.test_mooncake_api import MODEL, mooncake_query, post_mp


async def test_a_pod_without_an_engine_after_a_restart_is_unsynced(make_harness: Any, make_engine: Any,
                                                                     tmp_path: Path) -> None:
    state = tmp_path / "state"
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),), state_dir=state))
    await h.wait_connected()
    await publish_capture(h, engine, POD)
    status, before = await h.get(f"/v1/pods/{POD}")
    assert status == 200 and before["synced"] and before["blocks"]["gpu"] > 0, before
    await h.daemon.stop()  # writes the snapshot
    again = await make_harness(Config(state_dir=state))  # the engine is no longer configured
    status, after = await again.get(f"/v1/pods/{POD}")
    assert status == 200 and after["blocks"] == before["blocks"], after  # its state is kept, as it was
    assert after["synced"] is False and "no configured or registered engine" in after["unsynced_reason"], after
    status, text = await again.get("/metrics")
    assert f'kvindex_pod_synced{{pod="{POD}"}} 0.0' in text.decode()


async def precise_answers(h: Any, tokens: list[int]) -> dict[str, Any]:
    """What every precise route answers of ``POD`` for ``tokens``: /v1/score (every pod, and
    ``POD`` named), Dynamo's /query, Mooncake's /query and a decision recorded for ``POD``."""
    out: dict[str, Any] = {}
    status, s = await h.post("/v1/score", {"model": MODEL, "token_ids": tokens})
    assert status == 200, s
    out["score"] = (s["pods"].get(POD) or {}).get("precise")
    status, s = await h.post("/v1/score", {"model": MODEL, "token_ids": tokens, "pods": [POD]})
    assert status == 200, s
    out["score_named"] = s["pods"][POD]["precise"]["blocks"]
    status, d = await h.post("/query", {"token_ids": tokens, "model_name": MODEL})
    assert status == 200, d
    out["dynamo"] = (d["scores"].get(POD), d["instances"].get(POD, {}).get("longest_matched", 0))
    status, m = await post_mp(h, "/query", mooncake_query(tokens))
    assert status == 200, m
    out["mooncake"] = m["instances"].get(POD, {}).get("longest_matched", 0)
    status, r = await h.post("/v1/decisions", {"pod": POD, "token_ids": tokens,
                                               "request": {"model": MODEL, "prompt": "a prompt"}})
    assert status == 200, r
    out["decision"] = r["precise"]["tokens"]
    return out


async def held_then_stopped(make_harness: Any, make_engine: Any, tmp_path: Path) -> tuple[Path, list[int], dict]:
    """A daemon on a state dir fed the capture by its engine, then stopped (its snapshot written):
    the state dir, the longest request's tokens and every route's answer for them."""
    state = tmp_path / "state"
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),), state_dir=state))
    await h.wait_connected()
    await publish_capture(h, engine, POD)
    tokens = max((r["prompt_token_ids"] for r in meta_requests()), key=len)
    held = await precise_answers(h, tokens)
    await h.daemon.stop()
    return state, tokens, held


NOWHERE = {"score": None, "score_named": 0, "dynamo": (None, 0), "mooncake": 0, "decision": 0}


async def test_an_orphaned_pod_is_in_no_answer(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """Its blocks are kept (listed, unsynced) but, once the grace period is over, no route offers
    them as held: a router asking about the prompt the pod held is told nobody holds it, on every API."""
    state, tokens, held = await held_then_stopped(make_harness, make_engine, tmp_path)
    assert held["score_named"] > 0 and held["mooncake"] > 0 and held["decision"] > 0, held  # held, on every route
    again = await make_harness(Config(state_dir=state, orphan_grace_seconds=0))  # the engine is no longer configured
    status, pod = await again.get(f"/v1/pods/{POD}")
    assert status == 200 and pod["synced"] is False and pod["blocks"]["gpu"] > 0, pod
    orphaned = await precise_answers(again, tokens)
    assert orphaned == NOWHERE, orphaned
    status, _, _ = await raw(again, "DELETE", f"/v1/pods/{POD}")
    assert status == 200
    status, pods = await again.get("/v1/pods")
    assert POD not in {p["pod"] for p in pods["pods"]}, pods


async def test_an_orphaned_pod_is_answered_unsynced_for_its_grace_period(make_harness: Any, make_engine: Any,
                                                                        tmp_path: Path) -> None:
    """During ``orphan_grace_seconds`` after the start (an engine may register again) the restored
    blocks are answered as they were, the pod listed unsynced; after it, in no answer."""
    state, tokens, held = await held_then_stopped(make_harness, make_engine, tmp_path)
    grace = 1.5
    again = await make_harness(Config(state_dir=state, orphan_grace_seconds=grace))
    started = time.monotonic()
    assert await precise_answers(again, tokens) == held
    assert time.monotonic() - started < grace, "the check took longer than the grace period: raise it"
    status, pod = await again.get(f"/v1/pods/{POD}")
    assert status == 200 and pod["synced"] is False, pod
    await asyncio.sleep(grace - (time.monotonic() - started) + 0.1)
    assert await precise_answers(again, tokens) == NOWHERE
