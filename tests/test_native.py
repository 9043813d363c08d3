"""The native accelerators against their Python twins, on the same inputs.

CI builds them (a C compiler is all they need) and sets KVINDEX_REQUIRE_NATIVE=1, so a failed build fails there;
on a machine without a compiler they are skipped with the hint (``tests.conftest.need_native``).
"""

from __future__ import annotations

import json
import random
from array import array
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex import keys as K
from kvindex import native
from kvindex.approx.gojson import RenderError, go_json_loads
from kvindex.approx.hashing import kthena_chain
from kvindex.http.bodies import decode_json, json_body, u64s
from kvindex.http.dynamo import dynamo_body, query_answer
from kvindex.query.answers import PreciseAnswer
from kvindex.types import PodMatch
from kvindex.http.errors import ApiError
from tests.conftest import need_native

_keys = native.load("kvindex._keys")


def require(mod: object, name: str) -> None:
    need_native(mod, f"kvindex.{name}")


@pytest.mark.parametrize("block_size", [1, 4, 16, 64, 128, 1000])
def test_native_keys_equal_python(block_size: int) -> None:
    require(_keys, "_keys")
    rnd = random.Random(block_size)
    for n in (0, block_size - 1, block_size, 3 * block_size + 1, 8192):
        tokens = array("I", [rnd.randrange(1 << 32) for _ in range(n)])
        root = K.root_key("m", "lora", f"salt-{n}")
        assert _keys.prompt_keys(root, tokens, block_size) == K.py_prompt_keys(root, tokens, block_size)
        for limit in (0, 1, 7):
            assert _keys.prompt_keys(root, tokens, block_size, limit) == K.py_prompt_keys(root, tokens, block_size, limit)
        locals_ = K.py_local_hashes(tokens, block_size)
        assert _keys.local_hashes(tokens, block_size) == locals_
        assert _keys.chain_keys(root, locals_) == K.py_chain_keys(root, locals_)


@given(st.binary(max_size=700), st.sampled_from([1, 3, 7, 8, 31, 32, 33, 64, 100, 4096]), st.integers(0, (1 << 64) - 1),
       st.data())
@settings(max_examples=400, deadline=None)
def test_native_kthena_chain_equals_python(data: bytes, size: int, first: int, draw: st.DataObject) -> None:
    """The approximate index's Kthena chain in C (its own XXH64) against the Python reference
    (the xxhash package), on every block count from none to all, short last blocks included."""
    require(_keys, "_keys")
    count = draw.draw(st.integers(0, -(-len(data) // size)))
    assert _keys.kthena_chain(data, first, size, count) == kthena_chain(data, first, size, count)


def test_native_kthena_chain_refuses_what_it_cannot_hash() -> None:
    require(_keys, "_keys")
    for args in ((b"abc", 1, 0, 1), (b"abc", 1, 64, 2), (b"abc", -1, 64, 1), (b"abc", 1, 64, -1)):
        with pytest.raises((ValueError, OverflowError)):
            _keys.kthena_chain(*args)


def test_native_keys_match_dynamo_vector_and_public_api() -> None:
    require(_keys, "_keys")
    assert _keys.local_hashes(array("I", range(1000, 1032)), 16) == array("Q", [17863182269597592868, 14340445833846710668])
    assert K.prompt_keys is not K.py_prompt_keys  # the public names run on the C twin
    assert K.prompt_keys(7, list(range(40)), 4, limit=3) == K.py_prompt_keys(7, list(range(40)), 4, limit=3)


def test_native_keys_refuse_bad_input_like_python() -> None:
    require(_keys, "_keys")
    with pytest.raises(ValueError):
        _keys.prompt_keys(1, array("I", [1, 2]), 0)
    with pytest.raises(OverflowError):
        _keys.prompt_keys(1 << 64, array("I", [1, 2]), 1)
    with pytest.raises(OverflowError):
        _keys.chain_keys(1, [-1])
    with pytest.raises(TypeError):
        _keys.prompt_keys(1, array("Q", [1, 2]), 1)  # 8-byte items are not token ids
    assert _keys.prompt_keys(1, b"", 16) == array("Q")


def test_status_names_what_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in native.ACCELERATORS:
        need_native(native.load(name), name)
    assert native.status() == "native: " + ", ".join(native.ACCELERATORS)
    monkeypatch.setenv("KVINDEX_PURE_PYTHON", "1")
    assert native.load("kvindex._keys") is None and native.status().startswith("pure Python")
    monkeypatch.delenv("KVINDEX_PURE_PYTHON")
    monkeypatch.setenv("KVINDEX_REQUIRE_NATIVE", "1")
    with pytest.raises(ImportError, match="install a C compiler"):
        native.load("kvindex._no_such_accelerator")


# -- kvindex._jsontokens: the /query body's token ids, against msgspec.json.decode -------------

_json = native.load("kvindex._jsontokens")
_u32 = st.integers(min_value=0, max_value=(1 << 32) - 1)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False),
                    st.text(max_size=8), st.just('"token_ids": [1, 2]'), st.just("\\\"]}"))
def _nest(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    # a named function, not a two-line lambda: hypothesis reads the source to check that the
    # argument is used, and a lambda split over lines is sometimes misread (a spurious error)
    return st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["token_ids", "a", "t\u00e9"]), inner,
                                                         max_size=3)


_value = st.recursive(_scalar, _nest, max_leaves=12)
_token_ids = st.one_of(st.lists(_u32, max_size=40), st.lists(st.one_of(_u32, _scalar), max_size=6), _value)
_member = st.tuples(st.sampled_from(["token_ids", "model_name", "x", "token_id", "token_idss", "token\\u005fids"]),
                    st.one_of(_token_ids, _value)) | st.tuples(st.just("token_ids"), st.lists(_u32, max_size=40))


_SIGNED_ZERO = "refused: -0 among the token ids"


def _reference(raw: bytes, loads=msgspec.json.decode) -> object:
    try:
        return loads(raw)
    except (msgspec.DecodeError, RenderError) as exc:
        return type(exc).__name__


def _fast(raw: bytes, loads=msgspec.json.decode) -> object:
    try:
        body = decode_json(raw, "token_ids", loads, split=_json)
    except (msgspec.DecodeError, RenderError) as exc:
        return type(exc).__name__
    except ApiError as exc:  # kvindex refuses a signed token id the reference reads as 0
        assert b"-0" in raw and "-0 has a sign" in (exc.text or ""), exc.text
        return _SIGNED_ZERO
    if isinstance(body, dict) and isinstance(body.get("token_ids"), array):
        body["token_ids"] = list(body["token_ids"])
    return body


def agree(raw: bytes) -> None:
    """Both decoders a body may go through (plain, and Go's rules for rendered bodies)."""
    for loads in (msgspec.json.decode, go_json_loads):
        fast = _fast(raw, loads)
        assert fast == _reference(raw, loads) or fast is _SIGNED_ZERO


def _render(members: list[tuple[str, object]], sep: tuple[str, str], indent: int | None) -> bytes:
    """A JSON object, keys raw (so duplicates and escaped names survive), values by json.dumps."""
    pad = "\n" + " " * indent if indent is not None else ""
    inner = sep[0].join(f'{pad}"{k}"{sep[1]}{json.dumps(v, separators=sep)}' for k, v in members)
    return ("{" + inner + pad + "}").encode()


def with_variants(check: Callable[[bytes], None], raw: bytes, data: st.DataObject) -> None:
    """``check`` on ``raw``, on it truncated and on it with one byte changed: the same verdict."""
    check(raw)
    check(raw[:data.draw(st.integers(0, len(raw)))])
    if raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        check(raw[:i] + bytes([data.draw(st.sampled_from(b'0-.e,[]{}":\\ x\xff'))]) + raw[i + 1:])


@settings(max_examples=400, deadline=None)
@given(st.lists(_member, max_size=5), st.sampled_from([(",", ":"), (", ", ": "), (" ,\t", " :\r\n")]),
       st.one_of(st.none(), st.integers(0, 3)), st.data())
def test_body_scanner_agrees_with_the_reference_decoder(members, sep, indent, data) -> None:
    require(_json, "_jsontokens")
    with_variants(agree, _render(members, sep, indent), data)


def test_body_scanner_lifts_only_plain_u32_arrays() -> None:
    require(_json, "_jsontokens")
    tokens = list(range(0, 1 << 32, 1 << 20)) + [(1 << 32) - 1]
    values, rest = _json.split(json.dumps({"model_name": "m", "token_ids": tokens}).encode(), "token_ids")
    assert list(array("I", values)) == tokens and msgspec.json.decode(rest) == {"model_name": "m", "token_ids": []}
    for declined in (b'{"token_ids":[1,-2]}', b'{"token_ids":[01]}', b'{"token_ids":[1e3]}', b'{"token_ids":[1.5]}',
                     b'{"token_ids":[4294967296]}', b'{"token_ids":[true]}', b'{"token_ids":[1],"token_ids":[2]}',
                     b'{"token\\u005fids":[1]}', b'{"a":{"token_ids":[1]}}', b'[{"token_ids":[1]}]', b'{"token_ids":[1,]}',
                     # the bytes next to the digits, where 8 are read at once (a long body) and near its end
                     b'{"token_ids":[12:34],"model_name":"m"}', b'{"token_ids":[12/34],"model_name":"m"}',
                     b'{"token_ids":[12\xb134],"model_name":"m"}', b'{"token_ids":[1 2],"model_name":"m"}',
                     b'{"token_ids":[12345678901],"model_name":"m"}', b'{"token_ids":[0123456789],"model_name":"m"}',
                     b'{"token_ids":[7,12:]}', b'{"token_ids":[7,1/]}'):
        assert _json.split(declined, "token_ids") is None, declined
    for lifted in ([123456789, 12345678, 1234567, 0, 9], [4294967295, 99999999, 100000000]):
        body = json.dumps({"token_ids": lifted, "model_name": "m"}).encode()
        assert list(array("I", _json.split(body, "token_ids")[0])) == lifted
    assert decode_json(b'{"token_ids":[1],"token_ids":[2]}', "token_ids", split=_json) == {"token_ids": [2]}
    lifted = decode_json(b'{"token_ids":[7, 8],"prompt":"caf\xc3\xa9 \\ud800"}', "token_ids", go_json_loads, split=_json)
    assert lifted == {"token_ids": array("I", [7, 8]), "prompt": "caf\u00e9 \ufffd"}


# the 64-bit kind: /query_by_hash's block_hashes, against msgspec.json.decode + u64s (the reference)
_hash = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.sampled_from([0, -1, -(1 << 63), (1 << 63) - 1, 1 << 63,
                                                                          (1 << 64) - 1]),
                  st.integers(-(1 << 70), 1 << 70))
_hash_member = st.tuples(st.sampled_from(["block_hashes", "model_name", "block_hash"]),
                         st.one_of(st.lists(_hash, max_size=40), st.lists(st.one_of(_hash, _scalar), max_size=6), _value))


def _hashes_of(body: object) -> object:
    """What /query_by_hash makes of a decoded body: its block_hashes as u64s (a list), or None."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    if "block_hashes" in out:
        hashes = u64s(out["block_hashes"])
        out["block_hashes"] = None if hashes is None else list(hashes)
    return out


def agree_hashes(raw: bytes) -> None:
    try:
        fast = _hashes_of(decode_json(raw, None, split=_json, u64_field="block_hashes"))
    except msgspec.DecodeError as exc:
        fast = type(exc).__name__
    assert fast == _hashes_of(_reference(raw))


@settings(max_examples=400, deadline=None)
@given(st.lists(_hash_member, max_size=4), st.sampled_from([(",", ":"), (", ", ": "), (" ,\t", " :\r\n")]), st.data())
def test_hash_scanner_agrees_with_the_reference_decoder(members, sep, data) -> None:
    require(_json, "_jsontokens")
    with_variants(agree_hashes, _render(members, sep, None), data)


def test_hash_scanner_lifts_only_plain_64_bit_arrays() -> None:
    require(_json, "_jsontokens")
    hashes = [0, 1, -1, -(1 << 63), (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 12345678901234567890]
    values, rest = _json.split_u64(json.dumps({"block_hashes": hashes, "model_name": "m"}).encode(), "block_hashes")
    assert list(array("Q", values)) == [h & ((1 << 64) - 1) for h in hashes]
    assert msgspec.json.decode(rest) == {"block_hashes": [], "model_name": "m"}
    for declined in (b'{"block_hashes":[-0]}', b'{"block_hashes":[18446744073709551616]}', b'{"block_hashes":[01]}',
                     b'{"block_hashes":[-9223372036854775809]}', b'{"block_hashes":[1.0]}', b'{"block_hashes":[1e3]}',
                     b'{"block_hashes":[- 1]}', b'{"block_hashes":[--1]}', b'{"block_hashes":[true]}',
                     b'{"block_hashes":["1"]}', b'{"block_hashes":[1,]}'):
        assert _json.split_u64(declined, "block_hashes") is None, declined
    assert _json.split(b'{"token_ids":[-1]}', "token_ids") is None  # the u32 kind has no sign
    # a long body: digits read 8 at a time; every length a hash can have, and the bytes next to them
    tail = ',"model_name":"' + "m" * 24 + '"}'
    for digits in (1, 7, 8, 9, 15, 16, 17, 18, 19, 20, 21):
        for lifted in ([int("9" * digits)], [int("1" + "0" * (digits - 1))], [-int("9" * min(digits, 18))]):
            body = ('{"block_hashes":%s%s' % (json.dumps(lifted * 3), tail)).encode()
            got = _json.split_u64(body, "block_hashes")
            fits = all(-(1 << 63) <= h < 1 << 64 for h in lifted)
            assert (list(array("Q", got[0])) if got else None) == ([h & ((1 << 64) - 1) for h in lifted * 3] if fits else None)
        for bad in (":", "/", "\xb1", " 2", ".5", "e3"):
            body = ('{"block_hashes":[7,%s%s5]%s' % ("1" * digits, bad, tail)).encode()
            assert _json.split_u64(body, "block_hashes") is None, body
        body = ('{"block_hashes":[7,0%s]%s' % ("1" * digits, tail)).encode()
        assert _json.split_u64(body, "block_hashes") is None, body


@pytest.mark.parametrize("block_size", [1 << 30, (1 << 62), (1 << 62) + 1, 1 << 63, (1 << 64) - 1, 1 << 70])
def test_native_keys_take_any_block_size_like_python(block_size: int) -> None:
    """A block size comes off the wire: 4 * 2**62 once wrapped to 0 in C (SIGFPE, the daemon
    gone) and 4 * (2**62 + 1) to 4 (keys Python never makes)."""
    require(_keys, "_keys")
    tokens = array("I", range(64))
    assert _keys.prompt_keys(7, tokens, block_size) == K.py_prompt_keys(7, tokens, block_size) == array("Q")
    assert _keys.local_hashes(tokens, block_size) == K.py_local_hashes(tokens, block_size) == array("Q")


def test_index_keeps_a_huge_block_size_keyless() -> None:
    from kvindex.events import BlockStored
    from kvindex.index.precise import PreciseIndex

    idx = PreciseIndex()
    done = idx.apply("a", "m", 0, BlockStored((1, 2), None, array("I", range(64)), 1 << 62))
    assert done.orphans == 2 and idx.match(K.prompt_keys(K.root_key("m"), list(range(64)), 1 << 62)) == {}


# -- kvindex._jsontokens.dynamo_answer: Dynamo's /query answer written in C, against json_body(query_answer(...))
_plain_pod = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e, blacklist_characters='"\\'), max_size=12)
_pod = st.one_of(_plain_pod, st.text(max_size=6), st.sampled_from(['a"b', "a\\b", "caf\u00e9", "\n", "\x7f", ""]))
_depth = st.one_of(st.integers(0, 600), st.sampled_from([0, 1, (1 << 63) - 1, 1 << 63, 1 << 24, (1 << 24) + 1]),
                   st.integers(-3, -1))
_match = st.builds(lambda g, c, d, dp: PodMatch(g, c, d, dp), _depth, _depth, _depth,
                   st.dictionaries(st.one_of(st.integers(0, 300), st.integers(-2, -1), st.just(1 << 64)), _depth, max_size=4))
_plain_match = st.builds(lambda g, c, d, dp: PodMatch(g, c, d, dp), st.integers(0, 600), st.integers(0, 600),
                         st.integers(0, 600), st.dictionaries(st.integers(0, 300), st.integers(0, 600), max_size=4))
_size = st.one_of(st.integers(1, 64), st.sampled_from([0, -1, 1 << 40, 1 << 63, 1 << 64]))


def _reference_answer(matches: dict[str, PodMatch], block_size: int) -> bytes | str:
    try:
        return json_body(query_answer(PreciseAnswer(block_size, 0, (), matches)))
    except (OverflowError, MemoryError) as exc:  # a depth no index holds (frequencies as long as it)
        return type(exc).__name__


@settings(max_examples=600, deadline=None)
@given(st.dictionaries(_pod, _match, max_size=6), _size)
def test_dynamo_answer_writes_the_reference_bytes_or_declines(matches: dict[str, PodMatch], block_size: int) -> None:
    require(_json, "_jsontokens")
    got = _json.dynamo_answer(matches, block_size)
    if got is not None:
        assert got == _reference_answer(matches, block_size)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_plain_pod, _plain_match, max_size=10), st.integers(1, 64))
def test_dynamo_answer_takes_every_plain_answer(matches: dict[str, PodMatch], block_size: int) -> None:
    """Plain pod ids, depths and ranks (every answer an index gives): written in C, equal bytes;
    and the route's data (``dynamo_body``) is those bytes for JSON, the dict for msgpack."""
    require(_json, "_jsontokens")
    answer = PreciseAnswer(block_size, 0, (), matches)
    assert _json.dynamo_answer(matches, block_size) == json_body(query_answer(answer))
    assert json_body(dynamo_body(answer, "application/json")) == json_body(query_answer(answer))
    assert dynamo_body(answer, "application/msgpack") == query_answer(answer)
    assert dynamo_body(answer, "application/json", None) == query_answer(answer)
