"""Every dialect of reference/wire-format.md §7, as bytes an engine would send."""

from __future__ import annotations

from array import array
from typing import Any

import msgpack
import pytest

from adapters.dialects import DIALECTS
from adapters.vllm import VllmDecoder
from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError
from tests.conftest import q

TOK = list(range(1000, 1032))
H1, H2, HR = 3753563854825738204, 2378715151359315973, 3360539462836043092

# wire-format.md §6 A (map events) and B (array events), byte for byte
A = bytes.fromhex(
    "93cb41da39de00100000928ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf3417567050a24fdccf2102"
    "e4d3c29c9005b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020cd03e8cd03e9cd03eacd03ebcd03eccd03"
    "edcd03eecd03efcd03f0cd03f1cd03f2cd03f3cd03f4cd03f5cd03f6cd03f7cd03f8cd03f9cd03facd03fbcd03fccd03fdcd03fecd03ffcd"
    "0400cd0401cd0402cd0403cd0404cd0405cd0406cd0407aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a9"
    "6c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66"
    "756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf2ea308d628063d54a6"
    "6d656469756da3475055a967726f75705f6964780000")
B = bytes.fromhex(
    "93cb41da39de00100000929cab426c6f636b53746f72656492cf3417567050a24fdccf2102e4d3c29c9005c0dc0020cd03e8cd03e9cd03ea"
    "cd03ebcd03eccd03edcd03eecd03efcd03f0cd03f1cd03f2cd03f3cd03f4cd03f5cd03f6cd03f7cd03f8cd03f9cd03facd03fbcd03fccd03"
    "fdcd03fecd03ffcd0400cd0401cd0402cd0403cd0404cd0405cd0406cd040710c0a3475055c092c0c000ae66756c6c5f617474656e74696f"
    "6ec094ac426c6f636b52656d6f76656491cf2ea308d628063d54a34750550000")
C = bytes.fromhex("93cb41da39de001000009181a474797065b0416c6c426c6f636b73436c656172656400")

EXPECTED = (BlockStored(q(H1, H2), None, array("I", TOK), 16), BlockRemoved(q(HR)))


@pytest.mark.parametrize("payload", [A, B], ids=["map-events", "array-events"])
def test_reference_bytes(payload: bytes) -> None:
    batch = VllmDecoder().decode(payload)
    assert batch.events == EXPECTED and batch.ts == 1760000000.25 and batch.dp_rank == 0 and batch.skipped == ()


def test_all_blocks_cleared() -> None:
    assert VllmDecoder().decode(C).events == (AllBlocksCleared(),)


def pack(obj) -> bytes:
    return msgpack.packb(obj)


def test_two_element_batch_and_map_batch_and_nil_rank() -> None:
    ev = ["BlockRemoved", [5]]
    assert VllmDecoder().decode(pack([1.0, [ev]])).events == (BlockRemoved(q(5)),)
    assert VllmDecoder().decode(pack([1.0, [ev], None])).dp_rank == 0
    mb = VllmDecoder().decode(pack({"ts": 1.0, "events": [ev], "data_parallel_rank": 3}))
    assert mb.dp_rank == 3 and mb.events == (BlockRemoved(q(5)),)


def test_hash_forms() -> None:
    d = VllmDecoder()
    neg = d.decode(pack([0, [["BlockRemoved", [-1, -(1 << 63)]]]])).events[0]
    assert neg.block_hashes == q((1 << 64) - 1, 1 << 63)
    digest = bytes(range(32))
    got = d.decode(pack([0, [["BlockRemoved", [digest]]]])).events[0]
    assert got.block_hashes == q(int.from_bytes(digest[-8:], "big"))
    sg = DIALECTS["sglang"].decoder().decode(pack([0, [["BlockRemoved", [digest]]]])).events[0]
    assert sg.block_hashes == q(int.from_bytes(digest[:8], "big", signed=True) & ((1 << 64) - 1))


def test_parent_zero_means_none_and_sim_topic_dialect() -> None:
    ev = ["BlockStored", [1 << 63], 0, TOK[:16], 16, None, "GPU"]
    got = DIALECTS["llmd-sim"].decoder().decode(pack([0, [ev], 0])).events[0]
    assert got.parent_hash is None and got.block_hashes == q(1 << 63)
    assert DIALECTS["llmd-sim"].first_seq == 1 and DIALECTS["vllm"].first_seq == 0


def test_sglang_one_page_event_with_salt_dict() -> None:
    ev = ["BlockStored", [-5], None, TOK[:16], 16, None, "GPU", {"cache_salt": "t1"}]
    got = DIALECTS["sglang"].decoder().decode(pack([0, [ev], 0])).events[0]
    assert got.cache_salt == "t1" and got.lora_name is None and got.block_hashes == q((1 << 64) - 5)


def test_vllm_cache_salt_from_first_extra_keys_and_lora() -> None:
    ev = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": TOK, "block_size": 16,
          "lora_name": "sql", "extra_keys": [["sql", "salt-9"], ["sql"]], "future_field": {"x": 1}}
    got = VllmDecoder().decode(pack([0, [ev], 0])).events[0]
    assert (got.lora_name, got.cache_salt) == ("sql", "salt-9")


@pytest.mark.parametrize("lora,first,salt", [
    ("sql", ["sql", "sql"], "sql"),  # a tenant's salt equal to the adapter's name is still its salt
    ("sql", ["sql"], None),  # the adapter's name alone: no salt
    (None, ["sql"], "sql"),  # no adapter: a string that looks like one is the salt
    (None, [["img-1", 0], "img-1"], "img-1"),  # equal to a multimodal identifier
    ("sql", ["sql", ["sql", 0], "sql", b"\x01" * 32], "sql"),  # adapter, an MM entry, salt, embeds digest
    ("sql", ["other", "salt"], "salt"),  # position 0 is not the adapter: every string counts
])
def test_vllm_cache_salt_is_taken_by_position_not_by_value(lora: str | None, first: list[Any], salt: str | None) -> None:
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": TOK[:16],
          "block_size": 16, "lora_name": lora, "extra_keys": [first]}
    d = VllmDecoder()
    got = d.decode(pack([0, [ev], 0])).events[0]
    assert (got.lora_name, got.cache_salt) == (lora, salt)
    assert d.decode_python(pack([0, [ev], 0])).events[0] == got  # the C path and its reference agree


def test_unknown_events_and_fields_are_skipped_and_counted() -> None:
    batch = VllmDecoder().decode(pack([0, [["BlockInactive", [1]], {"type": "Future"}, 7, ["BlockRemoved", [9]]], 0]))
    assert batch.events == (BlockRemoved(q(9)),)
    assert batch.skipped == ("unknown_event_type", "unknown_event_type", "bad_event")


def test_token_pairs_keep_the_event_but_not_its_tokens() -> None:
    ev = ["BlockStored", [1], None, [[1, 2], [3, 4]], 2, None, "GPU"]
    batch = VllmDecoder().decode(pack([0, [ev], 0]))
    assert len(batch.events[0].token_ids) == 0 and batch.skipped == ("unsupported_token_ids",)


@pytest.mark.parametrize("payload,reason", [
    (b"\xc1", "msgpack"),
    (pack([1.0]), "bad_batch"),
    (pack("x"), "bad_batch"),
    (pack(["ts", []]), "bad_batch"),
    (pack([1.0, {}]), "bad_batch"),
    (pack([1.0, [], "r"]), "bad_batch"),
    (A[:50], "msgpack"),
    (b"\xdd\x00\x98\x96\x80" + b"\x00" * 8, "msgpack"),
    (A + b"\x00", "msgpack"),
])
def test_batch_level_garbage(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as e:
        VllmDecoder().decode(payload)
    assert e.value.reason == reason


def test_runs_of_removals_are_merged_in_order() -> None:
    ev = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": TOK[:16], "block_size": 16}
    rm = [{"type": "BlockRemoved", "block_hashes": [h], "medium": m} for h, m in ((1, "GPU"), (2, "GPU"), (3, "CPU"))]
    batch = VllmDecoder().decode(pack([0, [rm[0], rm[1], ev, rm[0], rm[2], {"type": "BlockRemoved", "block_hashes": [4],
                                                                             "medium": "CPU"}], 0]))
    assert batch.events == (BlockRemoved(q(1, 2)), BlockStored(q(7), None, array("I", TOK[:16]), 16),
                            BlockRemoved(q(1)), BlockRemoved(q(3, 4), "CPU"))
