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
import re
import typing
from collections.abc import Callable, Iterable, Iterator, MappingView
from itertools import chain
from typing import Any

import jinja2
import jinja2.nodes as nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_RENDER_STEPS = 2_000_000  # loop items + calls of one render: a large real chat needs ~10 per message
MAX_RENDER_CHARS = 8 << 20  # the rendered text, or any string/list the template builds (the body cap is 8 MiB)
MAX_INT_BITS = 1 << 16  # a number the template computes (Python prints at most 4,300 digits anyway)
MAX_JSON_INDENT = 64
MAX_SUM_COPIES = 8 * MAX_RENDER_CHARS  # items ``sum`` of sequences copies (each partial sum is a new one)
RESERVED = "__kvindex_render_budget"
_REMOVED_FILTERS = frozenset({"urlize"})
# filters that take a container as a container (never its printed text): all others are measured first
_CONTAINER_FILTERS = frozenset({"attr", "batch", "count", "d", "default", "dictsort", "first", "groupby", "items",
                                "join", "last", "length", "list", "map", "max", "min", "random", "reject",
                                "rejectattr", "reverse", "select", "selectattr", "slice", "sort", "sum", "unique"})
_INDENT_PER_LEVEL = {"pprint": 1}  # printed with this much indentation per level of nesting
_NAMED = frozenset({"join", "sum", "tojson", "batch", "slice", "center", "indent", "wordwrap", "replace",
                    "format"})  # the filters ``before_filter`` reads arguments of (by name: signatures differ)
_PASSED_FIRST = ("environment", "env", "eval_ctx", "context")  # what Jinja may pass a filter before its value
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")
_END = object()


class TemplateTooCostly(jinja2.TemplateError):
    """A render that would pass one of the module's bounds."""


def _refuse_over(size: int, what: str) -> None:
    """The check before a value is built."""
    if size > MAX_RENDER_CHARS:
        raise TemplateTooCostly(f"{what} would build at least {size} characters or items; "
                                f"the bound is {MAX_RENDER_CHARS}")


def _refuse_built(value: Any, what: str, name: str) -> Any:
    """The check after a value is built: ``value``, unless it is past a bound (``what`` names the
    operation, with ``{}`` for ``name``: formatted only for a refusal)."""
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_RENDER_CHARS:
        raise TemplateTooCostly(f"{what.format(name)} built {len(value)} characters or items; "
                                f"the bound is {MAX_RENDER_CHARS}")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateTooCostly(f"{what.format(name)} built a number of {value.bit_length()} bits; "
                                f"the bound is {MAX_INT_BITS}")
    return value


# -- how big a value is, printed ----------------------------------------------------------------
def _children(value: Any) -> Iterator[Any] | None:
    """What ``value`` prints of itself (a container's items, a namespace's attributes), or None."""
    if isinstance(value, dict):
        return chain(value.keys(), value.values())
    if isinstance(value, (list, tuple, set, frozenset, MappingView)):
        return iter(typing.cast(Iterable[Any], value))
    if isinstance(value, Namespace):
        return _children(value._Namespace__attrs)  # type: ignore[attr-defined]
    return None


def _scalar_size(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() * 3 // 10 + 1  # decimal digits, at least
    return 1


def printed_size(value: Any, indent: int = 0) -> int:
    """Characters ``str(value)`` (or a JSON or pretty dump) has, at least: a string's length, and a
    container's items walked (a shared item counted each time it is reached; ``indent`` characters
    per level of nesting on each item's line), stopping once past the bound. One iterator per
    level of nesting: no copy of what it counts."""
    top = _children(value)
    if top is None:
        return _scalar_size(value)
    seen, stack = 2, [(top, 1)]
    while stack and seen <= MAX_RENDER_CHARS:
        items, depth = stack[-1]
        item = next(items, _END)
        if item is _END:
            stack.pop()
            continue
        inner = _children(item)
        seen += (2 if inner is not None else _scalar_size(item) + 2) + depth * indent  # brackets or ", "
        if inner is not None:
            stack.append((inner, depth + 1))
    return seen


def _printed(value: Any) -> bool:
    """Whether measuring ``value`` printed means walking it (a container, a namespace)."""
    return _children(value) is not None


def _join_size(items: list[Any], sep: Any) -> int:
    """What ``sep.join`` of ``items`` (each printed) builds, at least; stops past the bound."""
    total = _scalar_size(sep) * max(len(items) - 1, 0)
    for item in items:
        total += printed_size(item)
        if total > MAX_RENDER_CHARS:
            break
    return total


def _spread(chars: int, sep: Any) -> int:
    """What joining ``chars`` single characters with ``sep`` builds."""
    return chars + max(chars - 1, 0) * _scalar_size(sep)


def _taken(value: Any, what: str) -> list[Any]:
    """An iterable consumed whole (joined, summed, listed), as a list; refused once its items and
    their lengths pass the bound (an iterator may build each item it yields: not all of them)."""
    if isinstance(value, list):
        return value
    items: list[Any] = []
    total = 0
    for item in value:
        items.append(item)
        total += 1 + (len(item) if isinstance(item, (str, bytes, list, tuple)) else 0)
        _refuse_over(total, what)
    return items


# -- format strings ------------------------------------------------------------------------------
def _formatted_size(fmt: str, args: Iterable[Any], percent: bool, what: str) -> int:
    """What formatting ``fmt`` with ``args`` builds, at most: its text, its widths, and each field
    filled with the largest printed argument."""
    if percent:
        fields = _PERCENT_FIELD.findall(fmt)
        if any("*" in pair for pair in fields):
            raise TemplateTooCostly(f"{what} with a '*' width is refused")
        widths = sum(max(int(w or 0), int(p or 0)) for w, p in fields)
    else:
        if _NESTED_FIELD.search(fmt):
            raise TemplateTooCostly(f"{what} with a nested {{...{{}}}} field is refused")
        fields = _BRACE_FIELD.findall(fmt)
        widths = sum(int(n) for field in fields for n in re.findall(r"\d+", field))
    largest = max((printed_size(a) for a in args), default=0)
    return len(fmt) + widths + len(fields) * largest


def _format_args(right: Any) -> list[Any]:
    """The values ``fmt % right`` may print: a tuple's items, a mapping's values, or ``right``."""
    if isinstance(right, tuple):
        return list(right)
    if isinstance(right, dict):
        return list(right.values())
    return [right]


# -- growth checked before: operators, str/bytes methods, filters ---------------------------------
def check_binop(op: str, left: Any, right: Any) -> None:
    """Refuse ``left <op> right`` when its result would pass a bound."""
    if op == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                _refuse_over(len(seq) * times, "'*'")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateTooCostly(f"'*' would build a number of more than {MAX_INT_BITS} bits")
    elif op == "+" and isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
        _refuse_over(len(left) + len(right), "'+'")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if (abs(left).bit_length() - 1) * right > MAX_INT_BITS:  # the result has at least that many bits
            raise TemplateTooCostly(f"'**' would build a number of more than {MAX_INT_BITS} bits")
    elif op == "%" and isinstance(left, (str, bytes)):
        _refuse_over(_formatted_size(_text(left), _format_args(right), True, "'%'"), "'%'")


def _text(value: str | bytes) -> str:
    """Bytes as latin-1 text: the same length, for counting."""
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str, default: Any = None) -> Any:
    return kwargs.get(name, args[at] if len(args) > at else default)


def check_method(name: str, subject: str | bytes, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse the str or bytes method call ``subject.name(*args, **kwargs)`` before it builds past
    the bound (Python's own parameters; a ``Markup`` subject is a str)."""
    text, kind = _text(subject), (str if isinstance(subject, str) else bytes)
    if name in ("center", "ljust", "rjust", "zfill"):
        width = _arg(args, kwargs, 0, "width", 0)
        _refuse_over(max(len(text), width if isinstance(width, int) else 0), name)
    elif name == "replace":
        old, new, count = _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"), _arg(args, kwargs, 2, "count", -1)
        if isinstance(old, kind) and isinstance(new, kind):
            _replaced(text, _text(old), len(new), count, name)
    elif name == "expandtabs":
        tab = _arg(args, kwargs, 0, "tabsize", 8)
        _refuse_over(len(text) + text.count("\t") * (tab if isinstance(tab, int) else 8), name)
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _refuse_over(len(text) * max(longest, 1), name)
    elif name == "join" and args and isinstance(args[0], (list, tuple)):  # (``call`` takes an iterator first)
        _refuse_over(_join_size(list(args[0]) if isinstance(args[0], tuple) else args[0], subject), name)
    elif name == "join" and args and isinstance(args[0], (str, bytes)):
        _refuse_over(_spread(len(args[0]), subject), name)
    elif name == "format" and kind is str:
        _refuse_over(_formatted_size(text, [*args, *kwargs.values()], False, name), name)
    elif name == "format_map" and kind is str and args and isinstance(args[0], dict):
        _refuse_over(_formatted_size(text, args[0].values(), False, name), name)


def _replaced(text: str, old: str, new_len: int, count: Any, what: str) -> None:
    times = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        times = min(times, count)
    _refuse_over(len(text) + times * new_len, what)


def before_filter(name: str, value: Any, named: dict[str, Any]) -> Any:
    """Refuse the filter call ``value | name(...)`` before it builds past the bound (``named``: its
    arguments by parameter name); the value to filter (an iterable that ``join``, ``sum`` or
    ``list`` consume, taken first)."""
    what = f"the filter '{name}'"
    if name == "join" and isinstance(value, (str, bytes)):  # its characters, joined
        _refuse_over(_spread(len(value), named.get("d", "")), what)
    elif name in ("join", "sum", "list") and not isinstance(value, (str, bytes)):
        value = _taken(value, what)
        if name == "join":
            _refuse_over(_join_size(value, named.get("d", "")), what)
        elif name == "sum":
            _check_sum(value, named.get("start", 0), what)
    elif name not in _CONTAINER_FILTERS and _printed(value):  # a filter of text, handed a container: str() of it
        indent = named.get("indent") if name == "tojson" else _INDENT_PER_LEVEL.get(name, 0)
        if name == "tojson":
            _check_json_indent(indent)
        _refuse_over(printed_size(value, len(indent) if isinstance(indent, str) else indent or 0), what)
    elif isinstance(value, (str, bytes)):
        _check_text_filter(name, _text(value), named, what)
    if name == "batch" and named.get("fill_with") is not None:
        _refuse_over(named.get("linecount", 0), what)  # the last batch is filled up to linecount
    elif name == "slice" and isinstance(slices := named.get("slices"), int) and slices > MAX_RANGE:
        raise TemplateTooCostly(f"{what} into more than {MAX_RANGE} parts is refused")
    return value


def _check_json_indent(indent: Any) -> None:
    if isinstance(indent, int) and not 0 <= indent <= MAX_JSON_INDENT or isinstance(indent, str) and len(
            indent) > MAX_JSON_INDENT:
        raise TemplateTooCostly(f"tojson's indent must be from 0 to {MAX_JSON_INDENT}")


def _check_sum(items: list[Any], start: Any, what: str) -> None:
    """``sum`` of sequences: the result's size, and the copies its partial sums make (quadratic)."""
    if isinstance(start, (list, tuple)) or any(isinstance(v, (list, tuple)) for v in items):
        total = printed_size(start) + printed_size(items)
        _refuse_over(total, what)
        if len(items) * total > MAX_SUM_COPIES:
            raise TemplateTooCostly(f"{what} of {len(items)} sequences would copy about {len(items) * total // 2} "
                                    f"items; the bound is {MAX_SUM_COPIES}")


def _check_text_filter(name: str, text: str, named: dict[str, Any], what: str) -> None:
    """The growing filters of a string, by their parameters."""
    if name == "center":
        width = named.get("width", 80)
        _refuse_over(max(len(text), width if isinstance(width, int) else 0), what)
    elif name == "indent":
        width = named.get("width", 4)
        _refuse_over(len(text) + (text.count("\n") + 1) * (len(width) if isinstance(width, str) else width), what)
    elif name == "wordwrap":  # at worst a line per character, each ended by the wrap string
        wrap = named.get("wrapstring")
        _refuse_over(len(text) + (len(text) + 1) * (len(wrap) if isinstance(wrap, str) else 1), what)
    elif name == "replace" and isinstance(named.get("old"), str) and isinstance(named.get("new"), str):
        _replaced(text, named["old"], len(named["new"]), named.get("count"), what)
    elif name == "format":
        _refuse_over(_formatted_size(text, [*named.get("args", ()), *named.get("kwargs", {}).values()], True, what),
                     what)


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
        _refuse_over(sum(printed_size(p) for p in parts), "'~'")
        return _refuse_built("".join(map(str, parts)), "'{}'", "~")


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
    signature = _value_signature(original) if name in _NAMED else None

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
        return _refuse_built(original(*head, value, *rest, **kwargs), "the filter '{}'", name)
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
        _refuse_over(n * high * 16, "lipsum")  # words of at most ~14 letters, a space or a comma each
        return original(n, html, low, high)
    return lipsum


# -- the sandbox ---------------------------------------------------------------------------------
def _finalize(value: Any) -> Any:
    if _printed(value):
        _refuse_over(printed_size(value), "printing a container")
    return value


def _concat(parts: Iterable[str]) -> str:
    """A block's output (``{% set %}`` blocks, macros, ``{% call %}``, ``{% filter %}``), joined once
    it is known to fit."""
    parts = list(parts)
    _refuse_over(sum(map(len, parts)), "a block's output")
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
        return _refuse_built(super().call_binop(context, op, left, right), "'{}'", op)

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
                args = (_taken(args[0], name), *args[1:])  # an iterator joined: taken first, to be counted
            check_method(name, subject, args, kwargs)
        return _refuse_built(super().call(__context, __obj, *args, **kwargs), "a call of {}", name or "a function")


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
