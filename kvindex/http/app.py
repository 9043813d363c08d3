"""kvindex's HTTP application (aiohttp): the services handlers read, the error middleware, the app.

The routes come from ``kvindex.http.native`` (kvindex's own API) and ``kvindex.http.dynamo`` (the
Dynamo / Mooncake compatibility API); the composition root (``kvindex.daemon``) hands them to
``make_app``. Bodies are checked in ``kvindex.http.bodies``.

Invariants:
- Every refused request gets a JSON ``{"error": "<one line>", "field": <name or null>}`` with a
  4xx (or 503 when a dependency is down), and is counted in ``kvindex_http_rejections`` by endpoint
  and reason. The store unreachable is a 503 ``store unavailable: <reason>``, never a 500 and
  never a partial answer. Nothing a request carries can crash the server or change state before it is valid.
- Refusals are logged without flooding (``log_refusal``): one line per (endpoint, reason) at most
  every ``REFUSAL_LOG_SECONDS``, saying how many were suppressed, names escaped (``kvindex.logs.shown``).
  An unexpected exception is a 500 ``internal error`` counted under reason ``internal``, its
  traceback logged at most once per (endpoint, exception type) per interval.
- A refused request holds nothing past its answer: the refusal kept for the answer drops its
  traceback (which holds the handler frames, the body among them, in a cycle with the refusal
  itself: with the collector paced for a server, ``kvindex.loops``, ~100 refused 7 MiB bodies
  stayed in memory until the next collection).
- While the saved state loads at start (``Services.loading``), every endpoint but ``/healthz``,
  ``/readyz`` (503 with the reason) and ``/metrics`` answers 503 ``loading: ...``.
- Handlers read parts from ``Services`` and call their methods; they hold no state of their own and
  never reach through a service into a store.
- Pod ids may contain ``/``: routes with a pod take the rest of the path, raw or URL-encoded.
- Every route has a scope (``scope``; a handler without one is ``READ``), checked by
  ``request_middleware`` before the body is read and the handler runs: ``OPEN`` (the health
  checks and the static dashboard page) never needs the token; ``WRITE`` (every mutation and the bulk exports
  ``/v1/state`` and ``/dump``, which carry every pod's keys, salted tenants' included) needs it
  whenever one is configured; ``READ`` needs it only with ``auth = "all"``. A caller who may not
  write leaves no trace in what writers read (``authorized``: ``/v1/score`` remembers its answer
  for ``/v1/decisions`` only for a caller who may write).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import web

from kvindex.query.answers import QueryError
from kvindex.config import Config
from kvindex.query.decisions import Decisions
from kvindex.query.whatif import WhatIf
from kvindex.query.drift import DriftAudit
from kvindex.http.errors import ApiError
from kvindex.http.server import read_body_within
from kvindex.index.protocol import StoreUnavailable
from kvindex.logs import BurstLog, shown
from kvindex.metrics import Metrics
from kvindex.query.service import QueryService
from kvindex.registrations import EngineRegistry
from kvindex.views import FleetView, PodsView

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN, READ, WRITE = "open", "read", "write"  # route scopes, see the module docstring
SCOPE_ATTR = "kvindex_scope"


def scope(level: str) -> Callable[[Handler], Handler]:
    """Mark a handler's scope (``OPEN``, ``READ`` or ``WRITE``)."""
    def mark(handler: Handler) -> Handler:
        setattr(handler, SCOPE_ATTR, level)
        return handler
    return mark


def route_scope(handler: object) -> str:
    return str(getattr(handler, SCOPE_ATTR, READ))


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
    token: str | None = None  # the bearer token: what it guards is config.auth (see the module docstring)
    state: Callable[[], Awaitable[bytes]] | None = None  # the snapshot format, for GET /v1/state
    before_metrics: Callable[[], Awaitable[None]] | None = None  # reads the store-backed gauges
    store_problem: Callable[[], str | None] | None = None  # why the store cannot serve, for /readyz
    loading: Callable[[], str | None] | None = None  # set while the saved state loads (start): 503s
    whatif: WhatIf | None = None  # every decision shadowed by each routing policy (GET /v1/whatif)


SERVICES = web.AppKey("services", Services)
REFUSALS = web.AppKey("refusals", BurstLog)  # the rate-limited log of refused requests
REFUSAL_LOG_SECONDS = 10.0
OPEN_WHILE_LOADING = frozenset({"/healthz", "/readyz", "/metrics"})  # the rest answers 503 "loading" meanwhile


def services(request: web.Request) -> Services:
    return request.app[SERVICES]


def endpoint_label(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "unmatched"


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request's gate, in one frame (each middleware is one more coroutine per request): the
    loading refusal, then the route's scope (an unmatched path or method is not a route: its
    404 / 405 needs no token and no body), then the body read whole within ``body_timeout`` and
    ``max_body_bytes`` (only once the caller passed the auth check: an unauthenticated request is
    answered unread), then the handler; every refusal answered and counted here."""
    svc = services(request)
    try:
        loading = svc.loading() if svc.loading is not None else None
        if loading is not None and request.path not in OPEN_WHILE_LOADING:
            raise ApiError(loading, status=503, reason="loading")
        match = request.match_info
        if match.http_exception is None:
            if needs_token(svc, route_scope(match.handler)) and not authorized(request):
                raise ApiError("missing or wrong bearer token", field="Authorization", status=401, reason="unauthorized")
            await read_body_within(request, svc.config.body_timeout, svc.config.max_body_bytes)
        return await handler(request)
    except QueryError as exc:
        err = ApiError(str(exc), field=exc.field, status=exc.status, reason=exc.reason)
    except StoreUnavailable as exc:
        err = ApiError(f"store unavailable: {exc}", status=503, reason="store_unavailable")
    except ApiError as exc:
        err = exc.with_traceback(None)  # kept past the except: its traceback would hold this frame (a cycle)
    except web.HTTPRequestEntityTooLarge:
        err = ApiError(f"body exceeds {svc.config.max_body_bytes} bytes", field="body", status=413, reason="too_large")
    except web.HTTPNotFound:
        err = ApiError(f"no route {request.method} {request.raw_path}", status=404, reason="no_route")
    except web.HTTPMethodNotAllowed:  # raw_path: as sent (percent-encoded), so the message stays one line
        err = ApiError(f"{request.method} not allowed on {request.raw_path}", status=405, reason="bad_method")
    except web.HTTPException:
        raise  # aiohttp's own answers (e.g. a redirect)
    except Exception as exc:  # noqa: BLE001 -- a bug, never the caller's fault: one line to the caller, the traceback to the log
        err = ApiError(f"internal error: {type(exc).__name__}", status=500, reason="internal")
        log_refusal(request, err, exc)
    svc.metrics.http_rejections.labels(endpoint_label(request), err.reason_label).inc()
    if err.reason_label != "internal":
        log_refusal(request, err)
    return web.Response(status=err.status_code, text=err.text, content_type="application/json")


def log_refusal(request: web.Request, err: ApiError, exc: BaseException | None = None) -> None:
    """One line per (endpoint, reason) per ``REFUSAL_LOG_SECONDS`` (an unexpected exception: per
    exception type, with its traceback); the request's path and the message escaped."""
    note_refusal(request.app[REFUSALS], request.method, request.path, endpoint_label(request), err, exc)


def note_refusal(refusals: BurstLog, method: str, path: str, endpoint: str, err: ApiError,
                 exc: BaseException | None = None) -> None:
    """``log_refusal`` of a request known by its method, path and endpoint label (the fast path's)."""
    key = (endpoint, err.reason_label, type(exc).__name__ if exc is not None else "")
    level = logging.ERROR if exc is not None else logging.INFO
    refusals.log(level, key, "%s %s refused %d (%s): %s", method, shown(path), err.status_code, err.reason_label,
                 shown(err.text), exc_info=exc)


def authorized(request: web.Request) -> bool:
    """No token is configured, or the request carries it (``Authorization: Bearer <token>``)."""
    token = services(request).token
    if token is None:
        return True
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def needs_token(svc: Services, level: str) -> bool:
    return svc.token is not None and (level == WRITE or (level == READ and svc.config.auth == "all"))


def make_app(svc: Services, routes: Iterable[web.RouteDef]) -> web.Application:
    """The application: ``routes`` (``native.routes()``, ``dynamo.routes()``) behind
    ``request_middleware``, bodies capped at ``max_body_bytes``."""
    app = web.Application(middlewares=[request_middleware],
                          client_max_size=svc.config.max_body_bytes)
    app[SERVICES] = svc
    app[REFUSALS] = BurstLog(logging.getLogger("kvindex.http"), interval=REFUSAL_LOG_SECONDS)
    app.add_routes(list(routes))
    return app
