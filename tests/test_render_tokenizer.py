"""``tokenizer = "render"``: vLLM's render endpoints, with the /tokenize fallback, against a real
aiohttp server that answers as vLLM 0.32 does (``entrypoints/scale_out/render/api_router.py``:
the chat render answers one ``GenerateRequest`` object, the completions render a list of them;
with ``--enable-scale-out`` off every render route answers 403 ``PermissionDeniedError``). The
server is the engine's stand-in; the unit under test is ``RenderTokenizer`` and the daemon."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from adapters.engine_tokenizer import MAX_ANSWER_BYTES, RenderTokenizer, TokenizeError
from adapters.hf_tokenizer import HFTokenizer
from kvindex.config import Config, ModelConfig
from tests.conftest import FIXTURES, serve_app

TIMEOUT = 10.0
CHAT = "/v1/chat/completions/render"
COMPLETIONS = "/v1/completions/render"


class FakeVllm:
    """Tokenizes with the tiny model's files and answers in vLLM's shapes; ``render`` picks how the
    render routes behave: "on", "off" (403, scale-out disabled), "absent" (404), "broken" (500)."""

    def __init__(self) -> None:
        self.tok = HFTokenizer.load(FIXTURES / "tiny-model")
        self.render = "on"
        self.tokenize_status = 200
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append((request.path, body))
        if request.path == "/tokenize":
            if self.tokenize_status != 200:
                return web.json_response({"error": {"message": "The model `x` does not exist."}},
                                         status=self.tokenize_status)
            ids = self.tok.tokenize_now(body)
            return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})
        if self.render == "off":
            return web.json_response({"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve "
                                                 "with --enable-scale-out to enable them.",
                                                 "type": "PermissionDeniedError", "code": 403}}, status=403)
        if self.render == "absent":
            return web.json_response({"detail": "Not Found"}, status=404)
        if self.render == "broken":
            return web.Response(text="Internal Server Error", status=500)
        if self.render == "huge":  # streamed (no Content-Length): the cap must hold while reading
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(64):
                await resp.write(b" " * 4096)
            await resp.write_eof()
            return resp
        one = {"request_id": "chatcmpl-1", "token_ids": self.tok.tokenize_now(body), "token_offsets": None,
               "features": None, "sampling_params": {"max_tokens": 16}, "model": body["model"], "stream": False,
               "cache_salt": None, "priority": 0}
        return web.json_response(one if request.path == CHAT else [one])


@pytest.fixture
async def vllm() -> AsyncIterator[tuple[str, FakeVllm]]:
    fake = FakeVllm()
    app = web.Application()
    for path in ("/tokenize", CHAT, COMPLETIONS):
        app.router.add_post(path, fake.handle)
    runner, url = await serve_app(app)
    try:
        yield url, fake
    finally:
        await runner.cleanup()


MESSAGES = [{"role": "user", "content": "hello there"}]


async def test_render_endpoints_shapes(vllm: tuple[str, FakeVllm]) -> None:
    base, fake = vllm
    async with asyncio.timeout(TIMEOUT), aiohttp.ClientSession() as session:
        tok = RenderTokenizer(base, session)
        chat = await tok.tokenize("tiny", {"messages": MESSAGES, "max_tokens": 3, "chat_template_kwargs": {"a": 1}})
        prompt = await tok.tokenize("tiny", {"prompt": "hello there", "stream": True})
    assert chat == fake.tok.tokenize_now({"messages": MESSAGES})
    assert prompt == fake.tok.tokenize_now({"prompt": "hello there"}) and prompt[0] == 0
    assert [p for p, _ in fake.calls] == [CHAT, COMPLETIONS] and not tok.render_off
    assert fake.calls[0][1] == {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": True,
                                "chat_template_kwargs": {"a": 1}}
    assert fake.calls[1][1] == {"model": "tiny", "prompt": "hello there"}


@pytest.mark.parametrize("mode", ["off", "absent"])
async def test_render_off_falls_back_to_tokenize_and_remembers(vllm: tuple[str, FakeVllm], mode: str) -> None:
    base, fake = vllm
    fake.render = mode
    async with asyncio.timeout(TIMEOUT), aiohttp.ClientSession() as session:
        tok = RenderTokenizer(base, session)
        first = await tok.tokenize("tiny", {"messages": MESSAGES})
        second = await tok.tokenize("tiny", {"prompt": "hello"})
    assert first == fake.tok.tokenize_now({"messages": MESSAGES})
    assert second == fake.tok.tokenize_now({"prompt": "hello"})
    assert tok.render_off and [p for p, _ in fake.calls] == [CHAT, "/tokenize", "/tokenize"]


async def test_a_404_that_tokenize_shares_is_not_remembered(vllm: tuple[str, FakeVllm]) -> None:
    base, fake = vllm
    fake.render, fake.tokenize_status = "absent", 404
    async with asyncio.timeout(TIMEOUT), aiohttp.ClientSession() as session:
        tok = RenderTokenizer(base, session)
        with pytest.raises(TokenizeError, match="HTTP 404"):
            await tok.tokenize("nope", {"prompt": "x"})
    assert not tok.render_off


async def test_render_errors_are_one_line(vllm: tuple[str, FakeVllm]) -> None:
    base, fake = vllm
    fake.render = "broken"
    async with asyncio.timeout(TIMEOUT), aiohttp.ClientSession() as session:
        tok = RenderTokenizer(base, session)
        with pytest.raises(TokenizeError, match="HTTP 500") as info:
            await tok.tokenize("tiny", {"prompt": "x"})
        assert "\n" not in str(info.value) and not tok.render_off
        fake.render = "on"
        with pytest.raises(ValueError):  # no prompt, no messages: refused before any request
            await tok.tokenize("tiny", {"input": "x"})
    assert len(fake.calls) == 1


@pytest.mark.parametrize("mode", ["on", "huge"])
async def test_an_answer_over_the_cap_is_a_one_line_error(vllm: tuple[str, FakeVllm], mode: str) -> None:
    base, fake = vllm
    fake.render = mode
    async with asyncio.timeout(TIMEOUT), aiohttp.ClientSession() as session:
        tok = RenderTokenizer(base, session, max_answer_bytes=100)
        with pytest.raises(TokenizeError, match=r"answer (of \d+ bytes|over 100 bytes)") as info:
            await tok.tokenize("tiny", {"messages": MESSAGES})
        assert "\n" not in str(info.value) and "100" in str(info.value) and not tok.render_off
        if mode == "on":  # the same answer under a cap it fits
            roomy = RenderTokenizer(base, session, max_answer_bytes=1 << 20)
            assert await roomy.tokenize("tiny", {"messages": MESSAGES}) == fake.tok.tokenize_now({"messages": MESSAGES})
    assert MAX_ANSWER_BYTES >= 8 << 20  # a max_token_ids answer fits


async def test_daemon_scores_a_body_through_render(vllm: tuple[str, FakeVllm], make_harness: Any) -> None:
    base, fake = vllm
    h = await make_harness(Config(models={"tiny": ModelConfig(tokenizer="render", tokenize_url=base)}))
    for mode in ("on", "off"):  # two bodies (the cache answers a body it has seen)
        fake.render = mode
        messages = [{"role": "user", "content": f"hello {mode}"}]
        status, answer = await h.post("/v1/score", {"model": "tiny", "messages": messages})
        assert status == 200, answer
        assert answer["prompt_tokens"] == len(fake.tok.tokenize_now({"messages": messages}))
    fake.render = "broken"
    status, answer = await h.post("/v1/score", {"model": "tiny", "prompt": "never seen"})
    assert status == 200  # render_off was remembered: /tokenize answers, render is not asked again
    assert [p for p, _ in fake.calls] == [CHAT, CHAT, "/tokenize", "/tokenize"]
