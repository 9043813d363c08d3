"""kvindex's native HTTP API: health, metrics, pods, scoring, decisions, explain, drift, state, dashboard.

Invariants:
- A handler checks its request (``kvindex.http.bodies``), calls the services' methods, and shapes
  the answer; it holds no state and reads no store itself.
- Mutating endpoints (pod removal and resync, decisions, the state export) are ``WRITE``: they
  require the bearer token when one is configured; the health checks and the dashboard page are
  ``OPEN``; every other route is ``READ`` (the token only with ``auth = "all"``; ``kvindex.http.app``).
- ``/v1/score`` remembers its precise answer for a later ``/v1/decisions`` only when the caller
  may write decisions (no token configured, or the caller sent it).
- Pod ids may contain ``/``: routes with a pod take the rest of the path, raw or URL-encoded.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any
from urllib.parse import unquote

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvindex.query.answers import PodAnswer, PreciseAnswer
from kvindex.http.app import OPEN, WRITE, authorized, scope, services
from kvindex.http.bodies import (
    ApiError,
    ScoreBody,
    decision_list,
    explain_request,
    json_response,
    limit_count,
    name_checked,
    optional_text,
    parse,
    pods_limit,
    read_body,
    window_seconds,
)
from kvindex.index.protocol import StoreUnavailable


def pod_from_path(request: web.Request) -> str:
    pod = unquote(request.match_info["pod"])
    if not pod:
        raise ApiError("pod id is empty", field="pod", reason="bad_field")
    return name_checked(pod, "pod")


# -- dashboard ---------------------------------------------------------------------------------
def load_dashboard() -> bytes:
    """The dashboard page, self-contained (inline CSS, JS and SVG; no network at all)."""
    return resources.files("kvindex.http").joinpath("static/dashboard.html").read_bytes()


def dashboard_handler(page: bytes) -> web.RouteDef:
    @scope(OPEN)  # the page is static (no data); what it shows comes from READ routes
    async def dashboard(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-cache"})
    return web.get("/", dashboard)


# -- health ------------------------------------------------------------------------------------
@scope(OPEN)
async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


@scope(OPEN)
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


@scope(WRITE)
async def delete_pod(request: web.Request) -> web.Response:
    pod = pod_from_path(request)
    if not await services(request).pods.remove(pod):
        raise ApiError(f"unknown pod {pod!r}", field="pod", status=404, reason="unknown_pod")
    return json_response({"removed": pod})


@scope(WRITE)
async def resync_pod(request: web.Request) -> web.Response:
    pod = pod_from_path(request)
    if not await services(request).fleet.resync(pod):
        raise ApiError(f"no engine stream feeds pod {pod!r}", field="pod", status=404, reason="unknown_pod")
    return json_response({"resynced": pod})


# -- scoring -----------------------------------------------------------------------------------
async def score(request: web.Request) -> web.Response:
    svc = services(request)
    t0 = time.perf_counter()
    body = await read_body(request, u32_field="token_ids")
    args = parse(body, ScoreBody)
    model, pods = args.model, pods_limit(args.pods)
    q = svc.query
    precise, candidates = await q.precise_and_candidates(pods, _precise_score(request, args, pods, body))
    approx = await q.approx_answer(model, body, candidates)
    if precise is None and approx is None:
        raise ApiError("nothing to score: give token_ids, prompt, messages or input", field="request", reason="missing_field")
    if approx is not None and approx.hashes:
        svc.metrics.approx_match_ratio.labels(svc.metrics.models.label(model)).observe(max(approx.blocks.values(), default=0) / len(approx.hashes))
    answer = {
        "model": model,
        "prompt_tokens": precise.prompt_tokens if precise else None,
        "block_size": precise.block_size if precise else None,
        "precise_reason": None if precise else q.no_precise_reason(model),  # why every pod's precise is null
        "pods": {pod: PodAnswer(pod, precise, approx).to_json(svc.config.tiers) for pod in candidates},
    }
    svc.metrics.query_timer("/v1/score").observe(time.perf_counter() - t0)
    return json_response(answer)


async def _precise_score(request: web.Request, args: ScoreBody, pods: list[str] | None,
                         body: dict[str, Any]) -> PreciseAnswer | None:
    """A score's precise side (None without tokens), remembered for the caller's decisions."""
    q = services(request).query
    token_ids = await q.token_ids_for(args.model, body)
    if token_ids is None:
        return None
    precise = await q.precise(args.model, token_ids, pods, optional_text(args.lora_name, "lora_name"),
                              optional_text(args.cache_salt, "cache_salt"))
    if authorized(request):  # what a decision reads, only a caller who may write decisions writes
        q.scores.remember(args.model, token_ids, pods, precise)
    return precise


async def models(request: web.Request) -> web.Response:
    """The models kvindex knows, OpenAI-shaped as vLLM lists them: base models (engines have
    published blocks of them, or ``[models]`` names them) with ``parent`` null, and every LoRA
    adapter with its ``parent`` (base), ``source`` (config, engine, events) and ``learned_from``."""
    svc = services(request)
    adapters = svc.query.adapters.views()
    sizes = await svc.query.store.block_sizes()
    bases = (set(sizes) | {m for m, mc in svc.config.models.items() if mc.base_model is None and m != "*"}
             | {a["parent"] for a in adapters})
    data = [{"id": m, "object": "model", "parent": None, "block_size": sizes.get(m)} for m in sorted(bases)]
    return json_response({"object": "list", "data": data + adapters})


@scope(WRITE)
async def decisions(request: web.Request) -> web.Response:
    svc = services(request)
    t0 = time.perf_counter()
    items, batch = decision_list(await read_body(request, u32_field="token_ids"))
    results = await svc.decisions.record(items)
    answer = {"results": results} if batch else results[0]
    svc.metrics.query_timer("/v1/decisions").observe(time.perf_counter() - t0)
    return json_response(answer)


async def latest_decisions(request: web.Request) -> web.Response:
    """The latest decisions of every source (pick, observe, api), newest first."""
    log = services(request).decisions.log
    entries = log.latest(limit_count(request.query.get("limit")))
    return json_response({"decisions": [e.to_json() for e in entries], "recorded": log.added})


async def whatif(request: web.Request) -> web.Response:
    """Every decision of the last ``window`` seconds beside what each routing policy would have
    picked: agreement, predicted tokens (a ratio of sums), the actual decisions' realized tokens
    and their regret (``kvindex.query.whatif``)."""
    svc = services(request)
    window = window_seconds(request.query.get("window"))
    if svc.whatif is None:
        return json_response({"decisions": 0, "policies": {}})
    return json_response(svc.whatif.summary(window))


async def explain(request: web.Request) -> web.Response:
    """What the router computes for a request: rendered prompt, block hashes, depth per pod."""
    q = services(request).query
    req, model, asked = explain_request(await read_body(request))
    rendered = q.render(model, req)
    hashes = q.approx_hashes(model, req) or ()
    pods = asked or await q.candidates(None, None)
    answer = await q.approx_match(model, hashes, pods)
    return json_response({
        "model": model, "personality": q.personality(model), "rendered": rendered,
        "rendered_bytes": len(rendered.encode("utf-8", "replace")),
        "block_hashes": list(hashes),
        "pods": {p: {"matched_blocks": answer.blocks.get(p, 0), "score": answer.scores.get(p, 0)} for p in pods},
    })


async def drift(request: web.Request) -> web.Response:
    svc = services(request)
    seconds = window_seconds(request.query.get("window"))
    if request.query.get("recheck") in ("1", "true"):
        await svc.drift.recheck_async()
    return json_response(svc.drift.summary(seconds))


async def drift_history(request: web.Request) -> web.Response:
    svc = services(request)
    return json_response({"points": [{"t": s.t, "pods": s.pods} for s in svc.drift.history]})


async def drift_pod(request: web.Request) -> web.Response:
    """Which prefixes (and cache_salt tenants) of the sampled prompts a pod holds and is believed to hold."""
    svc = services(request)
    pod = pod_from_path(request)
    return json_response({"pod": pod, "prefixes": await svc.drift.prefixes(pod)})


@scope(WRITE)
async def state(request: web.Request) -> web.Response:
    """Everything kvindex holds, in the snapshot format (``kvindex/persist/snapshot.py``): what
    ``--peer`` loads. Bulk data: guarded by the bearer token when one is configured."""
    svc = services(request)
    if svc.state is None:
        raise ApiError("state export is not available: the state lives in the shared store (--store redis://) or in "
                       "the ingest workers (--workers)", status=503, reason="unavailable")
    return web.Response(body=await svc.state(), content_type="application/x-kvindex-state")


def routes() -> list[web.RouteDef]:
    return [
        dashboard_handler(load_dashboard()),
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
        web.get("/v1/pods", list_pods),
        web.post("/v1/pods/{pod:.+}/resync", resync_pod),
        web.get("/v1/pods/{pod:.+}", get_pod),
        web.delete("/v1/pods/{pod:.+}", delete_pod),
        web.post("/v1/score", score),
        web.get("/v1/models", models),
        web.post("/v1/decisions", decisions),
        web.get("/v1/decisions", latest_decisions),
        web.get("/v1/whatif", whatif),
        web.post("/v1/approx/explain", explain),
        web.get("/v1/drift", drift),
        web.get("/v1/drift/history", drift_history),
        web.get("/v1/drift/pods/{pod:.+}", drift_pod),
        web.get("/v1/state", state),
    ]
