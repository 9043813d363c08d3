"""Tests for kvindex.approx (rendering, hashing) and kvindex.index.approx: every case of the approximate-index vectors
(fixtures/vectors/approx-vectors.json, computed independently of kvindex), plus the rendering,
defaulting, LRU, scoring and pod-removal rules of reference/approx-index.md."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.approx.gie import go_float, go_marshal, render_gie
from kvindex.approx.gojson import RenderError, go_json_fast, go_json_loads, has_digit_run, may_differ
from kvindex.approx.hashing import (
    gie_hashes,
    hash_request,
    kthena_hashes,
)
from kvindex.approx.kthena import render_kthena
from kvindex.index.approx import (
    ApproxIndex,
)
from kvindex.settings import GIE_V1_5, ApproxConfig, ApproxSettings

VECTORS_PATH = Path(__file__).parent.parent / "fixtures" / "vectors" / "approx-vectors.json"
VECTORS: dict[str, Any] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
KTHENA = VECTORS["kthena"]
GIE = VECTORS["gie_v1_5_0_approx_prefix"]
KTHENA_NAMES = {
    "blockSizeToHash": "block_size_to_hash",
    "maxBlocksToMatch": "max_blocks_to_match",
    "maxHashCacheSize": "max_hash_cache_size",
    "topKMatches": "top_k_matches",
}
MODEL = "Qwen/Qwen2.5-7B-Instruct"


def _steps() -> list[tuple[dict[str, Any], int]]:
    return [(sc, i) for sc in KTHENA["scoring_scenarios"] for i in range(len(sc["steps"]))]


def _step_id(param: tuple[dict[str, Any], int]) -> str:
    scenario, i = param
    step = scenario["steps"][i]
    suffix = f"-{step['pod']}" if "pod" in step else ""
    return f"{scenario['name']}-step{i:02d}-{step['op']}{suffix}"


def _cases(table: list[tuple[Any, ...]]) -> list[Any]:
    """``(id, *values)`` rows as ``pytest.param`` with readable ids."""
    return [pytest.param(*row[1:], id=row[0]) for row in table]


def _gie_index(**table: Any) -> ApproxIndex:
    return ApproxIndex(ApproxConfig(ApproxSettings.from_toml({"personality": GIE_V1_5, **table})))


def _kthena_index(evicted: list[str] | None = None, **table: Any) -> ApproxIndex:
    on_evict = evicted.append if evicted is not None else None
    return ApproxIndex(ApproxConfig(ApproxSettings.from_toml(table)), on_evict=on_evict)


# --- the vectors file itself -----------------------------------------------------------------


def test_vectors_have_only_known_sections() -> None:
    """A new section in the vectors must get a test here before this passes again."""
    assert set(VECTORS) == {"meta", "kthena", "gie_v1_5_0_approx_prefix"}
    assert set(KTHENA) == {"defaults", "hash_cases", "scoring_scenarios"}
    assert set(GIE) == {"defaults", "hash_cases"}
    ops = {step["op"] for sc in KTHENA["scoring_scenarios"] for step in sc["steps"]}
    assert ops == {"record", "query"}


def test_kthena_defaults_match_vectors() -> None:
    parsed = ApproxSettings.from_toml({})
    for key, attr in KTHENA_NAMES.items():
        assert getattr(parsed, attr) == KTHENA["defaults"][key] == getattr(ApproxSettings(), attr)
    assert parsed.personality == "kthena"


def test_gie_defaults_match_vectors() -> None:
    d = GIE["defaults"]
    parsed = ApproxSettings.from_toml({"personality": GIE_V1_5})
    assert d["blockSizeTokens"] * d["averageCharactersPerToken"] == d["block_bytes"]
    assert parsed.block_size_to_hash == d["block_bytes"]
    assert parsed.max_blocks_to_match == d["maxPrefixBlocksToMatch"]
    assert parsed.max_hash_cache_size == d["lruCapacityPerServer"]
    assert parsed == ApproxSettings.defaults(GIE_V1_5)


# --- Kthena hash cases -----------------------------------------------------------------------


@pytest.mark.parametrize("case", KTHENA["hash_cases"], ids=lambda c: c["name"])
def test_kthena_hash_case(case: dict[str, Any]) -> None:
    body = go_json_loads(json.dumps(case["request_body"]).encode("utf-8"))
    assert body == case["request_body"]
    assert case["accepted_by_router"] is True
    rendered = render_kthena(body)
    data = rendered.encode("utf-8")
    if case["rendered"] is not None:
        assert rendered == case["rendered"]
    assert len(data) == case["rendered_len_bytes"]
    assert hashlib.sha256(data).hexdigest() == case["rendered_sha256"]
    model = body["model"]
    assert xxhash.xxh64_intdigest(model.encode("utf-8")) == case["model_seed_xxh64"]
    settings = ApproxSettings.from_toml(KTHENA["defaults"])
    assert kthena_hashes(model, rendered, settings) == case["hashes"]
    assert hash_request(ApproxIndex(ApproxConfig()).config, model, body) == case["hashes"]


@pytest.mark.parametrize("case", KTHENA["hash_cases"], ids=lambda c: c["name"])
def test_kthena_hash_case_chain_prefixes(case: dict[str, Any]) -> None:
    """Every block-aligned prefix of a prompt hashes to a prefix of the chain."""
    data = render_kthena(case["request_body"]).encode("utf-8")
    model = case["request_body"]["model"]
    for blocks in range(len(case["hashes"]) + 1):
        try:
            prefix = data[: 64 * blocks].decode("utf-8")
        except UnicodeDecodeError:
            continue  # the prefix splits a character; the full case covers split blocks
        assert kthena_hashes(model, prefix, ApproxSettings()) == case["hashes"][:blocks]


# --- Kthena scoring scenarios ----------------------------------------------------------------


def _replay(scenario: dict[str, Any], upto: int) -> tuple[ApproxIndex, list[str]]:
    """An index with the records of steps[:upto] applied; queries have no side effects."""
    evicted: list[str] = []
    index = _kthena_index(evicted, **scenario["config"])
    for step in scenario["steps"][:upto]:
        if step["op"] == "record":
            model = step["request_body"]["model"]
            index.record(step["pod"], model, hash_request(index.config, model, step["request_body"]))
    return index, evicted


def _check_record(index: ApproxIndex, evicted: list[str], step: dict[str, Any]) -> None:
    model = step["request_body"]["model"]
    hashes = hash_request(index.config, model, step["request_body"])
    assert len(hashes) == step["num_hashes"]
    index.record(step["pod"], model, hashes)
    assert index.entries() == step["expect_entries_gauge_after"]
    assert dict(Counter(evicted)) == step["expect_evictions_total_after"]
    assert index.evictions == sum(step["expect_evictions_total_after"].values())
    assert all(index.believes(step["pod"], model, h) for h in hashes)


def _check_query(index: ApproxIndex, step: dict[str, Any]) -> None:
    model = step["request_body"]["model"]
    hashes = hash_request(index.config, model, step["request_body"])
    assert len(hashes) == step["num_hashes"]
    matches = index.match(model, hashes, step["candidates"])
    assert {p: m for p, m in matches.items() if m} == step["expect_match_lengths_topk"]
    assert matches == {p: step["expect_match_lengths_topk"].get(p, 0) for p in step["candidates"]}
    assert index.score(model, hashes, step["candidates"]) == step["expect_scores"]
    assert max(matches.values()) / len(hashes) == step["expect_match_ratio_observed"]


@pytest.mark.parametrize("param", _steps(), ids=_step_id)
def test_kthena_scoring_scenario_step(param: tuple[dict[str, Any], int]) -> None:
    scenario, i = param
    index, evicted = _replay(scenario, i)
    step = scenario["steps"][i]
    if step["op"] == "record":
        _check_record(index, evicted, step)
    else:
        _check_query(index, step)


@pytest.mark.parametrize("scenario", KTHENA["scoring_scenarios"], ids=lambda s: s["name"])
def test_kthena_scoring_queries_do_not_change_state(scenario: dict[str, Any]) -> None:
    index, _ = _replay(scenario, len(scenario["steps"]))
    before = index.entries()
    for step in scenario["steps"]:
        if step["op"] == "query":
            _check_query(index, step)
            _check_query(index, step)
    assert index.entries() == before


# --- GIE v1.5.0 hash cases -------------------------------------------------------------------


@pytest.mark.parametrize("case", GIE["hash_cases"], ids=lambda c: c["name"])
def test_gie_hash_case(case: dict[str, Any]) -> None:
    body = go_json_loads(json.dumps(case["request_body"]).encode("utf-8"))
    data = render_gie(body, api=case["api"])
    assert data == case["user_input"].encode("utf-8")
    assert render_gie(body) == data  # API chosen by key presence agrees with the path-based one
    assert len(data) == case["user_input_len_bytes"]
    assert hashlib.sha256(data).hexdigest() == case["user_input_sha256"]
    settings = ApproxSettings.defaults(GIE_V1_5)
    model = body["model"]
    assert gie_hashes(model, data, settings) == case["hashes_v1_5_0"]
    assert hash_request(_gie_index().config, model, body) == case["hashes_v1_5_0"]


@pytest.mark.parametrize("case", GIE["hash_cases"], ids=lambda c: c["name"])
def test_gie_hash_case_post_v1_5_partial_tail(case: dict[str, Any]) -> None:
    """v1.5.0 drops the partial tail; later GIE hashes it with the same chain step."""
    data = case["user_input"].encode("utf-8")
    ours = gie_hashes(case["request_body"]["model"], data, ApproxSettings.defaults(GIE_V1_5))
    later = case["hashes_post_v1_5_0_partial_tail"]
    assert later[: len(ours)] == ours
    tail = data[64 * len(ours) :]
    if len(data) < 64 or not tail:
        assert later == ours
    else:
        step = xxhash.xxh64_intdigest(tail + ours[-1].to_bytes(8, "little"))
        assert later == [*ours, step]


# --- Kthena rendering rules ------------------------------------------------------------------


def _chatml(*messages: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)


USER_X = {"role": "user", "content": "x"}
RENDER_CASES = [
    ("prompt_wins_over_messages", {"prompt": "p", "messages": [USER_X]}, "p"),
    ("empty_prompt_ignores_messages", {"prompt": "", "messages": [USER_X]}, ""),
    (
        "list_content_text_parts_only",
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
            {"type": "text", "text": "Answer in one sentence."},
        ]}]},
        _chatml(("user", "What is in this image?\nAnswer in one sentence.")),
    ),
    (
        "part_types_untyped_and_empty_text",
        {"messages": [{"role": "user", "content": [
            {"text": "a"}, {"type": 7, "text": "b"}, {"type": "input_text", "text": ""},
            {"type": "output_text", "text": "c"}, {"type": "refusal", "text": "no"},
            {"type": "text", "text": 5}, "bare string", None,
        ]}]},
        _chatml(("user", "a\nb\n\nc")),
    ),
    (
        "dropped_messages",
        {"messages": [
            "not an object", {"content": "no role"}, {"role": 3, "content": "bad role"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
            {"role": "user", "content": 42}, {"role": "user"},
            {"role": "", "content": "empty role kept"},
            {"role": "tool", "content": "r", "tool_call_id": "1", "name": "n"},
        ]},
        _chatml(("", "empty role kept"), ("tool", "r")),
    ),
    (
        "top_level_system_prepended",
        {"system": [{"type": "text", "text": "S"}], "messages": [{"role": "user", "content": "u"}]},
        _chatml(("system", "S"), ("user", "u")),
    ),
    (
        "empty_system_still_prepended",
        {"system": "", "messages": [{"role": "user", "content": "u"}]},
        _chatml(("system", ""), ("user", "u")),
    ),
    ("unparsable_system_ignored", {"system": 5, "messages": []}, ""),
    (
        "responses_list_input",
        {"instructions": "", "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "role": "assistant", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "1", "output": "o"},
            {"type": "reasoning", "role": "assistant", "content": "r"},
            {"role": "assistant", "content": "untyped item kept"},
            {"type": "", "role": "user", "content": "empty type kept"},
            {"type": "message", "role": "", "content": "no role"},
            {"type": "message", "content": "x"},
            {"type": "message", "role": "user", "content": None}, 7,
        ]},
        _chatml(("user", "hi"), ("assistant", "untyped item kept"), ("user", "empty type kept")),
    ),
    (
        "responses_empty_string_input",
        {"instructions": "Be brief.", "input": ""},
        _chatml(("developer", "Be brief."), ("user", "")),
    ),
    ("responses_all_items_skipped", {"instructions": 5, "input": [{"type": "reasoning"}]}, ""),
    ("messages_empty_list", {"messages": []}, ""),
]


@pytest.mark.parametrize("body,expected", _cases(RENDER_CASES))
def test_render_kthena(body: dict[str, Any], expected: str) -> None:
    assert render_kthena(body) == expected


REJECT_CASES = [
    ("prompt_list", {"prompt": ["a", "b"]}, "prompt must be a string"),
    ("prompt_token_ids", {"prompt": [1, 2, 3]}, "prompt must be a string"),
    ("prompt_null", {"prompt": None, "messages": []}, "prompt must be a string"),
    ("messages_object", {"messages": {"role": "user"}}, "messages must be a list"),
    ("messages_null", {"messages": None}, "messages must be a list"),
    ("input_number", {"input": 3}, "input must be"),
    ("input_null", {"input": None}, "input must be"),
    ("instructions_only", {"instructions": "x"}, "no prompt, messages or input"),
    ("empty_body", {}, "no prompt, messages or input"),
    ("wrong_case_key", {"Prompt": "x"}, "no prompt, messages or input"),
]


@pytest.mark.parametrize("body,message", _cases(REJECT_CASES))
def test_render_kthena_rejects(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RenderError, match=message) as info:
        render_kthena(body)
    assert "\n" not in str(info.value)
    with pytest.raises(RenderError):
        hash_request(ApproxIndex(ApproxConfig()).config, "m", body)


def test_render_kthena_rejects_non_object_body() -> None:
    with pytest.raises(RenderError, match="JSON object"):
        render_kthena(["prompt"])  # type: ignore[arg-type]


def test_empty_render_gives_no_hashes_and_zero_scores() -> None:
    index = ApproxIndex(ApproxConfig())
    hashes = hash_request(index.config, "m", {"input": []})
    assert hashes == []
    index.record("p", "m", hashes)
    assert index.entries() == 0 and index.pods() == []
    assert index.score("m", hashes, ["p", "q"]) == {"p": 0, "q": 0}


# --- Go JSON decoding ------------------------------------------------------------------------


GO_DECODE_CASES = [
    ("invalid_byte", b'{"prompt":"a\xffb"}', "a\ufffdb"),
    ("truncated_sequence_one_fffd_per_byte", b'{"prompt":"\xe6\x97x"}', "\ufffd\ufffdx"),
    ("encoded_surrogate_bytes", b'{"prompt":"\xed\xa0\x80"}', "\ufffd" * 3),
    ("lone_high_surrogate_escape", b'{"prompt":"\\ud800x"}', "\ufffdx"),
    ("lone_low_surrogate_escape", b'{"prompt":"\\udc00"}', "\ufffd"),
    ("high_then_high_then_pair", b'{"prompt":"\\ud800\\ud83d\\ude00"}', "\ufffd\U0001f600"),
    ("valid_multibyte", '{"prompt":"é日本"}'.encode(), "é日本"),
    ("duplicate_key_last_wins", b'{"prompt":"first","prompt":"second"}', "second"),
]


@pytest.mark.parametrize("raw,prompt", _cases(GO_DECODE_CASES))
def test_go_json_loads(raw: bytes, prompt: str) -> None:
    body = go_json_loads(raw)
    assert body["prompt"] == prompt
    assert render_kthena(body).encode("utf-8")  # always encodable


def test_go_json_loads_scrubs_keys_and_nested_values() -> None:
    body = go_json_loads(b'{"a\\udc00":[["\\ud800"],{"k":"\xff"}],"s":"\\ud800"}')
    assert body == {"a\ufffd": [["\ufffd"], {"k": "\ufffd"}], "s": "\ufffd"}
    assert go_json_loads('"\\ud800"') == "\ufffd"


@pytest.mark.parametrize(
    "raw", [b"", b"{", b'{"a":1,}', b"NaN", b'{"a":Infinity}', b"[1] [2]", b"\xff", b'"\x01"'],
    ids=["empty", "unterminated", "trailing_comma", "nan", "infinity", "two_values", "bad_byte",
         "control"],
)
def test_go_json_loads_rejects(raw: bytes) -> None:
    with pytest.raises(RenderError, match="^malformed JSON: ") as info:
        go_json_loads(raw)
    assert "\n" not in str(info.value)


FAST_PATH_CASES = [raw for _, raw, _ in GO_DECODE_CASES] + [
    b'{"input":[-0,0,1e2]}', b'{"a":-0.5,"b":-0e1,"c":-10}', b'[-0]', b'{"p":"\\u0041\\uD83D\\uDE00"}', b'{"p":"\\uDBFF"}',
    b'{"n":' + b"7" * 4000 + b"}", b'{"n":' + b"7" * 3999 + b"}", b'{"s":"' + b"1" * 5000 + b'"}',
    b'{"prompt":' + json.dumps(list(range(3000))).encode() + b"}", '{"p":"١٢٣"}'.encode(),
]


@given(st.lists(st.tuples(st.sampled_from([b"7", b"a", b",", b"0"]), st.integers(1, 40)), max_size=40),
       st.integers(1, 60))
@settings(max_examples=500, deadline=None)
def test_has_digit_run_is_the_regex_it_replaces(parts: list[tuple[bytes, int]], n: int) -> None:
    data = b"".join(c * k for c, k in parts)
    assert has_digit_run(data, n) == bool(re.search(rb"[0-9]{%d}" % n, data))


@given(st.lists(st.sampled_from([b"-", b"0", b"1", b".", b"e", b"a", b"\\", b"u", b"d", b"8"]), max_size=80))
@settings(max_examples=500, deadline=None)
def test_may_differ_is_the_regex_it_replaces(parts: list[bytes]) -> None:
    data = b"".join(parts)
    assert may_differ(data) == bool(re.search(rb"\\u[dD][89a-fA-F]|-0(?![.0-9eE])|[0-9]{4000}", data))


def test_may_differ_flags_only_what_msgspec_could_read_otherwise() -> None:
    assert may_differ(b'"\\ud800"') and may_differ(b"[-0]") and may_differ(b"1" * 4000)
    assert not may_differ(b'"\\u0041"') and not may_differ(b"[-0.5, -01]") and not may_differ(b"1" * 3999)


@pytest.mark.parametrize("raw", FAST_PATH_CASES, ids=range(len(FAST_PATH_CASES)))
def test_go_json_fast_agrees_with_the_reference_decoder(raw: bytes) -> None:
    """The msgspec fast path is only an optimisation of ``go_json_loads``: same value, and the
    same rendering (a 4000-digit integer or a -0 goes to the reference)."""
    ref = go_json_loads(raw)
    fast = go_json_fast(raw)
    assert type(fast) is type(ref) and repr(fast) == repr(ref)


def test_go_json_fast_refuses_as_the_reference_does() -> None:
    for raw in (b"", b"{", b'{"a":1,}', b"NaN", b"[1] [2]", b'"\x01"'):
        with pytest.raises(RenderError, match="^malformed JSON: "):
            go_json_fast(raw)


def test_lone_surrogate_hashes_like_replacement_character() -> None:
    index = ApproxIndex(ApproxConfig())
    via_go = hash_request(index.config, "m", go_json_loads(b'{"prompt":"x\\ud800y"}'))
    assert via_go == hash_request(index.config, "m", {"prompt": "x\ufffdy"})
    assert hash_request(index.config, "m", {"prompt": "x\ud800y"}) == via_go  # a raw Python str too


# --- GIE rendering ---------------------------------------------------------------------------


def test_render_gie_completions_list_prompt_joined() -> None:
    assert render_gie({"prompt": ["a", "b c", ""]}) == b"a b c "
    assert render_gie({"prompt": []}) == b""
    with pytest.raises(RenderError, match="prompt must be a string or a list of strings"):
        render_gie({"prompt": [1, 2]})


def test_render_gie_chat_content_blocks() -> None:
    body = {"messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "a<b"},
            {"type": "image_url", "image_url": {"url": "http://i", "detail": "low"}},
            {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
        ]},
        {"content": None}, {"role": "assistant", "content": ""}, {"ROLE": "tool", "Content": []},
    ]}
    media = '"image_url":{},"input_audio":{},"video_url":{}'
    expected = (
        '[{"role":"user","content":[{"type":"text","text":"a\\u003cb",' + media + "},"
        '{"type":"image_url","image_url":{"url":"http://i"},"input_audio":{},"video_url":{}},'
        '{"type":"input_audio","image_url":{},'
        '"input_audio":{"data":"AA==","format":"wav"},"video_url":{}}]},'
        '{"content":""},{"role":"assistant","content":""},{"role":"tool","content":[]}]'
    )
    assert render_gie(body) == expected.encode()


def test_render_gie_go_string_escapes() -> None:
    text = 'q"\\\n\r\t\b\f\x01\x7f\u2028\u2029&>é'
    expected = '"q\\"\\\\\\n\\r\\t\\b\\f\\u0001\x7f\\u2028\\u2029\\u0026\\u003eé"'
    assert render_gie({"messages": [{"content": text}]}) == f'[{{"content":{expected}}}]'.encode()


@pytest.mark.parametrize(
    "body,message",
    [
        ({"messages": {"a": 1}}, "messages must be a list"),
        ({"messages": ["x"]}, r"messages\[0\] must be an object"),
        ({"messages": [{"role": 1}]}, r"messages\[0\].role must be a string"),
        ({"messages": [{"content": 5}]}, r"messages\[0\].content must be"),
        ({"messages": [{"content": [{"type": 1}]}]}, r"content\[0\].type must be a string"),
        ({"messages": [{"content": [{"image_url": "u"}]}]}, r"image_url must be an object"),
        ({}, "no prompt, messages or input"),
    ],
    ids=["messages_object", "message_string", "role_number", "content_number", "type_number",
         "image_url_string", "nothing"],
)
def test_render_gie_rejects(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        render_gie(body)


def test_render_gie_responses_form() -> None:
    body = {"instructions": "Be <terse>", "tools": [{"type": "function", "name": "f"}],
            "input": [{"role": "user", "content": "hi", "n": 1, "x": 0.5, "b": True, "z": None}]}
    expected = (
        '[{"instructions":"Be \\u003cterse\\u003e"},{"tools":[{"name":"f","type":"function"}]},'
        '{"input":[{"b":true,"content":"hi","n":1,"role":"user","x":0.5,"z":null}]}]'
    )
    assert render_gie(body) == expected.encode()
    assert render_gie({"input": "s", "instructions": None}) == b'[{"input":"s"}]'
    assert render_gie({"messages": None}, api="responses") == b'[{"input":null}]'
    with pytest.raises(RenderError, match="api must be"):
        render_gie({"prompt": "x"}, api="embeddings")


@pytest.mark.parametrize(
    "value,text",
    [(1.0, "1"), (1, "1"), (-0.0, "-0"), (0.5, "0.5"), (1e20, "100000000000000000000"),
     (1e21, "1e+21"), (1e-6, "0.000001"), (1e-7, "1e-7"), (1.5e-10, "1.5e-10"),
     (123456789012345678, "123456789012345680"),
     (-2.5e300, "-2.5e+300"), (0.1, "0.1")],
)
def test_go_float_formatting(value: float, text: str) -> None:
    assert go_float(float(value)) == text
    assert go_marshal([value]) == f"[{text}]"


def test_go_json_negative_zero_int_keeps_sign_for_gie() -> None:
    assert render_gie(go_json_loads(b'{"input":[-0,0,1e2]}')) == b'[{"input":[-0,0,100]}]'


def test_gie_cache_salt_seeds_chain() -> None:
    index = _gie_index()
    body = {"prompt": "x" * 200}
    plain = hash_request(index.config, "m", body)
    salted = hash_request(index.config, "m", {**body, "cache_salt": "tenant-a"})
    assert len(plain) == len(salted) == 3 and plain[0] != salted[0]
    assert salted == gie_hashes("m", b"x" * 200, ApproxSettings.defaults(GIE_V1_5), "tenant-a")
    assert hash_request(index.config, "m", {**body, "cache_salt": 5}) == plain
    kthena = ApproxIndex(ApproxConfig())  # kvindex's extension: Kthena's seed takes the salt too
    assert hash_request(kthena.config, "m", {**body, "cache_salt": "s"}) != hash_request(kthena.config, "m", body)


def test_gie_hash_truncation_and_block_rules() -> None:
    s = ApproxSettings.from_toml({"personality": GIE_V1_5, "maxBlocksToMatch": 3})
    data = bytes(range(256)) * 2
    full = gie_hashes("m", data, ApproxSettings.defaults(GIE_V1_5))
    assert len(full) == 8
    assert gie_hashes("m", data, s) == full[:3]
    assert gie_hashes("m", data[:127], ApproxSettings.defaults(GIE_V1_5)) == full[:1]
    assert gie_hashes("m", data[:63], ApproxSettings.defaults(GIE_V1_5)) == []


def test_kthena_hash_limits() -> None:
    prompt = "ab" * 10000
    settings = ApproxSettings()
    hashes = kthena_hashes("m", prompt, settings)
    assert len(hashes) == 128
    assert kthena_hashes("m", prompt[:8192] + "different tail", settings) == hashes
    small = ApproxSettings(block_size_to_hash=16, max_blocks_to_match=3)
    assert len(kthena_hashes("m", "x" * 33, small)) == 3
    assert len(kthena_hashes("m", "x" * 32, small)) == 2


@pytest.mark.parametrize(
    "m,n,score", [(29, 50, 57), (29, 100, 28), (57, 100, 56), (58, 100, 57), (1, 3, 33)]
)
def test_kthena_score_float64_truncation(m: int, n: int, score: int) -> None:
    index = ApproxIndex(ApproxConfig())
    hashes = list(range(1, n + 1))
    index.record("p", "m", hashes[:m])
    assert index.score("m", hashes, ["p"]) == {"p": score}


# --- settings and config ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "table,expected",
    [
        ({}, ApproxSettings()),
        ({"blockSizeToHash": 0, "maxBlocksToMatch": -3, "maxHashCacheSize": 0, "topKMatches": -1},
         ApproxSettings()),
        ({"blockSizeToHash": 32, "maxBlocksToMatch": 10, "maxHashCacheSize": 7, "topKMatches": 2},
         ApproxSettings("kthena", 32, 10, 7, 2)),
        ({"personality": "gie-v1.5"}, ApproxSettings("gie-v1.5", 64, 256, 31250, 5)),
        ({"personality": "gie-v1.5", "maxBlocksToMatch": 0, "maxHashCacheSize": -1},
         ApproxSettings("gie-v1.5", 64, 256, 31250, 5)),
        ({"personality": "gie-v1.5", "blockSizeToHash": 16},
         ApproxSettings("gie-v1.5", 16, 256, 31250, 5)),
    ],
    ids=["omitted", "zero_and_negative", "explicit", "gie_defaults", "gie_zero_negative",
         "gie_explicit"],
)
def test_settings_defaulting(table: dict[str, Any], expected: ApproxSettings) -> None:
    assert ApproxSettings.from_toml(table) == expected


@pytest.mark.parametrize(
    "table,key",
    [
        ({"blockSizeToHash": "64"}, "blockSizeToHash"),
        ({"maxBlocksToMatch": 1.5}, "maxBlocksToMatch"),
        ({"maxHashCacheSize": True}, "maxHashCacheSize"),
        ({"topKMatches": None}, "topKMatches"),
        ({"personality": "vllm-router"}, "personality"),
        ({"personality": 1}, "personality"),
        ({"blocksizetohash": 64}, "blocksizetohash"),
    ],
    ids=["str", "float", "bool", "none", "unknown_personality", "personality_int", "unknown_key"],
)
def test_settings_rejects(table: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ApproxSettings.from_toml(table)
    with pytest.raises(ValueError, match=rf"approx\.{key}"):
        ApproxConfig.from_toml(table)


def test_settings_direct_construction_validated() -> None:
    with pytest.raises(ValueError, match="personality"):
        ApproxSettings("other")
    with pytest.raises(ValueError, match="top_k_matches"):
        ApproxSettings(top_k_matches=0)


def test_config_models_inherit_from_approx_table() -> None:
    config = ApproxConfig.from_toml({
        "maxHashCacheSize": 100, "topKMatches": 3,
        "models": {"gie-model": {"personality": "gie-v1.5"}, "small": {"topKMatches": 1}},
    })
    assert config.default == ApproxSettings("kthena", 64, 128, 100, 3)
    assert config.for_model("small") == ApproxSettings("kthena", 64, 128, 100, 1)
    assert config.for_model("gie-model") == ApproxSettings("gie-v1.5", 64, 256, 100, 3)
    assert config.for_model("unlisted") is config.default
    with pytest.raises(TypeError):
        config.models["x"] = ApproxSettings()  # type: ignore[index]


def test_config_errors_name_model_and_key() -> None:
    with pytest.raises(ValueError, match=r'approx\.models\."m"\.topKMatches'):
        ApproxConfig.from_toml({"models": {"m": {"topKMatches": "5"}}})
    with pytest.raises(ValueError, match=r'approx\.models\."m" must be a table'):
        ApproxConfig.from_toml({"models": {"m": 5}})
    with pytest.raises(ValueError, match=r"approx\.models must be a table"):
        ApproxConfig.from_toml({"models": []})


# --- Kthena store: LRU, match, removal --------------------------------------------------------


def test_kthena_record_evicts_deepest_blocks_first() -> None:
    evicted: list[str] = []
    index = _kthena_index(evicted, maxHashCacheSize=3)
    index.record("p", "m", [1, 2, 3, 4, 5])
    assert index.entries("p") == 3 and index.evictions == 2 and evicted == ["m", "m"]
    believed = [index.believes("p", "m", h) for h in (1, 2, 3, 4, 5)]
    assert believed == [True, True, True, False, False]
    assert index.match("m", [1, 2, 3, 4, 5], ["p"]) == {"p": 3}


def test_kthena_refresh_moves_to_most_recent_without_eviction() -> None:
    index = _kthena_index(maxHashCacheSize=3)
    index.record("p", "m", [1, 2, 3])  # recency, oldest first: 3, 2, 1
    index.record("p", "m", [3])  # refresh: 2, 1, 3
    assert index.evictions == 0
    index.match("m", [2], ["p"])  # lookups never touch recency
    index.record("p", "m", [9])  # evicts 2
    assert index.evictions == 1
    assert [index.believes("p", "m", h) for h in (1, 2, 3, 9)] == [True, False, True, True]


def test_kthena_lru_is_per_pod_and_shared_across_models() -> None:
    evicted: list[str] = []
    index = _kthena_index(evicted, maxHashCacheSize=2)
    index.record("p", "a", [1])
    index.record("p", "b", [1])  # same hash, other model: a distinct key
    index.record("q", "a", [1, 2])
    assert index.evictions == 0 and index.entries() == 4 and index.entries("q") == 2
    index.record("p", "a", [3])
    assert evicted == ["a"]
    assert not index.believes("p", "a", 1)
    assert index.believes("p", "b", 1) and index.believes("q", "a", 1)
    assert index.match("a", [1], ["p", "q"]) == {"p": 0, "q": 1}


def test_kthena_tie_at_cut_off_goes_to_sorted_pod_names() -> None:
    index = _kthena_index(topKMatches=2)
    for pod in ("pod-c", "pod-a", "pod-b"):
        index.record(pod, "m", [1, 2])
    index.record("pod-d", "m", [1])
    assert index.match("m", [1, 2], ["pod-d", "pod-c", "pod-b", "pod-a"]) == {
        "pod-d": 0, "pod-c": 0, "pod-b": 2, "pod-a": 2}
    assert index.score("m", [1, 2], ["pod-c", "pod-a"]) == {"pod-c": 100, "pod-a": 100}


def test_kthena_unknown_model_and_unknown_pods_score_zero() -> None:
    index = ApproxIndex(ApproxConfig())
    index.record("p", "m", [1, 2])
    assert index.score("other", [1, 2], ["p"]) == {"p": 0}
    assert index.score("m", [1, 2], ["p", "new", "p"]) == {"p": 100, "new": 0}
    assert index.score("m", [], ["p"]) == {"p": 0}


def test_remove_pod_drops_everything_without_counting_evictions() -> None:
    gie = ApproxSettings.defaults(GIE_V1_5)
    config = ApproxConfig(ApproxSettings(max_hash_cache_size=4), {"g": gie})
    index = ApproxIndex(config)
    index.record("p", "m", [1, 2, 3, 4, 5])
    index.record("p", "g", [7, 8])
    index.record("q", "m", [1, 2])
    evictions = index.evictions
    assert index.pods() == ["p", "q"]
    index.remove_pod("p")
    assert index.pods() == ["q"] and index.entries("p") == 0 and index.entries() == 2
    assert index.evictions == evictions
    assert not index.believes("p", "m", 1) and not index.believes("p", "g", 7)
    assert index.match("m", [1, 2], ["p", "q"]) == {"p": 0, "q": 2}
    index.remove_pod("q")
    index.remove_pod("never-seen")
    assert index.pods() == [] and index.entries() == 0
    assert index._kthena._index == {} and index._gie._index == {}  # no empty sets left behind


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from("mn"),
                          st.lists(st.integers(0, 20), max_size=8, unique=True)), max_size=40))
def test_kthena_memory_bounded_by_lru(ops: list[tuple[str, str, list[int]]]) -> None:
    index = _kthena_index(maxHashCacheSize=5)
    for pod, model, hashes in ops:
        index.record(pod, model, hashes)
        assert all(index.entries(p) <= 5 for p in "abc")
    store = index._kthena._index
    triples = {(m, h, p) for m, by_hash in store.items() for h, ps in by_hash.items() for p in ps}
    assert len(triples) == index.entries()
    assert all(ps for by_hash in index._kthena._index.values() for ps in by_hash.values())
    assert all(index.believes(p, m, h) for m, h, p in triples)


# --- GIE store -------------------------------------------------------------------------------


def test_gie_forward_walk_and_float_scores() -> None:
    index = _gie_index()
    index.record("a", "m", [1, 2, 3])
    index.record("b", "m", [1, 2])
    index.record("c", "m", [2])
    assert index.match("m", [1, 2, 3, 4], ["a", "b", "c", "d"]) == {"a": 3, "b": 2, "c": 1, "d": 0}
    assert index.score("m", [1, 2, 3, 4], ["a", "b", "d"]) == {"a": 0.75, "b": 0.5, "d": 0.0}
    assert index.match("m", [9, 2, 3], ["a", "c"]) == {"a": 0, "c": 0}  # stops at the first miss
    assert index.score("m", [], ["a"]) == {"a": 0}


def test_gie_store_has_no_topk_and_no_model_index() -> None:
    config = ApproxConfig(ApproxSettings.defaults(GIE_V1_5))
    index = ApproxIndex(config)
    for pod in "abcdefg":
        index.record(pod, "m1", [1, 2])
    assert index.match("m2", [1, 2], list("abcdefg")) == dict.fromkeys("abcdefg", 2)


def test_gie_record_order_and_stale_quirk() -> None:
    evicted: list[str] = []
    config = ApproxConfig(ApproxSettings(GIE_V1_5, 64, 256, 2, 5))
    index = ApproxIndex(config, on_evict=evicted.append)
    index.record("p", "m", [1, 2, 3])  # LRU adds 1, 2, 3: 1 is evicted, then re-inserted in the map
    assert index.entries("p") == 2 and evicted == ["m"]
    assert index.believes("p", "m", 1)  # stale belief, as in GIE v1.5.0
    index.record("p", "m", [4])  # evicts 2: first block first means oldest first
    assert [index.believes("p", "m", h) for h in (1, 2, 3, 4)] == [True, False, True, True]
    assert index.match("m", [1, 2, 3], ["p"]) == {"p": 1}


def test_gie_stale_beliefs_are_bounded() -> None:
    index = ApproxIndex(ApproxConfig(ApproxSettings(GIE_V1_5, 64, 256, 2, 5)))
    index.record("p", "m", [1, 2, 3, 4, 5, 6])  # 1..4 evicted by the same call; cap keeps 2 stale
    believed = [index.believes("p", "m", h) for h in range(1, 7)]
    assert believed == [False, False, True, True, True, True]
    index.record("p", "m", [3])  # re-added to the LRU: no longer stale
    assert index.entries("p") == 2 and index.believes("p", "m", 3)
    assert sum(len(ps) for ps in index._gie._index.values()) <= 2 * 2


def test_gie_and_kthena_stores_are_separate() -> None:
    config = ApproxConfig(ApproxSettings(), {"g": ApproxSettings.defaults(GIE_V1_5)})
    index = ApproxIndex(config)
    index.record("p", "k", [1, 2])
    index.record("p", "g", [1, 2])
    assert index.entries("p") == 4 and index.pods() == ["p"]
    assert index.believes("p", "k", 1) and index.believes("p", "g", 1)
    assert not index.believes("p", "other-kthena-model", 1)
    assert index.score("g", [1, 2], ["p"]) == {"p": 1.0}
    assert index.score("k", [1, 2], ["p"]) == {"p": 100}


@pytest.mark.parametrize("personality", ["kthena", "gie-v1.5"])
def test_salted_tenants_never_match_each_other(personality: str) -> None:
    index = ApproxIndex(ApproxConfig(ApproxSettings.defaults(personality), {}))
    prompt = "x" * 300
    body = {"model": "m", "prompt": prompt}
    plain = hash_request(index.config, "m", body)
    salted = hash_request(index.config, "m", {**body, "cache_salt": "tenant-a"})
    other = hash_request(index.config, "m", {**body, "cache_salt": "tenant-b"})
    assert len({tuple(plain), tuple(salted), tuple(other)}) == 3
    index.record("p", "m", salted)
    assert index.match("m", other, ["p"]) == {"p": 0} and index.match("m", plain, ["p"]) == {"p": 0}
    assert index.match("m", salted, ["p"])["p"] == len(salted)


def test_depth_has_no_top_k_cut_off() -> None:
    index = ApproxIndex(ApproxConfig())
    hashes = hash_request(index.config, "m", {"model": "m", "prompt": "y" * 500})
    pods = [f"p{i}" for i in range(8)]
    for p in pods:
        index.record(p, "m", hashes)
    assert sum(1 for n in index.match("m", hashes, pods).values() if n) == 5  # Kthena's topKMatches
    assert index.depth("m", hashes, pods) == {p: len(hashes) for p in pods}