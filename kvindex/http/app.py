"""kvindex's native HTTP API (aiohttp): health, metrics, pods, scoring, decisions, drift.

Invariants:
- Every refused request gets a JSON ``{"error": "<one line>", "field": <name or null>}`` with a
  4xx (or 503 when a dependency is down), and is counted in ``kvindex_http_rejections`` by endpoint
  and reason. The store unreachable is a 503 ``store unavailable: <reason>``, never a 500 and
  never a partial answer. Nothing a request carries can crash the server or change state before it is valid.
- Handlers read parts from ``Services``; they hold no state of their own.
- Pod ids may contain ``/``: routes with a pod take the rest of the path, raw or URL-encoded.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import unquote

import msgpack
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvindex import native
from kvindex.approx.render import RenderError, go_json_loads
from kvindex.config import Config
from kvindex.decisions import Decisions
from kvindex.drift import DriftAudit
from kvindex.index.protocol import StoreUnavailable
from kvindex.metrics import Metrics
from kvindex.query import PodAnswer, QueryError, QueryService
from kvindex.views import FleetView, PodsView

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MSGPACK = "application/msgpack"


@dataclass(frozen=True, slots=True)
class Services:
    config: Config
    metrics: Metrics
    query: QueryService
    fleet: FleetView
    pods: PodsView
    decisions: Decisions
    drift: DriftAudit
    token: str | None = None  # bearer token for mutating endpoints
    state: Callable[[], Awaitable[bytes]] | None = None  # the snapshot format, for GET /v1/state
    before_metrics: Callable[[], Awaitable[None]] | None = None  # reads the store-backed gauges
    store_problem: Callable[[], str | None] | None = None  # why the store cannot serve, for /readyz


SERVICES = web.AppKey("services", Services)


class ApiError(web.HTTPException):
    """A refused request: one line, the field at fault, a reason label for the metric."""

    def __init__(self, message: str, *, field: str | None = None, status: int = 400, reason: str = "bad_request") -> None:
        self.status_code = status
        super().__init__(text=json.dumps({"error": message, "field": field}), content_type="application/json")
        self.reason_label = reason


def services(request: web.Request) -> Services:
    return request.app[SERVICES]


def endpoint_label(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "unmatched"


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    svc = services(request)
    try:
        return await handler(request)
    except QueryError as exc:
        err = ApiError(str(exc), field=exc.field, status=exc.status, reason=exc.reason)
    except StoreUnavailable as exc:
        err = ApiError(f"store unavailable: {exc}", status=503, reason="store_unavailable")
    except ApiError as exc:
        err = exc
    except web.HTTPRequestEntityTooLarge:
        err = ApiError(f"body exceeds {svc.config.max_body_bytes} bytes", field="body", status=413, reason="too_large")
    except web.HTTPNotFound:
        err = ApiError(f"no route {request.method} {request.raw_path}", status=404, reason="no_route")
    except web.HTTPMethodNotAllowed:  # raw_path: as sent (percent-encoded), so the message stays one line
        err = ApiError(f"{request.method} not allowed on {request.raw_path}", status=405, reason="bad_method")
    svc.metrics.http_rejections.labels(endpoint_label(request), err.reason_label).inc()
    return web.Response(status=err.status_code, text=err.text, content_type="application/json")


def require_token(request: web.Request) -> None:
    """Mutating endpoints: when a token is configured, a matching bearer token is required."""
    import hmac

    token = services(request).token
    if token is None:
        return
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError("missing or wrong bearer token", field="Authorization", status=401, reason="unauthorized")


def decode_json(raw: bytes, u32_field: str | None, loads: Callable[[bytes], Any] = msgspec.json.decode,
                split: Any = native.load("kvindex._jsontokens")) -> Any:
    """``loads(raw)``, except that a top-level array of u32s named ``u32_field`` comes back as an
    ``array("I")``: with the C scanner (``kvindex._jsontokens``) its digits go straight into u32s,
    and only the rest of the body goes through ``loads`` (~50 us instead of ~300 us for 8k token
    ids with msgspec, ~1 ms with the Go-compatible decoder). Whatever the scanner declines is
    decoded whole, as before."""
    lifted = split.split(raw, u32_field) if u32_field is not None and split is not None else None
    if lifted is None:
        return loads(raw)
    values, rest = lifted
    body = loads(rest)  # the scanner's "{...}" with the array taken out: a dict
    body[u32_field] = array("I", values)
    return body


async def read_body(request: web.Request, *, allow_msgpack: bool = False, go: bool = True,
                    u32_field: str | None = None) -> dict[str, Any]:
    """The body as a dict. ``go``: decode JSON as Go does (for bodies whose text the approximate
    index renders); otherwise the plain fast decoder (token ids, hashes). Either way the
    top-level field ``u32_field`` (token ids, which nothing renders) comes back as an
    ``array("I")`` when it is a plain u32 array."""
    raw = await request.read()
    if allow_msgpack and request.content_type == MSGPACK:
        try:
            body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:
            raise ApiError("body is not valid msgpack", field="body", reason="malformed") from None
    else:
        try:
            body = decode_json(raw, u32_field, go_json_loads if go else msgspec.json.decode)
        except (RenderError, msgspec.DecodeError):
            raise ApiError("body is not valid JSON", field="body", reason="malformed") from None
    if not isinstance(body, dict):
        raise ApiError("body must be a JSON object", field="body", reason="malformed")
    return body


def json_response(data: Any, status: int = 200) -> web.Response:
    """``data`` as JSON, encoded by msgspec (in C: an 8k-token answer costs microseconds, not the
    ~0.1 ms of the standard library's encoder)."""
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def reply(request: web.Request, data: Any, status: int = 200) -> web.Response:
    if request.content_type == MSGPACK:
        return web.Response(body=msgpack.packb(data), status=status, content_type=MSGPACK)
    return json_response(data, status=status)


def get_str(body: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(f"{name} is required", field=name, reason="missing_field")
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(f"{name} must be a non-empty string", field=name, reason="bad_field")
    return value


def get_pods(body: dict[str, Any], limit: int = 10_000) -> list[str] | None:
    pods = body.get("pods")
    if pods is None:
        return None
    if not isinstance(pods, list) or not all(isinstance(p, str) and p for p in pods):
        raise ApiError("pods must be an array of pod ids (strings)", field="pods", reason="bad_field")
    if len(pods) > limit:
        raise ApiError(f"pods has {len(pods)} entries; the limit is {limit}", field="pods", status=413, reason="too_large")
    return pods


def pod_from_path(request: web.Request) -> str:
    pod = unquote(request.match_info["pod"])
    if not pod:
        raise ApiError("pod id is empty", field="pod", reason="bad_field")
    return pod


# -- dashboard ---------------------------------------------------------------------------------
DASHBOARD = web.AppKey("dashboard", bytes)


def load_dashboard() -> bytes:
    """The dashboard page, self-contained (inline CSS, JS and SVG; no network at all)."""
    return resources.files("kvindex.http").joinpath("static/dashboard.html").read_bytes()


async def dashboard(request: web.Request) -> web.Response:
    return web.Response(body=request.app[DASHBOARD], content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


# -- health ------------------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    svc = services(request)
    try:
        problems = await svc.pods.readiness_problems()
    except StoreUnavailable as exc:
        problems = [f"store unavailable: {exc}"]
    problem = svc.store_problem() if svc.store_problem is not None else None
    if problem is not None and problem not in problems:
        problems.insert(0, problem)
    if problems:
        return json_response({"status": "not ready", "reasons": problems}, status=503)
    return json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    svc = services(request)
    if svc.before_metrics is not None:
        await svc.before_metrics()
    data = generate_latest(svc.metrics.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


# -- pods --------------------------------------------------------------------------------------
async def list_pods(request: web.Request) -> web.Response:
    return json_response({"pods": await services(request).pods.views()})


async def get_pod(request: web.Request) -> web.Response:
    pod = pod_from_path(request)
    for view in await services(request).pods.views():
        if view["pod"] == pod:
            return json_response(view)
    raise ApiError(f"unknown pod {pod!r}", field="pod", status=404, reason="unknown_pod")


async def delete_pod(request: web.Request) -> web.Response:
    require_token(request)
    pod = pod_from_path(request)
    if not await services(request).pods.remove(pod):
        raise ApiError(f"unknown pod {pod!r}", field="pod", status=404, reason="unknown_pod")
    return json_response({"removed": pod})


async def resync_pod(request: web.Request) -> web.Response:
    require_token(request)
    pod = pod_from_path(request)
    if not await services(request).fleet.resync(pod):
        raise ApiError(f"no engine stream feeds pod {pod!r}", field="pod", status=404, reason="unknown_pod")
    return json_response({"resynced": pod})


# -- scoring -----------------------------------------------------------------------------------
async def score(request: web.Request) -> web.Response:
    svc = services(request)
    t0 = time.perf_counter()
    body = await read_body(request, u32_field="token_ids")
    model = get_str(body, "model")
    assert model is not None
    pods = get_pods(body)
    q = svc.query
    token_ids = await q.token_ids_for(model, body)
    precise = None
    if token_ids is not None:
        precise = await q.precise(model, token_ids, pods, get_str(body, "lora_name", required=False),
                                  get_str(body, "cache_salt", required=False))
        q.scores.remember(model, token_ids, pods, precise)
    candidates = await q.candidates(pods, precise)
    approx = await q.approx_answer(model, body, candidates)
    if precise is None and approx is None:
        raise ApiError("nothing to score: give token_ids, prompt, messages or input", field="request", reason="missing_field")
    if approx is not None and approx.hashes:
        svc.metrics.approx_match_ratio.labels(model).observe(max(approx.blocks.values(), default=0) / len(approx.hashes))
    answer = {
        "model": model,
        "prompt_tokens": precise.prompt_tokens if precise else None,
        "block_size": precise.block_size if precise else None,
        "pods": {pod: PodAnswer(pod, precise, approx).to_json() for pod in candidates},
    }
    svc.metrics.query_seconds.labels("/v1/score").observe(time.perf_counter() - t0)
    return json_response(answer)


async def decisions(request: web.Request) -> web.Response:
    require_token(request)
    svc = services(request)
    t0 = time.perf_counter()
    answer = await svc.decisions.record_body(await read_body(request, u32_field="token_ids"))
    svc.metrics.query_seconds.labels("/v1/decisions").observe(time.perf_counter() - t0)
    return json_response(answer)


async def explain(request: web.Request) -> web.Response:
    """What the router computes for a request: rendered prompt, block hashes, depth per pod."""
    svc = services(request)
    body = await read_body(request)
    req = body.get("request", body)
    if not isinstance(req, dict):
        raise ApiError("request must be an OpenAI request body (object)", field="request", reason="bad_field")
    model = get_str(req, "model")
    assert model is not None
    settings = svc.query.approx.config.for_model(model)
    try:
        rendered = svc.query.approx.render(model, req)
    except RenderError as exc:
        raise ApiError(str(exc), field="request", reason="unrenderable") from None
    hashes = svc.query.approx_hashes(model, req) or ()
    pods = get_pods(body) or await svc.query.candidates(None, None)
    answer = await svc.query.approx_match(model, hashes, pods)
    return json_response({
        "model": model, "personality": settings.personality, "rendered": rendered,
        "rendered_bytes": len(rendered.encode("utf-8", "replace")),
        "block_hashes": list(hashes),
        "pods": {p: {"matched_blocks": answer.blocks.get(p, 0), "score": answer.scores.get(p, 0)} for p in pods},
    })


async def drift(request: web.Request) -> web.Response:
    svc = services(request)
    window = request.query.get("window")
    try:
        seconds = float(window) if window is not None else None
    except ValueError:
        raise ApiError("window must be a number of seconds", field="window", reason="bad_field") from None
    if seconds is not None and not 0 < seconds < 1e9:
        raise ApiError("window must be a positive number of seconds", field="window", reason="bad_field")
    if request.query.get("recheck") in ("1", "true"):
        await svc.drift.recheck_async()
    return json_response(svc.drift.summary(seconds))


async def drift_history(request: web.Request) -> web.Response:
    svc = services(request)
    return json_response({"points": [{"t": s.t, "pods": s.pods} for s in svc.drift.history]})


async def state(request: web.Request) -> web.Response:
    """Everything kvindex holds, in the snapshot format (``kvindex/state.py``): what ``--peer`` loads.
    Bulk data: guarded by the bearer token when one is configured."""
    require_token(request)
    svc = services(request)
    if svc.state is None:
        raise ApiError("state export is not available: the state lives in the shared store (--store redis://) or in "
                       "the ingest workers (--workers)", status=503, reason="unavailable")
    return web.Response(body=await svc.state(), content_type="application/x-kvindex-state")


def make_app(svc: Services, extra_routes: list[web.RouteDef] | None = None) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=svc.config.max_body_bytes)
    app[SERVICES] = svc
    app[DASHBOARD] = load_dashboard()
    app.add_routes([
        web.get("/", dashboard),
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
        web.get("/v1/pods", list_pods),
        web.post("/v1/pods/{pod:.+}/resync", resync_pod),
        web.get("/v1/pods/{pod:.+}", get_pod),
        web.delete("/v1/pods/{pod:.+}", delete_pod),
        web.post("/v1/score", score),
        web.post("/v1/decisions", decisions),
        web.post("/v1/approx/explain", explain),
        web.get("/v1/drift", drift),
        web.get("/v1/drift/history", drift_history),
        web.get("/v1/state", state),
    ])
    if extra_routes:
        app.add_routes(extra_routes)
    return app
