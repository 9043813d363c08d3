"""One render's budget: its steps and the work it may do, and the refusal every bound raises.

Invariants:
- A ``RenderBudget`` counts ``MAX_RENDER_STEPS`` steps (loop items, calls, filters) and
  ``MAX_RENDER_WORK`` units of work (an ASCII character built, 4 for another, ``ITEM_COST`` per
  list item, ``WALK_COST`` per item a size check walks), and at steps and charges (every 64th)
  its ``MAX_RENDER_SECONDS`` of wall-clock time; past any, ``TemplateTooCostly`` (one line). One
  call that runs long between two steps is not interrupted: its size checks must bound it.
- ``rendering(budget)`` makes it the current render's while a block runs (a ``ContextVar``: one
  per thread or task, reset after); ``charge`` charges the current one, and nothing outside a
  render.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import jinja2

MAX_RENDER_CHARS = 8 << 20  # the rendered text, or any string/list the template builds (the body cap is 8 MiB)
MAX_RENDER_STEPS = 2_000_000  # loop items, calls and filters of one render: a large real chat needs ~10 per message
MAX_RENDER_WORK = 16 * MAX_RENDER_CHARS  # what one render builds in all (characters, items) and walks
WALK_COST = 32  # an item a size check walks, against a character built: the walk is Python, the copy memcpy
MAX_RENDER_ITEMS = 1 << 20  # items of any one list or tuple the template builds (a real chat: ~10k)
ITEM_COST = 64  # a list item built, against a character (a pointer and, mostly, an object)
MAX_RENDER_SECONDS = 10.0  # one render's wall-clock time, checked at every step and charge
_CURRENT: ContextVar[RenderBudget | None] = ContextVar("kvindex_render_budget", default=None)


class TemplateTooCostly(jinja2.TemplateError):
    """A render that would pass one of the bounds."""


class RenderBudget:
    """One render's steps and work."""

    def __init__(self, steps: int = MAX_RENDER_STEPS, work: int = MAX_RENDER_WORK) -> None:
        self.steps_left = steps
        self.work_left = work
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self._ticks = 0

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise TemplateTooCostly(f"the template takes more than {MAX_RENDER_STEPS} steps (loop items, calls "
                                    "and filters)")
        self._in_time()

    def charge(self, units: int) -> None:
        self.work_left -= units
        if self.work_left < 0:
            raise TemplateTooCostly(f"the template builds more than {MAX_RENDER_WORK} characters or items in all "
                                    "(or walks as many)")
        self._in_time()

    def _in_time(self) -> None:
        self._ticks += 1
        if not self._ticks & 63 and time.monotonic() > self.deadline:  # the clock read every 64th time
            raise TemplateTooCostly(f"the template takes more than {MAX_RENDER_SECONDS:g} s to render")

    def loop(self, iterable: Any) -> Iterator[Any]:
        for item in iterable:
            self.step()
            yield item


@contextmanager
def rendering(budget: RenderBudget) -> Iterator[RenderBudget]:
    """``budget`` is the current render's (what the checks charge) while the block runs."""
    token = _CURRENT.set(budget)
    try:
        yield budget
    finally:
        _CURRENT.reset(token)


def current_budget() -> RenderBudget | None:
    return _CURRENT.get()


def charge(units: int) -> None:
    """``units`` of work charged to the current render's budget (none outside a render)."""
    budget = _CURRENT.get()
    if budget is not None:
        budget.charge(units)
