"""Logging helpers: a limiter so that a burst of bad input is logged once, not once per frame,
and ``shown``, the one way a name that came from outside is written into a log line.

Invariants:
- ``BurstLog``: per key, at most one line per ``interval`` seconds; the line says how many were
  suppressed since the last one. ``burst_logger`` is a logger (for a library that logs through
  one, aiohttp's server) with the same rule per (message, exception type), its tracebacks
  replaced by the exception's one line.
- ``shown(value)`` is one line of printable text whatever ``value`` holds: control characters
  (newlines, escapes, ...) and other non-printable code points are written as Python escapes
  (``\\n``, ``\\x1b``, ``\\u2028``), and past ``limit`` characters it is cut, with a marker saying
  how many were left out. Every request- or engine-provided name (pod, instance id, model, LoRA,
  salt, topic) goes through it before it reaches a log line: ``OneLine``, the filter on the
  log handlers of ``kvindex`` and of its shard workers (``one_line_logs``), applies it to every
  string argument of every record (and to a message that itself holds control characters), so
  no log line can be forged or flooded by a name, whichever module logs it. Tracebacks
  (``exc_info``) are formatted apart, as usual.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

SHOWN_CHARS = 300  # what of a name (or any string argument) a log line shows


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``value`` (a str, or anything else via ``str``) as one printable line, cut at ``limit``."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) - limit
    if cut > 0:
        text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return f"{text}...[{cut} more chars]" if cut > 0 else text


class OneLine(logging.Filter):
    """A handler filter: every record's string (and exception) arguments through ``shown`` (one
    line, cut)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(shown(a) if isinstance(a, str) else shown(str(a)) if isinstance(a, BaseException) else a
                                for a in record.args)  # an exception's text may carry what a peer sent
        if isinstance(record.msg, str) and not record.msg.isprintable():
            record.msg = shown(record.msg, limit=len(record.msg))
        return True


def one_line_logs() -> None:
    """``OneLine`` on every handler of the root logger (after ``logging.basicConfig``)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(OneLine())


class BurstFilter(logging.Filter):
    """At most one record per (message, exception type) per ``interval`` seconds, the traceback
    replaced by one line (``Type: its message, whitespace collapsed``), the suppressed count appended."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 4096) -> None:
        super().__init__()
        self._interval = interval
        self._clock = clock
        self._max_keys = max_keys
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        key = (str(record.msg), type(exc).__name__ if exc is not None else "")
        now = self._clock()
        last, suppressed = self._last.get(key, (float("-inf"), 0))
        if now - last < self._interval:
            self._last[key] = (last, suppressed + 1)
            return False
        if len(self._last) >= self._max_keys:
            self._last.clear()
        self._last[key] = (now, 0)
        msg = record.getMessage()
        if exc is not None:
            msg += f": {type(exc).__name__}: {shown(' '.join(str(exc).split()))}"
            record.exc_info, record.exc_text = None, None
        record.msg, record.args = msg + (f" ({suppressed} more like this suppressed)" if suppressed else ""), None
        return True


def burst_logger(name: str, parent: logging.Logger, interval: float = 10.0) -> logging.Logger:
    """A logger of its own (not in the logging registry: nothing global is changed) whose records go
    to ``parent``'s handlers through a ``BurstFilter``."""
    logger = logging.Logger(name)  # noqa: LOG001 -- outside the registry on purpose
    logger.parent = parent
    logger.addFilter(BurstFilter(interval))
    return logger


class BurstLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 4096) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._max_keys = max_keys
        self._last: dict[tuple[str, ...], tuple[float, int]] = {}

    def warning(self, key: tuple[str, ...], msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def log(self, level: int, key: tuple[str, ...], msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        """``msg % args`` at ``level`` unless a line of ``key`` went out less than ``interval`` ago."""
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
        self._logger.log(level, msg, *args, exc_info=exc_info)
