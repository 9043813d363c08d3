"""kvindex's HTTP application (aiohttp): the services handlers read, the error middleware, the app.

The routes come from ``kvindex.http.native`` (kvindex's own API) and ``kvindex.http.dynamo`` (the
Dynamo / Mooncake compatibility API); the composition root (``kvindex.daemon``) hands them to
``make_app``. Bodies are checked in ``kvindex.http.bodies``.

Invariants:
- Every refused request gets a JSON ``{"error": "<one line>", "field": <name or null>}`` with a
  4xx (or 503 when a dependency is down), and is counted in ``kvindex_http_rejections`` by endpoint
  and reason. The store unreachable is a 503 ``store unavailable: <reason>``, never a 500 and
  never a partial answer. Nothing a request carries can crash the server or change state before it is valid.
- While the saved state loads at start (``Services.loading``), every endpoint but ``/healthz``,
  ``/readyz`` (503 with the reason) and ``/metrics`` answers 503 ``loading: ...``.
- Handlers read parts from ``Services`` and call their methods; they hold no state of their own and
  never reach through a service into a store.
- Pod ids may contain ``/``: routes with a pod take the rest of the path, raw or URL-encoded.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import web

from kvindex.answers import QueryError
from kvindex.config import Config
from kvindex.decisions import Decisions
from kvindex.drift import DriftAudit
from kvindex.http.errors import ApiError
from kvindex.index.protocol import StoreUnavailable
from kvindex.metrics import Metrics
from kvindex.query import QueryService
from kvindex.registrations import EngineRegistry
from kvindex.views import FleetView, PodsView

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Services:
    config: Config
    metrics: Metrics
    query: QueryService
    fleet: FleetView
    pods: PodsView
    decisions: Decisions
    drift: DriftAudit
    engines: EngineRegistry  # engines registered at runtime (the compatibility API)
    token: str | None = None  # bearer token for mutating endpoints
    state: Callable[[], Awaitable[bytes]] | None = None  # the snapshot format, for GET /v1/state
    before_metrics: Callable[[], Awaitable[None]] | None = None  # reads the store-backed gauges
    store_problem: Callable[[], str | None] | None = None  # why the store cannot serve, for /readyz
    loading: Callable[[], str | None] | None = None  # set while the saved state loads (start): 503s


SERVICES = web.AppKey("services", Services)
OPEN_WHILE_LOADING = frozenset({"/healthz", "/readyz", "/metrics"})  # the rest answers 503 "loading" meanwhile


def services(request: web.Request) -> Services:
    return request.app[SERVICES]


def endpoint_label(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "unmatched"


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    svc = services(request)
    try:
        loading = svc.loading() if svc.loading is not None else None
        if loading is not None and request.path not in OPEN_WHILE_LOADING:
            raise ApiError(loading, status=503, reason="loading")
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
    token = services(request).token
    if token is None:
        return
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError("missing or wrong bearer token", field="Authorization", status=401, reason="unauthorized")


def make_app(svc: Services, routes: Iterable[web.RouteDef]) -> web.Application:
    """The application: ``routes`` (``native.routes()``, ``dynamo.routes()``) behind the error
    middleware, bodies capped at ``max_body_bytes``."""
    app = web.Application(middlewares=[errors_middleware], client_max_size=svc.config.max_body_bytes)
    app[SERVICES] = svc
    app.add_routes(list(routes))
    return app
