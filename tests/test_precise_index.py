"""The precise index's contract, event by event (in-process; the fixture tests drive it over ZeroMQ).

``idx`` runs each case on the fast index (its native core) and on the readable reference
(kvindex.index.reference); the layout cases take the fast index only. Without the core (no C
compiler, ``KVINDEX_PURE_PYTHON=1``) the reference is what kvindex runs, and what is tested."""

from __future__ import annotations

from array import array

import pytest

from kvindex import keys as K
from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.index.precise import CORE, PreciseIndex, entries_of
from kvindex.index.reference import ReferenceIndex
from kvindex.types import Entry

Index = PreciseIndex | ReferenceIndex
INDEXES = {"reference": ReferenceIndex} | ({"core": PreciseIndex} if CORE is not None else {})

BS = 4
TOKENS = list(range(100, 116))  # 4 blocks of 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_hash=parent, token_ids=array("I", tokens), block_size=BS, **kw)


def keys_of(tokens: list[int], model: str = "m", lora: str | None = None, salt: str | None = None) -> list[int]:
    return K.prompt_keys(K.root_key(model, lora, salt), tokens, BS)


@pytest.fixture(params=list(INDEXES))
def idx(request: pytest.FixtureRequest) -> Index:
    i = INDEXES[request.param]()
    i.set_block_size("m", BS)
    return i


@pytest.fixture
def fast() -> PreciseIndex:
    if CORE is None:
        pytest.skip("the native core is not built (tests/test_core.py fails in CI without it)")
    i = PreciseIndex()
    i.set_block_size("m", BS)
    return i


def residue(idx: Index) -> int:
    """Inverted entries, duplicate counts and workers left (after everything was removed)."""
    if isinstance(idx, ReferenceIndex):
        return len(idx.workers)
    m = idx.memory()
    return m["entries"] + m["side"] + m["keys"] + m["masks"] + m["dups"] + sum(s is not None for s in idx._ident)


def depth(idx: Index, pod: str, keys: list[int]) -> int:
    m = idx.match(keys, [pod]).get(pod)
    return m.gpu if m else 0


def test_keys_match_dynamo_local_hash_vector() -> None:
    assert list(K.local_hashes(list(range(1000, 1032)), 16)) == [17863182269597592868, 14340445833846710668]


def test_chain_across_events_and_longest_prefix(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 0, stored([3], 2, TOKENS[8:12]))
    idx.apply("b", "m", 0, stored([1], None, TOKENS[:4]))
    ks = keys_of(TOKENS)
    assert depth(idx, "a", ks) == 3 and depth(idx, "b", ks) == 1
    assert set(idx.match(ks)) == {"a", "b"}
    assert idx.match(ks, ["b"])["b"].gpu == 1 and "a" not in idx.match(ks, ["b"])


def test_engine_hashes_need_not_agree_across_pods(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("b", "m", 0, stored([77, 78], None, TOKENS[:8]))  # another seed, same tokens
    assert depth(idx, "b", keys_of(TOKENS)) == 2


def test_refcount_per_copy(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 0, stored([2], 1, TOKENS[4:8]))  # vLLM recomputed block 2 into a second physical block
    idx.apply("a", "m", 0, BlockRemoved((2,)))
    assert depth(idx, "a", keys_of(TOKENS)) == 2
    idx.apply("a", "m", 0, BlockRemoved((2,)))
    assert depth(idx, "a", keys_of(TOKENS)) == 1
    assert idx.blocks_held("a")["gpu"] == 1
    assert idx.apply("a", "m", 0, BlockRemoved((2,))).unknown_removals == 1


def test_a_reannouncement_adds_no_copy(idx: Index) -> None:
    """vLLM's kv_cache_report_mode "full": the prefix a request hit, re-published parentless for
    blocks it holds once, then the request's new block chained on it; one removal each."""
    idx.apply("a", "m", 0, stored([1, 2, 3], None, TOKENS[:12]))
    again = idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    assert (again.stored, again.reannounced, again.stored_events) == (0, 2, 1)
    idx.apply("a", "m", 0, stored([4], 3, TOKENS[12:16]))
    assert idx.blocks_held("a")["gpu"] == 4 and depth(idx, "a", keys_of(TOKENS)) == 4
    idx.apply("a", "m", 0, BlockRemoved((4, 3, 2)))
    assert depth(idx, "a", keys_of(TOKENS)) == 1 and idx.blocks_held("a")["gpu"] == 1
    idx.apply("a", "m", 0, BlockRemoved((1,)))
    assert idx.pods() == [] and residue(idx) == 0


def test_a_parentless_store_of_hashes_not_all_held_adds_copies(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    done = idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))  # not a re-announcement: 2 is new
    assert (done.stored, done.reannounced) == (2, 0) and idx.blocks_held("a")["gpu"] == 3
    idx.apply("a", "m", 0, BlockRemoved((2, 1)))
    assert depth(idx, "a", keys_of(TOKENS)) == 1
    other = idx.apply("a", "m", 0, stored([1], None, TOKENS[:4], medium="CPU"))  # held on GPU, not in CPU
    assert other.stored == 1 and idx.blocks_held("a")["cpu"] == 1


def test_a_reannouncement_teaches_a_keyless_hash_its_key(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:4]))  # tokens ran out: 2 is keyless
    assert idx.blocks_held("a")["orphans"] == 1
    done = idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    assert (done.reannounced, done.orphans) == (2, 0)
    assert idx.blocks_held("a") == {"gpu": 2, "cpu": 0, "disk": 0, "orphans": 0}
    assert depth(idx, "a", keys_of(TOKENS)) == 2
    idx.apply("a", "m", 0, BlockRemoved((2, 1)))
    assert idx.pods() == [] and residue(idx) == 0


def test_orphans_are_kept_for_removal_but_never_match(idx: Index) -> None:
    done = idx.apply("a", "m", 0, stored([5, 6], 999, TOKENS[4:12]))
    assert done.orphans == 2
    assert idx.blocks_held("a") == {"gpu": 2, "cpu": 0, "disk": 0, "orphans": 2}
    assert idx.match(keys_of(TOKENS)) == {}
    idx.apply("a", "m", 0, BlockRemoved((5,)))
    assert idx.blocks_held("a")["orphans"] == 1


def test_block_size_mismatch_is_an_orphan(idx: Index) -> None:
    idx.apply("b", "m", 0, BlockStored(block_hashes=(7,), parent_hash=None, token_ids=array("I", TOKENS[:4]),
                                       block_size=4))  # b's blocks hold the model's block size
    ev = BlockStored(block_hashes=(1,), parent_hash=None, token_ids=array("I", TOKENS[:8]), block_size=8)
    done = idx.apply("a", "m", 0, ev)
    assert done.block_size_mismatch and done.orphans == 1


def test_all_blocks_cleared_clears_every_medium_of_its_rank(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 1, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 0, stored([1], None, [], medium="CPU"))
    idx.apply("b", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 0, AllBlocksCleared())
    assert idx.match(keys_of(TOKENS))["a"].dp == {1: 1}
    assert idx.blocks_held("a") == {"gpu": 1, "cpu": 0, "disk": 0, "orphans": 0}
    idx.clear_pod("a")
    assert idx.match(keys_of(TOKENS)).keys() == {"b"}


def test_dp_ranks_reported_separately(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 1, stored([1, 2], None, TOKENS[:8]))
    m = idx.match(keys_of(TOKENS))["a"]
    assert m.dp == {0: 1, 1: 2} and m.gpu == 2


def test_tiers_are_cumulative_through_the_device(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1, 2, 3, 4], None, TOKENS))
    idx.apply("a", "m", 0, stored([3], 2, TOKENS[8:12], medium="CPU"))  # offloaded, then evicted from the device
    idx.apply("a", "m", 0, stored([4], None, [], medium="DISK"))
    idx.apply("a", "m", 0, BlockRemoved((4, 3)))
    m = idx.match(keys_of(TOKENS))["a"]
    assert (m.gpu, m.cpu, m.disk) == (2, 3, 4)
    # an offloaded copy without tokens (vLLM's offload connector) finds its key through the hash
    idx.apply("a", "m", 0, stored([1], None, [], medium="CPU"))
    assert idx.blocks_held("a") == {"gpu": 2, "cpu": 2, "disk": 1, "orphans": 0}


def test_salts_and_loras_never_match_each_other(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4], cache_salt="tenant-1"))
    idx.apply("a", "m", 0, stored([2], None, TOKENS[:4], lora_name="sql"))
    assert depth(idx, "a", keys_of(TOKENS)) == 0
    assert depth(idx, "a", keys_of(TOKENS, salt="tenant-2")) == 0
    assert depth(idx, "a", keys_of(TOKENS, salt="tenant-1")) == 1
    assert depth(idx, "a", keys_of(TOKENS, lora="sql")) == 1
    assert depth(idx, "a", keys_of(TOKENS, model="other")) == 0


def test_a_keyless_copy_learns_its_key_later(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1], None, [], medium="CPU"))
    assert idx.blocks_held("a")["orphans"] == 1
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    m = idx.match(keys_of(TOKENS))["a"]
    assert (m.gpu, m.cpu) == (1, 1) and idx.blocks_held("a")["orphans"] == 0


def test_clear_pod_leaves_no_inverted_entries(idx: Index) -> None:
    for pod in ("a", "b"):
        idx.apply(pod, "m", 0, stored([1, 2, 3, 4], None, TOKENS))
    idx.clear_pod("a")
    idx.clear_pod("b")
    assert idx.pods() == [] and residue(idx) == 0


def test_export_and_load_reproduce_the_index(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 1, stored([3], 999, TOKENS[4:8]))
    idx.apply("b", "m", 0, stored([1, 2, 3], None, TOKENS[:12], medium="CPU"))
    copy = type(idx)()
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


def test_a_rank_clears_only_itself_and_empty_workers_are_freed(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 1, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 1, AllBlocksCleared())
    assert idx.match(keys_of(TOKENS))["a"].dp == {0: 2}
    idx.apply("a", "m", 7, BlockRemoved((5,)))  # removals for a rank that holds nothing create nothing
    idx.apply("a", "m", 0, BlockRemoved((1,)))
    idx.apply("a", "m", 0, BlockRemoved((2,)))
    assert idx.pods() == [] and residue(idx) == 0
    assert not isinstance(idx, PreciseIndex) or idx._ident == []


def test_hash_zero_and_the_largest_hash_are_held_like_any_other(idx: Index) -> None:
    top = (1 << 64) - 1
    idx.apply("a", "m", 0, stored([0, top], None, TOKENS[:8]))
    idx.apply("a", "m", 0, stored([5], top, TOKENS[8:12]))  # the parent is found by its hash
    ks = keys_of(TOKENS)
    assert depth(idx, "a", ks) == 3
    assert idx.engine_hashes("a") == {0: {0: ks[0], top: ks[1], 5: ks[2]}}
    idx.apply("a", "m", 0, BlockRemoved((0,)))
    assert depth(idx, "a", ks) == 0 and idx.blocks_held("a")["gpu"] == 2


def test_a_freed_slot_is_reused_and_matches_name_the_new_owner(idx: Index) -> None:
    ks = keys_of(TOKENS)
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("b", "m", 0, stored([1], None, TOKENS[:4]))
    assert set(idx.match(ks)) == {"a", "b"}
    idx.apply("a", "m", 0, AllBlocksCleared())
    idx.apply("c", "m", 0, stored([9, 8, 7], None, TOKENS[:12]))  # takes a's slot
    assert not isinstance(idx, PreciseIndex) or idx._ident[0] == ("c", 0)
    got = idx.match(ks)
    assert set(got) == {"b", "c"} and got["c"].gpu == 3 and got["b"].gpu == 1


def test_more_than_64_workers(idx: Index) -> None:
    ks = keys_of(TOKENS)
    for i in range(150):
        idx.apply(f"p{i}", "m", i % 2, stored([1000 + i] + [i, i + 1, i + 2][: i % 4], None, TOKENS[: 4 * (1 + i % 4)]))
    got = idx.match(ks)
    assert {p: m.gpu for p, m in got.items()} == {f"p{i}": 1 + i % 4 for i in range(150)}
    assert idx.match(ks, ["p149", "p3", "nobody"]) == {"p149": got["p149"], "p3": got["p3"]}
    for i in range(0, 150, 2):
        idx.clear_pod(f"p{i}")
    assert set(idx.match(ks)) == {f"p{i}" for i in range(1, 150, 2)}


def test_duplicates_of_hashes_and_of_keys_and_a_clear_while_they_exist(idx: Index) -> None:
    ks = keys_of(TOKENS)
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 0, stored([2], 1, TOKENS[4:8]))  # a second copy of hash 2
    idx.apply("a", "m", 0, stored([12], 1, TOKENS[4:8]))  # another hash, the same key
    idx.apply("b", "m", 0, stored([1, 2], None, TOKENS[:8]))
    assert idx.blocks_held("a")["gpu"] == 4 and depth(idx, "a", ks) == 2
    idx.apply("a", "m", 0, BlockRemoved((2, 12)))  # two of three holdings of ks[1] go
    assert depth(idx, "a", ks) == 2
    idx.apply("a", "m", 0, stored([12], 1, TOKENS[4:8]))
    idx.apply("a", "m", 0, AllBlocksCleared())  # while duplicates exist
    assert idx.match(ks)["b"].gpu == 2 and "a" not in idx.match(ks)
    assert not isinstance(idx, PreciseIndex) or idx.memory()["dups"] == 0
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    idx.apply("a", "m", 0, BlockRemoved((1,)))
    assert "a" not in idx.match(ks) and idx.pods() == ["b"]


def test_orphans_in_several_media_adopt_the_key_with_their_copies(idx: Index) -> None:
    idx.apply("a", "m", 0, stored([1], None, [], medium="CPU"))
    idx.apply("a", "m", 0, stored([1], 999, [], medium="CPU"))  # two keyless copies (an unknown parent)
    idx.apply("a", "m", 0, stored([1], None, [], medium="DISK"))
    assert idx.blocks_held("a") == {"gpu": 0, "cpu": 2, "disk": 1, "orphans": 2}
    idx.apply("a", "m", 0, stored([1], None, TOKENS[:4]))
    m = idx.match(keys_of(TOKENS))["a"]
    assert (m.gpu, m.cpu, m.disk) == (1, 1, 1) and idx.blocks_held("a")["orphans"] == 0
    idx.apply("a", "m", 0, BlockRemoved((1,), medium="CPU"))
    idx.apply("a", "m", 0, BlockRemoved((1,), medium="GPU"))
    m = idx.match(keys_of(TOKENS))["a"]
    assert (m.gpu, m.cpu, m.disk) == (0, 1, 1)  # one CPU copy is left
    idx.apply("a", "m", 0, BlockRemoved((1,), medium="CPU"))
    m = idx.match(keys_of(TOKENS))["a"]
    assert (m.gpu, m.cpu, m.disk) == (0, 0, 1)
    idx.apply("a", "m", 0, BlockRemoved((1,), medium="DISK"))
    assert idx.pods() == [] and residue(idx) == 0


def test_holder_sets_are_shared_and_counted(fast: PreciseIndex) -> None:
    idx = fast
    ks = keys_of(TOKENS)
    for i in range(12):
        idx.apply(f"p{i}", "m", 0, stored([1, 2, 3, 4][: 1 + i % 4], None, TOKENS[: 4 * (1 + i % 4)]))
    for _ in range(3):
        assert {p: m.gpu for p, m in idx.match(ks).items()} == {f"p{i}": 1 + i % 4 for i in range(12)}
        assert idx.match(ks[1:]).keys() == {f"p{i}" for i in range(12) if i % 4 == 0} ^ {f"p{i}" for i in range(12)}
    assert idx.memory()["masks"] == 4  # the holder sets of the 4 keys (12, 9, 6, 3 pods): one each
    for i in range(12):
        idx.apply(f"p{i}", "m", 0, AllBlocksCleared())
    assert idx.memory()["masks"] == 0 and idx.memory()["keys"] == 0


def test_exported_tables_hold_every_worker_and_medium_and_do_not_follow_the_index(fast: PreciseIndex) -> None:
    idx = fast
    idx.apply("a", "m", 0, stored([1, 2], None, TOKENS[:8]))
    idx.apply("a", "m", 0, stored([3], 999, TOKENS[8:12]))  # orphan
    idx.apply("a", "m", 0, stored([1], None, [], medium="CPU"))
    copy = idx.export_tables()
    idx.apply("a", "m", 0, BlockRemoved(block_hashes=(1, 2)))  # later changes do not reach the copy
    idx.apply("a", "m", 0, stored([7], None, TOKENS[:4]))
    ks = keys_of(TOKENS)
    assert [c[2] for c in copy] == ["GPU", "CPU"]  # media in order, GPU first
    assert len(copy[0][3]) == 3 * 24 and len(copy[1][3]) == 24
    assert sorted(entries_of(copy)) == sorted([Entry("a", 0, "CPU", 1, ks[0], 1), Entry("a", 0, "GPU", 1, ks[0], 1),
                                               Entry("a", 0, "GPU", 2, ks[1], 1), Entry("a", 0, "GPU", 3, None, 1)])


def test_prompt_keys_equal_the_chain_of_local_hashes() -> None:
    import random

    rng = random.Random(3)
    for _ in range(200):
        tokens = [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 90))]
        bs, limit, root = rng.choice([1, 4, 16]), rng.choice([None, 0, 1, 3, 50]), rng.getrandbits(64)
        want = K.chain_keys(root, K.local_hashes(tokens, bs, limit))
        assert K.prompt_keys(root, tokens, bs, limit) == want == K.prompt_keys(root, array("I", tokens), bs, limit)
    assert K.root_key("m", None, "s") == K.root_key("m", None, "s") != K.root_key("m", "s", None)


# -- block sizes follow the engines' streams (issue 13 class 4) --------------------------------------


def sized(hashes: list[int], tokens: list[int], bs: int, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_hash=parent, token_ids=array("I", tokens), block_size=bs)


def test_a_restored_worker_holds_no_model_the_snapshot_had_no_size_for(idx: Index) -> None:
    """Restored workers (model not known until their next store) once held every model's size: a
    model new since the snapshot never learned one (every store an orphan, 0 hits) and a
    registration of it raised KeyError (HTTP 500)."""
    idx.load_entries([Entry("A", 0, "GPU", 111, 12345, 1)])
    done = idx.apply("B", "Y", 0, sized([1, 2], TOKENS[:8], 16 // 4))
    assert done.orphans == 0 and done.block_size_mismatch == 0 and idx.block_size("Y") == 4
    assert idx.match(K.prompt_keys(K.root_key("Y"), TOKENS[:8], 4))["B"].gpu == 2
    fresh = type(idx)()
    fresh.load_entries([Entry("A", 0, "GPU", 111, 12345, 1)])
    assert fresh.set_block_size("Y", 16) == 16  # no KeyError: nobody holds Y's size
    assert fresh.block_size("Y") == 16


def test_a_restored_worker_holds_the_sizes_its_keys_were_made_with(idx: Index) -> None:
    """…and it still holds those (``sizes``: the snapshot's), until its own next store names its model."""
    idx.load_entries([Entry("A", 0, "GPU", 111, keys_of(TOKENS)[0], 1)])
    assert idx.apply("B", "m", 0, sized([9], TOKENS[:8], 8)).block_size_mismatch == 1
    assert idx.set_block_size("m", 8) == BS
    other = type(idx)()
    other.set_block_size("m", 8)  # configured: the snapshot said BS
    other.load_entries([Entry("A", 0, "GPU", 111, keys_of(TOKENS)[0], 1)], sizes={"m": BS})
    assert other.set_block_size("m", 16) == 16  # its keys were not made with 8: it holds nothing
    done = other.apply("B", "m", 0, stored([5], None, TOKENS[:4]))
    assert done.block_size_mismatch == 0 and other.block_size("m") == BS  # an engine's BS is followed
    assert other.match(keys_of(TOKENS)[:1]) == {"A": (1, 1, 1, {0: 1}), "B": (1, 1, 1, {0: 1})}
    assert other.apply("C", "m", 0, sized([6], TOKENS[:8], 8)).block_size_mismatch == 1  # now held


def test_a_worker_switching_models_does_not_hold_the_new_ones_size(idx: Index) -> None:
    """The fast index counted a worker as a holder of the model it was about to store (it set the
    worker's model before asking): the new model's first store was an orphan, its size never learned."""
    assert idx.apply("P", "B", 0, sized([1], TOKENS[:16], 16)).orphans == 0
    done = idx.apply("P", "A", 0, sized([2], TOKENS[:16], 16))
    assert (done.block_size_mismatch, done.orphans, idx.block_size("A")) == (0, 0, 16)
    assert idx.set_block_size("A", 16) == 16
    assert idx.match(K.prompt_keys(K.root_key("A"), TOKENS, 16))["P"].gpu == 1
    done = idx.apply("P", "C", 0, sized([3], TOKENS[:8], 8))  # another size: nobody holds C's either
    assert (done.block_size_mismatch, idx.block_size("C")) == (0, 8)
    assert idx.apply("P", "C", 0, sized([4], TOKENS[:16], 16)).block_size_mismatch == 1  # P holds C's now


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_workers_switching_models_and_sizes_leave_the_reference_s_state(seed: int) -> None:
    """A seeded workload whose workers switch models and block sizes, some restored from entries
    (with and without the sizes they were keyed with): the fast index and the
    reference agree on every count, block size and answer after every batch."""
    import random
    rng = random.Random(seed)
    ixs: list[Index] = [make() for make in INDEXES.values()]
    restored = [Entry(f"r{i}", 0, "GPU", 1000 + i, 77 + i, 1) for i in range(3)]
    for ix in ixs:
        ix.set_block_size("m0", 4)
        ix.load_entries(restored[:2])
        ix.load_entries(restored[2:], sizes={"m0": 8, "m1": 4})
    models, sizes, pods = ["m0", "m1", "m2"], [4, 8], ["r0", "r1", "r2", "p", "q"]
    nxt = 1
    for step in range(600):
        pod, model, roll = rng.choice(pods), rng.choice(models), rng.random()
        if roll < 0.65:
            n = rng.randint(1, 3)
            bs = rng.choice(sizes)
            evs: list = [sized(list(range(nxt, nxt + n)), [rng.randrange(3) for _ in range(n * bs)], bs)]
            nxt += n
        elif roll < 0.8:
            evs = [AllBlocksCleared()]
        elif roll < 0.9:
            evs = [BlockRemoved((rng.randrange(1, nxt + 1), rng.randrange(1000, 1003)))]
        else:
            bs = rng.choice(sizes)
            got = [ix.set_block_size(model, bs) for ix in ixs]
            assert len(set(got)) == 1, (step, got)
            continue
        done = [ix.apply_batch(pod, model, 0, evs) for ix in ixs]
        assert all(d == done[0] for d in done), (step, pod, model, evs)
        assert all(ix.block_sizes() == ixs[0].block_sizes() and ix.pods() == ixs[0].pods() for ix in ixs), step
    for ix in ixs[1:]:
        assert sorted(ix.export_entries()) == sorted(ixs[0].export_entries())


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_multi_event_batches_of_chains_tiers_loras_and_sizes_leave_the_reference_s_state(seed: int) -> None:
    """Batches of several events each (the device events take the fast index's native run,
    ``Core.apply_device``; a batch of one its one-step path, ``PreciseIndex._device_store``; every
    other event the general one): chained and
    parentless stores, unknown parents, other block sizes, a CPU tier, LoRA names and salts,
    removals known and unknown, clears. After every batch both indexes report the same counts, and
    at the end the same entries and the same matches."""
    import random
    rng = random.Random(seed)
    ixs: list[Index] = [make() for make in INDEXES.values()]
    for ix in ixs:
        ix.set_block_size("m", BS)
    held: dict[str, list[tuple[int, list[int]]]] = {p: [] for p in ("a", "b", "c")}  # pod -> (hash, its tokens)
    nxt, prompts = 1, []
    for step in range(400):
        pod = rng.choice(list(held))
        evs: list = []
        for _ in range(rng.randint(1, 6)):
            roll = rng.random()
            if roll < 0.6:
                n = rng.randint(1, 4)
                chain = held[pod]
                parent = chain[-1][0] if chain and rng.random() < 0.7 else (rng.choice([None, 10**9]))
                toks = [rng.randrange(50) for _ in range(n * BS)]
                kw: dict = {}
                if rng.random() < 0.1:
                    kw["lora_name"] = "lora-x"
                if rng.random() < 0.1:
                    kw["cache_salt"] = "s1"
                if rng.random() < 0.1:
                    kw["medium"] = "CPU"
                size = 2 if rng.random() < 0.05 else BS
                hs = list(range(nxt, nxt + n))
                nxt += n
                if rng.random() < 0.05:  # the side map's hashes, and copies of a hash held already
                    hs[0] = rng.choice([0, 2**64 - 1, nxt - n - 1])
                evs.append(BlockStored(block_hashes=array("Q", hs), parent_hash=parent, token_ids=array("I", toks),
                                       block_size=size, **kw))
                if size == BS and "medium" not in kw:
                    chain.extend(zip(hs, [toks[i * BS:(i + 1) * BS] for i in range(n)]))
                    if parent is None and not kw:
                        prompts.append([t for _, ts in chain[-n:] for t in ts])
            elif roll < 0.9 and held[pod]:
                k = rng.randint(1, min(3, len(held[pod])))
                gone = [h for h, _ in held[pod][-k:]][::-1]
                del held[pod][-k:]
                evs.append(BlockRemoved(array("Q", gone + ([10**12] if rng.random() < 0.2 else []))))
            elif roll > 0.98:
                evs.append(AllBlocksCleared())
                held[pod].clear()
        done = [ix.apply_batch(pod, "m", 0, evs) for ix in ixs]
        assert all(d == done[0] for d in done), (step, pod, evs)
        assert all(ix.pods() == ixs[0].pods() and ix.block_sizes() == ixs[0].block_sizes() for ix in ixs), step
    for ix in ixs[1:]:
        assert sorted(ix.export_entries()) == sorted(ixs[0].export_entries())
        for toks in prompts[-50:]:
            keys = keys_of(toks)
            assert ix.match(keys) == ixs[0].match(keys)
