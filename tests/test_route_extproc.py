"""kvindex's ext_proc server driven as Envoy drives it, without Envoy: a real gRPC client (grpcio)
sending the ProcessingRequest messages Envoy sends (FULL_DUPLEX_STREAMED for the picker,
observability mode for the observer), to a real daemon whose engines publish real vLLM KV events
over ZeroMQ and serve real /metrics pages. Tests with a real Envoy are in test_gateway.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from kvindex.config import Config, EngineConfig, ModelConfig
from kvindex.route.protocol import CHUNK_BYTES, DESTINATION, REQUEST_ID
from kvindex.settings import RouteSettings
from kvindex.tools.demo_replica import BLOCK_SIZE, Replica
from adapters.llmd_sim import SimTokenizer
from tests.conftest import serve_app, wait_for

MODEL = "m"
SYSTEM = " ".join(f"w{i}" for i in range(400))  # 400 tokens: 25 blocks


class MetricsEngine:
    """A simulated engine: vLLM's prefix cache publishing its KV events (``Replica``) and a real
    /metrics page whose waiting queue a test sets."""

    def __init__(self, i: int, ctx: Any) -> None:
        self.replica = Replica(i, MODEL, 1024, ctx)
        self.waiting = 0.0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        await self.replica.engine.start()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.runner, self.url = await serve_app(app)

    async def _metrics(self, request: web.Request) -> web.Response:
        usage = self.replica.cache.physical_blocks() / self.replica.cache.num_blocks
        return web.Response(text=f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {self.waiting}\n'
                                 f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {usage}\n')

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")

    async def serve(self, body: dict[str, Any]) -> tuple[int, int]:
        """What the engine does with a request: prefill (publishing its events); (prompt, cached) tokens."""
        ids = tuple(await SimTokenizer().tokenize(MODEL, body))
        adm = self.replica.admit(ids)
        await self.replica.publish(adm)
        return adm.prompt_tokens, adm.cached_tokens

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        await self.replica.engine.close()


@pytest.fixture
async def fleet(make_harness: Callable[..., Any]) -> AsyncIterator[tuple[Any, list[MetricsEngine]]]:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    engines = [MetricsEngine(i, ctx) for i in range(2)]
    for e in engines:
        await e.start()
    cfg = Config(engines=tuple(EngineConfig(e.replica.engine.endpoint, pod=e.replica.pod, model=MODEL,
                                            block_size=BLOCK_SIZE, replay=e.replica.engine.replay_address, url=e.url)
                               for e in engines),
                 models={MODEL: ModelConfig(tokenizer="llmd-sim")}, ext_proc_port=0,
                 route=RouteSettings(seed=1, scrape_seconds=0.02))
    h = await make_harness(cfg)
    await wait_for(lambda: all(lane.state.connected_peers for lane in h.daemon.fleet.lanes().values()), 10, "connected")
    for e in engines:
        await e.replica.engine.wait_subscribers(1)
    await wait_for(lambda: all(not h.daemon.route.path.scraper.stale(e.url) for e in engines), 5, "load scraped")
    await h.daemon.route.path.refresh()  # the directory now sees the lanes connected (else within 0.2 s)
    yield h, engines
    for e in engines:
        await e.close()
    ctx.term()


def header_map(headers: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def picker_messages(body: bytes, chunk: int = 30_000, subset: list[str] | None = None) -> list[pb.ProcessingRequest]:
    """What Envoy's picker filter sends for one POST: headers, then the body in chunks."""
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(
        {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"})))
    first.protocol_config.request_body_mode = 4  # FULL_DUPLEX_STREAMED
    out = [first]
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    for i, part in enumerate(parts):
        msg = pb.ProcessingRequest(request_body=pb.HttpBody(body=part, end_of_stream=i == len(parts) - 1))
        if subset is not None and i == len(parts) - 1:
            hint = struct_pb2.Struct()
            hint.update({"x-gateway-destination-endpoint-subset": subset})
            msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
        out.append(msg)
    return out


async def pick(port: int, body: bytes, **kw: Any) -> list[pb.ProcessingResponse]:
    """One picker stream: every answer until the body is back (or an immediate response)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                request_serializer=pb.ProcessingRequest.SerializeToString,
                                response_deserializer=pb.ProcessingResponse.FromString)()
        for m in picker_messages(body, **kw):
            await call.write(m)
        answers = []
        while True:
            r = await asyncio.wait_for(call.read(), 5)
            answers.append(r)
            if r.HasField("immediate_response") or r.request_body.response.body_mutation.streamed_response.end_of_stream:
                break
        await call.done_writing()
        return answers


def destination(answers: list[pb.ProcessingResponse]) -> tuple[str | None, str | None]:
    first = answers[0].request_headers.response
    hs = {h.header.key: h.header.raw_value.decode() for h in first.header_mutation.set_headers}
    meta = answers[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value \
        if "envoy.lb" in answers[0].dynamic_metadata.fields else None
    assert meta == hs.get(DESTINATION) and first.clear_route_cache == (meta is not None)
    return hs.get(DESTINATION), hs.get(REQUEST_ID)


async def observe_answer(port: int, request_id: str, served: str, usage: dict[str, Any]) -> None:
    """The observer's stream of the same request: its headers (with the picker's id), the answer."""
    attrs = struct_pb2.Struct()
    attrs.update({"upstream.address": served})
    messages = [
        pb.ProcessingRequest(observability_mode=True, request_headers=pb.HttpHeaders(
            headers=header_map({":method": "POST", REQUEST_ID: request_id}))),
        pb.ProcessingRequest(observability_mode=True, response_headers=pb.HttpHeaders(
            headers=header_map({":status": "200", "content-type": "application/json"}))),
        pb.ProcessingRequest(observability_mode=True, response_body=pb.HttpBody(
            body=json.dumps({"usage": usage}).encode(), end_of_stream=True)),
    ]
    messages[1].attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                request_serializer=pb.ProcessingRequest.SerializeToString,
                                response_deserializer=pb.ProcessingResponse.FromString)()
        for m in messages:
            await call.write(m)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF  # the observer answers nothing


def chat(user: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}


async def test_pick_sends_a_prefix_to_its_holder_and_the_body_back_whole(fleet: Any) -> None:
    h, (a, b) = fleet
    await a.serve(chat("hello"))  # a now holds the system prompt
    await h.wait_seq(a.replica.pod, 0)
    body = json.dumps(chat("again " * 30_000)).encode()  # ~210 KB: several chunks each way
    answers = await pick(h.daemon.ext_proc_port, body)
    dest, rid = destination(answers)
    assert dest == a.address and rid
    chunks = [r.request_body.response.body_mutation.streamed_response for r in answers[1:]]
    assert b"".join(c.body for c in chunks) == body and all(len(c.body) <= CHUNK_BYTES for c in chunks)
    prompt, cached = await a.serve(chat("again " * 30_000))
    await observe_answer(h.daemon.ext_proc_port, rid, dest, {"prompt_tokens": prompt,
                                                              "prompt_tokens_details": {"cached_tokens": cached}})
    status, doc = await h.get("/v1/decisions?limit=5")
    d = await wait_for(lambda: next((x for x in h.daemon.services.decisions.log.latest(5) if x.id == rid), None), 5)
    assert d.source == "pick" and d.pod == a.replica.pod and d.realized == cached == d.precise == 400 - 400 % 16
    status, doc = await h.get("/v1/decisions?limit=1")
    assert status == 200 and doc["decisions"][0]["id"] == rid and doc["decisions"][0]["prefix_from"][b.replica.pod] == "precise"


async def test_load_moves_cold_requests_and_the_subset_hint_binds(fleet: Any) -> None:
    h, (a, b) = fleet
    a.waiting = 20.0
    await wait_for(lambda: h.daemon.route.path.scraper.load(a.url).waiting == 20.0, 5, "a's queue scraped")
    picks = [destination(await pick(h.daemon.ext_proc_port, json.dumps(chat(f"cold {i}")).encode()))[0]
             for i in range(4)]
    assert picks == [b.address] * 4  # nobody holds these: the idle engine wins on load
    only_a = await pick(h.daemon.ext_proc_port, json.dumps(chat("x")).encode(), subset=[a.address])
    assert destination(only_a)[0] == a.address
    none = await pick(h.daemon.ext_proc_port, json.dumps(chat("x")).encode(), subset=["10.9.9.9:1"])
    assert none[0].immediate_response.status.code == 503 and b"subset" in none[0].immediate_response.body


async def test_bad_requests_get_one_line_reasons(fleet: Any) -> None:
    h, _ = fleet
    port = h.daemon.ext_proc_port
    cases = [(b"not json", 400, b"not valid JSON"), (b"[1, 2]", 400, b"JSON object"),
             (b'{"messages": []}', 400, b"model"), (json.dumps(chat("x") | {"model": "other"}).encode(), 503, b"other"),
             (b"[" * 100 + b"]" * 100, 400, b"deeper")]
    for body, status, words in cases:
        r = (await pick(port, body))[0].immediate_response
        assert r.status.code == status and words in r.body and json.loads(r.body)["error"]
    big = (await pick(port, b"x" * (33 << 20), chunk=1 << 20))[0].immediate_response
    assert big.status.code == 413
    status, doc = await h.get("/v1/pods")
    assert status == 200  # nothing of it hurt the daemon


async def test_an_unsynced_pod_is_scored_from_the_approximate_index(fleet: Any) -> None:
    h, (a, b) = fleet
    await a.serve(chat("hello"))
    await h.wait_seq(a.replica.pod, 0)
    a.replica.engine.clear_buffer()  # no replay possible: a gap can only end unsynced
    a.replica.seq += 5
    await a.serve(chat("later " * 40))  # new blocks: a batch, its seq 5 past the last
    await wait_for(lambda: not h.stream(a.replica.pod).synced, 5, "a unsynced")
    await h.daemon.route.path.refresh()
    answers = await pick(h.daemon.ext_proc_port, json.dumps(chat("q")).encode())
    _, rid = destination(answers)
    pending = h.daemon.route.path.inflight.take(rid)
    assert pending.details["prefix_from"] == {a.replica.pod: "approx", b.replica.pod: "precise"}


async def test_an_engine_refusing_connections_is_not_picked(fleet: Any) -> None:
    h, (a, b) = fleet
    await b.runner.cleanup()  # b's HTTP port closes
    b.runner = None
    await wait_for(lambda: h.daemon.route.path.scraper.down(b.url) is not None, 5, "b seen down")
    for i in range(3):
        assert destination(await pick(h.daemon.ext_proc_port, json.dumps(chat(f"c{i}")).encode()))[0] == a.address


async def test_health_services(fleet: Any) -> None:
    h, _ = fleet
    async with grpc.aio.insecure_channel(f"127.0.0.1:{h.daemon.ext_proc_port}") as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        for service in (b"liveness", b"readiness", b"envoy.service.ext_proc.v3.ExternalProcessor"):
            assert await check(b"\x0a" + bytes([len(service)]) + service) == b"\x08\x01"
        assert await check(b"\x0a\x03abc") == b"\x08\x03"
