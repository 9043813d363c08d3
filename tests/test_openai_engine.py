"""Tests of the simulated OpenAI/vLLM engine: a real aiohttp server and real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
from array import array
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from adapters.dialects import DIALECTS
from adapters.llmd_sim import SimTokenizer
from kvindex.events import BlockStored
from kvindex.tools.openai_api import answer_text
from kvindex.tools.openai_engine import EngineOptions, OpenAIEngine
from tests.conftest import ROOT, wait_for

MODEL = "sim-model"
TOK = SimTokenizer()


def words(n: int, start: int = 0) -> str:
    """A prompt of exactly ``n`` SimTokenizer tokens (one per word)."""
    return " ".join(f"w{i}" for i in range(start, start + n))


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def make(ctx: zmq.asyncio.Context) -> AsyncIterator[Callable[..., Any]]:
    made: list[OpenAIEngine] = []

    async def start(**kw: Any) -> OpenAIEngine:
        engine = OpenAIEngine(EngineOptions(**{"pod": f"pod-{len(made)}", "model": MODEL, **kw}), ctx)
        await engine.start()
        made.append(engine)
        return engine

    yield start
    for engine in made:
        await engine.close()


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def metrics(session: aiohttp.ClientSession, engine: OpenAIEngine) -> dict[str, float]:
    async with session.get(engine.url + "/metrics") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        text = await r.text()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.labels.get("model_name") == MODEL}


async def test_repeated_prompt_hits_full_blocks_before_last_token(make: Any, session: aiohttp.ClientSession) -> None:
    engine = await make()
    ids = list(range(1000, 1040))  # 40 tokens, block 16
    status, first = await post(session, engine.url + "/v1/completions",
                               {"model": MODEL, "prompt": ids, "max_tokens": 3})
    assert status == 200
    assert first["object"] == "text_completion" and first["model"] == MODEL
    assert first["choices"][0]["text"] == answer_text(3) and len(first["choices"][0]["text"].split()) == 3
    assert first["usage"] == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    _, again = await post(session, engine.url + "/v1/completions", {"model": MODEL, "prompt": ids})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert again["usage"]["completion_tokens"] == 16
    text = words(40)
    _, a = await post(session, engine.url + "/v1/completions", {"prompt": text})
    _, b = await post(session, engine.url + "/v1/completions", {"prompt": text})
    assert (a["usage"]["prompt_tokens"], a["usage"]["prompt_tokens_details"]["cached_tokens"]) == (40, 0)
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert (engine.stats.requests, engine.stats.prompt_tokens, engine.stats.cached_tokens) == (4, 160, 64)
    assert list(engine.stats.recent) == [(40, 0), (40, 32), (40, 0), (40, 32)]


async def test_chat_tokens_are_the_sim_tokenizers(make: Any, session: aiohttp.ClientSession) -> None:
    engine = await make()
    messages = [{"role": "system", "content": "You are terse. " + words(30)},
                {"role": "user", "content": [{"type": "text", "text": "Hi, there?"},
                                             {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    expected = list(TOK.tokenize_prompt(TOK.render_chat(messages)))
    status, tok = await post(session, engine.url + "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and tok["tokens"] == expected and tok["count"] == len(expected) and tok["max_model_len"] > 0
    _, tok_prompt = await post(session, engine.url + "/tokenize", {"prompt": "a b, c"})
    assert tok_prompt["tokens"] == list(TOK.tokenize_prompt("a b, c"))
    status, first = await post(session, engine.url + "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert status == 200 and first["object"] == "chat.completion"
    assert first["choices"][0]["message"] == {"role": "assistant", "content": answer_text(16)}
    assert first["usage"]["prompt_tokens"] == len(expected)
    _, again = await post(session, engine.url + "/v1/chat/completions",
                          {"model": MODEL, "messages": messages, "max_completion_tokens": 2})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(expected) - 1) // 16 * 16 > 0
    assert again["usage"]["completion_tokens"] == 2


class PackedSimTokenizer(SimTokenizer):
    """SimTokenizer answering the packed ``array("I")`` (as it may soon do)."""

    def tokenize_prompt(self, text: str) -> Any:
        return array("I", super().tokenize_prompt(text))


async def test_packed_token_ids_from_the_tokenizer_are_accepted(make: Any, session: aiohttp.ClientSession) -> None:
    engine = await make()
    engine.tokenizer = PackedSimTokenizer()
    messages = [{"role": "user", "content": words(40)}]
    expected = list(TOK.tokenize_prompt(TOK.render_chat(messages)))
    _, tok = await post(session, engine.url + "/tokenize", {"messages": messages})
    assert tok["tokens"] == expected
    for _ in range(2):
        status, r = await post(session, engine.url + "/v1/chat/completions", {"messages": messages})
        assert status == 200 and r["usage"]["prompt_tokens"] == len(expected)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(expected) - 1) // 16 * 16


async def test_chunked_request_body_is_accepted(make: Any) -> None:
    engine = await make()
    body = json.dumps({"model": MODEL, "prompt": words(20), "max_tokens": 2}).encode()
    chunks = [body[:7], body[7:30], body[30:]]
    reader, writer = await asyncio.open_connection("127.0.0.1", engine.port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for c in chunks:
            writer.write(b"%x\r\n%s\r\n" % (len(c), c))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b'"prompt_tokens":20' in payload


async def read_sse(session: aiohttp.ClientSession, url: str, body: Any) -> list[str]:
    async with session.post(url, json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = (await r.read()).decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


async def test_stream_with_usage_ends_with_usage_chunk_then_done(make: Any, session: aiohttp.ClientSession) -> None:
    engine = await make(decode_seconds_per_token=0.001)
    body = {"model": MODEL, "prompt": words(40), "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    data = await read_sse(session, engine.url + "/v1/completions", body)
    assert data[-1] == "[DONE]" and len(data) == 5 + 2
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:5]) == answer_text(5)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:5]] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 40
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    chat = await read_sse(session, engine.url + "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": words(40)}], "max_tokens": 3, "stream": True})
    assert chat[-1] == "[DONE]" and len(chat) == 3 + 1  # no usage chunk unless asked
    parsed = [json.loads(d) for d in chat[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in parsed)
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in parsed) == answer_text(3)


async def test_kv_events_reach_a_sub_socket_and_decode(make: Any, ctx: zmq.asyncio.Context,
                                                       session: aiohttp.ClientSession) -> None:
    engine = await make(pod="engine-a")
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.subscribe(b"")
        sub.connect(engine.kv_endpoint)
        await engine.replica.engine.wait_subscribers(1)
        text = words(40)
        tokens = list(TOK.tokenize_prompt(text))
        _, r = await post(session, engine.url + "/v1/completions", {"model": MODEL, "prompt": text})
        assert engine.replica.seq == 1  # published before the answer was written
        assert await sub.poll(5000)
        topic, seq, payload = await sub.recv_multipart()
        assert topic == f"kv@engine-a@{MODEL}".encode() and int.from_bytes(seq, "big") == 0
        batch = DIALECTS["vllm"].decoder().decode(payload)
        (stored,) = batch.events
        assert isinstance(stored, BlockStored)
        assert list(stored.token_ids) == tokens[:32] and stored.block_size == 16 and stored.parent_hash is None
        assert list(stored.block_hashes) == engine.replica.cache.hashes(tokens)
        await post(session, engine.url + "/v1/completions", {"prompt": text + " " + words(16, start=40)})
        assert await sub.poll(5000)
        _, seq2, payload2 = await sub.recv_multipart()
        (more,) = DIALECTS["vllm"].decoder().decode(payload2).events
        assert int.from_bytes(seq2, "big") == 1
        assert isinstance(more, BlockStored) and list(more.token_ids) == list(TOK.tokenize_prompt(
            text + " " + words(16, start=40)))[32:48]
        assert more.parent_hash == stored.block_hashes[-1]
        dealer.connect(engine.replay_endpoint)  # the ROUTER replays both batches, then the end marker
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(3)]
        assert [f[2] for f in replayed] == [seq, seq2, b"\xff" * 8]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)


async def test_metrics_move_with_load(make: Any, session: aiohttp.ClientSession) -> None:
    engine = await make(metrics_padding_lines=50, cache_blocks=64)
    m = await metrics(session, engine)
    assert m["vllm:num_requests_waiting"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    engine.pause()
    tasks = [asyncio.create_task(post(session, engine.url + "/v1/completions", {"prompt": words(40, start=100 * i)}))
             for i in range(3)]
    try:
        await wait_for(lambda: engine.waiting == 3, what="3 queued requests")
        m = await metrics(session, engine)
        assert m["vllm:num_requests_waiting"] == 3 and m["vllm:num_requests_running"] == 0
    finally:
        engine.resume()
        results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _ in results)
    m = await metrics(session, engine)
    assert m["vllm:num_requests_waiting"] == 0 and m["vllm:num_requests_running"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 6 / 64  # 3 prompts x 2 full blocks
    assert m["vllm:prompt_tokens_total"] == 120 == m["vllm:prefix_cache_queries_total"]
    assert m["vllm:prefix_cache_hits_total"] == 0
    engine.set_waiting_override(7)
    engine.set_usage_override(0.5)
    m = await metrics(session, engine)
    assert (m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"]) == (7, 0.5)
    async with session.get(engine.url + "/metrics") as r:
        lines = (await r.text()).splitlines()
    first_vllm = next(i for i, line in enumerate(lines) if "vllm:num_requests" in line)
    assert sum("sim_padding{" in line for line in lines[:first_vllm]) == 50
    assert not any("sim_padding" in line for line in lines[first_vllm:])
    assert "# TYPE vllm:num_requests_waiting gauge" in lines


async def test_max_running_and_close_refuses_queued(make: Any, session: aiohttp.ClientSession) -> None:
    engine = await make(max_running=1, prefill_seconds_per_token=0.005)
    slow = asyncio.create_task(post(session, engine.url + "/v1/completions", {"prompt": words(40)}))
    queued = asyncio.create_task(post(session, engine.url + "/v1/completions", {"prompt": words(8)}))
    await wait_for(lambda: engine.running == 1 and engine.waiting == 1, what="one running, one waiting")
    assert (await slow)[0] == 200 and (await queued)[0] == 200
    engine.pause()
    held = asyncio.create_task(post(session, engine.url + "/v1/completions", {"prompt": words(8)}))
    await wait_for(lambda: engine.waiting == 1, what="a held request")
    await engine.close()
    await engine.close()
    status, body = await held
    assert status == 503 and body["error"]["code"] == 503


async def test_bad_requests_get_vllm_errors_and_it_keeps_serving(make: Any, session: aiohttp.ClientSession) -> None:
    engine = await make()
    status, body = await post(session, engine.url + "/v1/completions", {"model": "x", "prompt": "hi"})
    assert status == 404 and body == {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                                "param": "model", "code": 404}}
    status, _ = await post(session, engine.url + "/v1/chat/completions", {"model": "x", "messages": []})
    assert status == 404
    garbage = [b"\x00\xffnot json", b"[1, 2]", b"", b'{"prompt": 5}', b'{"messages": "hi"}', b'{"messages": [3]}',
               b'{"prompt": [1, -2]}', b'{"prompt": [true]}', b'{"prompt": [[1], [2]]}', b'{"model": 3}']
    generation = [b'{"prompt": "a", "messages": [], "max_tokens": "9"}', b'{"prompt": "a", "messages": [], "max_tokens": 0}',
                  b'{"prompt": "a", "messages": [], "stream": "yes"}',
                  b'{"prompt": "a", "messages": [], "stream_options": 1}']
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        for raw in garbage + (generation if path != "/tokenize" else []):
            async with session.post(engine.url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400, (path, raw)
                err = (await r.json())["error"]
                assert err["type"] == "BadRequestError" and err["code"] == 400
    async with session.get(engine.url + "/health") as r:
        assert r.status == 200
    async with session.get(engine.url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    status, ok = await post(session, engine.url + "/v1/completions", {"prompt": "still here"})
    assert status == 200 and ok["usage"]["prompt_tokens"] == 2


async def test_cli_starts_engines_and_stops_on_sigterm(session: aiohttp.ClientSession) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvindex.tools.openai_fleet", "--replicas", "2", "--model", MODEL,
        "--cache-blocks", "128", "--prefill-us-per-token", "1", "--max-running", "4",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        info = json.loads(line)
        engines = info["engines"]
        assert [e["pod"] for e in engines] == ["sim-0", "sim-1"]
        assert all(e["url"] == "http://" + e["address"] and e["kv_endpoint"].startswith("tcp://127.0.0.1:")
                   and e["replay_endpoint"].startswith("tcp://127.0.0.1:") for e in engines)
        for e in engines:
            status, body = await post(session, e["url"] + "/v1/completions", {"model": MODEL, "prompt": words(20)})
            assert status == 200 and body["usage"]["prompt_tokens"] == 20
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 5)
        _, err = await proc.communicate()
        assert rc == 0, err.decode()
        assert await proc.stdout.read() == b""  # one JSON line, nothing more
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
