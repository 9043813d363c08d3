"""The native core (kvindex/index/_core.c, behind ``PreciseIndex``) against the readable oracle,
kvindex.index.reference.ReferenceIndex, and the snapshot row format against its Python definition.

The same seeded event stream goes to both indexes; after every batch what callers see must be
equal (per-batch counts, pods, blocks held, engine hashes, entries, ``match`` answers, with and
without a pod filter), at up to 400 workers (holder sets wider than 64 bits), with crowded home
slots, repeat copies, re-announcements, orphans, offloads and removals of unknown hashes. Like
tests/test_native.py these need the extension built (``tests.conftest.need_native``: CI fails
without it, elsewhere they skip).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from array import array

import pytest

from kvindex import keys as K
from kvindex import native
from kvindex.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.index import rows as R
from kvindex.index.memory import new_precise_index
from kvindex.index.precise import CORE, PreciseIndex
from kvindex.index.reference import ReferenceIndex
from tests.conftest import need_native

BS = 4
M64 = (1 << 64) - 1
MIX = 0x9E3779B97F4A7C15  # the core's Fibonacci hashing
INV = pow(MIX, -1, 1 << 64)  # h = v * INV has h * MIX = v: hashes whose home is chosen


def require() -> None:
    need_native(CORE, "kvindex.index._core")


def end_hash(rnd: random.Random) -> int:
    """A hash whose home is the last home slot of every table up to 2^20 slots: long probe runs
    that wrap around the end of the table."""
    return (((1 << 20) - 1) << 44 | rnd.getrandbits(44)) * INV % (1 << 64)


class Workload:
    """vLLM-like events: tenants' prompts sharing prefixes, per-pod engine hashes (the same block
    content gets the same hash within a pod), stores of the blocks a worker lacks (sometimes a
    repeat copy), leaf-first removals. Special cases are rare, as in production: unknown parents (orphans) and offloads
    without tokens in every 4th pod, tokens that run out, a wrong block size, repeat copies
    (parentless from the first block: re-announcements), held prefixes re-announced, keys
    held twice under different hashes, and
    in the pods ending in 7 hash 0 and the ends of u64. ``crowd`` of the hashes have the same (last) home slot."""

    def __init__(self, seed: int, pods: int, crowd: float = 0.08) -> None:
        self.rnd = rnd = random.Random(seed)
        systems = [[rnd.randrange(1 << 32) for _ in range(BS * rnd.randint(1, 6))] for _ in range(6)]
        self.prompts = [rnd.choice(systems) + [rnd.randrange(1 << 32) for _ in range(BS * rnd.randint(0, 12) + rnd.randint(0, BS - 1))]
                        for _ in range(300)]
        self.workers = [(f"pod-{p}", r) for p in range(pods) for r in range(1 + (p % 3 == 0))]
        self.crowd = crowd
        self.names: dict[tuple[str, int, tuple[int, ...]], int] = {}
        self.held: dict[tuple[str, int, str], list[int]] = {}

    def engine_hash(self, pod: str, rank: int, prefix: tuple[int, ...]) -> int:
        got = self.names.get((pod, rank, prefix))
        if got is None:
            rnd, x = self.rnd, self.rnd.random()
            if x < 0.03 and pod.endswith("7"):
                got = rnd.choice([0, M64, 1, M64 - 1])  # the ends of u64 (hash 0 is held aside)
            else:
                got = end_hash(rnd) if x < self.crowd else rnd.getrandbits(64)
            self.names[(pod, rank, prefix)] = got
        return got

    def store(self, pod: str, rank: int) -> BlockStored:
        rnd, tokens = self.rnd, self.rnd.choice(self.prompts)
        n = len(tokens) // BS
        chain = [self.engine_hash(pod, rank, tuple(tokens[: BS * (i + 1)])) for i in range(max(1, n))]
        held = self.held.setdefault((pod, rank, GPU), [])
        start = next((i for i, h in enumerate(chain) if h not in held), n)  # vLLM stores what it lacks
        if start and rnd.random() < 0.04:  # kv_cache_report_mode "full": the held prefix re-announced
            return BlockStored(tuple(chain[:start]), None, array("I", tokens[: BS * start]), BS)
        if start >= len(chain) or rnd.random() < 0.05:
            start = rnd.randrange(len(chain))  # a repeat copy
        hashes = tuple(chain[start:])
        if rnd.random() < 0.03:  # the same blocks under new engine hashes: the keys are held twice
            hashes = tuple(rnd.getrandbits(64) for _ in hashes)
        parent = None if start == 0 else chain[start - 1]
        body, medium, x = tokens[BS * start :], GPU, rnd.random()
        if int(pod[4:]) % 4 != 1:  # offloads and orphans in every 4th pod only: a second medium
            x = 0.5 + x / 2      # or an orphan sends all of a worker's stores to the slow path
        if x < 0.06:
            medium, body = rnd.choice(("CPU", "CPU_pinned", "DISK")), []  # an offload: no tokens
        elif x < 0.08:
            parent = rnd.getrandbits(64)  # an unknown parent: orphans
        elif x < 0.10:
            body = body[: BS * rnd.randint(0, 2)]  # tokens run out: fewer keys than hashes
        elif x < 0.12:
            medium = "CPU"
        self.held.setdefault((pod, rank, medium), []).extend(hashes)
        size = BS if rnd.random() > 0.01 else BS * 2  # rarely the wrong block size
        if medium != GPU and not body and x < 0.03:
            size, parent = 0, None  # a tier placeholder (vLLM's default offload events): block size 0
        lora = "lora-a" if rnd.random() < 0.1 else None
        return BlockStored(self.form(hashes), parent, array("I", body), size, medium, lora)

    def form(self, hashes: tuple[int, ...]) -> tuple[int, ...] | array:
        """Hashes as the decoders make them (a packed array("Q"), read in place) or as a tuple of
        ints (events built by hand), at random: the core's two readers, against the reference."""
        return array("Q", hashes) if self.rnd.random() < 0.5 else hashes

    def remove(self, pod: str, rank: int) -> BlockRemoved:
        rnd, medium = self.rnd, rnd_medium(self.rnd) if int(pod[4:]) % 4 == 1 else GPU
        held = self.held.get((pod, rank, medium), [])
        k = rnd.randint(1, 16)
        gone = held[-k:] if rnd.random() < 0.7 else rnd.sample(held, min(k, len(held)))  # leaf first, or any
        for h in gone:
            held.remove(h)
        if rnd.random() < 0.1:
            gone = gone + [rnd.getrandbits(64), end_hash(rnd)]  # unknown removals
        return BlockRemoved(self.form(tuple(reversed(gone))), medium)

    def batch(self) -> tuple[str, int, list]:
        pod, rank = self.rnd.choice(self.workers)
        events: list = []
        for _ in range(self.rnd.randint(1, 6)):
            x = self.rnd.random()
            if x < 0.55:
                events.append(self.store(pod, rank))
            elif x < 0.995:
                events.append(self.remove(pod, rank))
            else:
                events.append(AllBlocksCleared())
                for m in [m for m in self.held if m[:2] == (pod, rank)]:
                    del self.held[m]
        return pod, rank, events

    def query(self) -> array:
        return K.prompt_keys(K.root_key("m", "lora-a" if self.rnd.random() < 0.1 else None), self.rnd.choice(self.prompts), BS)


def rnd_medium(rnd: random.Random) -> str:
    return GPU if rnd.random() < 0.8 else rnd.choice(("CPU", "CPU_pinned", "DISK"))


def public(ix: PreciseIndex | ReferenceIndex, pods: list[str]) -> dict:
    """What callers see of ``pods`` (the oracle's terms)."""
    return {"pods": ix.pods(), "sizes": ix.block_sizes(), "held": {p: ix.blocks_held(p) for p in pods},
            "hashes": {p: ix.engine_hashes(p) for p in pods}}


def pair() -> tuple[PreciseIndex, ReferenceIndex]:
    require()
    fast, truth = PreciseIndex(), ReferenceIndex()
    for ix in (fast, truth):
        ix.set_block_size("m", BS)
    return fast, truth


@pytest.mark.parametrize("seed,pods,batches,crowd", [
    (1, 6, 3000, 0.08),
    (2, 90, 3000, 0.08),  # > 64 workers: holder sets wider than 64 bits
    (3, 260, 1500, 0.08),  # > 256 workers
    (4, 4, 2000, 0.5),  # crowded homes: long probe runs, wrap-around, backward shifts
])
def test_the_core_answers_as_the_reference_after_every_batch(seed: int, pods: int, batches: int, crowd: float) -> None:
    fast, truth = pair()
    wl = Workload(seed, pods, crowd)
    for b in range(batches):
        pod, rank, events = wl.batch()
        assert fast.apply_batch(pod, "m", rank, events) == truth.apply_batch(pod, "m", rank, events), f"batch {b}"
        touched = [pod]
        if b % 400 == 399:  # a pod goes away (restart, removal)
            gone = wl.rnd.choice(wl.workers)[0]
            fast.clear_pod(gone), truth.clear_pod(gone)
            touched.append(gone)
            for m in [m for m in wl.held if m[0] == gone]:
                del wl.held[m]
        assert public(fast, touched) == public(truth, touched), f"batch {b}"
        q = wl.query()
        some = [f"pod-{i}" for i in wl.rnd.sample(range(pods), min(3, pods))]
        if b % 4 == 0:  # the reference's match reads every entry: not after every batch
            assert fast.match(q) == truth.match(q) and fast.match(q, some) == truth.match(q, some), f"batch {b}"
            assert fast.match(list(q)) == fast.match(q), f"batch {b}"  # keys as ints, or packed (prompt_keys)
        if b % 250 == 0:
            assert sorted(fast.export_entries()) == sorted(truth.export_entries()), f"batch {b}"
    assert len(fast._ident) > 64 or pods < 64
    everyone = [f"pod-{i}" for i in range(pods)]
    assert public(fast, everyone) == public(truth, everyone)
    assert sorted(fast.export_entries()) == sorted(truth.export_entries())
    copy = PreciseIndex()  # one linear pass out and in: the same index
    copy.load_tables(fast.export_tables(), fast.block_sizes())
    assert sorted(copy.export_entries()) == sorted(truth.export_entries())
    for _ in range(50):
        q = wl.query()
        assert copy.match(q) == fast.match(q) == truth.match(q)


def test_emptied_workers_free_everything() -> None:
    fast, _ = pair()
    wl = Workload(7, 30)
    for _ in range(1500):
        pod, rank, events = wl.batch()
        fast.apply_batch(pod, "m", rank, events)
    assert fast.memory()["entries"] > 0
    for p in fast.pods():
        fast.clear_pod(p)
    stats = fast.memory()
    assert (stats["entries"], stats["side"], stats["keys"], stats["masks"], stats["dups"]) == (0, 0, 0, 0, 0), stats
    assert fast._ident == [] and fast.pods() == []


def test_snapshot_rows_in_c_equal_their_python_definition() -> None:
    require()
    rnd = random.Random(3)
    rows = [(rnd.getrandbits(64), None if rnd.random() < 0.2 else rnd.getrandbits(64), rnd.randint(1, 5)) for _ in range(2000)]
    rows += [(0, 0, 1), (M64, M64, (1 << 63) - 1), (1, None, 1 << 40)]
    packed = R.py_pack_rows(rows)
    assert CORE.pack(rows) == packed and len(packed) == R.ROW.size * len(rows) == CORE.ROW * len(rows)
    assert CORE.rows(packed) == R.py_unpack_rows(packed) == rows
    for bad in ([(1, 2, 0)], [(1, 2, 1 << 63)], [(1, 2, -1)], [(-1, 2, 1)], [(1 << 64, 2, 1)], [(1, 2)]):
        with pytest.raises((ValueError, OverflowError, TypeError)):
            CORE.pack(bad)
        with pytest.raises((ValueError, OverflowError, TypeError, struct_error())):
            R.py_pack_rows(bad)
    for ragged in (packed[:-1], b"x"):
        with pytest.raises(ValueError, match="multiple of 24"):
            CORE.rows(ragged)
        with pytest.raises(ValueError, match="multiple of 24"):
            R.py_unpack_rows(ragged)


def test_loaded_rows_replace_what_a_table_held_as_the_reference_does() -> None:
    """Found by review: an empty table created its medium (so media order, hence keys, differed);
    a hash twice in one table kept the first row's holdings (a freed worker stayed a holder);
    2**32 copies hung the loop that indexed them, and counts wrapped at 2**32."""
    fast, truth = pair()
    T = array("I", range(8))
    both = (fast, truth)
    tables = [("p", 0, "GPU", R.py_pack_rows([(5, 42, 1), (5, 42, 1)])), ("p", 0, "CPU", b""),
              ("q", 0, "GPU", R.py_pack_rows([(6, 42, 1)])), ("r", 0, "GPU", b""),
              ("s", 0, "GPU", R.py_pack_rows([(7, 42, 1), (7, None, 1), (8, None, 1), (8, 43, 2)]))]
    for ix in both:
        ix.load_tables(tables)
    assert fast.pods() == truth.pods() == ["p", "q", "s"]
    assert [public(ix, ["p", "q", "s"]) for ix in both][0] == public(truth, ["p", "q", "s"])
    for ix in both:
        ix.apply("p", "m", 0, BlockRemoved((5,)))
    assert fast.match([42]) == truth.match([42]) and fast.match([43]) == truth.match([43])
    assert fast.pods() == truth.pods() == ["q", "s"]
    huge = (1 << 32) - 1
    for ix in both:
        ix.load_tables([("h", 0, "GPU", R.py_pack_rows([(5, None, huge)])),
                        ("h", 0, "CPU", R.py_pack_rows([(9, None, huge)]))])
        ix.apply_batch("h", "m", 0, [BlockStored((9,), None, array("I"), 0, "CPU"), BlockStored((9,), None, array("I"), 0, "CPU")])
        ix.apply("h", "m", 0, BlockStored((5,), 99, T[:4], BS))  # an unknown parent: still keyless
        ix.apply("h", "m", 0, BlockStored((5,), None, T[:4], BS))  # its key is learned: 2**32 copies indexed
        ix.apply("h", "m", 0, BlockStored((9,), 5, T[4:8], BS))  # 9 is keyed on GPU: its CPU copies adopt the key
    assert public(fast, ["h"]) == public(truth, ["h"]) and fast.blocks_held("h")["cpu"] == huge + 2
    q = K.prompt_keys(K.root_key("m"), T, BS)
    assert fast.match(q) == truth.match(q)
    before = sorted(fast.export_entries())
    with pytest.raises(ValueError, match="0 copies"):  # one bad row refuses the call: nothing changes
        fast.load_tables([("h", 0, "GPU", R.py_pack_rows([(11, 1, 1)]) + bytes(24))])
    assert sorted(fast.export_entries()) == before
    assert fast.match([10**30]) == truth.match([10**30]) == {}  # a key that is not a u64 is held by nobody


def struct_error() -> type[Exception]:
    import struct
    return struct.error


def test_a_hash_that_is_not_a_u64_is_refused_and_changes_nothing() -> None:
    """The decoders make every hash a u64 (adapters/vllm.py); anything else is a caller's bug:
    the event is refused whole, before the index changes."""
    fast, _ = pair()
    tokens = array("I", range(16))
    fast.apply("a", "m", 0, BlockStored((5, 6), None, array("I", range(8)), BS))
    before = (sorted(fast.export_entries()), fast.memory())
    for hashes in [(7, 8, -1), (7, 1 << 64), (7, 2.5), (7, "8"), array("q", [7, -1])]:  # signed items: read as ints
        for ev in (BlockStored(hashes, None, tokens[: 4 * len(hashes)], BS), BlockRemoved(hashes)):
            with pytest.raises((OverflowError, TypeError)):
                fast.apply("a", "m", 0, ev)
            assert (sorted(fast.export_entries()), fast.memory()) == before


def test_no_reference_leaks() -> None:
    fast, _ = pair()
    tokens = array("I", range(64))
    hashes = tuple(random.Random(9).sample(range(1 << 62, 1 << 63), 16))
    fast.apply("x", "m", 0, BlockStored((1 << 63,), None, array("I", range(4)), BS))  # slot 0, held
    stored = BlockStored(hashes, None, tokens, BS)
    removed = BlockRemoved(hashes[::-1])
    watched = [*hashes, GPU, "gpu", stored, removed]

    def cycle(n: int) -> None:
        for _ in range(n):
            fast.apply_batch("x", "m", 0, [stored, stored, removed, removed])
            fast.apply_batch("y", "m", 0, [stored, removed])
            fast.apply_batch("x", "m", 0, [stored])
            fast.match(K.prompt_keys(K.root_key("m"), tokens, BS))
            fast.apply_batch("x", "m", 0, [removed])
            fast.load_tables(fast.export_tables()[:0])

    cycle(100)
    before = [sys.getrefcount(o) for o in watched]
    rss0 = rss()
    cycle(25_000)
    assert [sys.getrefcount(o) for o in watched] == before
    assert rss() - rss0 < 4 << 20, "RSS grew: a leak"
    assert fast.pods() == ["x"] and fast.memory()["entries"] == 1


def rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_without_the_core_the_reference_serves() -> None:
    require()
    assert isinstance(new_precise_index(), PreciseIndex) and "kvindex.index._core" in native.ACCELERATORS
    code = ("from kvindex.index import memory as p; from kvindex.index.reference import ReferenceIndex;"
            "assert p.CORE is None and isinstance(p.new_precise_index(), ReferenceIndex)")
    env = {**os.environ, "KVINDEX_PURE_PYTHON": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


# -- fuzzed batches: tiny hash pools, so every rule collides with every other ----------------------
FUZZ_MEDIA = ("GPU", "GPU", "GPU", "CPU", "DISK", "CPU2")


def fuzz_batch(rnd: random.Random, pool: list[int], tokens: list[array]) -> list:
    events: list = []
    for _ in range(rnd.randint(1, 4)):
        x = rnd.random()
        if x < 0.55:
            hashes = tuple(rnd.choice(pool) for _ in range(rnd.randint(1, 3)))
            medium, parent = rnd.choice(FUZZ_MEDIA), None if rnd.random() < 0.4 else rnd.choice(pool)
            body = array("I", [t for _ in range(rnd.choice([len(hashes)] * 4 + [len(hashes) - 1, 0]))
                               for t in rnd.choice(tokens)])
            size = BS if rnd.random() < 0.93 else 2 * BS
            if medium != GPU and rnd.random() < 0.5:
                body, size = array("I"), 0  # a tier placeholder
            events.append(BlockStored(hashes, parent, body, size, medium, rnd.choice([None, None, "l"])))
        elif x < 0.9:
            events.append(BlockRemoved(tuple(rnd.choice(pool) for _ in range(rnd.randint(1, 3))), rnd.choice(FUZZ_MEDIA)))
        elif x < 0.95:
            events.append(AllBlocksCleared())
    return events


def holder_sets(ix: ReferenceIndex) -> dict[tuple[int, int], set[tuple[str, int]]]:
    """(tier number, key) -> the workers holding it, from the reference's entries."""
    from kvindex.index.protocol import tier_of
    from kvindex.index.precise import TIER_NO
    out: dict[tuple[int, int], set[tuple[str, int]]] = {}
    for e in ix.export_entries():
        if e.key is not None:
            out.setdefault((TIER_NO[tier_of(e.medium)], e.key), set()).add((e.pod, e.dp_rank))
    return out


@pytest.mark.parametrize("first", range(0, 400, 100))
def test_fuzzed_batches_on_tiny_pools_answer_as_the_reference(first: int) -> None:
    require()
    for seed in range(first, first + 100):
        rnd = random.Random(seed)
        pods = [f"p{i}" for i in range(rnd.choice([1, 2, 3, 5, 70, 140]))]
        pool = [0, M64, 1] + [((rnd.getrandbits(3) << 61) | rnd.getrandbits(61)) * INV % (1 << 64) for _ in range(3)]
        tokens = [array("I", [rnd.randrange(3)] * BS) for _ in range(3)]
        fast, truth = pair()
        for step in range(40):
            pod, rank = rnd.choice(pods[:3]) if rnd.random() < 0.6 else rnd.choice(pods), rnd.choice([0, 0, 1])
            op = rnd.random()
            if op < 0.04:
                fast.clear_pod(pod), truth.clear_pod(pod)
            elif op < 0.08:
                size = rnd.choice([BS, 2 * BS])
                assert fast.set_block_size("m", size) == truth.set_block_size("m", size)
            elif op < 0.13:  # out and in again: snapshot rows of either, into fresh indexes
                tables = (fast if rnd.random() < 0.5 else truth).export_tables()
                fast, truth = PreciseIndex(), ReferenceIndex()
                fast.set_block_size("m", BS), truth.set_block_size("m", BS)
                assert fast.load_tables(tables) == truth.load_tables(tables)
            events = fuzz_batch(rnd, pool, tokens)
            where = f"seed {seed} step {step}"
            assert fast.apply_batch(pod, "m", rank, events) == truth.apply_batch(pod, "m", rank, events), where
            assert public(fast, pods[:6]) == public(truth, pods[:6]), where
            assert sorted(fast.export_entries()) == sorted(truth.export_entries()), where
            held = holder_sets(truth)
            assert fast.memory()["keys"] == len(held), where  # no key held that the reference does not hold
            for (tier, key), workers in held.items():
                assert {fast._ident[s] for s in fast._core.holders(tier, key)} == workers, where
            for (tier, key), workers in list(held.items())[:4]:
                q = [key] + [k for _, k in rnd.sample(sorted(held), min(3, len(held)))]
                some = rnd.sample(pods, min(2, len(pods)))
                assert fast.match(q) == truth.match(q) and fast.match(q, some) == truth.match(q, some), where
        for p in pods:
            fast.clear_pod(p)
        left = fast.memory()
        assert not any(left[k] for k in ("entries", "side", "keys", "masks", "dups")), (seed, left)
