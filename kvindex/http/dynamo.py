"""The Dynamo standalone KV indexer / Mooncake RFC #1403 compatibility API.

``/register``, ``/unregister``, ``/workers``, ``/query``, ``/query_by_hash``, ``/dump``, ``/health``
with the peer's field names and response shapes, JSON or msgpack (``application/msgpack``; the
answer uses the request's encoding). The same routes serve Mooncake's dialect of the RFC, told
apart per request by ``kvindex.http.mooncake.speaks_mooncake`` (its shapes live there); both
dialects' queries go through the same path, so their numbers agree.

The registration rules live in ``kvindex.registrations`` (``EngineRegistry``); bodies are checked in
``kvindex.http.bodies``; the handlers here shape the peer's answers.

Invariants:
- An engine registered here is known by ``str(instance_id)`` everywhere (pod id); its
  ``(instance_id, dp_rank)`` is unique; the first registration of a (model, routing_group) fixes
  its block size and a different one later is refused.
- Counts in answers are matched tokens (blocks × block size); ``cpu`` and ``disk`` are cumulative
  through the device tier. As Dynamo does, ``/query`` counts every full block of the prompt,
  the one holding its last token included (kvindex's native API does not: it answers the
  engine's ``cached_tokens``). ``frequencies[i]`` is how many workers hold the prefix's first
  i+1 blocks.
- ``/query_tiered_by_hash`` (Dynamo's selection service, ai-dynamo/dynamo#14570) answers in
  blocks: ``{"block_size", "tiered": {"device": {"scores": [[{"worker_id", "dp_rank"}, blocks]],
  "frequencies"}, "lower_tier": [["host_pinned"|"disk", {"hits": [[worker, blocks]]}]]}}``; a
  lower tier's hits are the blocks it holds beyond the device match (cpu − gpu, disk − cpu).
- ``/dump`` is Dynamo's (``kvindex.dynamo_dump``): numeric worker ids, one stored event per block.
- ``/query`` and ``/query_by_hash`` answer ``query_answer``'s dict; to a JSON request its JSON bytes
  made in one C pass (``kvindex._jsontokens.dynamo_answer``, held byte for byte equal to
  ``json_body(query_answer(...))`` by tests/test_native.py), as a ``msgspec.Raw`` that ``json_body``
  writes as it is (``dynamo_body``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from kvindex import native
from kvindex.query.answers import PreciseAnswer
from kvindex.http import mooncake
from kvindex.dynamo_dump import worker_number
from kvindex.http.app import OPEN, WRITE, Services, scope, services
from kvindex.http.bodies import (
    MSGPACK,
    QueryBody,
    QueryByHashBody,
    RegisterBody,
    UnregisterBody,
    block_hashes,
    decode_body,
    instance_id,
    json_response,
    parse,
    read_body,
    reply,
)
from kvindex.http.server import body_bytes
from kvindex.registrations import DEFAULT_GROUP


@scope(WRITE)
async def register(request: web.Request) -> web.Response:
    body = await read_body(request, allow_msgpack=True)
    if mooncake.speaks_mooncake(body):
        return await mooncake_register(request, body)
    args = parse(body, RegisterBody)
    iid = instance_id(args.instance_id)
    reg = await services(request).engines.register(
        iid, args.model_name, args.routing_group or DEFAULT_GROUP, args.block_size, args.dp_rank, args.endpoint,
        args.replay_endpoint, args.url)
    services(request).metrics.known(iid, args.model_name)
    return json_response({"status": "registered", "instance_id": iid, "dp_rank": reg.dp_rank}, status=201)


async def mooncake_register(request: web.Request, body: dict[str, Any]) -> web.Response:
    """Mooncake's ``/register``: 200 ``registered successfully``, also for a repeat of the same one."""
    args = parse(body, mooncake.MooncakeRegister)
    group, replay = mooncake.register_args(args)
    iid, engines = instance_id(args.instance_id), services(request).engines
    if not mooncake.same_registration(engines.registered(iid, args.dp_rank), args, group, replay):
        await engines.register(iid, args.modelname, group, args.block_size, args.dp_rank, args.endpoint, replay)
        services(request).metrics.known(iid, args.modelname)
    return reply(request, mooncake.registered(iid))


@scope(WRITE)
async def unregister(request: web.Request) -> web.Response:
    body = await read_body(request, allow_msgpack=True)
    if mooncake.speaks_mooncake(body):
        moon = parse(body, mooncake.MooncakeUnregister)
        iid, group = instance_id(moon.instance_id), mooncake.tenant(moon.tenant_id)
        found = await services(request).engines.unregister(iid, moon.modelname, group, moon.dp_rank)
        return reply(request, mooncake.unregistered(found, group))
    args = parse(body, UnregisterBody)
    iid = instance_id(args.instance_id)
    found = await services(request).engines.unregister(iid, args.model_name, args.routing_group, args.dp_rank)
    return json_response({"status": "unregistered", "instance_id": iid, "listeners": len(found)})


async def workers(request: web.Request) -> web.Response:
    engines = services(request).engines
    return json_response(engines.workers(request.query.get("model_name"), request.query.get("routing_group")))


_RANKS = tuple(str(r) for r in range(256))  # dp ranks as JSON keys, made once
_WRITER = native.load("kvindex._jsontokens")  # its dynamo_answer: query_answer's JSON in C (or None)


def dynamo_body(answer: PreciseAnswer, content_type: str, writer: Any = _WRITER) -> Any:
    """``query_answer(answer)`` as a route's data: for a JSON request (anything but msgpack, as
    ``reply`` answers) the same JSON bytes written in C, as a ``msgspec.Raw``; whatever the C
    writer declines (``dynamo_answer``: unusual pod ids or depths), the dict."""
    if writer is not None and content_type != MSGPACK:
        raw = writer.dynamo_answer(answer.matches, answer.block_size)
        if raw is not None:
            return msgspec.Raw(raw)
    return query_answer(answer)


def query_answer(answer: PreciseAnswer) -> dict[str, Any]:
    """Dynamo's /query answer, in tokens. One pass over the pods (64 pods are ~40 us of Python:
    the one-rank case, nearly every pod, skips the comprehensions)."""
    bs = answer.block_size
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    depths: list[int] = []
    for pod, m in answer.matches.items():
        dp = m.dp
        if len(dp) == 1:
            [(rank, n)] = dp.items()
            tokens = {_RANKS[rank] if rank < 256 else str(rank): n * bs}
            depths.append(n)
            if n:
                scores[pod] = tokens
        else:
            tokens = {str(r): n * bs for r, n in dp.items()}
            depths.extend(dp.values())
            if held := {r: t for r, t in tokens.items() if t}:
                scores[pod] = held
        gpu = m.gpu * bs
        instances[pod] = {"longest_matched": gpu, "gpu": gpu, "dp": tokens, "cpu": m.cpu * bs, "disk": m.disk * bs}
    return {"scores": scores, "frequencies": frequencies(depths), "instances": instances}


def frequencies(depths: list[int]) -> list[int]:
    """Dynamo's ``frequencies``: ``out[i]`` = how many workers hold at least i+1 blocks. With the
    depths in ascending order, the ``n - i`` workers from the i-th on hold every depth from the one
    before up to ``ds[i]``: one run of equal counts per distinct depth, built in C (``[c] * k``),
    not one Python step per block (8 workers at ~240 blocks: ~4 us, was ~16)."""
    ds = sorted(depths)
    out: list[int] = []
    n, prev = len(ds), 0
    for i, d in enumerate(ds):
        if d > prev:
            out += [n - i] * (d - prev)
            prev = d
    return out


async def query(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    return reply(request, await query_data(services(request), await body_bytes(request), request.content_type, t0))


async def query_data(svc: Services, raw: bytes, content_type: str, t0: float) -> Any:
    """``/query``'s answer (Dynamo's shape, or Mooncake's for its dialect) to the body ``raw`` sent
    as ``content_type``, observed in ``kvindex_query_seconds`` from ``t0``: what the aiohttp
    handler and the fast path (``kvindex.http.fastpath``) both answer."""
    body = decode_body(raw, content_type, allow_msgpack=True, go=False, u32_field="token_ids")
    moon = parse(body, mooncake.MooncakeQuery) if mooncake.speaks_mooncake(body) else None
    if moon is not None:  # Mooncake's fields, then the same path as Dynamo's
        m = mooncake.query_args(moon, body)
        args = QueryBody(model_name=m.model, routing_group=m.group, lora_name=m.lora_name, cache_salt=m.cache_salt)
        body["token_ids"] = m.token_ids
    else:
        args = parse(body, QueryBody)
    model, lora_name = svc.query.identity(args.model_name, args.lora_name)  # an adapter named as the model: its base
    token_ids = svc.query.check_token_ids(body.get("token_ids"))
    pods = await svc.engines.candidates(model, args.routing_group)
    if moon is not None:
        pods = mooncake.only_instance(pods, moon)
    answer = await svc.query.precise(model, token_ids, pods, lora_name, args.cache_salt, whole=True)
    svc.metrics.query_timer("/query").observe(time.perf_counter() - t0)
    return mooncake.query_answer(answer, moon) if moon is not None else dynamo_body(answer, content_type)


async def query_by_hash(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    return reply(request, await by_hash_data(services(request), await body_bytes(request), request.content_type, t0))


async def by_hash_data(svc: Services, raw: bytes, content_type: str, t0: float) -> Any:
    """``/query_by_hash``'s answer to the body ``raw`` sent as ``content_type`` (as ``query_data``)."""
    body = decode_body(raw, content_type, allow_msgpack=True, go=False, u64_field="block_hashes")
    if mooncake.speaks_mooncake(body):
        raise mooncake.refuse_by_hash(body)
    answer = await by_hash(svc, parse(body, QueryByHashBody))
    svc.metrics.query_timer("/query_by_hash").observe(time.perf_counter() - t0)
    return dynamo_body(answer, content_type)


def fast_routes() -> dict[str, Callable[[Services, bytes, str, float], Awaitable[Any]]]:
    """The routes ``kvindex.http.fastpath`` may answer before aiohttp, each with the function its
    aiohttp handler calls."""
    return {"/query": query_data, "/query_by_hash": by_hash_data}


async def by_hash(svc: Services, args: QueryByHashBody) -> PreciseAnswer:
    """The precise answer for the local block hashes of ``args``, among its model's engines (an
    adapter's are its base's)."""
    hashes = block_hashes(args, svc.config.max_token_ids)
    model = svc.query.identity(args.model_name)[0]
    return await svc.query.precise_by_local_hashes(args.model_name, hashes,
                                                   await svc.engines.candidates(model, args.routing_group))


def tiered_answer(answer: PreciseAnswer) -> dict[str, Any]:
    """Dynamo's ``TieredQueryResponse``: device scores and lower-tier extensions, in blocks."""
    device: list[list[Any]] = []
    host: list[list[Any]] = []
    disk: list[list[Any]] = []
    depths: list[int] = []
    for pod, m in answer.matches.items():
        wid = worker_number(pod)
        for rank, n in m.dp.items():
            depths.append(n)
            if n:
                device.append([{"worker_id": wid, "dp_rank": rank}, n])
        worker = {"worker_id": wid, "dp_rank": min(m.dp) if m.dp else 0}
        if m.cpu > m.gpu:
            host.append([worker, m.cpu - m.gpu])
        if m.disk > m.cpu:
            disk.append([worker, m.disk - m.cpu])
    lower = [[tier, {"hits": hits}] for tier, hits in (("host_pinned", host), ("disk", disk)) if hits]
    return {"block_size": answer.block_size,
            "tiered": {"device": {"scores": device, "frequencies": frequencies(depths)}, "lower_tier": lower}}


async def query_tiered_by_hash(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    svc = services(request)
    body = await read_body(request, allow_msgpack=True, go=False, u64_field="block_hashes")
    answer = await by_hash(svc, parse(body, QueryByHashBody))
    svc.metrics.query_timer("/query_tiered_by_hash").observe(time.perf_counter() - t0)
    return reply(request, tiered_answer(answer))


@scope(WRITE)
async def dump(request: web.Request) -> web.Response:
    """Every held keyed block as a Dynamo-style stored event; ``tokens_hash`` carries kvindex's key.
    Bulk data (every pod's keys, salted tenants' included): ``WRITE``, like ``GET /v1/state``."""
    return json_response(await services(request).engines.dump())


@scope(OPEN)
async def health(request: web.Request) -> web.Response:
    return web.Response(text="OK")


def routes() -> list[web.RouteDef]:
    return [
        web.get("/health", health),
        web.post("/register", register),
        web.post("/unregister", unregister),
        web.get("/workers", workers),
        web.post("/query", query),
        web.post("/query_by_hash", query_by_hash),
        web.post("/query_tiered_by_hash", query_tiered_by_hash),
        web.get("/dump", dump),
    ]
