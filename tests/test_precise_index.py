"""The precise index's contract, event by event (in-process; the fixture tests drive it over ZeroMQ)."""

from __future__ import annotations

from array import array

import pytest

from kvindex import keys as K
from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.precise import PreciseIndex

BS = 4
TOKENS = list(range(100, 116))  # 4 blocks of 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_hash=parent, token_ids=array("I", tokens), block_size=BS, **kw)


def keys_of(tokens: list[int], model: str = "m", lora: str | None = None, salt: str | None = None) -> list[int]:
    return K.prompt_keys(K.root_key(model, lora, salt), tokens, BS)


@pytest.fixture
def idx() -> PreciseIndex:
    i = PreciseIndex()
    i.set_block_size("m", BS)
    return i


def depth(idx: PreciseIndex, pod: str, keys: list[int]) -> int:
    m = idx.match(keys, [pod]).get(pod)
    return m.gpu if m else 0


def test_keys_match_dynamo_local_hash_vector() -> None:
    assert K.local_hashes(list(range(1000, 1032)), 16) == [17863182269597592868, 14340445833846710668]


def test_chain_across_events_and_longest_prefix(idx: PreciseIndex) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 0, stored([3], 2, TOKENS[8:12]))
    idx.apply("b", "m", 0, stored([1], None, TOKENS[:4]))
    ks = keys_of(TOKENS)
    assert depth(idx, "a", ks) == 3 and depth(idx, "b", ks) == 1
    assert set(idx.match(ks)) == {"a", "b"}
    assert idx.match(ks, ["b"])["b"].gpu == 1 and "a" not in idx.match(ks, ["b"])


def test_engine_hashes_need_not_agree_across_pods(idx: PreciseIndex) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("b", "m", 0, stored([77, 78], None, TOKENS[:8]))  # another seed, same tokens
    assert depth(idx, "b", keys_of(TOKENS)) == 2


def test_refcount_per_copy(idx: PreciseIndex) -> None:
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 0, BlockRemoved((1,)))
    assert depth(idx, "a", keys_of(TOKENS)) == 1
    idx.apply("a", "m", 0, BlockRemoved((1,)))
    assert depth(idx, "a", keys_of(TOKENS)) == 0
    assert idx.blocks_held("a")["gpu"] == 0
    assert idx.apply("a", "m", 0, BlockRemoved((1,))).unknown_removals == 1


def test_orphans_are_kept_for_removal_but_never_match(idx: PreciseIndex) -> None:
    done = idx.apply("a", "m", 0, stored([5, 6], 999, TOKENS[4:12]))
    assert done.orphans == 2
    assert idx.blocks_held("a") == {"gpu": 2, "cpu": 0, "disk": 0, "orphans": 2}
    assert idx.match(keys_of(TOKENS)) == {}
    idx.apply("a", "m", 0, BlockRemoved((5,)))
    assert idx.blocks_held("a")["orphans"] == 1


def test_block_size_mismatch_is_an_orphan(idx: PreciseIndex) -> None:
    ev = BlockStored(block_hashes=(1,), parent_hash=None, token_ids=array("I", TOKENS[:8]), block_size=8)
    done = idx.apply("a", "m", 0, ev)
    assert done.block_size_mismatch and done.orphans == 1


def test_all_blocks_cleared_clears_every_medium_of_its_rank(idx: PreciseIndex) -> None:
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 1, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 0, stored([1], None, [], medium="CPU"))
    idx.apply("b", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 0, AllBlocksCleared())
    assert idx.match(keys_of(TOKENS))["a"].dp == {1: 1}
    assert idx.blocks_held("a") == {"gpu": 1, "cpu": 0, "disk": 0, "orphans": 0}
    idx.clear_pod("a")
    assert idx.match(keys_of(TOKENS)).keys() == {"b"}


def test_dp_ranks_reported_separately(idx: PreciseIndex) -> None:
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 1, stored([1, 2], None, TOKENS[:8]))
    m = idx.match(keys_of(TOKENS))["a"]
    assert m.dp == {0: 1, 1: 2} and m.gpu == 2


def test_tiers_are_cumulative_through_the_device(idx: PreciseIndex) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 0, stored([3], 2, TOKENS[8:12], medium="CPU"))
    idx.apply("a", "m", 0, stored([4], 3, TOKENS[12:16], medium="DISK"))
    m = idx.match(keys_of(TOKENS))["a"]
    assert (m.gpu, m.cpu, m.disk) == (2, 3, 4)
    # an offloaded copy without tokens (vLLM's offload connector) finds its key through the hash
    idx.apply("a", "m", 0, stored([1], None, [], medium="CPU"))
    assert idx.blocks_held("a") == {"gpu": 2, "cpu": 2, "disk": 1, "orphans": 0}


def test_salts_and_loras_never_match_each_other(idx: PreciseIndex) -> None:
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4], cache_salt="tenant-1"))
    idx.apply("a", "m", 0, stored([2], None, TOKENS[:4], lora_name="sql"))
    assert depth(idx, "a", keys_of(TOKENS)) == 0
    assert depth(idx, "a", keys_of(TOKENS, salt="tenant-2")) == 0
    assert depth(idx, "a", keys_of(TOKENS, salt="tenant-1")) == 1
    assert depth(idx, "a", keys_of(TOKENS, lora="sql")) == 1
    assert depth(idx, "a", keys_of(TOKENS, model="other")) == 0


def test_a_keyless_copy_learns_its_key_later(idx: PreciseIndex) -> None:
    idx.apply("a", "m", 0, stored([1], None, [], medium="CPU"))
    assert idx.blocks_held("a")["orphans"] == 1
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    m = idx.match(keys_of(TOKENS))["a"]
    assert (m.gpu, m.cpu) == (1, 1) and idx.blocks_held("a")["orphans"] == 0


def test_clear_pod_leaves_no_inverted_entries(idx: PreciseIndex) -> None:
    for pod in ("a", "b"):
        idx.apply(pod, "m", 0, stored([1, 2, 3, 4], None, TOKENS))
    idx.clear_pod("a")
    idx.clear_pod("b")
    assert idx.pods() == [] and all(not h for h in idx._holders.values())


def test_export_and_load_reproduce_the_index(idx: PreciseIndex) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 1, stored([3], 999, TOKENS[4:8]))
    idx.apply("b", "m", 0, stored([1, 2, 3], None, TOKENS[:12], medium="CPU"))
    copy = PreciseIndex()
    copy.set_block_size("m", BS)
    assert copy.load_entries(idx.export_entries()) == 6
    assert sorted(copy.export_entries()) == sorted(idx.export_entries())
    ks = keys_of(TOKENS)
    assert copy.match(ks) == idx.match(ks)
    for pod in ("a", "b"):
        assert copy.blocks_held(pod) == idx.blocks_held(pod)
    copy.apply("a", "m", 0, BlockRemoved((1,)))
    copy.apply("a", "m", 0, BlockRemoved((1,)))
    assert depth(copy, "a", ks) == 0


def test_a_rank_clears_only_itself_and_empty_workers_are_freed(idx: PreciseIndex) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 1, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 1, AllBlocksCleared())
    assert idx.match(keys_of(TOKENS))["a"].dp == {0: 2}
    idx.apply("a", "m", 7, BlockRemoved((5,)))  # removals for a rank that holds nothing create nothing
    idx.apply("a", "m", 0, BlockRemoved((1,)))
    idx.apply("a", "m", 0, BlockRemoved((2,)))
    assert idx.pods() == [] and idx._slots == [None, None]
