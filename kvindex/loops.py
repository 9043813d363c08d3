"""The event loop kvindex runs on: uvloop by default (as vLLM's API server does), asyncio's own on
request; and the pace of Python's garbage collector in that process.

Invariants:
- ``auto`` is uvloop when it is installed (every platform but Windows), else asyncio's loop;
  ``uvloop`` without uvloop installed is a ConfigError, never a silent fallback.
- The choice is made once per process, by its entry point (``kvindex`` and its ingest workers,
  which inherit it through ``KVINDEX_LOOP``); nothing else creates loops.
- Measured (benchmarks/run.py, the ``HTTP ... health`` line): uvloop takes ~15-20% off an HTTP
  round trip, which is most of a /query.
- ``run`` sets the collector's youngest generation to ``GC_YOUNG_THRESHOLD`` allocations (Python's
  default is 700). At 700, a collection falls inside nearly every /query (an 8k-token answer
  allocates more), so each request's live objects are promoted; they pile up as survivors, and
  every few hundred queries a full collection walks the whole heap: 67-95 ms with 512 engines
  (their lanes, sockets and metric children), a stall on every query waiting then. Measured with
  1,500 /query after ingest at 512 engines: in one process, 3 stalls of 69-98 ms a run at 700 and
  none past the first request (7-11 ms) at 10,000; with ``--workers 2``, one of 23-42 ms every
  0.1-0.2 s at 700 and none above 7.5 ms at 10,000 (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvindex.config import ConfigError

CHOICES = ("auto", "uvloop", "asyncio")
ENV = "KVINDEX_LOOP"
GC_YOUNG_THRESHOLD = 10_000  # allocations between collections of the youngest generation
T = TypeVar("T")


def factory(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """(the loop's name, its factory for ``asyncio.Runner``; None means asyncio's default)."""
    if choice not in CHOICES:
        raise ConfigError(f"event loop {choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("event loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return "asyncio", None
    return "uvloop", uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """``asyncio.run(main)`` on the chosen loop, the collector paced for a server (above)."""
    _, new_loop = factory(choice)
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)
