"""The request path's parts, put together from the daemon's (``kvindex.daemon`` calls this only
when ``--ext-proc-port`` is given, so that ``xds-protos`` stays an optional extra).

Invariants: it builds, it starts nothing; the daemon starts and stops the ``RouteServer``.
A missing ``kvindex[gateway]`` install is a ``ConfigError`` naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from kvindex.config import Config, ConfigError
from kvindex.query.decisions import Decisions
from kvindex.views import FleetView, PodsView


def build_route(config: Config, fleet: FleetView, pods: PodsView, decisions: Decisions, base_of: Callable[[str], Any],
                registry: CollectorRegistry, session: Callable[[], aiohttp.ClientSession],
                ready: Callable[[], bool], shadows: Any = None) -> Any:
    try:
        from kvindex.route.server import RouteServer
    except ImportError as exc:
        raise ConfigError(f"--ext-proc-port needs Envoy's ext_proc stubs ({exc}): pip install 'kvindex[gateway]'") \
            from None
    from kvindex.route.endpoints import Directory
    from kvindex.route.load import LoadScraper
    from kvindex.route.metrics import RouteMetrics
    from kvindex.route.path import RequestPath

    r = config.route
    metrics = RouteMetrics(registry)
    scraper = LoadScraper(session, interval=r.scrape_seconds, staleness=r.staleness_seconds,
                          on_failure=lambda reason: metrics.errors.labels(f"scrape_{reason}").inc())
    path = RequestPath(r, Directory(fleet, pods), scraper, decisions, metrics, bases=base_of, shadows=shadows)
    return RouteServer(path, ready, on_error=lambda reason: metrics.errors.labels(reason).inc())
