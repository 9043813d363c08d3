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
  by ``taken``, which refuses it once it passes the bound). Every value ``refuse_built`` sees and
  every item ``printed_size`` walks is charged to the current render's budget
  (``adapters.template_budget.charge``); otherwise no state.
- A format's fields are read as Python reads them (``%``: a ``%(key)`` may hold brackets;
  ``str.format``: Python's own parser); each may print its width, the largest printed argument
  (4x for a repr) and ``FIELD_SLACK``. A ``*`` width, a nested ``{:{w}}`` field and a ``%`` field
  that cannot be read are refused, as is an ``encode``/``decode`` codec outside ``CODECS``.
"""

from __future__ import annotations

import codecs
import re
import string
import typing
from collections.abc import Iterable, Iterator, MappingView
from itertools import chain
from typing import Any

from jinja2.sandbox import MAX_RANGE
from jinja2.utils import Namespace

from adapters.template_budget import (
    ITEM_COST,
    MAX_RENDER_CHARS,
    MAX_RENDER_ITEMS,
    WALK_COST,
    TemplateTooCostly,
    charge,
)

MAX_INT_BITS = 1 << 16  # a number the template computes (Python prints at most 4,300 digits anyway)
MAX_JSON_INDENT = 64
MAX_SUM_COPIES = 8 * MAX_RENDER_CHARS  # items ``sum`` of sequences copies (each partial sum is a new one)
MAX_WRAP_CHARS = 256 << 10  # wordwrap's input: its time grows with the square of a long word
_CONSUMING_FILTERS = frozenset({"list", "sort", "unique", "batch", "slice", "groupby", "dictsort", "min", "max",
                                "reverse", "wordcount"})  # a list of (about) one item per item or character
FIELD_SLACK = 320  # what one format field may print beyond its argument's size ('%f' of 1e308: 316 characters)
CODECS = frozenset({"utf-8", "ascii", "latin-1", "iso8859-1", "utf-16", "utf-16-le", "utf-16-be", "utf-32",
                    "utf-32-le", "utf-32-be"})  # str.encode / bytes.decode: growth bounded, time linear
# filters that take a container as a container (never its printed text): all others are measured first
_CONTAINER_FILTERS = frozenset({"attr", "batch", "count", "d", "default", "dictsort", "first", "groupby", "items",
                                "join", "last", "length", "list", "map", "max", "min", "random", "reject",
                                "rejectattr", "reverse", "select", "selectattr", "slice", "sort", "sum", "unique"})
_GROWING_TEXT_FILTERS = frozenset({"center", "indent", "wordwrap", "replace", "format"})
FILTERS_READ_BY_NAME = frozenset({"join", "sum", "tojson", "batch", "slice", *_GROWING_TEXT_FILTERS})  # (by name:
# signatures differ, Jinja's tojson and HF's)
_PERCENT_SPEC = re.compile(r"[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([diouxXeEfFgGcrsa%])")
_END = object()


def refuse_over(size: int, what: str) -> None:
    """The check before a value is built."""
    if size > MAX_RENDER_CHARS:
        raise TemplateTooCostly(f"{what} would build at least {size} characters or items; "
                                f"the bound is {MAX_RENDER_CHARS}")


def refuse_items(count: int, what: str) -> None:
    """The check before a list or tuple is built."""
    if count > MAX_RENDER_ITEMS:
        raise TemplateTooCostly(f"{what} would build a list of at least {count} items; the bound is {MAX_RENDER_ITEMS}")


def refuse_built(value: Any, what: str, name: str) -> Any:
    """The check after a value is built: ``value``, unless it is past a bound (``what`` names the
    operation, with ``{}`` for ``name``: formatted only for a refusal); its size charged."""
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_RENDER_ITEMS:
            raise TemplateTooCostly(f"{what.format(name)} built a list of {len(value)} items; "
                                    f"the bound is {MAX_RENDER_ITEMS}")
        charge(len(value) * ITEM_COST)
    elif isinstance(value, (str, bytes)):
        if len(value) > MAX_RENDER_CHARS:
            raise TemplateTooCostly(f"{what.format(name)} built {len(value)} characters; "
                                    f"the bound is {MAX_RENDER_CHARS}")
        charge(len(value) if isinstance(value, bytes) or value.isascii() else 4 * len(value))
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateTooCostly(f"{what.format(name)} built a number of {value.bit_length()} bits; "
                                f"the bound is {MAX_INT_BITS}")
    return value


# -- how big a value is, printed ----------------------------------------------------------------
_WALKED = (dict, list, tuple, set, frozenset, MappingView, Namespace)  # what prints its items (``_children``)


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
    try:
        return len(str(value))  # a float, a macro, a method: small things, printed
    except Exception:  # noqa: BLE001 (whatever its __str__ raises, printing it raises too)
        return 1


def printed_size(value: Any, indent: int = 0) -> int:
    """Characters ``str(value)`` (or a JSON or pretty dump) has, at least: a string's length, and a
    container's items walked (a shared item counted each time it is reached; ``indent`` characters
    per level of nesting on each item's line), stopping once past the bound. One iterator per
    level of nesting: no copy of what it counts."""
    top = _children(value)
    if top is None:
        return _scalar_size(value)
    seen, walked, stack = 2, 0, [(top, 1)]
    while stack and seen <= MAX_RENDER_CHARS:
        items, depth = stack[-1]
        item = next(items, _END)
        if item is _END:
            stack.pop()
            continue
        inner = _children(item)
        seen += (2 if inner is not None else _scalar_size(item) + 2) + depth * indent  # brackets or ", "
        walked += 1
        if inner is not None:
            stack.append((inner, depth + 1))
    charge(walked * WALK_COST)
    return seen


def walks(value: Any) -> bool:
    """Whether measuring ``value`` printed means walking it (a container, a namespace)."""
    return isinstance(value, _WALKED)


def _join_size(items: list[Any], sep: Any) -> int:
    """What ``sep.join`` of ``items`` (each printed) builds, at least; stops past the bound."""
    total = printed_size(sep) * max(len(items) - 1, 0)
    for item in items:
        total += printed_size(item)
        if total > MAX_RENDER_CHARS:
            break
    return total


def _spread(chars: int, sep: Any) -> int:
    """What joining ``chars`` single characters with ``sep`` builds."""
    return chars + max(chars - 1, 0) * printed_size(sep)


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
        refuse_items(len(items), what)
    return items


# -- format strings ------------------------------------------------------------------------------
def _percent_fields(fmt: str, what: str) -> list[tuple[str, str, str]]:
    """(width, precision, conversion) of each field of a ``%`` format, read as CPython reads it (a
    ``%(key)`` may hold brackets); a ``*`` width or a field it cannot read is refused."""
    fields, at = [], fmt.find("%")
    while at >= 0:
        at += 1
        if at < len(fmt) and fmt[at] == "(":
            depth = 0
            while at < len(fmt):
                depth += {"(": 1, ")": -1}.get(fmt[at], 0)
                at += 1
                if depth == 0:
                    break
        spec = _PERCENT_SPEC.match(fmt, at)
        if spec is None:
            raise TemplateTooCostly(f"{what} with a field this check cannot read is refused")
        if "*" in spec.group(1, 2):
            raise TemplateTooCostly(f"{what} with a '*' width is refused")
        if spec.group(3) != "%":
            fields.append((spec.group(1) or "", spec.group(2) or "", spec.group(3)))
        at = fmt.find("%", spec.end())
    return fields


def _brace_fields(fmt: str, what: str) -> list[tuple[str, str, str]]:
    """(width, precision, conversion) of each field of a ``str.format`` string, parsed by Python's
    own parser; a width or precision given by another field (``{:{w}}``) is refused."""
    fields = []
    for _, name, spec, conversion in string.Formatter().parse(fmt):
        if name is None:
            continue
        if "{" in (spec or ""):
            raise TemplateTooCostly(f"{what} with a nested {{...{{}}}} field is refused")
        numbers = re.findall(r"\d+", spec or "")
        fields.append((str(sum(map(int, numbers))), "", "r" if conversion in ("r", "a") else "s"))
    return fields


def _formatted_size(fmt: str, fields: list[tuple[str, str, str]], args: Iterable[Any]) -> int:
    """What formatting ``fmt`` builds, at most: its text, and each field its width, the largest
    printed argument (4x for a repr: escapes) and ``FIELD_SLACK`` (numbers printed in full)."""
    largest = max((printed_size(a) for a in args), default=0)
    return len(fmt) + sum(max(int(w or 0), int(p or 0)) + largest * (4 if conv in "ra" else 1) + FIELD_SLACK
                          for w, p, conv in fields)


def _format_args(right: Any) -> list[Any]:
    """The values ``fmt % right`` may print: a tuple's items, or ``right`` itself and, for a
    mapping, its values (``%s`` prints the whole mapping, ``%(k)s`` one value)."""
    if isinstance(right, tuple):
        return list(right)
    if isinstance(right, dict):
        return [right, *right.values()]
    return [right]


# -- growth checked before: operators, str/bytes methods, filters ---------------------------------
def check_binop(op: str, left: Any, right: Any) -> None:
    """Refuse ``left <op> right`` when its result would pass a bound."""
    if op == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes)) and isinstance(times, int):
                refuse_over(len(seq) * times, "'*'")
            elif isinstance(seq, (list, tuple)) and isinstance(times, int):
                refuse_items(len(seq) * times, "'*'")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateTooCostly(f"'*' would build a number of more than {MAX_INT_BITS} bits")
    elif op == "+" and isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
        refuse_over(len(left) + len(right), "'+'")
    elif op == "+" and isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        refuse_items(len(left) + len(right), "'+'")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if (abs(left).bit_length() - 1) * right > MAX_INT_BITS:  # the result has at least that many bits
            raise TemplateTooCostly(f"'**' would build a number of more than {MAX_INT_BITS} bits")
    elif op == "%" and isinstance(left, (str, bytes)):
        text = _text(left)
        refuse_over(_formatted_size(text, _percent_fields(text, "'%'"), _format_args(right)), "'%'")


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
        _padded(text, _arg(args, kwargs, 0, "width", 0), name)
    elif name == "replace":
        old, new, count = _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"), _arg(args, kwargs, 2, "count", -1)
        if isinstance(old, kind) and isinstance(new, kind):
            _replaced(text, _text(old), len(new), count, name)
    elif name == "expandtabs":
        tab = _arg(args, kwargs, 0, "tabsize", 8)
        refuse_over(len(text) + text.count("\t") * (tab if isinstance(tab, int) else 8), name)
    elif name == "translate" and args:
        table = args[0].values() if isinstance(args[0], dict) else args[0] if isinstance(args[0], (list, tuple)) else ()
        refuse_over(len(text) * max(max((printed_size(v) for v in table), default=1), 1), name)
    elif name in ("encode", "decode"):
        codec = _arg(args, kwargs, 0, "encoding", "utf-8")
        try:
            known = codecs.lookup(codec).name if isinstance(codec, str) else None
        except LookupError:
            known = None
        if known not in CODECS:
            raise TemplateTooCostly(f"{name} with the codec {codec!r} is refused (these are allowed: "
                                    f"{', '.join(sorted(CODECS))})")
    elif name in ("split", "rsplit", "splitlines"):  # a list of up to one item per separator
        sep = _arg(args, kwargs, 0, "sep") if name != "splitlines" else None
        seps = text.count(_text(sep)) if isinstance(sep, (str, bytes)) and sep else sum(map(text.count, " \t\n\r\v\f"))
        refuse_items(seps + 1, name)
    elif name == "join" and args and isinstance(args[0], (list, tuple)):  # (``call`` takes an iterator first)
        refuse_over(_join_size(list(args[0]) if isinstance(args[0], tuple) else args[0], subject), name)
    elif name == "join" and args and isinstance(args[0], (str, bytes)):
        refuse_over(_spread(len(args[0]), subject), name)
    elif name == "format" and kind is str:
        refuse_over(_formatted_size(text, _brace_fields(text, name), [*args, *kwargs.values()]), name)
    elif name == "format_map" and kind is str and args and isinstance(args[0], dict):
        refuse_over(_formatted_size(text, _brace_fields(text, name), args[0].values()), name)


def _padded(text: str, width: Any, what: str) -> None:
    """``text`` padded to ``width`` (``center``, ``ljust``, ``rjust``, ``zfill``)."""
    refuse_over(max(len(text), width if isinstance(width, int) else 0), what)


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
    elif name in _CONSUMING_FILTERS and isinstance(value, (str, bytes, list, tuple)):
        refuse_items(len(value), what)
    elif name == "tojson":
        indent = named.get("indent")
        _check_json_layout(indent, named.get("separators"))
        refuse_over(printed_size(value, len(indent) if isinstance(indent, str) else indent or 0), what)
    elif name not in _CONTAINER_FILTERS and walks(value):  # a filter of text, handed a container: str() of it
        refuse_over(printed_size(value), what)
        if name in _GROWING_TEXT_FILTERS:
            _check_text_filter(name, str(value), named, what)
    elif name in _GROWING_TEXT_FILTERS and isinstance(value, (str, bytes)):
        _check_text_filter(name, _text(value), named, what)
    if name == "batch" and named.get("fill_with") is not None:
        refuse_items(named.get("linecount", 0), what)  # the last batch is filled up to linecount
    elif name == "slice" and isinstance(slices := named.get("slices"), int) and slices > MAX_RANGE:
        raise TemplateTooCostly(f"{what} into more than {MAX_RANGE} parts is refused")
    return value


def _check_json_layout(indent: Any, separators: Any) -> None:
    """tojson's indent and separators: each at most ``MAX_JSON_INDENT`` characters."""
    if (isinstance(indent, int) and not 0 <= indent <= MAX_JSON_INDENT) or (
            isinstance(indent, str) and len(indent) > MAX_JSON_INDENT):
        raise TemplateTooCostly(f"tojson's indent must be from 0 to {MAX_JSON_INDENT}")
    if separators is not None and printed_size(separators) > 2 * MAX_JSON_INDENT:
        raise TemplateTooCostly(f"tojson's separators must be at most {MAX_JSON_INDENT} characters each")


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
        _padded(text, named.get("width", 80), what)
    elif name == "indent":
        width = named.get("width", 4)
        refuse_over(len(text) + (text.count("\n") + 1) * (len(width) if isinstance(width, str) else width), what)
    elif name == "wordwrap":  # at worst a line per character, each ended by the wrap string
        if len(text) > MAX_WRAP_CHARS:
            raise TemplateTooCostly(f"{what} of more than {MAX_WRAP_CHARS} characters is refused (its time grows "
                                    "with the square of a long word)")
        wrap = named.get("wrapstring")
        refuse_over(len(text) + (len(text) + 1) * max(len(wrap) if isinstance(wrap, str) else 1, 1), what)
    elif name == "replace" and "old" in named and "new" in named:  # Jinja prints both
        _replaced(text, _as_text(named["old"], what), printed_size(named["new"]), named.get("count"), what)
    elif name == "format":
        kwargs = named.get("kwargs", {})
        args = [*named.get("args", ()), kwargs, *kwargs.values()]  # '%s' % kwargs prints the whole mapping
        refuse_over(_formatted_size(text, _percent_fields(text, what), args), what)


def _as_text(value: Any, what: str) -> str:
    """``str(value)``, once its printed size is known to fit."""
    if walks(value):
        refuse_over(printed_size(value), what)
    return str(value)
