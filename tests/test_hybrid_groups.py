"""Hybrid models: only the prefix group (adapters/vllm_groups.py) reaches the index.

No real capture of a hybrid model exists here (the tiny model is one full-attention group): the
frames are built as vLLM 0.32 publishes them (``vllm/distributed/kv_events.py``: msgspec structs,
the batch an array ``[ts, events, data_parallel_rank]``, each event a map tagged ``type`` whose
fields with default values are omitted; ``KVCacheManager.take_events`` sets ``kv_cache_spec_kind``
and ``kv_cache_spec_sliding_window`` on every BlockStored from its group; a BlockRemoved carries
``group_idx`` alone). ``VLLM_BYTES`` are the bytes vLLM 0.32's own encoder produced for one such
batch (``KVEventBatch`` of two stores and a removal, encoded with ``msgspec.msgpack.Encoder``):
the builder below reproduces them exactly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgpack

from adapters.vllm import VllmDecoder
from kvindex.config import Config
from kvindex.events import NON_PREFIX_GROUP, BlockRemoved, BlockStored
from tests.conftest import engine_config, ipc_endpoint, q, wait_for
from tests.test_native_decoder import check

VLLM_BYTES = bytes.fromhex(
    "93cb3ff8000000000000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920b0cb1706172"
    "656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f"
    "72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f"
    "737065635f6b696e64ae66756c6c5f617474656e74696f6e8ba474797065ab426c6f636b53746f726564ac626c6f636b5f"
    "686173686573920b0cb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa62"
    "6c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69"
    "647801b26b765f63616368655f737065635f6b696e64ae736c6964696e675f77696e646f77bc6b765f63616368655f7370"
    "65635f736c6964696e675f77696e646f770884a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865"
    "73910ba66d656469756da3475055a967726f75705f69647801c0")
BS = 32
POD = "10.0.0.9:8000"
TOKENS = list(range(1000, 1000 + 4 * BS))  # 4 blocks


def stored(hashes: list[int], parent: int | None, tokens: list[int], group: int, kind: str,
           window: int | None = None, block_size: int = BS) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                          "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
                          "lora_name": None, "group_idx": group, "kv_cache_spec_kind": kind}
    if window is not None:
        ev["kv_cache_spec_sliding_window"] = window
    return ev


def removed(hashes: list[int], group: int) -> list[dict[str, Any]]:
    """One BlockRemoved per block, as vLLM's BlockPool publishes them."""
    return [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": group} for h in hashes]


def batch(*events: dict[str, Any], ts: float = 1.5) -> bytes:
    return msgpack.packb([ts, list(events), None])


def test_the_builder_writes_what_vllm_writes() -> None:
    built = batch(stored([11, 12], None, list(range(1, 9)), 0, "full_attention", block_size=4),
                  stored([11, 12], None, list(range(1, 9)), 1, "sliding_window", 8, block_size=4), *removed([11], 1))
    assert built == VLLM_BYTES


def test_only_the_prefix_group_is_decoded_on_both_paths() -> None:
    for decoder in (VllmDecoder(), VllmDecoder(fast=None)):
        got = decoder.decode(VLLM_BYTES)
        assert got.events == (BlockStored(q(11, 12), None, got.events[0].token_ids, 4),)  # type: ignore[union-attr]
        assert got.skipped == (NON_PREFIX_GROUP, NON_PREFIX_GROUP) and decoder.groups == [0]
        later = decoder.decode(batch(*removed([12], 1), *removed([12], 0)))  # group_idx alone says which
        assert later.events == (BlockRemoved(q(12)),) and later.skipped == (NON_PREFIX_GROUP,)


def test_the_prefix_group_is_the_first_full_attention_group_even_when_removals_come_first() -> None:
    """A Mamba group 0, full attention in group 1; a batch's evictions precede its stores (vLLM
    evicts while allocating, then caches): the decoder looks ahead for the prefix group."""
    payload = batch(*removed([7], 0), *removed([7], 1), stored([8], None, TOKENS[:BS], 0, "mamba"),
                    stored([8], None, TOKENS[:BS], 1, "full_attention"))
    for decoder in (VllmDecoder(), VllmDecoder(fast=None)):
        got = decoder.decode(payload)
        assert [type(e).__name__ for e in got.events] == ["BlockRemoved", "BlockStored"] and decoder.groups == [1]
        assert got.events[0].group_idx == 1 and got.skipped == (NON_PREFIX_GROUP,) * 2  # type: ignore[union-attr]


def test_c_and_python_agree_on_hybrid_streams() -> None:
    """The C twin takes hybrid batches and skips what Python skips, equally, except a batch that
    needs Python's look-ahead (a removal before the prefix group is known); the decoder's prefix
    group evolves the same."""
    groups: list[int | None] = [None]
    stream = [
        batch(*removed([1], 0)),  # nothing known yet: Python applies it, C leaves it to Python
        VLLM_BYTES,
        batch(stored([21], 12, TOKENS[:BS], 0, "full_attention")),  # the prefix group's alone: C takes it
        batch(*removed([21], 0), *removed([21], 1)),
        batch(stored([31], None, TOKENS[:BS], 2, "mla_attention")),  # another full-attention group: not the prefix
        batch(stored([41], None, TOKENS[:BS], 0, "unknown")),  # the prefix group's index with another kind
        batch(stored([51], None, TOKENS[:BS], 0, 7)),  # type: ignore[arg-type]  # garbage kind
    ]
    taken = [check(p, groups) for p in stream]
    assert taken == [False, True, True, True, True, True, False] and groups == [0]  # garbage kind: Python's
    fast = VllmDecoder()
    assert [fast.decode(p).skipped for p in stream[1:6]] == [(NON_PREFIX_GROUP,) * 2, (), (NON_PREFIX_GROUP,), (NON_PREFIX_GROUP,),
                                                             (NON_PREFIX_GROUP,)]


async def test_a_sliding_window_groups_events_never_change_a_full_attention_answer(
        make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """A real daemon over ZeroMQ: full attention (group 0) stores 4 blocks; the sliding-window
    group (1) stores the same hashes (parentless: held already, as a re-announcement would be),
    then slides past the first two; the full-attention group evicts its last two. The answers
    are those of the full-attention events alone: 4, then 4, then 2 blocks."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine, pod=POD, model="hyb"),)))
    await h.wait_connected()
    hashes = [101, 102, 103, 104]
    steps = [
        (batch(stored(hashes, None, TOKENS, 0, "full_attention"), stored(hashes, None, TOKENS, 1, "sliding_window", 64)), 4),
        (batch(*removed(hashes[:2], 1)), 4),
        (batch(*removed(hashes[:1:-1], 0)), 2),
        (batch(stored(hashes[2:], 102, TOKENS[2 * BS:], 1, "sliding_window", 64)), 2),
    ]
    for seq, (payload, want) in enumerate(steps):
        await engine.publish([f"kv@{POD}@hyb".encode(), seq.to_bytes(8, "big"), payload])
        await h.wait_seq(POD, seq)
        status, q = await h.post("/query", {"token_ids": TOKENS + [7], "model_name": "hyb"})
        assert status == 200 and q["instances"].get(POD, {}).get("longest_matched", 0) == want * BS, (seq, q)
    assert h.daemon.index.blocks_held(POD)["gpu"] == 2
    status, metrics = await h.get("/metrics")
    assert f'kvindex_events_skipped_total{{pod="{POD}",reason="non_prefix_group"}} 4.0'.encode() in metrics
    assert b'reason="non_prefix_group"' not in metrics.split(b"kvindex_decode_errors")[1].split(b"# HELP")[0]


def test_a_rejected_store_teaches_no_prefix_group() -> None:
    """A store the decoder skips (here block size 0 on the GPU: bad_block_size) is no evidence of
    the stream's prefix group: the group is learned from the first store that is decoded, so the
    valid group-0 stores and removals that follow reach the index (on both paths, C equal)."""
    bad = stored([5], None, [], 3, "full_attention", block_size=0)
    stream = [
        batch(bad),
        batch(stored([6], None, TOKENS[:BS], 0, "full_attention")),
        batch(*removed([6], 0)),
    ]
    for decoder in (VllmDecoder(), VllmDecoder(fast=None)):
        first = decoder.decode(stream[0])
        assert first.events == () and first.skipped == ("bad_block_size",) and decoder.groups == [None]
        assert [type(e).__name__ for e in decoder.decode(stream[1]).events] == ["BlockStored"]
        assert decoder.decode(stream[2]).events == (BlockRemoved(q(6)),) and decoder.groups == [0]
    # the rejected store ahead of a valid one in one batch: the valid one's group is the prefix group
    mixed = batch(bad, stored([6], None, TOKENS[:BS], 0, "full_attention"), *removed([6], 3))
    for decoder in (VllmDecoder(), VllmDecoder(fast=None)):
        got = decoder.decode(mixed)
        assert [type(e).__name__ for e in got.events] == ["BlockStored"] and decoder.groups == [0]
        assert got.skipped == (NON_PREFIX_GROUP, NON_PREFIX_GROUP)
    groups: list[int | None] = [None]
    assert [check(p, groups) for p in (*stream, mixed)] == [False, True, True, True] and groups == [0]
    array_bad = msgpack.packb([1.0, [["BlockStored", [5], None, [], 0, None, "GPU", None, None, 3]], None])
    array_good = msgpack.packb([1.0, [["BlockStored", [6], None, TOKENS[:BS], BS, None, "GPU", None, None, 0]], None])
    groups = [None]
    assert [check(p, groups) for p in (array_bad, array_good)] == [False, True] and groups == [0]


def test_a_new_life_forgets_the_prefix_group() -> None:
    """vLLM's group layout is the engine process's: ``new_life`` (an engine restart) forgets the
    prefix group, an AllBlocksCleared (same process, same layout) does not."""
    for decoder in (VllmDecoder(), VllmDecoder(fast=None)):
        decoder.decode(batch(stored([6], None, TOKENS[:BS], 1, "full_attention")))
        decoder.decode(batch({"type": "AllBlocksCleared"}))
        assert decoder.groups == [1]
        decoder.new_life()
        assert decoder.groups == [None]
        got = decoder.decode(batch(stored([6], None, TOKENS[:BS], 0, "full_attention")))
        assert [type(e).__name__ for e in got.events] == ["BlockStored"] and decoder.groups == [0]


async def test_an_engine_restarted_with_another_group_layout_is_indexed_by_its_own_prefix_group(
        make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """A real daemon over ZeroMQ: the engine's first life is a model whose full attention is group
    1 (group 0 is Mamba); it restarts (seq back to 0, other bytes) as a model whose full attention is
    group 0 (group 1 a sliding window). The new life's first batch, whose events are all of groups
    the old prefix group skips, is the restart, and it and what follows are indexed by group 0."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine, pod=POD, model="hyb"),)))
    await h.wait_connected()
    topic = f"kv@{POD}@hyb".encode()
    old = [201, 202]
    first_life = [batch(stored(old, None, TOKENS[:2 * BS], 0, "mamba"), stored(old, None, TOKENS[:2 * BS], 1, "full_attention")),
                  batch(*removed(old[1:], 1))]
    for seq, payload in enumerate(first_life):
        await engine.publish([topic, seq.to_bytes(8, "big"), payload])
    await h.wait_seq(POD, 1)
    assert h.daemon.index.blocks_held(POD)["gpu"] == 1
    # seq back to 0 with only a malformed store of another group: no evidence of a restart, even as
    # a new life would decode it (the malformed store teaches no group): rejected, state kept
    await engine.publish([topic, (0).to_bytes(8, "big"), batch(stored([9], None, [], 0, "full_attention", block_size=0))])
    for _ in range(200):
        _, metrics = await h.get("/metrics")
        if b'reason="backward_seq_without_events"' in metrics:
            break
        await asyncio.sleep(0.02)
    assert b'reason="backward_seq_without_events"' in metrics
    assert h.stream(POD).restarts == 0 and h.daemon.index.blocks_held(POD)["gpu"] == 1
    engine.clear_buffer()  # the engine restarts: a new process, another model's group layout
    new = [301, 302, 303, 304]
    second_life = [batch(stored(new, None, TOKENS, 0, "full_attention"), stored(new, None, TOKENS, 1, "sliding_window", 64)),
                   batch(*removed(new[:1], 1), *removed(new[3:], 0))]
    for seq, payload in enumerate(second_life):
        await engine.publish([topic, seq.to_bytes(8, "big"), payload])
    await wait_for(lambda: h.stream(POD).restarts == 1 and h.stream(POD).last_seq == 1, 10, "second life")
    assert h.daemon.index.blocks_held(POD)["gpu"] == 3
    status, q = await h.post("/query", {"token_ids": TOKENS + [7], "model_name": "hyb"})
    assert status == 200 and q["instances"].get(POD, {}).get("longest_matched", 0) == 3 * BS, q
