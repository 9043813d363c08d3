"""kvindex._apply (the C store/remove/rehash loops) against the Python of kvindex.index.precise,
and both against the readable oracle, kvindex.index.reference.

The same seeded event stream goes to a pure-Python index (``PreciseIndex(native=None)``), an
accelerated one and the ``ReferenceIndex``. The two fast ones are compared piece by piece after
every batch (holders per tier, duplicate holdings, the interned masks, each worker's slot arrays byte for
byte, side dicts, extra copies and orphans): a mutant of the C code shows up there. Both are held
to the reference on what callers see (per-batch counts, pods, blocks held, engine hashes, entries,
match() answers). Like tests/test_native.py, the C ones need the extension built
(``tests.conftest.need_native``: CI fails without it, elsewhere they skip).
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
from kvindex.index import holders
from kvindex.index.holders import MASKS_CAP
from kvindex.index.precise import PreciseIndex
from kvindex.index.reference import ReferenceIndex
from kvindex.index.table import MIX, Table
from tests.conftest import need_native

_apply = native.load("kvindex._apply")
BS = 4
M64 = (1 << 64) - 1
INV = pow(MIX, -1, 1 << 64)  # h = v * INV has h * MIX = v: hashes whose home is chosen


def require() -> None:
    need_native(_apply, "kvindex._apply")


def end_hash(rnd: random.Random) -> int:
    """A hash whose home is the last home slot of every table up to 2^20 slots: long runs past
    ``size``, so entries take the last slot (``_extend``) and rehashes stop there."""
    return (((1 << 20) - 1) << 44 | rnd.getrandbits(44)) * INV % (1 << 64)


class Workload:
    """vLLM-like events: tenants' prompts sharing prefixes, per-pod engine hashes (the same block
    content gets the same hash within a pod), stores of the blocks a worker lacks (sometimes a
    repeat copy), leaf-first removals. Special cases are rare, as in production, so most elements
    take the C loops and each special one is handed back: unknown parents (orphans) and offloads
    without tokens in every 4th pod, tokens that run out, a wrong block size, repeat copies
    (parentless from the first block: re-announcements), held prefixes re-announced, keys
    held twice under different hashes, and
    in the pods ending in 7 hash 0 and hashes that are not u64s. ``crowd`` of the hashes have the same (last) home slot."""

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
                got = rnd.choice([0, -rnd.randrange(1, 99), (1 << 64) + rnd.randrange(99), M64])
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
        return BlockStored(hashes, parent, array("I", body), size, medium, lora)

    def remove(self, pod: str, rank: int) -> BlockRemoved:
        rnd, medium = self.rnd, rnd_medium(self.rnd) if int(pod[4:]) % 4 == 1 else GPU
        held = self.held.get((pod, rank, medium), [])
        k = rnd.randint(1, 16)
        gone = held[-k:] if rnd.random() < 0.7 else rnd.sample(held, min(k, len(held)))  # leaf first, or any
        for h in gone:
            held.remove(h)
        if rnd.random() < 0.1:
            gone = gone + [rnd.getrandbits(64), end_hash(rnd)]  # unknown removals
        return BlockRemoved(tuple(reversed(gone)), medium)

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

    def query(self) -> list[int]:
        return K.prompt_keys(K.root_key("m", "lora-a" if self.rnd.random() < 0.1 else None), self.rnd.choice(self.prompts), BS)


def rnd_medium(rnd: random.Random) -> str:
    return GPU if rnd.random() < 0.8 else rnd.choice(("CPU", "CPU_pinned", "DISK"))


def table_state(t: Table) -> tuple:
    return (t.tab.tobytes(), t.size, t.bits, t.sh, t.m, t.used, t.limit, dict(t.side), list(t.items()))


def state(ix: PreciseIndex, pods: list[str] | None = None) -> dict:
    """Every piece of state (the tables of ``pods``' workers only, when given: a batch changes no other)."""
    workers = {wid: (w.slot, w.bit, list(w.media), {m: table_state(t) for m, t in w.media.items()},
                     dict(w.extra), w.orphans) for wid, w in ix._workers.items() if pods is None or wid[0] in pods}
    return {"holders": ix._inv.tiers, "dups": ix._inv.dups, "masks": ix._inv.masks, "workers": workers,
            "slots": [None if w is None else w.ident for w in ix._slots], "block_size": ix._block_size}


def public(ix: PreciseIndex | ReferenceIndex, pods: list[str]) -> dict:
    """What callers see of ``pods`` (the oracle's terms)."""
    return {"pods": ix.pods(), "sizes": ix.block_sizes(), "held": {p: ix.blocks_held(p) for p in pods},
            "hashes": {p: ix.engine_hashes(p) for p in pods}}


def oracle() -> ReferenceIndex:
    ix = ReferenceIndex()
    ix.set_block_size("m", BS)
    return ix


def pair() -> tuple[PreciseIndex, PreciseIndex]:
    require()
    ref, fast = PreciseIndex(native=None), PreciseIndex(native=_apply)
    for ix in (ref, fast):
        ix.set_block_size("m", BS)
    return ref, fast


@pytest.mark.parametrize("seed,pods,batches,crowd,masks_cap", [
    (1, 6, 3000, 0.08, None),
    (2, 90, 3000, 0.08, None),  # > 64 workers: masks wider than 64 bits
    (3, 200, 1500, 0.08, None),
    (4, 4, 2000, 0.5, None),  # runs past the end of the tables: _extend, rehash stops
    (5, 40, 2000, 0.08, 6),  # a tiny interning cache: it starts over often
])
def test_c_and_python_loops_leave_one_state_and_both_the_reference_s(monkeypatch: pytest.MonkeyPatch, seed: int, pods: int,
                                                                     batches: int, crowd: float, masks_cap: int | None) -> None:
    if masks_cap is not None:
        monkeypatch.setattr(holders, "MASKS_CAP", masks_cap)
    ref, fast = pair()
    truth = oracle()
    wl = Workload(seed, pods, crowd)
    for b in range(batches):
        pod, rank, events = wl.batch()
        done = truth.apply_batch(pod, "m", rank, events)
        assert fast.apply_batch(pod, "m", rank, events) == ref.apply_batch(pod, "m", rank, events) == done
        touched = [pod]
        if b % 400 == 399:  # a pod goes away (restart, removal)
            gone = wl.rnd.choice(wl.workers)[0]
            ref.clear_pod(gone), fast.clear_pod(gone), truth.clear_pod(gone)
            touched.append(gone)
            for m in [m for m in wl.held if m[0] == gone]:
                del wl.held[m]
        every = None if b % 50 == 0 else touched
        assert state(fast, every) == state(ref, every), f"batch {b}"  # C and Python, byte for byte
        assert public(fast, touched) == public(truth, touched), f"batch {b}"
        q = wl.query()
        some = [f"pod-{i}" for i in wl.rnd.sample(range(pods), min(3, pods))]
        assert fast.match(q) == ref.match(q) and fast.match(q, some) == ref.match(q, some)
        if b % 8 == 0:  # the reference's match reads every entry: not after every batch
            assert fast.match(q) == truth.match(q) and fast.match(q, some) == truth.match(q, some)
        if b % 250 == 0:
            assert sorted(fast.export_entries()) == sorted(truth.export_entries()), f"batch {b}"
    assert len(fast._slots) > 64 or pods < 64
    everyone = [f"pod-{i}" for i in range(pods)]
    assert public(fast, everyone) == public(truth, everyone)
    assert sorted(fast.export_entries()) == sorted(ref.export_entries()) == sorted(truth.export_entries())


def test_tables_grow_shrink_and_extend_identically() -> None:
    require()
    rnd = random.Random(5)
    pool = [rnd.getrandbits(64) for _ in range(3000)] + [end_hash(rnd) for _ in range(400)] + list(range(1, 300))
    ref, fast = Table(native=None), Table(native=_apply)
    for step in range(40_000):
        h = rnd.choice(pool)
        if rnd.random() < (0.65 if (step // 8000) % 2 == 0 else 0.3):
            assert ref.insert(h, h ^ 5) == fast.insert(h, h ^ 5)
        else:
            assert ref.pop(h) == fast.pop(h)
        if step % 97 == 0:
            assert table_state(fast) == table_state(ref), step
    assert table_state(fast) == table_state(ref)


def test_bad_events_fail_or_pass_as_in_python() -> None:
    ref, fast = pair()
    keys = K.prompt_keys(K.root_key("m"), list(range(16)), BS)
    odd = [(1, 2.5, 3, 4), (1, 2, "3", 4)]  # not ints: both paths raise the same error
    for hashes in odd:
        for ev in (BlockStored(hashes, None, array("I", range(16)), BS), BlockRemoved(hashes)):
            errors = []
            for ix in (ref, fast):
                with pytest.raises((TypeError, OverflowError)) as e:
                    ix.apply_batch("a", "m", 0, [BlockStored((7, 8), None, array("I", range(8)), BS), ev])
                errors.append(e.type)
            assert errors[0] is errors[1]
            assert state(fast) == state(ref)
    big = (M64, 1 << 64, -3, 0, True, 9)  # non-u64 ints and hash 0 go to the side dict, as in Python
    for ix in (ref, fast):
        assert ix.apply("b", "m", 0, BlockStored(big, None, array("I", range(24)), BS)).stored == 6
        ix.apply("b", "m", 0, BlockRemoved(big[::-1]))
    assert state(fast) == state(ref) and fast.match(keys) == ref.match(keys)


def test_direct_calls_with_the_wrong_types_hand_everything_back() -> None:
    require()
    t, holders, masks = Table(native=_apply), {}, {}
    assert _apply.store(t, holders, masks, 1, (5, 6), [7, 8], 0, MASKS_CAP) == 2 and t.used == 2
    assert _apply.store(t, [], masks, 1, (9,), [1], 0, MASKS_CAP) == 0  # holders not a dict
    assert _apply.store(t, holders, masks, 1.0, (9,), [1], 0, MASKS_CAP) == 0  # bit not an int
    assert _apply.store(t, holders, masks, 1, iter((9,)), [1], 0, MASKS_CAP) == 0  # not a sequence
    assert _apply.store(t, holders, masks, 1, (9, 10), [1], 0, MASKS_CAP) == 1  # keys run out
    assert _apply.store(t, holders, masks, 1, (11,), [1 << 64], 0, MASKS_CAP) == 0  # key not a u64
    with pytest.raises(AttributeError):
        _apply.store(object(), holders, masks, 1, (9,), [1], 0, MASKS_CAP)
    bad = Table(native=_apply)
    bad.tab = array("I", bytes(64))  # not array("Q"): nothing done
    assert _apply.store(bad, holders, masks, 1, (9,), [1], 0, MASKS_CAP) == 0
    assert _apply.remove(bad, holders, masks, ~1, {}, {}, GPU, "gpu", 0, (5,), 0, MASKS_CAP) == (0, 0, 0)
    holders[7] = "not a mask"
    assert _apply.remove(t, holders, masks, ~1, {}, {}, GPU, "gpu", 0, (5,), 0, MASKS_CAP) == (0, 0, 0)
    holders[7] = 1
    assert _apply.remove(t, holders, masks, ~1, {}, {}, GPU, "gpu", 0, (5, 77), 0, MASKS_CAP) == (2, 1, 1)
    assert t.used == 2 and 7 not in holders and t.get(6) == 8 and t.get(5) is None  # 6 and 9 stay
    with pytest.raises(TypeError):
        _apply.rehash(array("I"), t.tab, t.sh, t.m, 0)
    with pytest.raises(ValueError):
        _apply.rehash(t.tab, array("Q", bytes(16 * 40)), 60, 14, 1)
    with pytest.raises(TypeError):
        _apply.store(t, holders)


def test_no_reference_leaks() -> None:
    ref, fast = pair()
    tokens = array("I", range(64))
    hashes = tuple(rnd_hash for rnd_hash in random.Random(9).sample(range(1 << 62, 1 << 63), 16))
    fast.apply("x", "m", 0, BlockStored((1 << 63,), None, array("I", range(4)), BS))  # slot 0, held
    stored = BlockStored(hashes, None, tokens, BS)
    removed = BlockRemoved(hashes[::-1])
    w = fast._workers[("x", 0)]
    watched = [*hashes, w.bit, GPU, "gpu"]

    def cycle(n: int) -> None:
        for _ in range(n):
            fast.apply_batch("x", "m", 0, [stored, stored, removed, removed])
            fast.apply_batch("y", "m", 0, [stored, removed])
            fast.apply_batch("x", "m", 0, [stored])
            fast.apply_batch("x", "m", 0, [removed])

    cycle(100)
    before = [sys.getrefcount(o) for o in watched]
    rss0 = rss()
    cycle(25_000)
    assert [sys.getrefcount(o) for o in watched] == before
    assert rss() - rss0 < 4 << 20, "RSS grew: a leak"
    assert fast._inv.tiers["gpu"] and len(fast._workers) == 1


def rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_pure_python_everywhere_with_the_env_var() -> None:
    require()
    assert PreciseIndex()._native is _apply and Table().native is _apply and "kvindex._apply" in native.ACCELERATORS
    code = ("from kvindex.index import precise as p, table; ix = p.PreciseIndex(); w = ix._worker('a', 0);"
            "assert table.APPLY is None and ix._native is None and w.media['GPU'].native is None")
    env = {**os.environ, "KVINDEX_PURE_PYTHON": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
