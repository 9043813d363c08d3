"""Tests of the simulated engine cache, the workload generator and the message file format."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import msgpack
import pytest

from kvindex.tools.engine_sim import (
    SimulatedCache,
    block_hashes,
    encode_batch,
    to_array_event,
)
from kvindex.tools.workload import (
    Request,
    Workload,
    read_messages,
    render_text,
    write_messages,
)

ROOT = Path(__file__).resolve().parent.parent
TS = 1760000000.25
H1, H2, H_REMOVED = 3753563854825738204, 2378715151359315973, 3360539462836043092

# wire-format.md §6, example A (frame 2, map events) and B (frame 2, legacy array events).
EXAMPLE_A = (
    "93cb41da39de00100000928ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf"
    "3417567050a24fdccf2102e4d3c29c9005b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69"
    "6473dc0020cd03e8cd03e9cd03eacd03ebcd03eccd03edcd03eecd03efcd03f0cd03f1cd03f2cd03f3cd03f4"
    "cd03f5cd03f6cd03f7cd03f8cd03f9cd03facd03fbcd03fccd03fdcd03fecd03ffcd0400cd0401cd0402cd04"
    "03cd0404cd0405cd0406cd0407aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da34750"
    "55a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f636163"
    "68655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f76"
    "6564ac626c6f636b5f68617368657391cf2ea308d628063d54a66d656469756da3475055a967726f75705f69"
    "64780000"
)
EXAMPLE_B = (
    "93cb41da39de00100000929cab426c6f636b53746f72656492cf3417567050a24fdccf2102e4d3c29c9005c0"
    "dc0020cd03e8cd03e9cd03eacd03ebcd03eccd03edcd03eecd03efcd03f0cd03f1cd03f2cd03f3cd03f4cd03"
    "f5cd03f6cd03f7cd03f8cd03f9cd03facd03fbcd03fccd03fdcd03fecd03ffcd0400cd0401cd0402cd0403cd"
    "0404cd0405cd0406cd040710c0a3475055c092c0c000ae66756c6c5f617474656e74696f6ec094ac426c6f63"
    "6b52656d6f76656491cf2ea308d628063d54a34750550000"
)
EXAMPLE_C = "93cb41da39de001000009181a474797065b0416c6c426c6f636b73436c656172656400"


def example_events() -> list[dict]:
    """The events of §6 A, as the simulator's map dialect spells them."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [H1, H2],
        "parent_block_hash": None,
        "token_ids": list(range(1000, 1032)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [H_REMOVED], "medium": "GPU", "group_idx": 0}
    return [stored, removed]


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def removed_hashes(events: list[dict]) -> list[int]:
    return [e["block_hashes"][0] for e in events if e["type"] == "BlockRemoved"]


def stored_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "BlockStored"]


# --- wire bytes -------------------------------------------------------------------------------


def test_example_a_map_bytes_reproduced() -> None:
    assert encode_batch(example_events(), TS, 0, "map").hex() == EXAMPLE_A


def test_example_b_array_bytes_reproduced_from_map_events() -> None:
    assert encode_batch(example_events(), TS, 0, "array").hex() == EXAMPLE_B
    assert SimulatedCache.encode_batch(example_events(), TS, dialect="array").hex() == EXAMPLE_B


def test_example_c_all_blocks_cleared() -> None:
    cache = SimulatedCache(4, 4)
    cache.admit(toks(0, 9))
    events = cache.reset()
    assert events == [{"type": "AllBlocksCleared"}]
    assert encode_batch(events, TS).hex() == EXAMPLE_C
    assert msgpack.unpackb(encode_batch(events, TS, dialect="array")) == [
        TS, [["AllBlocksCleared"]], 0,
    ]


def test_array_event_field_order() -> None:
    stored, removed = example_events()
    assert to_array_event(stored)[:5] == ["BlockStored", [H1, H2], None, stored["token_ids"], 16]
    assert len(to_array_event(stored)) == 12 and to_array_event(stored)[11] is None
    assert to_array_event(removed) == ["BlockRemoved", [H_REMOVED], "GPU", 0]
    with pytest.raises(ValueError):
        to_array_event({"type": "Bogus"})
    with pytest.raises(ValueError):
        encode_batch([], TS, dialect="json")


# --- cache semantics --------------------------------------------------------------------------


def test_first_admission_stores_full_blocks_from_root() -> None:
    cache = SimulatedCache(8, 4, hash_seed=3)
    adm = cache.admit(toks(0, 10))
    assert (adm.cached_tokens, adm.prompt_tokens) == (0, 10)
    [ev] = adm.events
    assert ev["block_hashes"] == block_hashes(toks(0, 10), 4, 3)
    assert ev["parent_block_hash"] is None
    assert ev["token_ids"] == toks(0, 8)
    assert ev["extra_keys"] == [None, None] and ev["block_size"] == 4
    assert cache.held() == set(ev["block_hashes"])


def test_hash_chain_depends_on_prefix_and_seed() -> None:
    a = block_hashes(toks(0, 8), 4)
    b = block_hashes([99] + toks(1, 7), 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second-block tokens, different prefix
    assert block_hashes(toks(0, 8), 4, 1) != a
    assert all(0 <= h < 2**64 for h in a)


def test_extension_stores_with_parent() -> None:
    cache = SimulatedCache(8, 4)
    first = cache.admit(toks(0, 9)).events[0]
    adm = cache.admit(toks(0, 17))
    [ev] = adm.events
    assert adm.cached_tokens == 8
    assert ev["parent_block_hash"] == first["block_hashes"][-1]
    assert ev["token_ids"] == toks(8, 8)
    assert ev["block_hashes"] == block_hashes(toks(0, 17), 4)[2:]


def test_last_token_block_is_never_a_hit() -> None:
    cache = SimulatedCache(8, 4)
    cache.admit(toks(0, 8))  # exactly two full blocks
    assert cache.lookup(toks(0, 8)) == 4  # the block holding the last token is recomputed
    assert cache.lookup(toks(0, 9)) == 8
    assert cache.lookup(toks(0, 1)) == 0 and cache.lookup([]) == 0
    adm = cache.admit(toks(0, 8))
    assert adm.cached_tokens == 4
    [ev] = adm.events  # vLLM stores a second physical copy, no dedup
    h = block_hashes(toks(0, 8), 4)
    assert ev["block_hashes"] == [h[1]] and ev["parent_block_hash"] == h[0]
    assert cache.physical_blocks() == 3 and len(cache.held()) == 2


def test_cached_tokens_equal_lookup() -> None:
    cache = SimulatedCache(64, 16)
    wl = Workload(5, tenants=3, system_tokens=100, turn_tokens=(5, 40), answer_tokens=(5, 40))
    for req in wl.take(300):
        expected = cache.lookup(req.token_ids)
        assert cache.admit(req.token_ids).cached_tokens == expected


def test_eviction_children_before_parents_lru() -> None:
    cache = SimulatedCache(4, 4)
    a = cache.admit(toks(0, 9)).events[0]["block_hashes"]  # A0, A1
    b = cache.admit(toks(100, 9)).events[0]["block_hashes"]  # B0, B1
    adm = cache.admit(toks(200, 9))
    assert removed_hashes(adm.events) == [a[1], a[0]]  # LRU request first, its child first
    assert [e["type"] for e in adm.events] == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    adm = cache.admit(toks(300, 9))
    assert removed_hashes(adm.events) == [b[1], b[0]]


def test_hit_touches_blocks_as_most_recently_used() -> None:
    cache = SimulatedCache(4, 4)
    a = cache.admit(toks(0, 9)).events[0]["block_hashes"]
    b = cache.admit(toks(100, 9)).events[0]["block_hashes"]
    hit = cache.admit(toks(0, 9))  # full hit on A: no events, A becomes MRU
    assert hit.cached_tokens == 8 and hit.events == []
    adm = cache.admit(toks(200, 9))
    assert removed_hashes(adm.events) == [b[1], b[0]]
    assert cache.held() == set(a) | set(stored_events(adm.events)[0]["block_hashes"])


def test_hit_blocks_are_not_evicted_by_their_own_request() -> None:
    cache = SimulatedCache(3, 4)
    a = cache.admit(toks(0, 9)).events[0]["block_hashes"]
    adm = cache.admit(toks(0, 13))  # hits A0 A1, needs 1 new block: the free one
    assert adm.cached_tokens == 8 and removed_hashes(adm.events) == []
    adm = cache.admit(toks(0, 17))  # hits 3 blocks, needs a 4th: nothing is free
    assert adm.cached_tokens == 12 and adm.events == []
    assert set(a) <= cache.held()


def test_over_capacity_stores_only_what_fits() -> None:
    cache = SimulatedCache(2, 4)
    [ev] = cache.admit(toks(0, 13)).events  # 3 full blocks, room for 2
    assert ev["block_hashes"] == block_hashes(toks(0, 13), 4)[:2]
    assert ev["token_ids"] == toks(0, 8)
    assert cache.lookup(toks(0, 13)) == 8


def test_each_duplicate_copy_is_removed() -> None:
    cache = SimulatedCache(3, 4)
    cache.admit(toks(0, 8))
    cache.admit(toks(0, 8))  # second copy of block 1
    h = block_hashes(toks(0, 8), 4)
    adm = cache.admit(toks(500, 12))
    assert sorted(removed_hashes(adm.events)) == sorted([h[1], h[1], h[0]])
    assert cache.held() == set(stored_events(adm.events)[0]["block_hashes"])


def test_reset_clears_everything() -> None:
    cache = SimulatedCache(4, 4)
    cache.admit(toks(0, 9))
    cache.reset()
    assert cache.held() == set() and cache.lookup(toks(0, 9)) == 0
    adm = cache.admit(toks(0, 9))  # no removals for the forgotten hashes
    assert adm.cached_tokens == 0 and [e["type"] for e in adm.events] == ["BlockStored"]


def test_cache_is_deterministic() -> None:
    def run() -> list[bytes]:
        cache = SimulatedCache(50, 16)
        wl = Workload(9, tenants=4, system_tokens=200)
        return [encode_batch(cache.admit(r.token_ids).events, 0.0) for r in wl.take(100)]

    assert run() == run()


# --- workload ---------------------------------------------------------------------------------


def test_workload_same_seed_same_output() -> None:
    assert Workload(7).take(200) == Workload(7).take(200)
    assert Workload(7).take(20) != Workload(8).take(20)


def test_workload_text_and_prefix_structure() -> None:
    wl = Workload(1, tenants=4, system_tokens=300, one_off_fraction=0.3)
    last: dict[str, Request] = {}
    system = {t.name: t.system_prompt for t in wl.tenants}
    for req in wl.take(400):
        assert req.text == render_text(req.token_ids)
        assert req.token_ids[:300] == system[req.tenant]
        assert all(0 <= t < 32000 for t in req.token_ids)
        prev = last.get(req.conversation)
        if prev is not None:  # a conversation only grows
            assert len(req.token_ids) > len(prev.token_ids)
            assert req.token_ids[: len(prev.token_ids)] == prev.token_ids
            assert req.text.startswith(prev.text + " ")
        last[req.conversation] = req
    assert any("/c" in c for c in last) and any("/o" in c for c in last)


def test_messages_round_trip(tmp_path: Path) -> None:
    msgs = [("kv@pod-0@model", 0, b"abc"), ("kv@pod-1@m", 2**64 - 1, b""), ("", 7, bytes(300))]
    path = tmp_path / "m.bin"
    assert write_messages(path, iter(msgs)) == 3
    assert list(read_messages(path)) == msgs
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError):
        list(read_messages(path))


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_workload", ROOT / "benchmarks/gen_workload.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dialect", ["map", "array"])
def test_gen_workload_deterministic_and_consistent(tmp_path: Path, dialect: str) -> None:
    gen = _gen_module()
    argv = ["--replicas", "3", "--capacity", "300", "--blocks", "5000", "--tenants", "4",
            "--queries", "5", "--dialect", dialect, "--quiet"]
    doc1 = gen.main([str(tmp_path / "a.bin"), *argv])
    doc2 = gen.main([str(tmp_path / "b.bin"), *argv])
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert json.loads((tmp_path / "a.bin.json").read_text()) == doc1
    assert {k: v for k, v in doc1.items() if k != "messages_file"} == {
        k: v for k, v in doc2.items() if k != "messages_file"
    }
    seqs: dict[str, list[int]] = {}
    for topic, seq, payload in read_messages(tmp_path / "a.bin"):
        seqs.setdefault(topic, []).append(seq)
        ts, events, rank = msgpack.unpackb(payload)
        assert rank == 0 and events
        assert isinstance(events[0], dict if dialect == "map" else list)
    assert all(s == list(range(len(s))) for s in seqs.values())
    assert sorted(seqs) == doc1["topics"] and doc1["stats"]["block_ops"] >= 5000
    assert len(doc1["queries"]) == 5
