"""One render's budget: its steps and the work it may do, and the refusal every bound raises.

Invariants:
- A ``RenderBudget`` counts ``MAX_RENDER_STEPS`` steps (loop items, calls, filters) and
  ``MAX_RENDER_WORK`` units of work (a character or item built, ``WALK_COST`` per item a size
  check walks); past either, ``TemplateTooCostly`` (one line).
- ``rendering(budget)`` makes it the current render's while a block runs (a ``ContextVar``: one
  per thread or task, reset after); ``charge`` charges the current one, and nothing outside a
  render.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import jinja2

MAX_RENDER_CHARS = 8 << 20  # the rendered text, or any string/list the template builds (the body cap is 8 MiB)
MAX_RENDER_STEPS = 2_000_000  # loop items, calls and filters of one render: a large real chat needs ~10 per message
MAX_RENDER_WORK = 16 * MAX_RENDER_CHARS  # what one render builds in all (characters, items) and walks
WALK_COST = 32  # an item a size check walks, against a character built: the walk is Python, the copy memcpy
_CURRENT: ContextVar[RenderBudget | None] = ContextVar("kvindex_render_budget", default=None)


class TemplateTooCostly(jinja2.TemplateError):
    """A render that would pass one of the bounds."""


class RenderBudget:
    """One render's steps and work."""

    def __init__(self, steps: int = MAX_RENDER_STEPS, work: int = MAX_RENDER_WORK) -> None:
        self.steps_left = steps
        self.work_left = work

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise TemplateTooCostly(f"the template takes more than {MAX_RENDER_STEPS} steps (loop items, calls "
                                    "and filters)")

    def charge(self, units: int) -> None:
        self.work_left -= units
        if self.work_left < 0:
            raise TemplateTooCostly(f"the template builds more than {MAX_RENDER_WORK} characters or items in all "
                                    "(or walks as many)")

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
