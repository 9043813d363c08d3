"""The store guard in front of a real Redis that stops answering (SIGSTOP: a network cut): the first
call times out; until the next probe, calls fail fast without touching the store; a probe that
succeeds brings the store back for everyone. The clock is the test's, so nothing here is timed."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvindex.index.factory import build_stores
from kvindex.index.guarded import Guarded, StoreGuard
from kvindex.index.protocol import StoreUnavailable
from kvindex.logs import BurstLog
from kvindex.metrics import Metrics
from kvindex.settings import ApproxConfig
from tests.redis_server import RedisServer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_store_that_stopped_answering_fails_fast_between_probes(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    registry = CollectorRegistry()
    stores = build_stores(server.url, ApproxConfig(), on_evict=None)
    clock = Clock()
    guard = StoreGuard(stores, Metrics(registry), BurstLog(logging.getLogger("test")), probe_seconds=1.0, clock=clock)
    precise = Guarded(stores.precise, guard)
    try:
        await stores.open()
        assert await precise.pods() == []

        def errors() -> float:
            return registry.get_sample_value("kvindex_store_errors_total", {"op": "pods"}) or 0.0

        server.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(StoreUnavailable):
            await precise.pods()  # a real call: it waits for the socket timeout
        assert (errors(), guard.up) == (1.0, False)
        for _ in range(5):  # within the probe interval: refused at once, the store is not asked
            with pytest.raises(StoreUnavailable, match="redis at"):
                await precise.pods()
        assert errors() == 1.0

        clock.now += 1.0  # the next call is a probe: the store is still cut off
        with pytest.raises(StoreUnavailable):
            await precise.pods()
        assert errors() == 2.0

        server.proc.send_signal(signal.SIGCONT)
        clock.now += 1.0
        assert await precise.pods() == []  # the probe succeeds: up again for every caller
        assert guard.up and registry.get_sample_value("kvindex_store_up") == 1.0
        assert await precise.pods() == []
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        await stores.close()
        server.stop()
