"""The routable engines: every engine lane whose engine has a ``url``, by the pods its streams name.

Invariants:
- An ``Endpoint`` is a pod kvindex can route to: its OpenAI base URL, the ``ip:port`` Envoy
  dials (the URL's host resolved when it is a name; an IP literal as it is), its model, and
  ``synced``: whether its precise answers may be trusted (the pod's stream is synced and its
  publisher connected). A pod whose engine has no URL is never an endpoint.
- ``refresh()`` rebuilds the whole set from the fleet's lanes and the pod directory
  (``kvindex.views``) in one go; between refreshes the set is read without awaiting. A URL whose
  name does not resolve keeps its last address (or is left out, said once in the log).
- ``for_model(model, bases)`` are the endpoints that serve ``model``: those whose model is it or
  one of ``bases`` (a LoRA adapter's base), and those whose model is not known yet.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvindex.route.protocol import host_port, join
from kvindex.views import FleetView, PodsView

log = logging.getLogger("kvindex.route.endpoints")
RESOLVE_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class Endpoint:
    pod: str
    model: str | None
    url: str
    address: str
    synced: bool


class Directory:
    def __init__(self, fleet: FleetView, pods: PodsView) -> None:
        self._fleet, self._pods = fleet, pods
        self._endpoints: tuple[Endpoint, ...] = ()
        self._by_address: dict[str, Endpoint] = {}
        self._resolved: dict[str, tuple[str, float]] = {}  # host -> (ip, when)

    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._endpoints

    def by_address(self, address: str | None) -> Endpoint | None:
        return self._by_address.get(address) if address else None

    def urls(self) -> set[str]:
        return {e.url for e in self._endpoints} | {
            lane.engine.url for lane in self._fleet.lanes().values() if lane.engine.url}

    def for_model(self, model: str, bases: Iterable[str] = ()) -> list[Endpoint]:
        names = {model, *bases}
        return [e for e in self._endpoints if e.model is None or e.model in names]

    async def refresh(self) -> None:
        engines = {lane.engine.endpoint: lane.engine for lane in self._fleet.lanes().values() if lane.engine.url}
        if not engines:
            self._endpoints, self._by_address = (), {}
            return
        found = []
        for view in await self._pods.views():
            engine = engines.get(view.get("endpoint") or "")
            if engine is None or engine.url is None:
                continue
            address = await self._address(engine.url)
            if address is not None:
                synced = bool(view.get("synced", True)) and bool(view.get("connected"))
                found.append(Endpoint(view["pod"], view.get("model") or engine.model, engine.url, address, synced))
        self._endpoints = tuple(sorted(found, key=lambda e: e.pod))
        self._by_address = {e.address: e for e in self._endpoints}

    async def _address(self, url: str) -> str | None:
        host, port = host_port(url)
        try:
            ipaddress.ip_address(host)
            return join(host, port)
        except ValueError:
            pass
        cached = self._resolved.get(host)
        if cached is not None and time.monotonic() - cached[1] < RESOLVE_SECONDS:
            return join(cached[0], port)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            ip = str(infos[0][4][0])
        except (OSError, IndexError) as exc:
            if cached is None:
                log.warning("engine URL %s: host %s does not resolve (%s): not routable", url, host, exc)
                return None
            return join(cached[0], port)
        self._resolved[host] = (ip, time.monotonic())
        return join(ip, port)
