"""Bounds on what rendering a chat template may cost: a template is code, and a request may bring one.

Invariants:
- ``BoundedSandbox`` is Jinja's immutable sandbox in which one render (``render_bounded``) has a
  ``RenderBudget`` of ``MAX_RENDER_STEPS`` steps: every item a ``{% for %}`` loop takes and every
  call the template makes (functions, macros, methods) costs one step; the render fails when they
  run out (Jinja's own ``range`` already stops at 100,000 items per call; nested loops do not).
- No value the template builds may exceed ``MAX_RENDER_CHARS`` (characters, or items of a list),
  and the check comes **before** the value is built: ``*``, ``+``, ``**`` (result bits),
  ``%`` and ``str.format`` (field widths), ``~`` (the template's ``Concat`` nodes are rewritten
  into a checked call at compile), the growing string methods and filters (``center``, ``ljust``,
  ``rjust``, ``zfill``, ``indent``, ``wordwrap``, ``replace``, ``expandtabs``, ``format``), and a
  container printed with ``{{ }}`` or ``tojson`` (its items are counted, a shared item each time
  it is reached, up to the bound; ``tojson``'s ``indent`` is at most ``MAX_JSON_INDENT``).
- The rendered text is collected chunk by chunk and the render fails once it passes
  ``MAX_RENDER_CHARS``.
- Every refusal raises ``TemplateTooCostly`` (a ``jinja2.TemplateError``) with one line.
- The reserved name ``RESERVED`` carries the budget into the render; a template that names it is
  refused at compile (it could otherwise shadow the budget).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jinja2
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_STEPS = 2_000_000  # loop items + calls of one render: a large real chat needs ~10 per message
MAX_RENDER_CHARS = 8 << 20  # the rendered text, or any string/list the template builds (the body cap is 8 MiB)
MAX_JSON_INDENT = 64
RESERVED = "__kvindex_render_budget"
_GROWING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "replace", "expandtabs", "format", "format_map"})
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")


class TemplateTooCostly(jinja2.TemplateError):
    """A render that would pass one of the module's bounds."""


def _refuse_over(size: int, what: str) -> None:
    if size > MAX_RENDER_CHARS:
        raise TemplateTooCostly(f"{what} would build {size} characters or items; the bound is {MAX_RENDER_CHARS}")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _container_size(value: Any) -> int:
    """Items reachable from ``value`` (a shared item counted each time), stopping past the bound."""
    seen, stack = 0, [value]
    while stack and seen <= MAX_RENDER_CHARS:
        item = stack.pop()
        seen += len(item) + 1 if isinstance(item, str) else 3  # printed: at least a digit or bracket and ", "
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return seen


def check_container(value: Any, what: str) -> None:
    if isinstance(value, (list, tuple, dict)):
        _refuse_over(_container_size(value), what)


def _format_width(fmt: str, percent: bool) -> int:
    """An upper bound of what the fields of format string ``fmt`` add to its length."""
    if percent:
        widths = []
        for width, precision in _PERCENT_FIELD.findall(fmt):
            if "*" in (width, precision):
                raise TemplateTooCostly("'%' formatting with a '*' width is refused")
            widths.append(max(int(width or 0), int(precision or 0)))
        return sum(widths)
    return sum(int(n) for field in _BRACE_FIELD.findall(fmt) for n in re.findall(r"\d+", field))


def _args_chars(args: Iterable[Any]) -> int:
    return sum(len(a) if isinstance(a, str) else 32 for a in args)


def check_growth(name: str, subject: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a growing string operation ``subject.name(*args)`` whose result would pass the bound."""
    if not isinstance(subject, str):
        return
    values = [*args, *kwargs.values()]
    if name in ("center", "ljust", "rjust", "zfill", "wordwrap"):
        width = next((v for v in values if isinstance(v, int)), 0)
        _refuse_over(max(len(subject), width) * (2 if name == "wordwrap" else 1), name)
    elif name == "indent":
        width = values[0] if values and isinstance(values[0], int) else len(values[0]) if values and isinstance(values[0], str) else 4
        _refuse_over(len(subject) + (subject.count("\n") + 1) * width, name)
    elif name == "replace" and len(values) >= 2 and isinstance(values[0], str) and isinstance(values[1], str):
        count = subject.count(values[0]) if values[0] else len(subject) + 1
        if len(values) > 2 and isinstance(values[2], int) and values[2] >= 0:
            count = min(count, values[2])
        _refuse_over(len(subject) + count * len(values[1]), name)
    elif name == "expandtabs":
        tab = values[0] if values and isinstance(values[0], int) else 8
        _refuse_over(len(subject) + subject.count("\t") * tab, name)
    elif name in ("format", "format_map"):
        _refuse_over(len(subject) + _format_width(subject, percent=False) + _args_chars(values), name)


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``left <operator> right`` when its result would pass the bound."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                _refuse_over(len(seq) * times, "'*'")
    elif operator == "+":
        _refuse_over(_size(left) + _size(right), "'+'")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        _refuse_over(max(abs(left).bit_length(), 1) * right // 8, "'**'")
    elif operator == "%" and isinstance(left, str):
        _refuse_over(len(left) + _format_width(left, percent=True) + _args_chars(
            right if isinstance(right, tuple) else (right,)), "'%'")


class RenderBudget:
    """One render's steps; called by the rewritten template: ``(RESERVED)("for", iterable)`` or
    ``(RESERVED)("~", *parts)``."""

    def __init__(self, steps: int = MAX_RENDER_STEPS) -> None:
        self.left = steps

    def step(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise TemplateTooCostly(f"the template takes more than {MAX_RENDER_STEPS} steps (loop items and calls)")

    def _loop(self, iterable: Any) -> Iterator[Any]:
        for item in iterable:
            self.step()
            yield item

    def __call__(self, kind: str, *parts: Any) -> Any:
        if kind == "for":
            return self._loop(parts[0])
        for part in parts:
            check_container(part, "'~'")
        texts = [str(p) for p in parts]
        _refuse_over(sum(map(len, texts)), "'~'")
        return "".join(texts)


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


def _bounded_filter(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def bounded(value: Any, *args: Any, **kwargs: Any) -> Any:
        if name == "format":
            if isinstance(value, str):
                _refuse_over(len(value) + _format_width(value, percent=True) + _args_chars(args), name)
        else:
            check_growth(name, value, args, kwargs)
        return original(value, *args, **kwargs)
    return bounded


def _finalize(value: Any) -> Any:
    check_container(value, "printing a container")
    return value


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with this module's bounds (module invariants)."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=_finalize, **options)
        for name in ("center", "indent", "wordwrap", "replace", "format"):
            self.filters[name] = _bounded_filter(name, self.filters[name])

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = __context.get(RESERVED)
        if isinstance(budget, RenderBudget) and __obj is not budget:
            budget.step()
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        name = getattr(method, "__name__", "")
        if isinstance(getattr(method, "__self__", None), str) and name in _GROWING_METHODS:
            check_growth(name, method.__self__, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def compile_bounded(env: BoundedSandbox, tree: nodes.Template) -> jinja2.Template:
    """The template of ``tree`` (parsed by ``env``), its loops and ``~`` bounded."""
    return env.from_string(bound_tree(tree))


def render_bounded(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """``template`` rendered with ``variables`` under a fresh budget, the output capped."""
    chunks, total = [], 0
    for chunk in template.generate(**variables, **{RESERVED: RenderBudget()}):
        total += len(chunk)
        _refuse_over(total, "the rendered text")
        chunks.append(chunk)
    return "".join(chunks)
