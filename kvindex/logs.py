"""Logging helpers: a limiter so that a burst of bad input is logged once, not once per frame.

Invariant: per key, at most one line per ``interval`` seconds; the line says how many were
suppressed since the last one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class BurstLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 4096) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._max_keys = max_keys
        self._last: dict[tuple[str, ...], tuple[float, int]] = {}

    def warning(self, key: tuple[str, ...], msg: str, *args: object) -> None:
        now = self._clock()
        last, suppressed = self._last.get(key, (float("-inf"), 0))
        if now - last < self._interval:
            self._last[key] = (last, suppressed + 1)
            return
        if len(self._last) >= self._max_keys:
            self._last.clear()
        self._last[key] = (now, 0)
        if suppressed:
            msg += f" ({suppressed} more like this suppressed)"
        self._logger.warning(msg, *args)
