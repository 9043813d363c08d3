"""vLLM 0.34's BlockStored: ``lookahead_token_ids`` (EAGLE/MTP lookahead-aware hashing) and the
labels ``locality``, ``ownership``, ``session_id`` (docs/vllm-versions.md has the version matrix).

No capture of a 0.34 engine exists here: the frames come from msgspec structs declared below as
vLLM declares its events (``vllm/distributed/kv_events.py``: ``omit_defaults``, tagged by class
name, fields in declaration order; the batch ``array_like``), encoded by ``msgspec.msgpack`` as
vLLM encodes them: maps since #42892, and the same structs ``array_like`` for the positional
dialect. The engine hashes are arbitrary u64s (an EAGLE hash covers the lookahead tokens too, so
one block's tokens published twice with other continuations have two hashes). The matched length
is checked against ``served_blocks``' rule applied by hand to the engine's view (which block
hashes it would compute for the prompt and hold), never against kvindex's own keys.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.vllm import VllmDecoder
from kvindex.config import Config
from kvindex.events import BlockRemoved, BlockStored
from kvindex.index.lookahead import LookaheadBook, lookahead_variant, served_blocks
from tests.conftest import engine_config, ipc_endpoint, wait_for
from tests.test_native_decoder import _fast, check


def twin_agrees(raw: bytes) -> bool:
    """The C twin equals the Python decoder on ``raw`` or declines it (True: it took it); without
    the twin (pure Python), True: the Python assertions around it run either way."""
    return check(raw) if _fast is not None else True

BS = 16
MODEL = "eagle"
POD, OLD_POD = "10.0.0.34:8000", "10.0.0.33:8000"
PROMPT = list(range(2000, 2000 + 3 * BS + 5))  # three full blocks and five tokens


class Stored(msgspec.Struct, omit_defaults=True, tag="BlockStored"):
    """vLLM 0.34's BlockStored, as declared (fields without defaults first, then defaulted ones)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int] | None] | None = None


class Removed(msgspec.Struct, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class StoredArray(Stored, array_like=True, tag="BlockStored"):
    pass


class RemovedArray(Removed, array_like=True, tag="BlockRemoved"):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


ENCODE = msgspec.msgpack.Encoder()


def store(hashes: list[int], parent: int | None, tokens: list[int], lookahead: list[list[int] | None] | None,
          *, array: bool = False, **labels: Any) -> Stored:
    kind = StoredArray if array else Stored
    return kind(hashes, parent, tokens, BS, None, "GPU", None, extra_keys=[None] * len(hashes), group_idx=0,
                kv_cache_spec_kind="full_attention", lookahead_token_ids=lookahead, **labels)


def payload(*events: Any, rank: int = 0) -> bytes:
    return ENCODE.encode(Batch(1760000000.25, list(events), rank))


def blocks_of(tokens: list[int], first: int, n: int) -> list[int]:
    return tokens[first * BS:(first + n) * BS]


def lookaheads(tokens: list[int], first: int, n: int) -> list[list[int] | None]:
    """EAGLE's one lookahead token per block: the token after it."""
    return [[tokens[(first + i + 1) * BS]] for i in range(n)]


# -- the wire --------------------------------------------------------------------------------------

@pytest.mark.parametrize("array", [False, True], ids=["maps", "arrays"])
def test_the_034_shape_decodes_alike_in_python_and_c(array: bool) -> None:
    """Maps (defaults omitted) and arrays (every field, by position): C takes the batch and equals
    Python; a store without the field has none; labels are carried; removals' labels accepted
    (removals are hash-keyed: a run of them is merged as before)."""
    removed = RemovedArray if array else Removed
    raw = payload(store([11, 12], None, PROMPT[:32], [[PROMPT[16]], None], array=array, locality="LOCAL",
                        ownership="tier-a", session_id="conv-7"),
                  store([13], 12, PROMPT[32:48], None, array=array),
                  removed([11], "GPU", 0, "LOCAL", "tier-a"), removed([12], "GPU", 0, "REMOTE"))
    if array:
        assert msgpack.unpackb(raw)[1][0][12:16] == ["LOCAL", "tier-a", "conv-7", [[PROMPT[16]], None]]
    assert twin_agrees(raw), raw.hex()
    first, second, gone = VllmDecoder(fast=None).decode(raw).events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored) and isinstance(gone, BlockRemoved)
    assert [None if t is None else list(t) for t in first.lookahead_token_ids or ()] == [[PROMPT[16]], None]
    assert (first.locality, first.ownership, first.session_id) == ("LOCAL", "tier-a", "conv-7")
    assert list(first.token_ids) == PROMPT[:32]  # the block's own tokens: what its key is made of
    assert second.lookahead_token_ids is None and second.session_id is None
    assert list(gone.block_hashes) == [11, 12]


@pytest.mark.parametrize("bad,reason", [
    ({"lookahead_token_ids": [[1]]}, "bad_lookahead_token_ids"),  # one entry for two hashes
    ({"lookahead_token_ids": [list(range(BS + 1)), None]}, "bad_lookahead_token_ids"),  # past the next block
    ({"lookahead_token_ids": [[-1], None]}, "bad_lookahead_token_ids"),
    ({"lookahead_token_ids": "x"}, "bad_lookahead_token_ids"),
    ({"session_id": 7}, "bad_label"),
    ({"locality": ["LOCAL"]}, "bad_label"),
])
def test_unusable_values_are_named_on_both_paths(bad: dict[str, Any], reason: str) -> None:
    ev = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": PROMPT[:32],
          "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, **bad}
    raw = msgpack.packb([1.0, [ev], 0])
    twin_agrees(raw)
    got = VllmDecoder(fast=None).decode(raw)
    assert got.skipped == (reason,)
    assert len(got.events) == (reason == "bad_label")  # a label is dropped alone, a lookahead takes the event


_entry = st.one_of(st.none(), st.lists(st.integers(0, 1 << 33), max_size=BS + 2))
_label = st.one_of(st.none(), st.text(max_size=4), st.integers(-2, 2), st.binary(max_size=2))


@settings(max_examples=400, deadline=None)
@given(st.lists(_entry, min_size=0, max_size=3) | st.none() | st.integers(-2, 2), _label, _label, _label, st.booleans(),
       st.integers(1, 3))
def test_generated_034_fields_are_equal_or_declined(lookahead: Any, locality: Any, ownership: Any, session: Any,
                                                    array: bool, n: int) -> None:
    fields = {"block_hashes": list(range(1, n + 1)), "parent_block_hash": None, "token_ids": PROMPT[:n * BS],
              "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None,
              "group_idx": 0, "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None,
              "locality": locality, "ownership": ownership, "session_id": session, "lookahead_token_ids": lookahead}
    ev: Any = ["BlockStored", *fields.values()] if array else {"type": "BlockStored", **fields}
    check(msgpack.packb([1.0, [ev], 0]))


# -- the rule --------------------------------------------------------------------------------------

def test_served_blocks_is_the_rfc_table() -> None:
    """vLLM RFC #50438: the token after the last matched block unknown: that block is not served;
    known and equal to what the held block's hash covers: served; known and different: the
    longest earlier hit."""
    held = [lookahead_variant([PROMPT[48]])]
    assert served_blocks(3, BS, PROMPT[:48], held) == 2  # unknown
    assert served_blocks(3, BS, PROMPT[:49], held) == 3  # equal
    assert served_blocks(3, BS, PROMPT[:48] + [7], held) == 2  # different
    assert served_blocks(3, BS, PROMPT, []) == 2  # a lookahead kvindex does not know: the engine's own drop
    assert served_blocks(0, BS, PROMPT, held) == 0
    assert served_blocks(3, BS, PROMPT, [lookahead_variant([]), *held]) == 3  # a hash covering no more tokens


# -- a real daemon over ZeroMQ ---------------------------------------------------------------------

async def served(h: Any, tokens: list[int], pod: str = POD) -> int:
    status, s = await h.post("/v1/score", {"model": MODEL, "token_ids": tokens, "pods": [pod]})
    assert status == 200, s
    return s["pods"][pod]["precise"]["tokens"]


async def daemon(make_harness: Any, make_engine: Any, tmp_path: Path) -> tuple[Any, Any, Any]:
    new = await make_engine(ipc_endpoint(tmp_path, "new"))
    old = await make_engine(ipc_endpoint(tmp_path, "old"))
    h = await make_harness(Config(engines=(engine_config(new, pod=POD, model=MODEL),
                                           engine_config(old, pod=OLD_POD, model=MODEL))))
    await h.wait_connected()
    return new, old, h


class Engine:
    """One fake engine's stream: frames published in order, each waited for."""

    def __init__(self, engine: Any, h: Any, pod: str) -> None:
        self.engine, self.h, self.pod, self.seq = engine, h, pod, 0

    async def send(self, *events: Any) -> None:
        await self.engine.publish([f"kv@{self.pod}@{MODEL}".encode(), self.seq.to_bytes(8, "big"), payload(*events)])
        await self.h.wait_seq(self.pod, self.seq)
        self.seq += 1


@pytest.mark.parametrize("array", [False, True], ids=["maps", "arrays"])
async def test_the_matched_length_is_what_a_lookahead_engine_serves(make_harness: Any, make_engine: Any,
                                                                    tmp_path: Path, array: bool) -> None:
    """PROMPT's three full blocks stored by a 0.34 engine with EAGLE lookahead (pod POD) and by a
    0.33 one (OLD_POD: no field). For a prompt sharing the three blocks, the 0.34 engine serves
    the third only when the prompt goes on with the token its hash covers; the 0.33 stream is
    judged as before (no lookahead: the index's depth)."""
    new, old, h = await daemon(make_harness, make_engine, tmp_path)
    e34, e33 = Engine(new, h, POD), Engine(old, h, OLD_POD)
    await e34.send(store([101, 102, 103], None, blocks_of(PROMPT, 0, 3), lookaheads(PROMPT, 0, 3), array=array,
                         session_id="conv-1", locality="LOCAL"))
    await e33.send(store([201, 202, 203], None, blocks_of(PROMPT, 0, 3), None, array=array))
    diverged = PROMPT[:48] + [9, 9, 9]
    assert await served(h, PROMPT) == 48  # the token after block 3 is PROMPT[48]: all three
    assert await served(h, diverged) == 32  # another token there: block 3's EAGLE hash differs
    assert await served(h, PROMPT[:49]) == 48  # exactly the lookahead token more
    assert await served(h, PROMPT[:48]) == 32  # block 3 holds the last token: two keys; block 2's lookahead is there
    assert await served(h, diverged, OLD_POD) == 48  # no lookahead: as before
    status, metrics = await h.get("/metrics")
    assert b"kvindex_decode_errors_total{" not in metrics  # the labels and lookahead accepted, nothing malformed
    assert f'kvindex_blocks_stored_total{{pod="{POD}"}} 3.0'.encode() in metrics


async def test_the_last_block_published_late_and_variants_removed(make_harness: Any, make_engine: Any,
                                                                 tmp_path: Path) -> None:
    """A prompt of exactly four blocks: the engine publishes its fourth block only once the first
    generated token exists (the block's hash covers it), with the third as parent, in a later
    batch. Then another request stores the same fourth block's tokens with another continuation
    (another EAGLE hash, the same kvindex key): both continuations are served, a third is not;
    removing one hash leaves the other's."""
    prompt = list(range(5000, 5000 + 4 * BS))
    new, _, h = await daemon(make_harness, make_engine, tmp_path)
    e = Engine(new, h, POD)
    await e.send(store([1, 2, 3], None, blocks_of(prompt, 0, 3), lookaheads(prompt, 0, 3)))
    ask_a, ask_b, ask_c = prompt + [77, 1], prompt + [88, 1], prompt + [99, 1]
    assert await served(h, ask_a) == 48  # block 4 not published yet: three served (PROMPT[48] follows block 3)
    await e.send(store([4], 3, blocks_of(prompt, 3, 1), [[77]]))  # the generated token 77 now exists
    assert (await served(h, ask_a), await served(h, ask_c)) == (64, 48)
    await e.send(store([40], 3, blocks_of(prompt, 3, 1), [[88]], session_id="conv-2"))
    assert (await served(h, ask_a), await served(h, ask_b), await served(h, ask_c)) == (64, 64, 48)
    await e.send(Removed([4], "GPU", 0, "LOCAL"))
    assert (await served(h, ask_a), await served(h, ask_b)) == (48, 64)
    await e.send(Removed([40], "GPU", 0))
    assert await served(h, ask_b) == 48


def test_the_book_forgets_a_restarted_engine_and_ignores_lower_tiers() -> None:
    """A restarted engine may hash without lookahead: its matches are the index's again. A CPU
    store teaches nothing; a worker never in lookahead mode is never judged."""
    book = LookaheadBook()
    ev = BlockStored(block_hashes=(1, 2, 3), parent_hash=None, token_ids=array("I", PROMPT[:48]), block_size=BS,
                     lookahead_token_ids=(None, None, None))
    book.apply(POD, MODEL, 0, [ev])
    assert book.in_mode(POD, 0) and not book.in_mode(POD, 1)
    book.apply(POD, MODEL, 1, [BlockStored(block_hashes=(1,), parent_hash=None, token_ids=array("I", PROMPT[:16]),
                                           block_size=BS, medium="CPU", lookahead_token_ids=(None,))])
    assert not book.in_mode(POD, 1)
    book.forget(POD)
    assert not book.in_mode(POD, 0)


async def test_an_engine_restarted_without_lookahead_is_matched_as_before(make_harness: Any, make_engine: Any,
                                                                          tmp_path: Path) -> None:
    """The engine's first life hashes with lookahead; it restarts (seq back to 0, a new process)
    without it: its new blocks are served as the index holds them, a diverging prompt included."""
    new, _, h = await daemon(make_harness, make_engine, tmp_path)
    e = Engine(new, h, POD)
    await e.send(store([1, 2, 3], None, blocks_of(PROMPT, 0, 3), lookaheads(PROMPT, 0, 3)))
    await e.send(store([9], None, [100 + t for t in range(BS)], [[5]]))
    diverged = PROMPT[:48] + [9, 9, 9]
    assert await served(h, diverged) == 32
    new.clear_buffer()  # the engine restarts
    e.seq = 0
    await e.engine.publish([f"kv@{POD}@{MODEL}".encode(), (0).to_bytes(8, "big"),
                            payload(store([21, 22, 23], None, blocks_of(PROMPT, 0, 3), None))])
    await wait_for(lambda: h.stream(POD).restarts == 1 and h.stream(POD).last_seq == 0, 10, "second life")
    assert not h.daemon.query.lookahead.in_mode(POD, 0)
    assert await served(h, diverged) == 48
