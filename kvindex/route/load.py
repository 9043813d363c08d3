"""Engine load, scraped: each engine's ``GET <url>/metrics`` read every ``scrape_seconds``.

What is read (reference/routing.md §1.1): requests waiting (vLLM ``vllm:num_requests_waiting``,
SGLang ``sglang:num_queue_reqs``) and KV cache in use (``vllm:kv_cache_usage_perc``,
``sglang:token_usage``), summed (waiting) or maxed (usage) over an engine's series.

Invariants:
- One task per engine URL, owned by the ``LoadScraper`` (``watch`` starts and stops them,
  ``close`` cancels and awaits them all); a scrape never overlaps the previous one of its engine.
- ``load(url)`` is the last answer while it is younger than ``staleness_seconds``, else unknown
  (``Load()``: the scorers score it neutral) and ``stale(url)`` says so.
- An engine whose port refuses connections (or resets them) is ``down`` until a scrape succeeds:
  the picker excludes it. Every other failure (a timeout, an HTTP error, a page without the
  metrics, one over ``max_bytes``) leaves it up with its load going stale; each is counted by
  reason (``on_failure``) and never raises out of the task.
- Only the lines of the wanted metrics are parsed (found with ``bytes.find``): a 100 KB page of
  histograms costs one pass in C.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from kvindex.route.scorers import Load

log = logging.getLogger("kvindex.route.load")
WAITING = (b"vllm:num_requests_waiting", b"sglang:num_queue_reqs")
USAGE = (b"vllm:kv_cache_usage_perc", b"sglang:token_usage")
MAX_PAGE_BYTES = 8 << 20


def metric_values(page: bytes, name: bytes) -> list[float]:
    """Every sample of ``name`` in a Prometheus text page (not of a longer name it prefixes)."""
    out, pos, start = [], 0, b"\n" + name
    if page.startswith(name):
        page = b"\n" + page
    while (pos := page.find(start, pos)) >= 0:
        pos += len(start)
        if pos < len(page) and page[pos:pos + 1] not in (b"{", b" ", b"\t"):
            continue
        end = page.find(b"\n", pos)
        line = page[pos:end if end >= 0 else len(page)]
        if line.startswith(b"{"):
            close = line.rfind(b"}")
            line = line[close + 1:] if close >= 0 else b""
        fields = line.split()
        try:
            value = float(fields[0]) if fields else math.nan
        except ValueError:
            continue
        if math.isfinite(value):
            out.append(value)
    return out


def parse_load(page: bytes) -> Load | None:
    """The load a page reports; None when it names neither metric."""
    waiting = next((v for name in WAITING if (v := metric_values(page, name))), None)
    usage = next((v for name in USAGE if (v := metric_values(page, name))), None)
    if waiting is None and usage is None:
        return None
    return Load(waiting=sum(waiting) if waiting else None,
                kv_usage=min(1.0, max(0.0, max(usage))) if usage else None)


@dataclass(frozen=True, slots=True)
class Scraped:
    load: Load
    at: float  # monotonic time of the answer


class LoadScraper:
    def __init__(self, session: Callable[[], aiohttp.ClientSession], *, interval: float = 0.05,
                 staleness: float = 2.0, timeout: float = 1.0, max_bytes: int = MAX_PAGE_BYTES,
                 on_failure: Callable[[str], None] = lambda reason: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._session, self._interval, self._staleness, self._timeout = session, interval, staleness, timeout
        self._max_bytes, self._on_failure, self._clock = max_bytes, on_failure, clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._last: dict[str, Scraped] = {}
        self._down: dict[str, str] = {}  # url -> why (connection refused)

    def watch(self, urls: set[str]) -> None:
        """Scrape exactly ``urls`` from now on."""
        for url in set(self._tasks) - urls:
            self._tasks.pop(url).cancel()
            self._last.pop(url, None)
            self._down.pop(url, None)
        for url in urls - set(self._tasks):
            self._tasks[url] = asyncio.create_task(self._run(url), name=f"load scrape {url}")

    def load(self, url: str) -> Load:
        last = self._last.get(url)
        return last.load if last is not None and self._clock() - last.at <= self._staleness else Load()

    def stale(self, url: str) -> bool:
        last = self._last.get(url)
        return last is None or self._clock() - last.at > self._staleness

    def down(self, url: str) -> str | None:
        """Why the engine at ``url`` is not routable now (it refuses connections), or None."""
        return self._down.get(url)

    async def _run(self, url: str) -> None:
        while True:
            started = self._clock()
            await self.scrape(url)
            await asyncio.sleep(max(0.0, self._interval - (self._clock() - started)))

    async def scrape(self, url: str) -> None:
        """One scrape of ``url`` (the task's step; tests call it directly)."""
        reason = None
        try:
            page = await self._fetch(url)
            load = parse_load(page)
            if load is None:
                reason = "no_load_metrics"
            else:
                self._last[url] = Scraped(load, self._clock())
            if self._down.pop(url, None) is not None:
                log.info("engine %s answers again: routable", url)
        except (aiohttp.ClientConnectorError, ConnectionResetError, aiohttp.ServerDisconnectedError) as exc:
            reason = "refused"
            if url not in self._down:
                log.warning("engine %s refuses connections (%s): not routable until it answers", url, exc)
            self._down[url] = f"refuses connections ({type(exc).__name__})"
        except asyncio.TimeoutError:
            reason = "timeout"
        except (aiohttp.ClientError, ValueError) as exc:
            reason = "http_error" if isinstance(exc, aiohttp.ClientResponseError) else "bad_page"
        if reason is not None:
            self._on_failure(reason)

    async def _fetch(self, url: str) -> bytes:
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        async with self._session().get(url.rstrip("/") + "/metrics", timeout=timeout) as r:
            r.raise_for_status()
            page = await r.content.read(self._max_bytes + 1)
            if len(page) > self._max_bytes:
                raise ValueError(f"/metrics over {self._max_bytes} bytes")
            return page

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
