"""adapters._vllm (the C decoder) against VllmDecoder's Python path: equal, or declined.

For every payload the C twin returns None (decode it in Python) or exactly what the Python path
returns; and it must not decline the batches engines really send, or it would be dead weight.
"""

from __future__ import annotations

import base64
import json
import math
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.vllm import _KINDS, VllmDecoder
from kvindex import native
from kvindex.events import DecodeError, EventBatch
from kvindex.tools.engine_sim import SimulatedCache, encode_batch
from kvindex.tools.workload import Workload
from tests.conftest import CONFIGS, FIXTURES, need_native, q
from tests.test_decoder import A, B, C

_fast = native.load("adapters._vllm")


def _reference(payload: bytes, groups: list[int | None]) -> tuple[object, list[int | None]]:
    """What a pure-Python decoder whose prefix group was ``groups`` decodes, and its groups after."""
    python = VllmDecoder(fast=None)
    python.groups = list(groups)
    try:
        return python.decode(payload), python.groups
    except DecodeError as exc:
        return exc, python.groups


def check(payload: bytes, groups: list[int | None] | None = None) -> bool:
    """The C result equals the reference or is None; True when C took it. ``groups``: a decoder's
    prefix group (adapters/vllm_groups.py) before the payload, left as the decoder leaves it (C
    may only change it when it takes the payload, to what Python would); None: a new decoder's."""
    need_native(_fast, "adapters._vllm")
    before = [None] if groups is None else list(groups)
    got = _fast.decode(payload, _KINDS) if groups is None else _fast.decode(payload, _KINDS, groups)
    ref, after = _reference(payload, before)
    if got is not None:
        if isinstance(ref, EventBatch) and math.isnan(ref.ts):  # NaN != NaN: compare the rest
            assert math.isnan(got.ts) and (got.events, got.dp_rank, got.skipped) == (ref.events, ref.dp_rank, ref.skipped)
        else:
            assert got == ref, payload.hex()
    if groups is not None:
        assert groups == (after if got is not None else before), payload.hex()
        groups[:] = after  # the decoder's Python path learns what C declined
    return got is not None


def fixture_payloads() -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for path in sorted(FIXTURES.rglob("events.jsonl")):
        for line in path.read_text().splitlines():
            frames = json.loads(line)["frames"]
            out.setdefault(path.parent.name, []).append(base64.b64decode(frames[-1]))
    return out


def test_every_recorded_vllm_payload_is_taken_and_equal() -> None:
    payloads = fixture_payloads()
    assert len(payloads) >= 4
    for name, batch in payloads.items():
        groups: list[int | None] = [None]  # one decoder per capture, as one engine lane has
        taken = [check(p, groups) for p in batch]
        if name == "small_bytes_hashes":  # 32-byte hashes: the Python path's job
            assert not any(taken)
        else:  # all but batches of removals before the first store (the prefix group is not known)
            assert all(taken[next(i for i, t in enumerate(taken) if t):]), name
            assert groups == [0], name


def test_reference_bytes_and_simulated_engines_in_both_dialects() -> None:
    assert all(check(p) for p in (A, B, C))
    for dialect in ("map", "array"):
        cache, wl = SimulatedCache(num_blocks=64, block_size=4), Workload(3, tenants=3, system_tokens=40)
        groups: list[int | None] = [None]
        for i, req in enumerate(wl.take(200)):
            events = cache.admit(req.token_ids).events
            assert check(encode_batch(events, ts=float(i), dp_rank=i % 3, dialect=dialect), groups) or groups == [None]


_u64 = st.integers(0, (1 << 64) - 1)
_any = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=False),
                 st.text(max_size=4), st.binary(max_size=4), st.lists(st.integers(0, 3), max_size=2),
                 st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2))
_hash = st.one_of(_u64, _u64, st.integers(-(1 << 63), -1), st.binary(min_size=1, max_size=32))
_medium = st.sampled_from([None, "", "GPU", "gpu", "CPU_tier", "disk", "ß"])
_extra = st.one_of(st.none(), st.just([]), st.lists(st.one_of(st.none(), st.lists(st.one_of(st.text(max_size=3), _any),
                   max_size=3), st.dictionaries(st.just("cache_salt"), st.text(max_size=3)), _any), max_size=3))
_stored = st.fixed_dictionaries({
    "type": st.just("BlockStored"), "block_hashes": st.lists(_hash, max_size=4) | st.lists(_u64, min_size=1, max_size=4),
    "parent_block_hash": st.one_of(st.none(), st.just(0), _hash), "token_ids": st.lists(st.integers(-1, 1 << 33), max_size=8)
    | st.lists(st.integers(0, 1 << 32 - 1), max_size=8), "block_size": st.one_of(st.integers(-1, 8), _any),
    "medium": _medium, "lora_name": st.one_of(st.none(), st.sampled_from(["sql", "a"]), _any),
    "extra_keys": _extra, "group_idx": st.one_of(st.none(), st.integers(-3, 3), _any)},
    optional={"lora_id": _any, "kv_cache_spec_kind": _any, "zzz": _any})
_removed = st.fixed_dictionaries({"type": st.just("BlockRemoved"), "block_hashes": st.lists(_hash, max_size=3)
                                  | st.lists(_u64, min_size=1, max_size=3)},
                                 optional={"medium": _medium, "group_idx": st.one_of(st.none(), st.integers(0, 2)), "x": _any})
_cleared = st.fixed_dictionaries({"type": st.sampled_from(["AllBlocksCleared", "Other"])}, optional={"x": _any})
_good_stored = st.fixed_dictionaries({
    "type": st.just("BlockStored"), "block_hashes": st.lists(_u64, min_size=1, max_size=4),
    "parent_block_hash": st.one_of(st.none(), _u64), "token_ids": st.lists(st.integers(0, (1 << 32) - 1), max_size=8),
    "block_size": st.integers(1, 8), "medium": _medium, "lora_name": st.sampled_from([None, "sql"]),
    "extra_keys": st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.sampled_from(["sql", "s1", 7, None]),
                                                                                   max_size=3)), max_size=2)),
    "group_idx": st.one_of(st.none(), st.integers(0, 2))}, optional={"lora_id": st.none(), "kv_cache_spec_kind": st.one_of(
        st.text(max_size=3), st.sampled_from(["full_attention", "mla_attention", "sliding_window", "mamba"]))})
_good_removed = st.fixed_dictionaries({"type": st.just("BlockRemoved"), "block_hashes": st.lists(_u64, min_size=1, max_size=3)},
                                      optional={"medium": _medium, "group_idx": st.one_of(st.none(), st.integers(0, 2))})
_event = st.one_of(_stored, _removed, _cleared, _good_stored, _good_stored, _good_removed, _good_removed)

ARRAY_FIELDS = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                                "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"],
                "BlockRemoved": ["block_hashes", "medium", "group_idx"], "AllBlocksCleared": [], "Other": []}


def as_array(ev: dict, keep: int) -> list:
    fields = ARRAY_FIELDS[ev["type"]]
    return [ev["type"], *(ev.get(f) for f in fields)][: max(1, keep)]


@settings(max_examples=600, deadline=None)
@given(st.lists(_event, max_size=5), st.sampled_from(["map", "array", "mixed"]), st.integers(0, 14),
       st.one_of(st.none(), st.integers(-1, 1 << 17)), st.one_of(st.floats(allow_nan=False), st.integers(-(1 << 60), 1 << 60),
       st.none()), st.booleans(), st.data())
def test_generated_payloads_equal_or_declined(events, dialect, keep, rank, ts, three, data) -> None:
    if dialect == "map":
        evs = events
    elif dialect == "array":
        evs = [as_array(e, keep) for e in events]
    else:
        evs = [as_array(e, keep) if i % 2 else e for i, e in enumerate(events)]
    payload = msgpack.packb([ts, evs, rank] if three else [ts, evs])
    check(payload)
    check(payload, [data.draw(st.sampled_from([None, 0, 1, 2]))])  # a decoder that knows its prefix group (or not)
    cut = data.draw(st.integers(0, len(payload)))  # truncated, one byte changed, trailing bytes
    check(payload[:cut])
    i = data.draw(st.integers(0, len(payload) - 1))
    check(payload[:i] + bytes([data.draw(st.integers(0, 255))]) + payload[i + 1:])
    check(payload + b"\x00")


def test_random_bytes_never_crash_and_fixture_mutations_agree() -> None:
    rnd = random.Random(5)
    samples = [p for batch in fixture_payloads().values() for p in batch[:20]]
    for _ in range(3000):
        p = bytearray(rnd.choice(samples))
        for _ in range(rnd.randrange(1, 4)):
            p[rnd.randrange(len(p))] = rnd.randrange(256)
        check(bytes(p))
        check(bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 40))))


_GOOD = {"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None, "token_ids": list(range(8)),
         "block_size": 4, "medium": "GPU", "lora_name": None, "extra_keys": None, "group_idx": 0}


def _batch(ts: object = 1.0, rank: object = 0, **fields: object) -> bytes:
    return msgpack.packb([ts, [{**_GOOD, **fields}], rank])


@pytest.mark.parametrize("payload,taken", [
    (_batch(), True),
    (_batch(rank=65535), True), (_batch(rank=65536), False), (_batch(rank=-1), False),
    (_batch(ts=1 << 53), False), (_batch(ts=(1 << 53) + 1), False), (_batch(ts=True), False),
    (_batch(block_hashes=[]), False), (_batch(block_size=0), False), (_batch(block_size=1 << 16), True),
    # a tier placeholder (vLLM's offloading connector): block size 0, no tokens, not on GPU
    (_batch(block_size=0, token_ids=[], medium="CPU", parent_block_hash=None), True),
    (_batch(block_size=0, token_ids=[], medium="cpu"), True), (_batch(block_size=0, medium="CPU"), False),
    (_batch(block_size=0, token_ids=[], medium="GPU"), False), (_batch(block_size=0, token_ids=[], medium=None), False),
    (_batch(block_size=0, token_ids=[], medium="gpu"), False),
    (_batch(block_size=(1 << 16) + 1), False), (_batch(block_size=1 << 62), False),
    # vLLM's cache_salt: the last string of the first extra keys that is not the LoRA name
    (_batch(lora_name="sql", extra_keys=[["s1", "sql"]]), True), (_batch(extra_keys=[["s1", 7, None, "s2"]]), True),
    (_batch(lora_name="sql", extra_keys=[["sql"]]), True), (_batch(extra_keys=[[], ["x"]]), True),
    (_batch(extra_keys=[{"cache_salt": "t"}]), False),
], ids=lambda v: v.hex()[:24] if isinstance(v, bytes) else str(v))
def test_boundaries_are_taken_or_declined_and_equal(payload: bytes, taken: bool) -> None:
    assert check(payload) is taken


def _map(*pairs: tuple[bytes, object]) -> bytes:
    """A one-event batch whose event map is written key by key (duplicate keys, any order, raw keys)."""
    body = b"".join(k + msgpack.packb(v) for k, v in pairs)
    return b"\x93" + msgpack.packb(1.0) + b"\x91\xde" + len(pairs).to_bytes(2, "big") + body + msgpack.packb(0)


_KEY = {name: msgpack.packb(name) for name in _GOOD}


@pytest.mark.parametrize("order,taken", [
    (["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"], True),  # vLLM's: one pass
    (["block_hashes", "type", "parent_block_hash", "token_ids", "block_size", "medium"], True),  # type later: two
    (["block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "type"], True),
])
def test_the_event_maps_key_order_does_not_change_the_answer(order: list[str], taken: bool) -> None:
    payload = _map(*((_KEY[k], _GOOD[k]) for k in order))
    assert check(payload) is taken
    assert _fast.decode(payload, _KINDS) == VllmDecoder(fast=None).decode(_batch())


@pytest.mark.parametrize("extra", [
    (_KEY["type"], "BlockStored"), (_KEY["type"], "BlockRemoved"),  # "type" twice, after it came first
    (msgpack.packb(7), 1), (msgpack.packb(b"bin"), 1), (b"\xa2\xff\xfe", 1),  # not a key, or invalid UTF-8
    (msgpack.packb("unknown"), {"x": [1, -1, 2.5, None]}), (msgpack.packb("unknown"), [[[]]]),
])
def test_a_type_first_map_is_still_checked_key_by_key(extra: tuple[bytes, object]) -> None:
    """The one-pass read of a map that starts with "type" refuses what pass 1 refuses, at any place."""
    for at in (1, 3, 6):
        pairs = [(_KEY[k], _GOOD[k]) for k in ("type", "block_hashes", "parent_block_hash", "token_ids",
                                                 "block_size", "medium")]
        pairs.insert(at, extra)
        check(_map(*pairs))
    removal = _map((_KEY["type"], "BlockRemoved"), (_KEY["block_hashes"], [5]), extra)
    check(removal)


@pytest.mark.parametrize("width", ["fixint", "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64"])
def test_ints_of_every_width_read_alike(width: str) -> None:
    """Token ids and hashes in every msgpack int header (the common ones are read in place)."""
    head, size = {"fixint": (None, 0), "u8": (0xCC, 1), "u16": (0xCD, 2), "u32": (0xCE, 4), "u64": (0xCF, 8),
                  "i8": (0xD0, 1), "i16": (0xD1, 2), "i32": (0xD2, 4), "i64": (0xD3, 8)}[width]
    value = 5 if head is None else (1 << (8 * size - 2)) + 3 if head < 0xD0 else (1 << (8 * size - 3)) + 3
    packed = bytes([value]) if head is None else bytes([head]) + value.to_bytes(size, "big")
    default = msgpack.packb(7)
    for field in ("token_ids", "block_hashes"):
        payload = _batch(**{field: [7] * 4})
        at = payload.index(msgpack.packb([7] * 4))
        body = payload[:at] + bytes([0x94]) + packed * 4 + payload[at + 1 + 4 * len(default):]
        taken = check(body)
        if field == "block_hashes" or value <= 0xFFFFFFFF:
            assert taken, (width, field)


def test_invalid_utf8_in_extra_keys_is_declined() -> None:
    good = _batch(extra_keys=[["s\u00e9"]])
    assert check(good)
    bad = good.replace("s\u00e9".encode(), b"s\xff")  # same length: the msgpack str header holds
    assert bad != good and not check(bad)


def test_block_sizes_past_the_bound_are_skipped_as_bad_block_size() -> None:
    batch = VllmDecoder().decode(_batch(block_size=1 << 62))
    assert batch.events == () and batch.skipped == ("bad_block_size",)


@pytest.mark.parametrize("path", ["python", "c"])
def test_a_tier_placeholder_is_taken_and_block_size_0_elsewhere_is_bad(path: str) -> None:
    """vLLM's CPU-tier stores are placeholders (offload_cpu capture): taken, with block size 0 and
    no tokens; block size 0 on the device tier, or with token ids, stays bad_block_size."""
    if path == "c":
        need_native(_fast, "adapters._vllm")
    dec = VllmDecoder(fast=None) if path == "python" else VllmDecoder()
    placeholder = {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": [],
                   "block_size": 0, "medium": "CPU", "group_idx": 0}
    batch = dec.decode(msgpack.packb([1.0, [placeholder], 0]))
    assert batch.skipped == () and len(batch.events) == 1
    ev = batch.events[0]
    assert (ev.block_hashes, ev.block_size, list(ev.token_ids), ev.medium, ev.parent_hash) == (q(9), 0, [], "CPU", None)
    for bad in ({"medium": "GPU"}, {"medium": None}, {"token_ids": [1, 2]}):
        batch = dec.decode(msgpack.packb([1.0, [{**placeholder, **bad}], 0]))
        assert batch.events == () and batch.skipped == ("bad_block_size",), bad


def test_every_offload_cpu_payload_is_taken_and_equal() -> None:
    """The CPU-offload capture (placeholders on the CPU tier), through one decoder as a lane runs it:
    C takes every batch (the prefix group known from the first store on), as Python decodes it."""
    path = CONFIGS / "offload_cpu" / "events.jsonl"
    payloads = [base64.b64decode(json.loads(line)["frames"][-1]) for line in path.read_text().splitlines()]
    assert len(payloads) == 331
    groups: list[int | None] = [None]
    assert all([check(p, groups) for p in payloads])
    assert groups == [0]
    python = VllmDecoder(fast=None)  # the Python path alone, one decoder for the stream
    assert all(python.decode(p).skipped == () for p in payloads)


def test_a_refused_store_teaches_no_prefix_group_on_either_path() -> None:
    """The reviewer's repro: a stream's first batch is one store of group 3 with block size 0 on the
    GPU (bad_block_size). Neither path learns group 3 from it (C declines the batch, Python skips
    the store), so the group-0 store and removal that follow are taken by C and applied."""
    groups: list[int | None] = [None]
    refused = _batch(group_idx=3, block_size=0, token_ids=[], kv_cache_spec_kind="full_attention")
    assert not check(refused, groups) and groups == [None]
    assert VllmDecoder().decode(refused).skipped == ("bad_block_size",)
    assert check(_batch(), groups) and groups == [0]
    removal = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [5], "group_idx": 0}], 0])
    assert check(removal, groups) and groups == [0]
    fresh = VllmDecoder()
    for payload in (refused, _batch(), removal):
        fresh.decode(payload)
    assert fresh.groups == [0] and fresh.decode(removal).skipped == ()
