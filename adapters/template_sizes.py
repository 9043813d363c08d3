"""How big what a chat template builds would be, and the refusals: the measuring rules that
``adapters.template_bounds`` applies before and after each operation of a render.

Invariants:
- ``printed_size`` is a lower bound of the characters ``str(value)`` (or a JSON or pretty dump)
  has: a string's length; a container's (list, tuple, set, dict, mapping view, Jinja namespace)
  items walked, a shared item counted each time it is reached, with ``indent`` characters per
  level of nesting; it stops once past ``MAX_RENDER_CHARS`` and copies nothing it counts.
- ``refuse_over`` is the check before a value is built ("would build at least N"); ``refuse_built``
  the check after ("built N"), also of numbers past ``MAX_INT_BITS`` bits. Both raise
  ``TemplateTooCostly`` (a ``jinja2.TemplateError``) with one line.
- ``check_binop``, ``check_method`` and ``before_filter`` refuse, before it runs, an operator, a
  str/bytes method or a filter whose result would pass a bound; ``before_filter`` reads the
  arguments of the filters in ``FILTERS_READ_BY_NAME`` by parameter name (Jinja's and HF's
  ``tojson`` differ) and hands back the value to filter (an iterable consumed whole, taken first
  by ``taken``, which refuses it once it passes the bound). Pure functions: no state.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Iterable, Iterator, MappingView
from itertools import chain
from typing import Any

import jinja2
from jinja2.sandbox import MAX_RANGE
from jinja2.utils import Namespace

MAX_RENDER_CHARS = 8 << 20  # the rendered text, or any string/list the template builds (the body cap is 8 MiB)
MAX_INT_BITS = 1 << 16  # a number the template computes (Python prints at most 4,300 digits anyway)
MAX_JSON_INDENT = 64
MAX_SUM_COPIES = 8 * MAX_RENDER_CHARS  # items ``sum`` of sequences copies (each partial sum is a new one)
# filters that take a container as a container (never its printed text): all others are measured first
_CONTAINER_FILTERS = frozenset({"attr", "batch", "count", "d", "default", "dictsort", "first", "groupby", "items",
                                "join", "last", "length", "list", "map", "max", "min", "random", "reject",
                                "rejectattr", "reverse", "select", "selectattr", "slice", "sort", "sum", "unique"})
_INDENT_PER_LEVEL = {"pprint": 1}  # printed with this much indentation per level of nesting
FILTERS_READ_BY_NAME = frozenset({"join", "sum", "tojson", "batch", "slice", "center", "indent", "wordwrap", "replace",
                    "format"})  # the filters ``before_filter`` reads arguments of (by name: signatures differ)
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")
_END = object()


class TemplateTooCostly(jinja2.TemplateError):
    """A render that would pass one of the module's bounds."""


def refuse_over(size: int, what: str) -> None:
    """The check before a value is built."""
    if size > MAX_RENDER_CHARS:
        raise TemplateTooCostly(f"{what} would build at least {size} characters or items; "
                                f"the bound is {MAX_RENDER_CHARS}")


def refuse_built(value: Any, what: str, name: str) -> Any:
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


def walks(value: Any) -> bool:
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


def taken(value: Any, what: str) -> list[Any]:
    """An iterable consumed whole (joined, summed, listed), as a list; refused once its items and
    their lengths pass the bound (an iterator may build each item it yields: not all of them)."""
    if isinstance(value, list):
        return value
    items: list[Any] = []
    total = 0
    for item in value:
        items.append(item)
        total += 1 + (len(item) if isinstance(item, (str, bytes, list, tuple)) else 0)
        refuse_over(total, what)
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
                refuse_over(len(seq) * times, "'*'")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateTooCostly(f"'*' would build a number of more than {MAX_INT_BITS} bits")
    elif op == "+" and isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
        refuse_over(len(left) + len(right), "'+'")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if (abs(left).bit_length() - 1) * right > MAX_INT_BITS:  # the result has at least that many bits
            raise TemplateTooCostly(f"'**' would build a number of more than {MAX_INT_BITS} bits")
    elif op == "%" and isinstance(left, (str, bytes)):
        refuse_over(_formatted_size(_text(left), _format_args(right), True, "'%'"), "'%'")


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
        refuse_over(max(len(text), width if isinstance(width, int) else 0), name)
    elif name == "replace":
        old, new, count = _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"), _arg(args, kwargs, 2, "count", -1)
        if isinstance(old, kind) and isinstance(new, kind):
            _replaced(text, _text(old), len(new), count, name)
    elif name == "expandtabs":
        tab = _arg(args, kwargs, 0, "tabsize", 8)
        refuse_over(len(text) + text.count("\t") * (tab if isinstance(tab, int) else 8), name)
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        refuse_over(len(text) * max(longest, 1), name)
    elif name == "join" and args and isinstance(args[0], (list, tuple)):  # (``call`` takes an iterator first)
        refuse_over(_join_size(list(args[0]) if isinstance(args[0], tuple) else args[0], subject), name)
    elif name == "join" and args and isinstance(args[0], (str, bytes)):
        refuse_over(_spread(len(args[0]), subject), name)
    elif name == "format" and kind is str:
        refuse_over(_formatted_size(text, [*args, *kwargs.values()], False, name), name)
    elif name == "format_map" and kind is str and args and isinstance(args[0], dict):
        refuse_over(_formatted_size(text, args[0].values(), False, name), name)


def _replaced(text: str, old: str, new_len: int, count: Any, what: str) -> None:
    times = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        times = min(times, count)
    refuse_over(len(text) + times * new_len, what)


def before_filter(name: str, value: Any, named: dict[str, Any]) -> Any:
    """Refuse the filter call ``value | name(...)`` before it builds past the bound (``named``: its
    arguments by parameter name); the value to filter (an iterable that ``join``, ``sum`` or
    ``list`` consume, taken first)."""
    what = f"the filter '{name}'"
    if name == "join" and isinstance(value, (str, bytes)):  # its characters, joined
        refuse_over(_spread(len(value), named.get("d", "")), what)
    elif name in ("join", "sum", "list") and not isinstance(value, (str, bytes)):
        value = taken(value, what)
        if name == "join":
            refuse_over(_join_size(value, named.get("d", "")), what)
        elif name == "sum":
            _check_sum(value, named.get("start", 0), what)
    elif name not in _CONTAINER_FILTERS and walks(value):  # a filter of text, handed a container: str() of it
        indent = named.get("indent") if name == "tojson" else _INDENT_PER_LEVEL.get(name, 0)
        if name == "tojson":
            _check_json_indent(indent)
        refuse_over(printed_size(value, len(indent) if isinstance(indent, str) else indent or 0), what)
    elif isinstance(value, (str, bytes)):
        _check_text_filter(name, _text(value), named, what)
    if name == "batch" and named.get("fill_with") is not None:
        refuse_over(named.get("linecount", 0), what)  # the last batch is filled up to linecount
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
        refuse_over(total, what)
        if len(items) * total > MAX_SUM_COPIES:
            raise TemplateTooCostly(f"{what} of {len(items)} sequences would copy about {len(items) * total // 2} "
                                    f"items; the bound is {MAX_SUM_COPIES}")


def _check_text_filter(name: str, text: str, named: dict[str, Any], what: str) -> None:
    """The growing filters of a string, by their parameters."""
    if name == "center":
        width = named.get("width", 80)
        refuse_over(max(len(text), width if isinstance(width, int) else 0), what)
    elif name == "indent":
        width = named.get("width", 4)
        refuse_over(len(text) + (text.count("\n") + 1) * (len(width) if isinstance(width, str) else width), what)
    elif name == "wordwrap":  # at worst a line per character, each ended by the wrap string
        wrap = named.get("wrapstring")
        refuse_over(len(text) + (len(text) + 1) * (len(wrap) if isinstance(wrap, str) else 1), what)
    elif name == "replace" and isinstance(named.get("old"), str) and isinstance(named.get("new"), str):
        _replaced(text, named["old"], len(named["new"]), named.get("count"), what)
    elif name == "format":
        refuse_over(_formatted_size(text, [*named.get("args", ()), *named.get("kwargs", {}).values()], True, what),
                     what)
