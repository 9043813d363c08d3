"""SGLang's ``kv_indexer.v1.KVIndexer`` served over kvindex's own gRPC server (``kvindex.route.grpc``):
``kvindex serve --grpc-port``.

Invariants:
- Methods: the four unary RPCs of ``kv_indexer.proto`` and ``grpc.health.v1.Health/Check``
  (services "" and ``kv_indexer.v1.KVIndexer``: SERVING while the port is open). A call is one
  request message, answered once the client half-closes: with one response message and OK, or
  with no message and a status. Every call ends in ``kvindex_sglang_grpc_requests_total{method,
  code}``; every refusal (and every transport error of the port: not gRPC, an unknown method, a
  message over ``MAX_MESSAGE_BYTES``) in ``kvindex_sglang_grpc_errors_total{reason}``.
- Malformed protobuf, a second request message or none: INVALID_ARGUMENT; SGLang's own checks
  (``kvindex.sglang.placements``): INVALID_ARGUMENT, RESOURCE_EXHAUSTED or FAILED_PRECONDITION;
  the store unreachable: UNAVAILABLE; a bug: INTERNAL (logged). None of them ends the connection.
- With a token: ``ApplyExternalKvBatch`` needs ``authorization: Bearer <token>`` (every method
  does with ``auth = "all"``), else UNAUTHENTICATED, as the HTTP API's writes do.
- Every call's task is owned here; ``stop`` closes the port (calls in flight get ``grace``
  seconds), then cancels and awaits what is left.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from kvindex.config import Config
from kvindex.index.protocol import StoreUnavailable
from kvindex.pods import Orphans
from kvindex.route.grpc import HEALTH_CHECK, INTERNAL, INVALID_ARGUMENT, OK, SERVICE_UNKNOWN, SERVING, UNAVAILABLE, \
    Call, GrpcServer, HealthCheck
from kvindex.sglang import wire
from kvindex.sglang.placements import ExternalPlacements, Refused
from kvindex.views import FleetView

log = logging.getLogger("kvindex.sglang")
SERVICE = "kv_indexer.v1.KVIndexer"
MAX_MESSAGE_BYTES = 8 << 20  # SGLang's indexer's decoding limit
UNAUTHENTICATED = 16
Run = Callable[[bytes], Awaitable[bytes]]


class Unary:
    """One unary call (``kvindex.route.grpc.Handler``)."""

    def __init__(self, call: Call, method: str, run: Run, server: IndexerServer) -> None:
        self._call, self._method, self._run, self._server = call, method, run, server
        self._request: bytes | None = None
        self._task: asyncio.Task[None] | None = None

    def message(self, data: bytes) -> None:
        if self._request is not None:
            self._server.fail(self._call, self._method, INVALID_ARGUMENT, "two_messages", "a unary call takes one message")
            return
        self._request = data

    def end(self) -> None:
        if self._request is None:
            self._server.fail(self._call, self._method, INVALID_ARGUMENT, "no_message", "no request message")
            return
        self._task = self._server.spawn(self._answer(self._request), self._method)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _answer(self, request: bytes) -> None:
        server, call = self._server, self._call
        try:
            response = await self._run(request)
        except wire.WireError as exc:
            server.fail(call, self._method, INVALID_ARGUMENT, exc.reason, str(exc))
        except Refused as exc:
            server.fail(call, self._method, exc.code, exc.reason, str(exc))
        except StoreUnavailable as exc:
            server.fail(call, self._method, UNAVAILABLE, "store_unavailable", str(exc))
        except Exception:  # noqa: BLE001 -- a bug ends this call, never the server
            log.exception("%s failed", self._method)
            server.fail(call, self._method, INTERNAL, "internal", "internal error")
        else:
            call.send(response)
            call.finish(OK)
            server.requests.labels(self._method, "0").inc()


class IndexerServer:
    def __init__(self, placements: ExternalPlacements, registry: CollectorRegistry, token: str | None = None,
                 auth: str = "writes", max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.placements, self._token, self._auth = placements, token, auth
        self.requests = Counter("kvindex_sglang_grpc_requests", "SGLang indexer API calls (--grpc-port) by method and "
                                "gRPC status code", ["method", "code"], registry=registry)
        self.errors = Counter("kvindex_sglang_grpc_errors", "SGLang indexer API calls refused, by reason",
                              ["reason"], registry=registry)
        self.refused_blocks = Counter("kvindex_sglang_refused_blocks", "Reported hashes not indexed: not whole "
                                      "blocks (no FULL component) or past max_blocks_per_pod", registry=registry)
        methods: dict[bytes, Any] = {HEALTH_CHECK: lambda call: HealthCheck(call, self._health)}
        for name, run, write in (("ApplyExternalKvBatch", self._apply, True), ("MatchExternalKv", self._match, False),
                                 ("MatchExternalKvPrefix", self._prefix, False),
                                 ("GetExternalKvHitCounts", self._hit_counts, False)):
            methods[f"/{SERVICE}/{name}".encode()] = self._method(name, run, write)
        self.grpc = GrpcServer(methods, max_message_bytes=max_message_bytes,
                               on_error=lambda reason: self.errors.labels(reason).inc())
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int | None:
        return self.grpc.port

    def in_flight(self) -> int:
        """Calls open on the port (a request not yet answered, or not yet half-closed)."""
        return self.grpc.open_streams()

    def _method(self, name: str, run: Run, write: bool) -> Callable[[Call], Any]:
        def handler(call: Call) -> Any:
            if self._token is not None and (write or self._auth == "all") and not self._authorized(call):
                self.fail(call, name, UNAUTHENTICATED, "unauthenticated", "a bearer token is required")
                return _Ignore()
            return Unary(call, name, run, self)
        return handler

    def _authorized(self, call: Call) -> bool:
        scheme, _, given = call.metadata.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), (self._token or "").encode())

    @staticmethod
    def _health(service: str) -> int:
        return SERVING if service in ("", SERVICE) else SERVICE_UNKNOWN

    def fail(self, call: Call, method: str, code: int, reason: str, message: str) -> None:
        if call.finished:
            return
        self.errors.labels(reason).inc()
        self.requests.labels(method, str(code)).inc()
        call.finish(code, message)

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(f"sglang {name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the four methods --------------------------------------------------------------------
    async def _apply(self, data: bytes) -> bytes:
        batch = wire.decode_apply(data)
        refused = await self.placements.apply(batch)
        if refused:
            self.refused_blocks.inc(refused)
        return wire.uint_field(4, batch.seq)  # ApplyExternalKvBatchResponse{applied_seq}

    async def _match(self, data: bytes) -> bytes:
        q = wire.decode_query(data)
        found = await self.placements.placements(q.hashes, q.flag)
        return wire.messages_field(1, (wire.node_match(pod, address, (wire.tier_hashes(t, hs) for t, hs in sorted(tiers.items())))
                                       for pod, address, tiers in found))

    async def _prefix(self, data: bytes) -> bytes:
        q = wire.decode_query(data)
        rows, read = await self.placements.prefix(q.hashes, q.limit)
        return wire.prefix_response((wire.prefix_match(*row) for row in rows), rows[0][1] if rows else 0, read)

    async def _hit_counts(self, data: bytes) -> bytes:
        q = wire.decode_query(data)
        return wire.messages_field(1, (wire.hit_entry(h, n) for h, n in await self.placements.hit_counts(q.hashes)))

    # -- the port ----------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        bound = await self.grpc.start(host, port)
        log.info("SGLang indexer API: gRPC %s on %s:%d", SERVICE, host, bound)
        return bound

    async def stop(self, grace: float = 5.0) -> None:
        await self.grpc.stop(grace)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Ignore:
    """The handler of a call already answered (refused before it started)."""

    def message(self, data: bytes) -> None: ...
    def end(self) -> None: ...
    def cancel(self) -> None: ...


def build_indexer(config: Config, store: Any, fleet: FleetView, orphans: Orphans, registry: CollectorRegistry,
                  token: str | None) -> IndexerServer | None:
    """The server of ``--grpc-port`` over the daemon's store, or None without ``--grpc-port``.
    ``Config`` checked that the store is the memory one (a ``placements.HashStore``: the daemon
    types its store as the contract, which has no hash reads)."""
    if config.grpc_port is None:
        return None
    return IndexerServer(ExternalPlacements(store, fleet, orphans, config.max_blocks_per_pod), registry, token,
                         config.auth)
