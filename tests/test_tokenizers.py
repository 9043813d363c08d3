"""Tests for the simulator tokenizer, the engine /tokenize client and the caching wrapper."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from adapters.engine_tokenizer import EngineTokenizer, TokenizeError, tokenize_request
from adapters.llmd_sim import SimTokenizer, fnv1a_32, split_tokens
from kvindex.tokenize import CachingTokenizer, Tokenizer, cache_key
from tests.conftest import serve_app

TIMEOUT = 10.0

# --- simulator tokenizer ---------------------------------------------------------------------

VECTOR = [638357778, 638357778, 399020470, 1618501362, 2382766391,
          4116459851, 2312110321, 933488787, 2781045010]


def test_sim_vector() -> None:
    text = "### user: Hello, world!\n"
    assert split_tokens(text) == ["#", "#", "# ", "user", ": ", "Hello", ", ", "world", "!\n"]
    assert SimTokenizer().tokenize_prompt(text) == VECTOR


def test_fnv1a_32_known_values() -> None:
    assert fnv1a_32(b"") == 0x811C9DC5
    assert fnv1a_32(b"a") == 0xE40C292C
    assert fnv1a_32(b"foobar") == 0xBF9CF968


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("", []),
        ("  lead", ["lead"]),  # leading whitespace is matched by nothing: dropped
        ("a\vb", ["a", "b"]),  # \v is not Go's \s: dropped, not trailing whitespace
        ("a\t\n\f\r b", ["a\t\n\f\r ", "b"]),
        ("héllo wörld", ["h", "llo ", "w", "rld"]),  # ASCII \w only; non-ASCII dropped
        ("x_1+y-2\\z", ["x_1", "+", "y", "-", "2", "\\", "z"]),
        ("{}[]<>=\"'~^&*()$%@;?!/.,:", list("{}[]<>=\"'~^&*()$%@;?!/.,:")),
        ("a|b`c", ["a", "b", "c"]),  # | and ` are not in the alternation
    ],
)
def test_sim_split(text: str, tokens: list[str]) -> None:
    assert split_tokens(text) == tokens


def test_render_chat_plain_and_tool_call_id() -> None:
    sim = SimTokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world!"},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "assistant", "content": None},
    ]
    assert sim.render_chat(messages) == (
        "### system: Be brief.\n### user: Hello, world!\n### tool(call_1): 42\n### assistant: \n"
    )


def test_render_chat_parts_and_tool_calls() -> None:
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
            {"type": "image_url"},  # no url object: skipped
            {"type": "unknown", "text": "ignored"},
            {"type": "text", "text": "again"},
        ],
    }
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
            {"id": "c2", "type": "function", "function": {"name": None, "arguments": "x"}},
            {"id": "c3", "type": "function", "function": {"name": "g"}},
        ],
    }
    assert SimTokenizer().render_chat([message, assistant]) == (
        "### user: look\nimage: http://x/a.png\nagain\n"
        '### assistant: [f({"a":1})][g()]\n'
    )


async def test_sim_tokenize_bodies() -> None:
    sim = SimTokenizer()
    assert list(await sim.tokenize("m", {"prompt": "### user: Hello, world!\n"})) == VECTOR
    chat = {"messages": [{"role": "user", "content": "Hello, world!"}]}
    assert list(await sim.tokenize("m", chat)) == VECTOR
    with pytest.raises(ValueError, match="prompt"):
        await sim.tokenize("m", {"prompt": [1, 2, 3]})
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        await sim.tokenize("m", {"messages": ["not an object"]})


# --- engine /tokenize client -----------------------------------------------------------------


class FakeTokenizeServer:
    """A small aiohttp app imitating vLLM's POST /tokenize; ``mode`` selects a failure."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.requests: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.mode == "error":
            return web.json_response({"error": "model\nnot found"}, status=404)
        if self.mode == "slow":
            await asyncio.sleep(5)
        if self.mode == "garbage":
            return web.Response(text="<html>oops</html>")
        if self.mode == "no_tokens":
            return web.json_response({"count": 1})
        if "messages" in body:
            tokens = [len(body["messages"]), int(body.get("add_generation_prompt", False))]
        else:
            tokens = [len(w) for w in body["prompt"].split()]
        return web.json_response({"count": len(tokens), "tokens": tokens, "max_model_len": 2048})


@pytest.fixture
async def tokenize_server() -> AsyncIterator[tuple[str, FakeTokenizeServer]]:
    fake = FakeTokenizeServer()
    app = web.Application()
    app.router.add_post("/tokenize", fake.handle)
    runner, url = await serve_app(app)
    try:
        yield url, fake
    finally:
        await runner.cleanup()


async def test_engine_tokenizer_prompt_and_chat(
    tokenize_server: tuple[str, FakeTokenizeServer],
) -> None:
    base, fake = tokenize_server
    async with asyncio.timeout(TIMEOUT), aiohttp.ClientSession() as session:
        tok = EngineTokenizer(base + "/", session)
        assert await tok.tokenize("tiny", {"prompt": "ab cde f", "max_tokens": 3}) == [2, 3, 1]
        messages = [{"role": "user", "content": "hi"}]
        assert await tok.tokenize("tiny", {"messages": messages, "temperature": 0}) == [1, 1]
    assert fake.requests == [
        {"model": "tiny", "prompt": "ab cde f"},
        {"model": "tiny", "messages": messages, "add_generation_prompt": True},
    ]


def test_tokenize_request_passes_rendering_fields() -> None:
    body = {"messages": [], "add_generation_prompt": False, "tools": [], "stream": True}
    assert tokenize_request("m", body) == {
        "model": "m", "messages": [], "add_generation_prompt": False, "tools": []
    }
    with pytest.raises(ValueError):
        tokenize_request("m", {"input": "x"})


@pytest.mark.parametrize(
    ("mode", "match"),
    [("error", "HTTP 404"), ("garbage", "not JSON"), ("no_tokens", "malformed")],
)
async def test_engine_tokenizer_errors(
    tokenize_server: tuple[str, FakeTokenizeServer], mode: str, match: str
) -> None:
    base, fake = tokenize_server
    fake.mode = mode
    async with asyncio.timeout(TIMEOUT), aiohttp.ClientSession() as session:
        with pytest.raises(TokenizeError, match=match) as info:
            await EngineTokenizer(base, session).tokenize("m", {"prompt": "x"})
    assert "\n" not in str(info.value)


async def test_engine_tokenizer_timeout(tokenize_server: tuple[str, FakeTokenizeServer]) -> None:
    base, fake = tokenize_server
    fake.mode = "slow"
    async with asyncio.timeout(TIMEOUT), aiohttp.ClientSession() as session:
        with pytest.raises(TokenizeError, match="timed out"):
            await EngineTokenizer(base, session, timeout=0.2).tokenize("m", {"prompt": "x"})


async def test_engine_tokenizer_connection_refused(unused_tcp_port: int) -> None:
    async with asyncio.timeout(TIMEOUT), aiohttp.ClientSession() as session:
        tok = EngineTokenizer(f"http://127.0.0.1:{unused_tcp_port}", session)
        with pytest.raises(TokenizeError):
            await tok.tokenize("m", {"prompt": "x"})


# --- caching ---------------------------------------------------------------------------------


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    async def tokenize(self, model: str, body: dict[str, Any]) -> list[int]:
        self.calls += 1
        if body.get("prompt") == "fail":
            raise RuntimeError("boom")
        return [len(model), len(json.dumps(body, sort_keys=True))]


async def test_caching_hits_and_misses() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)
    assert isinstance(cache, Tokenizer) and isinstance(SimTokenizer(), Tokenizer)
    first = await cache.tokenize("m", {"prompt": "a", "max_tokens": 1})
    first.append(999)  # callers get a copy
    second = await cache.tokenize("m", {"max_tokens": 7, "prompt": "a", "stream": True})
    assert second == first[:-1]
    await cache.tokenize("other", {"prompt": "a"})
    assert (cache.hits, cache.misses, inner.calls, len(cache)) == (1, 2, 2, 2)


async def test_caching_bound_is_lru() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner, maxsize=2)
    await cache.tokenize("m", {"prompt": "a"})
    await cache.tokenize("m", {"prompt": "b"})
    await cache.tokenize("m", {"prompt": "a"})  # hit: "a" becomes most recent
    await cache.tokenize("m", {"prompt": "c"})  # evicts "b"
    assert len(cache) == 2
    await cache.tokenize("m", {"prompt": "a"})
    await cache.tokenize("m", {"prompt": "b"})
    assert (cache.hits, cache.misses) == (2, 4)


async def test_caching_does_not_cache_errors() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            await cache.tokenize("m", {"prompt": "fail"})
    assert (inner.calls, cache.misses, len(cache)) == (2, 2, 0)


def test_cache_key_canonical() -> None:
    a = cache_key("m", {"messages": [{"role": "u", "content": "é"}], "temperature": 1})
    b = cache_key("m", {"messages": [{"content": "é", "role": "u"}]})
    assert a == b and "é" in a
    assert cache_key("m", {"prompt": "x"}) != cache_key("m", {"messages": "x"})
    with pytest.raises(ValueError):
        CachingTokenizer(CountingTokenizer(), maxsize=0)


async def test_caching_over_sim_tokenizer() -> None:
    cache = CachingTokenizer(SimTokenizer())
    for _ in range(3):
        assert await cache.tokenize("m", {"prompt": "### user: Hello, world!\n"}) == VECTOR
    assert (cache.hits, cache.misses) == (2, 1)
