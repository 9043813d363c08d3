"""Dynamo's ``/dump`` and ``/query_tiered_by_hash`` shapes, in process (``kvindex.dynamo_dump``).

The real programs are in tests/e2e/test_dynamo_interop.py (marker dynamo); here, without them:
kvindex's dump read back gives exactly kvindex's keys; a dump recorded from Dynamo's own indexer
(ai-dynamo-runtime 1.6.1, fixtures/dynamo-1.6.1/small-dump.json, after the ``small`` capture)
restores a kvindex (``--peer``, the peer having no ``/v1/state``) that answers as one that
ingested the capture; the tiered answer's lower tiers; worker-id mapping; the lineage bound.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
from aiohttp import web

from kvindex import keys as K
from kvindex.config import Config
from kvindex.dynamo_dump import entries_from_dump, is_dynamo_dump, worker_number
from kvindex.index.lineage import Lineage
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, engine_config, ipc_endpoint, serve_app

ROOT = Path(__file__).resolve().parents[1]
DYNAMO_DUMP = ROOT / "fixtures" / "dynamo-1.6.1" / "small-dump.json"
MODEL, BS = "tiny", 32


def requests() -> list[dict[str, Any]]:
    return json.loads((FIXTURES / "small" / "meta.json").read_text())["requests"]


async def fed(make_harness: Any, make_engine: Any, tmp_path: Path, pod: str, dynamo_dump: bool = True) -> Any:
    """A daemon that ingested the whole ``small`` capture as pod ``pod``."""
    engine = await make_engine(ipc_endpoint(tmp_path, "e"))
    h = await make_harness(Config(engines=(engine_config(engine, pod=pod),), dynamo_dump=dynamo_dump))
    await h.wait_connected()
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    for m in captured:
        await engine.publish(m.frames)
    await h.wait_seq(pod, int.from_bytes(captured[-1].frames[1], "big"))
    return h


def test_worker_numbers() -> None:
    assert worker_number("7") == 7 and worker_number("0") == 0 and worker_number(str((1 << 64) - 1)) == (1 << 64) - 1
    n = worker_number("vllm-0")
    assert n == worker_number("vllm-0") == 5936549689409078744 and n < 1 << 63  # stable: SHA-256, top bit cleared
    assert len({worker_number(f"pod-{i}") for i in range(1000)}) == 1000
    assert worker_number(str(1 << 64)) != 1 << 64 and worker_number("٣") < 1 << 63  # too big, not ASCII: hashed


async def test_kvindex_dump_reads_back_to_its_keys(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    h = await fed(make_harness, make_engine, tmp_path, "vllm-0")
    status, dump = await h.get("/dump")
    assert status == 200 and is_dynamo_dump(dump)
    group = dump[f"{MODEL}:default"]
    assert group["kvindex_unplaced"] == []
    seen: set[int] = set()
    for ev in group["events"]:  # parents before children, each parent held by the same worker
        stored = ev["event"]["data"]["stored"]
        assert ev["worker_id"] == worker_number("vllm-0") and ev["pod"] == "vllm-0"
        assert stored["parent_hash"] is None or stored["parent_hash"] in seen
        seen.update(b["block_hash"] for b in stored["blocks"])
    sizes, entries, _ = entries_from_dump(dump)
    assert sizes == {MODEL: BS}
    held = {h_: k for h_, k in (await h.daemon.store.engine_hashes("vllm-0"))[0].items()}
    assert {e.hash: e.key for e in entries} == held and len(held) == 46  # the exact keys, from local hashes
    # a prompt's local hashes are the dumped tokens_hash values of its blocks
    r = max(requests(), key=lambda r: r["cached_tokens"])
    want = K.local_hashes(r["prompt_token_ids"], BS)[: r["cached_tokens"] // BS]
    assert set(want) <= {b["tokens_hash"] for ev in group["events"] for b in ev["event"]["data"]["stored"]["blocks"]}


async def test_without_dynamo_dump_the_dump_places_nothing_and_says_so(make_harness: Any, make_engine: Any,
                                                                      tmp_path: Path) -> None:
    """The default keeps no per-block hashes (ingest stays as fast as before): /dump is still
    Dynamo's shape, every block listed in ``kvindex_unplaced`` with its key, none in the tree."""
    h = await fed(make_harness, make_engine, tmp_path, "vllm-0", dynamo_dump=False)
    assert h.daemon.index is not None and h.daemon.index.lineage is None
    status, dump = await h.get("/dump")
    assert status == 200 and is_dynamo_dump(dump)
    group = dump[f"{MODEL}:default"]
    assert group["events"] == [] and len(group["kvindex_unplaced"]) == 46


async def dynamo_peer(dump: bytes) -> tuple[web.AppRunner, str]:
    """A peer that speaks as Dynamo's indexer: no /v1/state, its recorded /dump."""
    app = web.Application()
    app.router.add_get("/dump", lambda _: web.Response(body=dump, content_type="application/json"))
    return await serve_app(app)


async def test_peer_recovers_from_a_dynamo_dump(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    live = await fed(make_harness, make_engine, tmp_path, "1")  # Dynamo's worker 1 ingested the same capture
    runner, url = await dynamo_peer(DYNAMO_DUMP.read_bytes())
    try:
        h = await make_harness(Config(peer=url, dynamo_dump=True))
        assert h.daemon.restored_from == "peer"  # start() returns once the restore is over
        agree = 0
        for r in requests():
            body = {"token_ids": r["prompt_token_ids"], "model_name": MODEL}
            (s1, a), (s2, b) = await h.post("/query", body), await live.post("/query", body)
            assert s1 == s2 == 200
            agree += a == b
        assert agree == len(requests()) == 20
        _, dump = await h.get("/dump")  # the restored blocks are placed again: they kept their local hashes
        assert len(entries_from_dump(dump)[1]) == 46 and dump[f"{MODEL}:default"]["kvindex_unplaced"] == []
    finally:
        await runner.cleanup()


async def test_peer_refuses_what_is_not_a_dump(make_harness: Any) -> None:
    for body in (b"not json", json.dumps({"m:default": {"events": "x"}}).encode()):
        runner, url = await dynamo_peer(body)
        try:
            h = await make_harness(Config(peer=url))  # start() returns once the restore is over
            assert h.daemon.restored_from is None and await h.daemon.store.pods() == []  # it started empty
            status, _ = await h.get("/readyz")
            assert status == 200
        finally:
            await runner.cleanup()


async def test_tiered_answer_has_lower_tiers(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "t"))
    h = await make_harness(Config())
    status, got = await h.post("/register", {"instance_id": 7, "endpoint": engine.endpoint, "model_name": MODEL,
                                             "block_size": 4})
    assert status == 201, got
    await h.wait_connected()
    tokens = list(range(1, 17))  # 4 blocks of 4: 2 on the GPU, 3 in CPU memory (the first two in both)
    gpu = {"type": "BlockStored", "block_hashes": [1, 2, 3], "parent_block_hash": None, "token_ids": tokens[:12],
           "block_size": 4}
    cpu = {**gpu, "medium": "CPU"}  # offloaded copies of device blocks, then the third leaves the device
    evicted = {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}
    await engine.publish([b"kv@x@tiny", (0).to_bytes(8, "big"), msgpack.packb([1.0, [gpu, cpu, evicted], 0])])
    await h.wait_seq("7", 0)
    lh = K.local_hashes(tokens, 4)
    status, q = await h.post("/query_tiered_by_hash", {"block_hashes": [x - (1 << 64) if x >= 1 << 63 else x for x in lh],
                                                       "model_name": MODEL, "routing_group": "default"})
    assert status == 200 and q == {"block_size": 4, "tiered": {
        "device": {"scores": [[{"worker_id": 7, "dp_rank": 0}, 2]], "frequencies": [1, 1]},
        "lower_tier": [["host_pinned", {"hits": [[{"worker_id": 7, "dp_rank": 0}, 1]]}]]}}
    status, q = await h.post("/query", {"token_ids": tokens, "model_name": MODEL})
    assert q["instances"]["7"] == {"longest_matched": 8, "gpu": 8, "dp": {"0": 8}, "cpu": 12, "disk": 12}
    status, err = await h.post("/query_tiered_by_hash", {"block_hashes": ["x"], "model_name": MODEL})
    assert status == 400 and err["field"] == "block_hashes"
    status, q = await h.post("/query_tiered_by_hash", {"block_hashes": lh, "model_name": "other"})
    assert status == 200 and q["tiered"] == {"device": {"scores": [], "frequencies": []}, "lower_tier": []}


def test_lineage_is_bounded_by_what_is_held() -> None:
    held: dict[int, int] = {}  # as the index's holder maps: key -> mask
    lin = Lineage(lambda: [held])
    for i in range(10 * (1 << 16)):
        lin.add(0, [i], [i])
        if i % 8 == 0:
            held[i] = 1  # one key in eight stays held
    assert len(lin) <= 4 * (1 << 16) + 1 and len(lin) < 10 * (1 << 16) // 2
    assert lin.of(0) == (0, 0) and lin.of(8 * (1 << 16)) == (0, 8 * (1 << 16))  # held ones survive every prune
    assert lin.of(1) is None  # an unheld one from before the last prune is gone
    lin.add(5, [11, 12], [21, 22])  # a chain: each key's parent is the one before it
    assert lin.of(21) == (5, 11) and lin.of(22) == (21, 12)
