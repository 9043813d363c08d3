"""adapters._llmd_sim (the simulator tokenizer in C) against its definition,
``adapters.llmd_sim.py_tokenize_prompt``, on the same inputs.

The C comparisons need the extension built (``tests.conftest.need_native``: CI fails without it,
elsewhere and under ``KVINDEX_PURE_PYTHON=1`` they are skipped); the tests of the public names run
either way, on whichever twin is in use.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import llmd_sim
from adapters.llmd_sim import SimTokenizer, py_tokenize_prompt, split_tokens, tokenize_ids
from kvindex import native
from tests.conftest import need_native

_C = native.load("adapters._llmd_sim")
PUNCT = "{}:,-.?!;@#$%^&*()+_~/\\><[]=\"'"  # the regex's punctuation alternatives
SPACES = "\t\n\f\r "  # Go's \s


def c_ids(text: str) -> list[int]:
    need_native(_C, "adapters._llmd_sim")
    assert _C is not None
    out = _C.tokenize(text)
    assert isinstance(out, array) and out.typecode == "I"
    return out.tolist()


def fnv(data: bytes) -> int:
    """FNV-1a-32 written out again here (not llmd_sim's): the ids are checked independently."""
    h = 2166136261
    for b in data:
        h = (h ^ b) * 16777619 % 2**32
    return h


EDGES = [
    "", " ", "   ", "\t\n\f\r ", "\v", "\v\v a", " leading", "\n\nleading", "trailing   ", "a", "ab c",
    PUNCT, " ".join(PUNCT), "".join(c + c for c in PUNCT), PUNCT + "abc" + PUNCT,
    "_abc", "a_b", "__", "___x__", "_", "-", "a-b", "a--b", "-_-", "_-_", "a_", "_a_", "9_x", "x_9-y_",
    "x\v y", "x \v y", "x\vy", "x\x00y", "a\r\nb\r\n", "line\r\n\r\n  next", "\x1c\x1d\x1e\x1f\x85",
    "café au lait", "naïve_x", "é_x", "日本語テキスト ok", "emoji 🙂 here🙂there", "🙂", "\u00a0a\u2003b\u3000c",
    "Ωmega", "ÀB", "x\u200by", "<|im_start|>user\nhi<|im_end|>", "### user: Hello, world!\n",
    "a" * 100_000, "_" * 5000, "{" * 5000, " " * 10_000 + "x" + " " * 10_000, "é" * 20_000,
    ("word " * 3000) + ("\t" * 3000), "ab" * 20_000 + "-" + "9" * 30_000,
]


@pytest.mark.parametrize("text", EDGES, ids=range(len(EDGES)))
def test_c_equals_definition_on_edge_cases(text: str) -> None:
    assert c_ids(text) == py_tokenize_prompt(text)


TRICKY = [
    ("_abc", ["_", "abc"]), ("a_b", ["a_b"]), ("__", ["_", "_"]), ("a-b", ["a", "-", "b"]),
    ("x\v y", ["x", "y"]), ("_a_ ", ["_", "a_ "]), (" a\r\n b", ["a\r\n ", "b"]), ("é_x", ["_", "x"]),
    ("### ", ["#", "#", "# "]),
]


@pytest.mark.parametrize(("text", "tokens"), TRICKY)
def test_split_of_the_tricky_cases(text: str, tokens: list[str]) -> None:
    assert split_tokens(text) == tokens  # what the regex does (leftmost-first: '_' alone first)
    assert py_tokenize_prompt(text) == [fnv(t.encode()) for t in tokens]


@pytest.mark.parametrize(("text", "tokens"), TRICKY)
def test_c_on_the_tricky_cases(text: str, tokens: list[str]) -> None:
    assert c_ids(text) == [fnv(t.encode()) for t in tokens]


def test_ids_computed_independently() -> None:
    assert fnv(b"a") == 0xE40C292C
    assert c_ids("a") == [0xE40C292C]
    assert c_ids("") == [] and c_ids(" \v\t") == []
    assert c_ids("foobar") == [0xBF9CF968]
    assert c_ids("a a") == [fnv(b"a "), fnv(b"a")]
    assert c_ids("### user: Hello, world!\n") == [638357778, 638357778, 399020470, 1618501362, 2382766391,
                                                  4116459851, 2312110321, 933488787, 2781045010]


_chars = st.one_of(
    st.sampled_from(list(PUNCT + SPACES + "\v\x00")),
    st.sampled_from(list("abcXYZ019_")),
    st.characters(min_codepoint=0, max_codepoint=127),
    st.characters(min_codepoint=128, codec="utf-8"),  # no lone surrogates
)


@settings(max_examples=400, deadline=None)
@given(st.text(_chars, max_size=200))
def test_c_equals_definition_on_generated_text(text: str) -> None:
    assert c_ids(text) == py_tokenize_prompt(text)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["_", "-", "a", "Z9", " ", "\v", "\r\n", "é", "🙂", "\t", "{"]), max_size=60))
def test_c_equals_definition_on_generated_runs(parts: list[str]) -> None:
    text = "".join(parts)
    assert c_ids(text) == py_tokenize_prompt(text)


def test_lone_surrogates_take_the_python_path() -> None:
    text = "ab\ud800 cd_\udfff-e"
    assert py_tokenize_prompt(text) == [fnv(b"ab"), fnv(b"cd_"), fnv(b"-"), fnv(b"e")]
    assert tokenize_ids(text) == array("I", py_tokenize_prompt(text))
    assert SimTokenizer().tokenize_prompt(text) == py_tokenize_prompt(text)


def test_c_refuses_what_it_cannot_read() -> None:
    need_native(_C, "adapters._llmd_sim")
    assert _C is not None
    with pytest.raises(ValueError):  # UnicodeEncodeError: the caller falls back (test above)
        _C.tokenize("ab\ud800 cd")
    with pytest.raises(TypeError):
        _C.tokenize(b"bytes")


def test_public_names_equal_the_definition() -> None:
    text = "### user: naïve_x -- 🙂 {ok}\v\n" * 50
    ids = tokenize_ids(text)
    assert isinstance(ids, array) and ids.typecode == "I" and ids.tolist() == py_tokenize_prompt(text)
    got = SimTokenizer().tokenize_prompt(text)
    assert type(got) is list and got == py_tokenize_prompt(text)


def test_public_names_run_on_the_c_twin() -> None:
    need_native(_C, "adapters._llmd_sim")
    text = "x_1 -y" * 10
    assert llmd_sim.tokenize_ids(text).tolist() == c_ids(text)
    assert "_c_tokenize" in vars(llmd_sim)  # chosen at import: the C twin, not the definition


CHATS: list[list[Any]] = [
    [{"role": "user", "content": "Hello, world!"}],
    [{"role": "system", "content": "Be brief_ok."}, {"role": "user", "content": "naïve café\v 🙂 -_-"},
     {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f_1", "arguments": '{"a": 1}'}}]},
     {"role": "tool", "tool_call_id": "call_9", "content": "42\r\n"}],
    [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                                  {"type": "input_audio", "input_audio": {"format": "wav"}}, {"type": "other"}]}],
]


@pytest.mark.parametrize("messages", CHATS, ids=range(len(CHATS)))
async def test_chat_rendering_end_to_end(messages: list[Any]) -> None:
    sim = SimTokenizer()
    rendered = sim.render_chat(messages)
    expected = py_tokenize_prompt(rendered)
    assert expected == [fnv(t.encode()) for t in split_tokens(rendered)]
    got = await sim.tokenize("m", {"messages": messages})
    assert isinstance(got, array) and got.typecode == "I" and list(got) == expected  # packed: no int per token
    assert list(await sim.tokenize("m", {"prompt": rendered})) == expected


@pytest.mark.parametrize("messages", CHATS, ids=range(len(CHATS)))
def test_c_on_rendered_chats(messages: list[Any]) -> None:
    rendered = SimTokenizer().render_chat(messages)
    assert c_ids(rendered) == py_tokenize_prompt(rendered)
