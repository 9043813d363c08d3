"""The request path's server: the ext_proc gRPC port (``kvindex serve --ext-proc-port``), its
health service, and the loops that keep the engines' directory and load current.

Invariants:
- Methods served: ``envoy.service.ext_proc.v3.ExternalProcessor/Process`` (each stream an
  ``Exchange``) and ``grpc.health.v1.Health/Check`` with the services ``liveness`` (and "": the
  process answers), ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` (SERVING
  once ``ready()``: the daemon's state is whole); any other name is SERVICE_UNKNOWN.
- ``start`` binds and starts the refresh loop (the endpoint directory every ``REFRESH_SECONDS``,
  and the load scraper told which engine URLs to scrape); ``stop`` closes the listener, lets the
  streams in flight finish for ``grace`` seconds (GOAWAY), then cancels and awaits every task it
  owns: the loop, the scraper's, the streams'.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvindex.route.exchange import Exchange, Tasks
from kvindex.route.extproc import PROCESS
from kvindex.route.grpc import HEALTH_CHECK, NOT_SERVING, SERVICE_UNKNOWN, SERVING, Call, GrpcServer, HealthCheck
from kvindex.route.verdicts import RoutePath

MESSAGE_OVERHEAD = 1 << 20
log = logging.getLogger("kvindex.route")
REFRESH_SECONDS = 0.2
READY_SERVICES = ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


class RouteServer:
    def __init__(self, path: RoutePath, ready: Callable[[], bool], on_error: Callable[[str], None]) -> None:
        self.path, self._ready, self._on_error = path, ready, on_error
        self.tasks = Tasks()
        # one ext_proc message may carry a whole buffered body: the body limit, plus room for the rest
        self.grpc = GrpcServer({PROCESS: self._exchange, HEALTH_CHECK: self._health},
                               max_message_bytes=path.max_body_bytes + MESSAGE_OVERHEAD, on_error=self._on_error)
        self._loop: asyncio.Task[None] | None = None

    def _exchange(self, call: Call) -> Exchange:
        return Exchange(call, self.path, self.tasks, self._on_error)

    def _health(self, call: Call) -> HealthCheck:
        return HealthCheck(call, self.status)

    def status(self, service: str) -> int:
        if service in ("", "liveness"):
            return SERVING
        if service in READY_SERVICES:
            return SERVING if self._ready() else NOT_SERVING
        return SERVICE_UNKNOWN

    async def start(self, host: str, port: int) -> int:
        await self.path.refresh()
        bound = await self.grpc.start(host, port)
        self._loop = asyncio.create_task(self._refresh_forever(), name="route directory refresh")
        return bound

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await self.path.refresh()
            except Exception:  # noqa: BLE001 -- the store unreachable: keep the last directory, try again
                self._on_error("directory_refresh_failed")

    async def stop(self, grace: float = 5.0) -> None:
        await self.grpc.stop(grace)
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        await self.tasks.close()
        await self.path.close()
