"""Bounds on what rendering a chat template may cost: a template is code, and a request may bring one.

Invariants:
- ``BoundedSandbox`` is Jinja's immutable sandbox in which one render (``render_bounded``) has a
  ``RenderBudget`` of ``MAX_RENDER_STEPS`` steps: every item a ``{% for %}`` loop takes (a
  recursive loop's ``loop(...)`` too) and every call the template makes (functions, macros,
  methods) costs one step; the render fails when they run out (Jinja's own ``range`` already stops
  at 100,000 items per call; nested loops do not). A step is not a unit of time: one step may
  still copy up to the size bound below.
- No value the template builds may exceed ``MAX_RENDER_CHARS`` (characters, bytes, or items of a
  list), and no number ``MAX_INT_BITS`` bits. Two kinds of check, each refusal saying which:
  - **before** it is built ("would build at least N"), wherever the value could be far larger
    than its inputs: ``*``, ``+``, ``**``, ``%`` and ``str.format`` (fields times the largest
    printed argument, plus widths; nested ``{:{w}}`` widths are refused), ``~`` and the output of
    a block (``{% set %}…{% endset %}``, macros, ``{% call %}``, ``{% filter %}``), the growing
    string and bytes methods (``center``, ``ljust``, ``rjust``, ``zfill``, ``replace``,
    ``expandtabs``, ``translate``, ``join``, ``format``, ``format_map``), the growing filters
    (``center``, ``indent``, ``wordwrap``, ``replace``, ``format``, ``batch``), ``lipsum``, ``slice``
    (into at most Jinja's ``MAX_RANGE`` parts), ``sum`` (also its quadratic copying), and every
    filter that prints its value (``join``, ``string``, ``tojson`` with its indent of at most
    ``MAX_JSON_INDENT``, ``pprint``, ``trim``, ``upper``, ...: the value is measured as printed,
    ``printed_size``, a shared item each time it is reached, up to the bound); an iterable that
    ``join``, ``sum`` or ``list`` consume is taken item by item up to the bound; a printed
    container ``{{ }}`` is measured first too;
  - **after** it returns ("built N"), for every filter (built in, or set in ``env.filters`` later:
    ``BoundedFilters`` wraps whatever is put in it), call and operator: what grows by at most a
    constant factor of its inputs (``escape``, ``upper``, ``encode``, ``tojson`` of non-ASCII:
    up to ~12x) is built and then refused.
- The rendered text is collected chunk by chunk and the render fails once it passes
  ``MAX_RENDER_CHARS``. ``urlize`` (its output grows by its ``target`` per URL; no prompt uses
  it) is not available: a template naming it does not compile.
- Every refusal raises ``TemplateTooCostly`` (a ``jinja2.TemplateError``) with one line.
- The reserved name ``RESERVED`` carries the budget into the render; a template that names it is
  refused at compile (it could otherwise shadow the budget).
"""


from __future__ import annotations

import functools
import inspect
import operator
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jinja2
import jinja2.nodes as nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from adapters.template_sizes import (
    FILTERS_READ_BY_NAME,
    MAX_RENDER_CHARS,
    TemplateTooCostly,
    before_filter,
    check_binop,
    check_method,
    printed_size,
    refuse_built,
    refuse_over,
    taken,
    walks,
)

__all__ = ["MAX_RENDER_CHARS", "MAX_RENDER_STEPS", "RESERVED", "BoundedSandbox", "TemplateTooCostly",
           "compile_bounded", "render_bounded"]

MAX_RENDER_STEPS = 2_000_000  # loop items + calls of one render: a large real chat needs ~10 per message
RESERVED = "__kvindex_render_budget"
_REMOVED_FILTERS = frozenset({"urlize"})
_PASSED_FIRST = ("environment", "env", "eval_ctx", "context")  # what Jinja may pass a filter before its value


# -- steps ---------------------------------------------------------------------------------------
class RenderBudget:
    """One render's steps; called by the rewritten template: ``(RESERVED)("for", iterable)`` or
    ``(RESERVED)("~", *parts)``."""

    def __init__(self, steps: int = MAX_RENDER_STEPS) -> None:
        self.left = steps

    def step(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise TemplateTooCostly(f"the template takes more than {MAX_RENDER_STEPS} steps (loop items and calls)")

    def loop(self, iterable: Any) -> Iterator[Any]:
        for item in iterable:
            self.step()
            yield item

    def __call__(self, kind: str, *parts: Any) -> Any:
        if kind == "for":
            return self.loop(parts[0])
        refuse_over(sum(printed_size(p) for p in parts), "'~'")
        return refuse_built("".join(map(str, parts)), "'{}'", "~")


def _budget_call(*args: Any) -> nodes.Call:
    return nodes.Call(nodes.Name(RESERVED, "load"), [nodes.Const(args[0]), *args[1:]], [], None, None)


def bound_tree(tree: nodes.Template) -> nodes.Template:
    """``tree`` with every loop's iterable and every ``~`` passed through the render's budget."""
    for loop in tree.find_all(nodes.For):
        loop.iter = _budget_call("for", loop.iter)
    for concat in list(tree.find_all(nodes.Concat)):
        call = _budget_call("~", *concat.nodes)
        concat.nodes = [call]  # a Concat of one checked, joined string
    return tree


# -- filters -------------------------------------------------------------------------------------
def _value_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s parameters from the value filtered on. Jinja passes the environment or context
    first when the filter is marked so; the signature names it, except where an async variant
    added the marker to a function without such a parameter (``slice``, ``list``, ``first``)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name in _PASSED_FIRST:
        params = params[1:]
    return sig.replace(parameters=params)


def bounded_filter(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` checked before (``before_filter``) and after it runs. The wrapper carries the
    filter's marker, so Jinja passes it the environment or context the filter asks for, and the
    wrapper hands it on."""
    passed = 1 if hasattr(original, "jinja_pass_arg") else 0
    signature = _value_signature(original) if name in FILTERS_READ_BY_NAME else None

    @functools.wraps(original)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        head, value, rest = args[:passed], args[passed], args[passed + 1:]
        named: dict[str, Any] = {}
        if signature is not None:
            try:
                named = signature.bind_partial(value, *rest, **kwargs).arguments
            except TypeError:
                pass  # the filter itself says what is wrong with its arguments
        value = before_filter(name, value, named)
        return refuse_built(original(*head, value, *rest, **kwargs), "the filter '{}'", name)
    return bounded


class BoundedFilters(dict[str, Callable[..., Any]]):
    """An environment's filters, each one bounded (``bounded_filter``) as it is put in."""

    def __init__(self, filters: dict[str, Callable[..., Any]]) -> None:
        super().__init__()
        self.update(filters)

    def __setitem__(self, name: str, fn: Callable[..., Any]) -> None:
        super().__setitem__(name, bounded_filter(name, fn))

    def update(self, *others: Any, **more: Callable[..., Any]) -> None:  # type: ignore[override]
        for name, fn in dict(*others, **more).items():
            self[name] = fn

    def setdefault(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:  # type: ignore[override]
        if name not in self:
            self[name] = fn
        return self[name]

    def __ior__(self, other: Any) -> BoundedFilters:  # type: ignore[override,misc]
        self.update(other)
        return self


def _bounded_lipsum(original: Callable[..., str]) -> Callable[..., str]:
    @functools.wraps(original)
    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (Jinja's names)
        n, low, high = operator.index(n), operator.index(min), operator.index(max)
        refuse_over(n * high * 16, "lipsum")  # words of at most ~14 letters, a space or a comma each
        return original(n, html, low, high)
    return lipsum


# -- the sandbox ---------------------------------------------------------------------------------
def _finalize(value: Any) -> Any:
    if walks(value):
        refuse_over(printed_size(value), "printing a container")
    return value


def _concat(parts: Iterable[str]) -> str:
    """A block's output (``{% set %}`` blocks, macros, ``{% call %}``, ``{% filter %}``), joined once
    it is known to fit."""
    parts = list(parts)
    refuse_over(sum(map(len, parts)), "a block's output")
    return "".join(parts)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with this module's bounds (module invariants)."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})
    concat = staticmethod(_concat)  # type: ignore[assignment]

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=_finalize, **options)
        self.filters = BoundedFilters({k: v for k, v in self.filters.items() if k not in _REMOVED_FILTERS})
        self.globals["lipsum"] = _bounded_lipsum(typing.cast(Callable[..., str], self.globals["lipsum"]))

    def call_binop(self, context: jinja2.runtime.Context, op: str, left: Any, right: Any) -> Any:
        check_binop(op, left, right)
        return refuse_built(super().call_binop(context, op, left, right), "'{}'", op)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = __context.get(RESERVED)
        if isinstance(budget, RenderBudget) and __obj is not budget:
            budget.step()
            if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level: its items cost steps
                args = (budget.loop(args[0]), *args[1:])
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        name = getattr(method, "__name__", "")
        subject = getattr(method, "__self__", None)
        if isinstance(subject, (str, bytes)):
            if name == "join" and args and not isinstance(args[0], (list, tuple, str, bytes)):
                args = (taken(args[0], name), *args[1:])  # an iterator joined: taken first, to be counted
            check_method(name, subject, args, kwargs)
        return refuse_built(super().call(__context, __obj, *args, **kwargs), "a call of {}", name or "a function")


def compile_bounded(env: BoundedSandbox, tree: nodes.Template) -> jinja2.Template:
    """The template of ``tree`` (parsed by ``env``), its loops and ``~`` bounded."""
    return env.from_string(bound_tree(tree))


def render_bounded(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """``template`` rendered with ``variables`` under a fresh budget, the output capped."""
    chunks, total = [], 0
    for chunk in template.generate(**variables, **{RESERVED: RenderBudget()}):
        total += len(chunk)
        refuse_over(total, "the rendered text")
        chunks.append(chunk)
    return "".join(chunks)
