"""Bounds on what rendering a chat template may cost: a template is code, and a request may bring one.

Invariants:
- ``BoundedSandbox`` is Jinja's immutable sandbox; one render (``render_bounded``) runs under a
  fresh ``RenderBudget`` (``adapters.template_budget``): ``MAX_RENDER_STEPS`` steps (every item a
  ``{% for %}`` loop takes, a recursive loop's ``loop(...)`` too, every call, every filter, each
  item ``map``/``select`` hand a filter) and ``MAX_RENDER_WORK`` units of work (every value built,
  every item a size check walks). A step is not a unit of time: one may still copy 8 MiB.
- No value the template builds may exceed ``MAX_RENDER_CHARS`` (characters, bytes, or items of a
  list), and no number ``MAX_INT_BITS`` bits. The rules are ``adapters.template_sizes``'; here
  they are applied: **before** each ``*``, ``+``, ``**``, ``%`` (the operators intercepted), ``~``
  (the template's ``Concat`` nodes are rewritten into a checked call at compile), str/bytes method
  call, filter call (``before_filter``), ``lipsum``, block output (``{% set %}`` blocks, macros,
  ``{% call %}``, ``{% filter %}``: ``concat``) and printed container (``finalize``), wherever the
  value could be far larger than its inputs ("would build at least N"); **after** each of them,
  and every call and filter whatever it is, on the value returned ("built N"): what grows by at
  most a constant factor (``escape``, ``upper``, ``encode`` of an allowed codec, ``tojson`` of
  non-ASCII: up to ~12x) is built and then refused. Every filter is wrapped as it is put in
  ``env.filters`` (``BoundedFilters``), built in or set later, and is passed the environment or
  context it asks for as Jinja would.
- The rendered text is collected chunk by chunk and the render fails once it passes
  ``MAX_RENDER_CHARS``. ``urlize`` and ``pprint`` (outputs their inputs do not bound; no prompt
  uses them) are not available: a template naming them does not compile.
- A template that names ``RESERVED`` anywhere (it carries the budget into the render, and could
  be shadowed) is refused at compile (``bound_tree``).
- Every refusal raises ``TemplateTooCostly`` (a ``jinja2.TemplateError``) with one line.
"""

from __future__ import annotations

import functools
import inspect
import operator
import typing
from collections.abc import Callable, Iterable
from typing import Any

import jinja2
import jinja2.nodes as nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from adapters.template_budget import (
    MAX_RENDER_CHARS,
    MAX_RENDER_STEPS,
    RenderBudget,
    TemplateTooCostly,
    current_budget,
    rendering,
)
from adapters.template_sizes import (
    FILTERS_READ_BY_NAME,
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

RESERVED = "__kvindex_render_budget"
_REMOVED_FILTERS = frozenset({"urlize", "pprint"})  # their output is not bounded by their input's (no prompt uses them)
_PASSED_FIRST = ("environment", "env", "eval_ctx", "context")  # what Jinja may pass a filter before its value


# -- the tree -----------------------------------------------------------------------------------
class TreeBudget(RenderBudget):
    """The budget as the rewritten template calls it: ``(RESERVED)("for", iterable)`` or
    ``(RESERVED)("~", *parts)``."""

    def __call__(self, kind: str, *parts: Any) -> Any:
        if kind == "for":
            return self.loop(parts[0])
        refuse_over(sum(printed_size(p) for p in parts), "'~'")
        return refuse_built("".join(map(str, parts)), "'{}'", "~")


def _budget_call(*args: Any) -> nodes.Call:
    return nodes.Call(nodes.Name(RESERVED, "load"), [nodes.Const(args[0]), *args[1:]], [], None, None)


def bound_tree(tree: nodes.Template) -> nodes.Template:
    """``tree`` with every loop's iterable and every ``~`` passed through the render's budget; a
    tree that names ``RESERVED`` anywhere (a variable, a macro, a parameter, an import) is refused:
    it could shadow the budget."""
    for node in tree.find_all(nodes.Node):
        for field in node.fields:
            value = getattr(node, field, None)
            if value == RESERVED or (isinstance(value, (list, tuple)) and RESERVED in value):
                raise TemplateTooCostly(f"a template may not name {RESERVED}")
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
        budget = current_budget()
        if budget is not None:
            budget.step()
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
    return refuse_built("".join(parts), "{}", "a block's output")


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
    with rendering(TreeBudget()) as budget:
        for chunk in template.generate(**variables, **{RESERVED: budget}):
            total += len(chunk)
            refuse_over(total, "the rendered text")
            budget.charge(len(chunk))
            chunks.append(chunk)
    return "".join(chunks)
