"""The event loop kvindex runs on: uvloop by default (as vLLM's API server does), asyncio's own on request.

Invariants:
- ``auto`` is uvloop when it is installed (every platform but Windows), else asyncio's loop;
  ``uvloop`` without uvloop installed is a ConfigError, never a silent fallback.
- The choice is made once per process, by its entry point (``kvindex`` and its ingest workers,
  which inherit it through ``KVINDEX_LOOP``); nothing else creates loops.
- Measured (benchmarks/run.py, the ``HTTP ... health`` line): uvloop takes ~15-20% off an HTTP
  round trip, which is most of a /query.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvindex.config import ConfigError

CHOICES = ("auto", "uvloop", "asyncio")
ENV = "KVINDEX_LOOP"
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
    """``asyncio.run(main)`` on the chosen loop."""
    _, new_loop = factory(choice)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)
