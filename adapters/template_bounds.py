"""Bounds on what rendering a chat template may cost: a template is code, and a request may bring one.

Invariants:
- ``BoundedSandbox`` is Jinja's immutable sandbox in which one render (``render_bounded``) has a
  ``RenderBudget`` of ``MAX_RENDER_STEPS`` steps: every item a ``{% for %}`` loop takes and every
  call the template makes (functions, macros, methods) costs one step; the render fails when they
  run out (Jinja's own ``range`` already stops at 100,000 items per call; nested loops do not).
- No value the template builds may exceed ``MAX_RENDER_CHARS`` (characters, bytes, or items of a
  list). Every filter (built in, or set in ``env.filters`` later: ``BoundedFilters`` wraps what
  is set in it) and every call (functions, methods, macros) has its result's size checked when it
  returns; what could build past the bound before that check sees it is checked **before** it is
  built: ``*``, ``+``, ``**`` (result bits), ``%`` and ``str.format`` (field widths), ``~`` (the
  template's ``Concat`` nodes are rewritten into a checked call at compile), the growing string
  and bytes methods (``center``, ``ljust``, ``rjust``, ``zfill``, ``replace``, ``expandtabs``,
  ``translate``, ``join``, ``format``), the growing filters (``center``, ``indent``, ``wordwrap``,
  ``replace``, ``format``, ``batch``), the filters that serialise or concatenate a container
  (``join``, ``sum``, ``string``, ``pprint``, ``tojson``, ``xmlattr``, ``urlencode``: its items are
  counted, a shared item each time it is reached, indentation included, up to the bound;
  ``tojson``'s ``indent`` is at most ``MAX_JSON_INDENT``; an iterable ``join``, ``sum`` or ``list``
  consume is taken item by item up to the bound), ``slice`` (into at most Jinja's ``MAX_RANGE``
  parts), ``lipsum``, and a container printed with ``{{ }}``. ``urlize`` (its output grows with ``target`` per URL; no prompt uses it) is not
  available. A filter that takes the environment or context first is passed them as Jinja would.
- The rendered text is collected chunk by chunk and the render fails once it passes
  ``MAX_RENDER_CHARS``.
- Every refusal raises ``TemplateTooCostly`` (a ``jinja2.TemplateError``) with one line.
- The reserved name ``RESERVED`` carries the budget into the render; a template that names it is
  refused at compile (it could otherwise shadow the budget).
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from itertools import chain
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jinja2
import jinja2.nodes as nodes
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

MAX_RENDER_STEPS = 2_000_000  # loop items + calls of one render: a large real chat needs ~10 per message
MAX_RENDER_CHARS = 8 << 20  # the rendered text, or any string/list the template builds (the body cap is 8 MiB)
MAX_JSON_INDENT = 64
RESERVED = "__kvindex_render_budget"
_GROWING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "replace", "expandtabs", "translate", "join",
                              "format", "format_map"})
_SERIALISING_FILTERS = {"string": 0, "pprint": 1, "xmlattr": 0, "urlencode": 0}  # name -> indent per level
_REMOVED_FILTERS = frozenset({"urlize"})
_NAMED = frozenset({"join", "sum", "tojson", "batch", "slice"})  # filters read by parameter name
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")


class TemplateTooCostly(jinja2.TemplateError):
    """A render that would pass one of the module's bounds."""


def _refuse_over(size: int, what: str) -> None:
    if size > MAX_RENDER_CHARS:
        raise TemplateTooCostly(f"{what} would build at least {size} characters or items; the bound is {MAX_RENDER_CHARS}")


_SIZED = (str, bytes, list, tuple)
_END = object()


def _size(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 0


def _container_size(value: Any, indent: int = 0) -> int:
    """Characters ``value`` prints as, at least: every item reachable from it (a shared item
    counted each time; ``indent`` characters per level of nesting on its line), stopping past
    the bound. Walked with one iterator per level of nesting: no copy of what it counts."""
    seen, stack = 0, [(iter((value,)), 0)]
    while stack and seen <= MAX_RENDER_CHARS:
        items, depth = stack[-1]
        item = next(items, _END)
        if item is _END:
            stack.pop()
            continue
        seen += (len(item) + 1 if isinstance(item, (str, bytes)) else 3) + depth * indent  # a digit or bracket, ", "
        if isinstance(item, dict):
            stack.append((chain(item.keys(), item.values()), depth + 1))
        elif isinstance(item, (list, tuple)):
            stack.append((iter(item), depth + 1))
    return seen


def check_container(value: Any, what: str, indent: int = 0) -> None:
    if isinstance(value, (list, tuple, dict)):
        _refuse_over(_container_size(value, indent), what)


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


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


def check_growth(name: str, subject: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a growing string operation ``subject.name(*args)`` whose result would pass the bound."""
    if not isinstance(subject, (str, bytes)):
        return
    text = _text(subject)  # bytes counted as latin-1 text: the same length
    values = [*args, *kwargs.values()]
    if name in ("center", "ljust", "rjust", "zfill"):
        width = next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), 0)
        _refuse_over(max(len(subject), width), name)
    elif name == "wordwrap":  # at worst a line per character, each ended by the wrap string
        wrap = kwargs.get("wrapstring", args[2] if len(args) > 2 else None)
        _refuse_over(len(subject) + (len(subject) + 1) * (_size(wrap) or 1), name)
    elif name == "translate" and values and isinstance(values[0], dict):
        longest = max((_size(v) for v in values[0].values()), default=1)
        _refuse_over(len(subject) * max(longest, 1), name)
    elif name == "join" and values and isinstance(values[0], (list, tuple)):  # (``call`` takes an iterator first)
        _refuse_over(_join_size(list(values[0]), subject), name)
    elif name == "indent":
        width = values[0] if values and isinstance(values[0], int) else len(values[0]) if values and isinstance(values[0], str) else 4
        _refuse_over(len(text) + (text.count("\n") + 1) * width, name)
    elif name == "replace" and len(values) >= 2 and isinstance(values[0], type(subject)) \
            and isinstance(values[1], type(subject)):
        count = text.count(_text(values[0])) if values[0] else len(text) + 1
        if len(values) > 2 and isinstance(values[2], int) and values[2] >= 0:
            count = min(count, values[2])
        _refuse_over(len(subject) + count * len(values[1]), name)
    elif name == "expandtabs":
        tab = values[0] if values and isinstance(values[0], int) else 8
        _refuse_over(len(text) + text.count("\t") * tab, name)
    elif name in ("format", "format_map") and isinstance(subject, str):
        _refuse_over(len(text) + _format_width(text, percent=False) + _args_chars(values), name)


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``left <operator> right`` when its result would pass the bound."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, _SIZED) and isinstance(times, int):
                _refuse_over(len(seq) * times, "'*'")
    elif operator == "+":
        _refuse_over(_size(left) + _size(right), "'+'")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        _refuse_over(max(abs(left).bit_length(), 1) * right // 8, "'**'")
    elif operator == "%" and isinstance(left, (str, bytes)):
        _refuse_over(len(left) + _format_width(_text(left), percent=True) + _args_chars(
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


def _join_size(items: list[Any], sep: Any) -> int:
    """What ``sep.join`` of ``items`` (printed as strings) builds, at least; stops past the bound."""
    total = _size(sep) * max(len(items) - 1, 0)
    for item in items:
        total += len(item) if isinstance(item, (str, bytes)) else _container_size(item) if isinstance(
            item, (list, tuple, dict)) else 1
        if total > MAX_RENDER_CHARS:
            break
    return total


def _taken(value: Any, what: str) -> list[Any]:
    """An iterable consumed whole (joined, summed, listed), as a list; refused once its items and
    their lengths pass the bound (an iterator may build each item it yields: not all of them)."""
    if isinstance(value, list):
        return value
    items: list[Any] = []
    total = 0
    for item in value:
        items.append(item)
        total += 1 + _size(item)
        _refuse_over(total, what)
    return items


def before_filter(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any], named: dict[str, Any]) -> Any:
    """Refuse the filter call ``value | name(*args, **kwargs)`` before it builds past the bound
    (``named``: its arguments by parameter name, for the filters in ``_NAMED``); the value to
    filter (an iterable that ``join``, ``sum`` or ``list`` consume, taken first)."""
    what = f"the filter '{name}'"
    if name == "format" and isinstance(value, str):
        _refuse_over(len(value) + _format_width(value, percent=True) + _args_chars(args), what)
    elif name in ("center", "indent", "wordwrap", "replace"):
        check_growth(name, value, args, kwargs)
    elif name in ("join", "sum", "list") and not isinstance(value, (str, bytes, dict)):
        value = _taken(value, what)
        if name == "join":
            _refuse_over(_join_size(value, named.get("d", "")), what)
        elif name == "sum" and (isinstance(start := named.get("start", 0), _SIZED)
                                or any(isinstance(v, _SIZED) for v in value)):
            _refuse_over(_container_size(start) + _container_size(value), what)
    elif name == "tojson":
        indent = named.get("indent")
        if isinstance(indent, int) and not 0 <= indent <= MAX_JSON_INDENT or isinstance(indent, str) and len(
                indent) > MAX_JSON_INDENT:
            raise TemplateTooCostly(f"tojson's indent must be at most {MAX_JSON_INDENT}")
        check_container(value, what, _size(indent) if isinstance(indent, str) else indent or 0)
    elif name in _SERIALISING_FILTERS:
        check_container(value, what, _SERIALISING_FILTERS[name])
    elif name == "batch" and named.get("fill_with") is not None:
        _refuse_over(named.get("linecount", 0), what)  # the last batch is filled up to linecount
    elif name == "slice" and isinstance(slices := named.get("slices"), int) and slices > MAX_RANGE:
        raise TemplateTooCostly(f"slice into more than {MAX_RANGE} parts is refused")
    return value


def _value_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s parameters from the value filtered on (the environment or context Jinja passes
    first left out: some filters' signatures name it, their async variants' do not)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name in ("environment", "env", "eval_ctx", "context"):
        params = params[1:]
    return sig.replace(parameters=params)


def bounded_filter(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` checked before (``before_filter``) and after (its result's size). A filter
    that takes the environment, eval context or context first keeps that: the wrapper carries
    its marker, so Jinja passes it that argument, and the wrapper hands it on."""
    passed = 1 if hasattr(original, "jinja_pass_arg") else 0
    signature = _value_signature(original) if name in _NAMED else None  # Jinja's tojson and HF's differ

    @functools.wraps(original)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        head, value, rest = args[:passed], args[passed], args[passed + 1:]
        named = signature.bind_partial(value, *rest, **kwargs).arguments if signature is not None else {}
        value = before_filter(name, value, rest, kwargs, named)
        out = original(*head, value, *rest, **kwargs)
        _refuse_over(_size(out), f"the filter '{name}'")
        return out
    return bounded


class BoundedFilters(dict[str, Callable[..., Any]]):
    """An environment's filters, each one bounded (``bounded_filter``) as it is set."""

    def __setitem__(self, name: str, fn: Callable[..., Any]) -> None:
        super().__setitem__(name, bounded_filter(name, fn))

    def update(self, *others: Any, **more: Callable[..., Any]) -> None:  # type: ignore[override]
        for name, fn in dict(*others, **more).items():
            self[name] = fn


def _lipsum(original: Callable[..., str]) -> Callable[..., str]:
    def bounded(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (Jinja's names)
        if isinstance(n, int) and isinstance(max, int):
            _refuse_over(n * max * 16, "lipsum")  # words of at most ~14 letters, a space or a comma each
        return original(n, html, min, max)
    return bounded


def _finalize(value: Any) -> Any:
    check_container(value, "printing a container")
    return value


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with this module's bounds (module invariants)."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=_finalize, **options)
        filters = BoundedFilters()
        filters.update({k: v for k, v in self.filters.items() if k not in _REMOVED_FILTERS})
        self.filters = filters
        self.globals["lipsum"] = _lipsum(typing.cast(Callable[..., str], self.globals["lipsum"]))

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = __context.get(RESERVED)
        if isinstance(budget, RenderBudget) and __obj is not budget:
            budget.step()
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        name = getattr(method, "__name__", "")
        if isinstance(getattr(method, "__self__", None), (str, bytes)) and name in _GROWING_METHODS:
            if name == "join" and args and not isinstance(args[0], (list, tuple, str, bytes)):
                args = (_taken(args[0], name), *args[1:])  # an iterator joined: taken first, to be counted
            check_growth(name, method.__self__, args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        _refuse_over(_size(out), f"a call of {name or 'a function'}")
        return out


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
