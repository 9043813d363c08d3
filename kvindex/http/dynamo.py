"""The Dynamo standalone KV indexer / Mooncake RFC #1403 compatibility API.

``/register``, ``/unregister``, ``/workers``, ``/query``, ``/query_by_hash``, ``/dump``, ``/health``
with the peer's field names and response shapes, JSON or msgpack (``application/msgpack``; the
answer uses the request's encoding).

Invariants:
- An engine registered here is known by ``str(instance_id)`` everywhere (pod id); its
  ``(instance_id, dp_rank)`` is unique; the first registration of a (model, routing_group) fixes
  its block size and a different one later is refused.
- Counts in answers are matched tokens (blocks × block size); ``cpu`` and ``disk`` are cumulative
  through the device tier. Like kvindex's native API, ``/query`` never counts the block holding
  the prompt's last token (the engine never serves it from cache): the answer equals the engine's
  ``cached_tokens``. ``frequencies[i]`` is how many workers hold the prefix's first i+1 blocks.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Annotated, Any

import msgspec
from aiohttp import web

from kvindex.config import ConfigError, EngineConfig
from kvindex.http.app import (
    ApiError,
    get_str,
    json_response,
    read_body,
    reply,
    require_token,
    services,
)
from kvindex.query import PreciseAnswer

DEFAULT_GROUP = "default"


@dataclass(frozen=True, slots=True)
class Registration:
    instance_id: str
    model: str
    group: str
    block_size: int
    dp_rank: int
    engine: EngineConfig

    @property
    def lane_key(self) -> str:
        return f"register:{self.instance_id}:{self.dp_rank}"

    def to_json(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "model": self.model, "group": self.group,
                "block_size": self.block_size, "dp_rank": self.dp_rank, "endpoint": self.engine.endpoint,
                "replay": self.engine.replay}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Registration:
        """A saved registration (snapshot, write-ahead log); ``ValueError`` if malformed."""
        try:
            iid, model, group = str(d["instance_id"]), str(d["model"]), str(d["group"])
            block_size, dp_rank = int(d["block_size"]), int(d["dp_rank"])
            engine = EngineConfig(endpoint=str(d["endpoint"]), pod=iid, model=model, block_size=block_size,
                                  dp_rank=dp_rank, replay=d.get("replay") if isinstance(d.get("replay"), str) else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"saved registration {d!r} is malformed: {exc}") from None
        return cls(iid, model, group, block_size, dp_rank, engine)


class Registrations:
    """Engines added at runtime; each owns one lane in the fleet."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, int], Registration] = {}
        self.block_sizes: dict[tuple[str, str], int] = {}
        self.on_change: Callable[[str, Registration], None] | None = None  # ("add" | "remove", reg)

    def add(self, reg: Registration) -> None:
        self.by_key[(reg.instance_id, reg.dp_rank)] = reg
        self.block_sizes.setdefault((reg.model, reg.group), reg.block_size)
        if self.on_change is not None:
            self.on_change("add", reg)

    def remove(self, reg: Registration) -> None:
        del self.by_key[(reg.instance_id, reg.dp_rank)]
        if not self.matching(model=reg.model, group=reg.group):
            self.block_sizes.pop((reg.model, reg.group), None)  # the next registration fixes it again
        if self.on_change is not None:
            self.on_change("remove", reg)

    def matching(self, instance_id: str | None = None, model: str | None = None,
                 group: str | None = None, dp_rank: int | None = None) -> list[Registration]:
        return [r for r in self.by_key.values()
                if (instance_id is None or r.instance_id == instance_id) and (model is None or r.model == model)
                and (group is None or r.group == group) and (dp_rank is None or r.dp_rank == dp_rank)]


REGISTRATIONS = web.AppKey("registrations", Registrations)


def _instance_id(body: dict[str, Any]) -> str:
    value = body.get("instance_id")
    if type(value) is int and value >= 0 or isinstance(value, str) and value:
        return str(value)
    raise ApiError("instance_id must be a non-negative integer or a non-empty string", field="instance_id",
                   reason="missing_field" if value is None else "bad_field")


def _int(body: dict[str, Any], name: str, default: int | None = None, *, minimum: int = 0) -> int:
    value = body.get(name, default)
    if type(value) is not int or value < minimum:
        if value is None:
            raise ApiError(f"{name} is required", field=name, reason="missing_field")
        raise ApiError(f"{name} must be an integer >= {minimum}", field=name, reason="bad_field")
    return value


async def register(request: web.Request) -> web.Response:
    require_token(request)
    body = await read_body(request)
    regs = request.app[REGISTRATIONS]
    iid, model = _instance_id(body), get_str(body, "model_name")
    endpoint = get_str(body, "endpoint")
    group = get_str(body, "routing_group", required=False) or DEFAULT_GROUP
    block_size, dp_rank = _int(body, "block_size", minimum=1), _int(body, "dp_rank", 0)
    assert model is not None and endpoint is not None
    if (iid, dp_rank) in regs.by_key:
        raise ApiError(f"instance {iid} dp_rank {dp_rank} is already registered", field="instance_id",
                       status=409, reason="duplicate")
    store = services(request).query.store
    fixed = regs.block_sizes.get((model, group)) or await store.block_size(model)
    if fixed is not None and fixed != block_size:  # one block size per model: keys are chunked by it
        raise ApiError(f"block_size {block_size} differs from {fixed}, fixed by the first registration of "
                       f"{model}:{group}", field="block_size", reason="block_size_mismatch")
    try:
        engine = EngineConfig(endpoint=endpoint, pod=iid, model=model, block_size=block_size, dp_rank=dp_rank,
                              replay=get_str(body, "replay_endpoint", required=False))
    except ConfigError as exc:
        raise ApiError(str(exc), field="endpoint", reason="bad_field") from None
    reg = Registration(iid, model, group, block_size, dp_rank, engine)
    await store.set_block_size(model, block_size)
    regs.add(reg)
    services(request).fleet.add(reg.lane_key, engine)
    return json_response({"status": "registered", "instance_id": iid, "dp_rank": dp_rank}, status=201)


async def unregister(request: web.Request) -> web.Response:
    require_token(request)
    body = await read_body(request)
    regs = request.app[REGISTRATIONS]
    iid, model = _instance_id(body), get_str(body, "model_name")
    group = get_str(body, "routing_group", required=False)
    dp_rank = _int(body, "dp_rank") if body.get("dp_rank") is not None else None
    found = regs.matching(iid, model, group, dp_rank)
    if not found:
        raise ApiError(f"instance {iid} is not registered for {model}", field="instance_id", status=404,
                       reason="unknown_instance")
    svc = services(request)
    for reg in found:
        await svc.fleet.remove(reg.lane_key)
        regs.remove(reg)
        await svc.query.store.clear_pod(iid, reg.dp_rank)
    if not regs.matching(iid):
        await svc.pods.remove(iid)
    return json_response({"status": "unregistered", "instance_id": iid, "listeners": len(found)})


async def workers(request: web.Request) -> web.Response:
    regs = request.app[REGISTRATIONS]
    fleet = services(request).fleet
    lanes = fleet.lanes()
    model = request.query.get("model_name")
    group = request.query.get("routing_group")
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for reg in sorted(regs.matching(model=model, group=group), key=lambda r: (r.instance_id, r.dp_rank)):
        w = out.setdefault((reg.instance_id, reg.model, reg.group), {
            "instance_id": reg.instance_id, "source": "zmq", "status": "active", "model_name": reg.model,
            "routing_group": reg.group, "block_size": reg.block_size, "endpoints": {}, "listeners": {}})
        failure = fleet.lane_task_failed(reg.lane_key)
        lane = lanes.get(reg.lane_key)
        status = "failed" if failure else "active" if lane and lane.state.connected_peers else "pending"
        w["endpoints"][str(reg.dp_rank)] = reg.engine.endpoint
        w["listeners"][str(reg.dp_rank)] = {"endpoint": reg.engine.endpoint, "status": status,
                                            **({"last_error": failure} if failure else {})}
    for w in out.values():
        states = {lst["status"] for lst in w["listeners"].values()}
        w["status"] = next((s for s in ("failed", "pending", "active") if s in states), "paused")
    return json_response(list(out.values()))


async def _candidates(request: web.Request, model: str, group: str | None) -> list[str] | None:
    """The pods a query may answer with: its routing group's (one index per (model, group), as
    Dynamo keeps). The default group also holds every engine not registered through /register."""
    regs = request.app[REGISTRATIONS]
    group = group or DEFAULT_GROUP
    if group != DEFAULT_GROUP:
        return sorted({r.instance_id for r in regs.matching(model=model, group=group)})
    elsewhere = {r.instance_id for r in regs.by_key.values() if r.group != DEFAULT_GROUP}
    if not elsewhere:
        return None
    inside = {r.instance_id for r in regs.by_key.values() if r.group == DEFAULT_GROUP}
    return sorted((set(await services(request).query.store.pods()) - elsewhere) | inside)


_RANKS = tuple(str(r) for r in range(256))  # dp ranks as JSON keys, made once


def _scores(answer: PreciseAnswer) -> dict[str, Any]:
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
    return {"scores": scores, "frequencies": _frequencies(depths), "instances": instances}


def _frequencies(depths: list[int]) -> list[int]:
    """``out[i]`` = how many workers hold at least i+1 blocks: suffix sums of a depth histogram."""
    if not depths:
        return []
    hist = [0] * (max(depths) + 1)
    for d in depths:
        hist[d] += 1
    out = list(accumulate(reversed(hist[1:])))  # the suffix sums, in C
    out.reverse()
    return out


async def query(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    svc = services(request)
    body = await read_body(request, allow_msgpack=True, go=False, u32_field="token_ids")
    model = get_str(body, "model_name")
    assert model is not None
    token_ids = svc.query.check_token_ids(body.get("token_ids"))
    group = get_str(body, "routing_group", required=False)
    answer = await svc.query.precise(model, token_ids, await _candidates(request, model, group),
                               get_str(body, "lora_name", required=False), get_str(body, "cache_salt", required=False))
    svc.metrics.query_seconds.labels("/query").observe(time.perf_counter() - t0)
    return reply(request, _scores(answer))


_HASHES = list[Annotated[int, msgspec.Meta(ge=-(1 << 63))]]  # ints (no bools), none below i64


def _u64s(value: Any) -> Sequence[int] | None:
    """Dynamo's block hashes (i64, its form, or u64 for the same bits) as u64s; None unless every
    one is. The common cases are C-level conversions: no Python loop over 512 hashes."""
    try:
        ints = msgspec.convert(value, _HASHES)
    except msgspec.ValidationError:
        return None
    for kind in ("q", "Q"):  # all i64: the same bits as u64s; all non-negative: u64s already
        try:
            return array("Q", array(kind, ints).tobytes())
        except OverflowError:
            pass
    if all(h < 1 << 64 for h in ints):  # both forms in one request
        return [h & (1 << 64) - 1 for h in ints]
    return None


async def query_by_hash(request: web.Request) -> web.Response:
    t0 = time.perf_counter()
    svc = services(request)
    body = await read_body(request, allow_msgpack=True, go=False)
    model = get_str(body, "model_name")
    assert model is not None
    if body.get("cache_salt") is not None:
        raise ApiError("cache_salt is not supported by /query_by_hash: use /query with token_ids", field="cache_salt")
    hashes = _u64s(body.get("block_hashes"))
    if hashes is None:
        raise ApiError("block_hashes must be an array of 64-bit integers", field="block_hashes", reason="bad_field")
    if len(hashes) > svc.config.max_token_ids:
        raise ApiError("block_hashes is too long", field="block_hashes", status=413, reason="too_large")
    group = get_str(body, "routing_group", required=False)
    answer = await svc.query.precise_by_local_hashes(model, hashes, await _candidates(request, model, group))
    svc.metrics.query_seconds.labels("/query_by_hash").observe(time.perf_counter() - t0)
    return reply(request, _scores(answer))


async def dump(request: web.Request) -> web.Response:
    """Every held keyed block as a Dynamo-style stored event; ``tokens_hash`` carries kvindex's key."""
    svc = services(request)
    out: dict[str, Any] = {}
    store = svc.query.store
    for view in await svc.pods.views():
        pod, model = view["pod"], view.get("model") or "unknown"
        group = f"{model}:{DEFAULT_GROUP}"
        if group not in out:
            out[group] = {"block_size": await store.block_size(model), "events": []}
        entry = out[group]
        for rank, blocks in (await store.engine_hashes(pod)).items():
            stored = [{"block_hash": h, "tokens_hash": k} for h, k in blocks.items() if k is not None]
            if stored:
                entry["events"].append({"worker_id": pod, "dp_rank": rank, "event": {
                    "event_id": len(entry["events"]), "data": {"stored": {"parent_hash": None, "blocks": stored}}}})
    return json_response(out)


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
        web.get("/dump", dump),
    ]
