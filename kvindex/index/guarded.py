"""The store guard: what this replica knows about its store's health, and the one place that reacts.

Invariants:
- Every ``StoreUnavailable`` a guarded store raises (lanes, queries, endpoints, timers) is seen
  here: counted by operation (``kvindex_store_errors_total{op}``), ``kvindex_store_up`` is 0 and
  ``reason`` holds its one line until a call succeeds again; it is logged once per burst.
- A ``StoreLost`` (the store lost what it held) is announced to ``on_lost`` once per loss (the
  daemon makes every lane resynchronise) and the stores are re-opened once, serialised
  (``ensure_open``), before anything is written to them again.
- While the store is down, callers fail fast: one call per ``probe_seconds`` goes through to the
  store (a probe, whoever makes it: a lane's retry or a query), every other one raises the last
  ``StoreUnavailable`` at once, so a network cut costs a query its 503, not a socket timeout.
- The memory backend is never wrapped (it cannot fail): its hot path stays one plain await.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from kvindex.index.protocol import StoreLost, Stores, StoreUnavailable
from kvindex.logs import BurstLog
from kvindex.metrics import Metrics
from kvindex.storeurl import describe

log = logging.getLogger("kvindex.store")


class StoreGuard:
    def __init__(self, stores: Stores, metrics: Metrics, burst: BurstLog, *, probe_seconds: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stores = stores
        self._probe_seconds = probe_seconds
        self._clock = clock
        self._last_try = 0.0
        self._metrics = metrics
        self._burst = burst
        self._reopen_lock = asyncio.Lock()
        self._reopen_due = False
        self.up = True
        self.reason: str | None = None
        self.errors = 0
        self.losses = 0
        self.on_lost: Callable[[], None] | None = None
        metrics.store_up.set(1)

    def failed(self, op: str, exc: StoreUnavailable) -> None:
        self.errors += 1
        self._metrics.store_errors.labels(op).inc()
        self._metrics.store_up.set(0)
        self.up, self.reason = False, str(exc) or type(exc).__name__
        self._last_try = self._clock()
        self._burst.warning(("store", op), "store %s: %s failed: %s", describe(self._stores.url), op, self.reason)
        if isinstance(exc, StoreLost) and not self._reopen_due:
            self._reopen_due = True
            self.losses += 1
            log.error("store %s LOST its state (%s): every engine stream resynchronises through its replay "
                      "endpoint; queries answer 503 until their model is resynchronised", describe(self._stores.url),
                      self.reason)
            if self.on_lost is not None:
                self.on_lost()

    def admit(self) -> bool:
        """True when a call may go to the store: always while it is up; once per ``probe_seconds``
        while it is down."""
        if self.up:
            return True
        now = self._clock()
        if now - self._last_try < self._probe_seconds:
            return False
        self._last_try = now
        return True

    def succeeded(self) -> None:
        if not self.up:
            log.info("store %s answers again (after %d failed calls)", describe(self._stores.url), self.errors)
            self.up, self.reason = True, None
            self._metrics.store_up.set(1)

    @property
    def reopen_due(self) -> bool:
        return self._reopen_due

    async def ensure_open(self) -> None:
        """After a loss: re-open the stores (once, whoever asks first); StoreUnavailable if still down."""
        if not self._reopen_due:
            return
        async with self._reopen_lock:
            if not self._reopen_due:
                return
            try:
                await self._stores.open()
            except StoreUnavailable as exc:
                self.failed("open", exc)
                raise
            self._reopen_due = False
            self.succeeded()
            log.info("store %s re-opened after its loss", describe(self._stores.url))


class Guarded:
    """A store whose every coroutine reports its failures and successes to the guard."""

    def __init__(self, inner: Any, guard: StoreGuard) -> None:
        self._inner = inner
        self._guard = guard
        self.name = inner.name

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        guard = self._guard

        async def call(*args: Any, **kw: Any) -> Any:
            if not guard.admit():
                raise StoreUnavailable(guard.reason or "store unavailable")
            try:
                out = await attr(*args, **kw)
            except StoreUnavailable as exc:
                guard.failed(name, exc)
                raise
            guard.succeeded()
            return out

        call.__name__ = name
        setattr(self, name, call)  # resolved once per method
        return call
