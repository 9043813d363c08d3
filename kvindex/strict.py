"""Strict decoding of TOML tables into typed values: nothing passes that is not understood.

``decode(value, kind)`` first checks every key of ``value`` against the fields of ``kind`` (a
msgspec Struct or a dataclass, nested through ``list[...]`` and ``dict[str, ...]``), then lets
msgspec convert it. The first unknown key or table is refused naming itself, where it is and the
closest known name (``difflib``, ignoring case, ``_`` and ``-``)::

    unknown table [servr] (did you mean [server]?)
    unknown key prot in [server] (did you mean port?)
    unknown key colour in [[engines]] #2 (known: endpoint, pod, model, ...)

Wrong shapes and types are refused the same way (``[server] port must be an integer, got 'x'``),
and so is a ``ValueError`` raised by the type's own validation (``__post_init__``), prefixed
with where the table is.

Invariants: a refusal is a ``Refused`` (a ``ValueError``) with a one-line message; ``path`` is
where ``value`` sits in the document (``("engines", 1)`` is the second ``[[engines]]``) and
``label`` names the root when it is not a TOML document (``--engine ...``); conversion is
msgspec's lax mode (``"16"`` -> 16, ``"true"`` -> True) as hand-edited TOML and command-line
``key=value`` pairs need. Vocabulary: imports msgspec and the standard library only.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

T = TypeVar("T")
Path = tuple[str | int, ...]

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")
_AT = re.compile(r"^(.*) - at `\$(.*)`$")
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[(\.\.\.)\]")
_EXPECTED = re.compile(r"^Expected `([^`]+)`, got `([^`]+)`")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")
_NOUNS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
          "object": "a table", "array": "an array", "null": "omitted"}


class Refused(ValueError):
    """A value that does not fit its type; the message is one line and says where."""


def decode(value: Any, kind: type[T], path: Path = (), label: str | None = None) -> T:
    """``value`` as a ``kind``, or ``Refused`` naming the first thing that does not fit."""
    info = mi.type_info(kind)
    check(value, info, path, label)
    try:
        return msgspec.convert(value, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise Refused(_explain(exc, value, info, path, label)) from None


def check(value: Any, t: mi.Type, path: Path = (), label: str | None = None) -> None:
    """Refuse the first unknown key or wrong shape of table in ``value`` (types are msgspec's job)."""
    t = _table_type(t) or t
    if isinstance(t, (mi.StructType, mi.DataclassType)):
        if not isinstance(value, dict):
            raise Refused(f"{where(path, label)} must be a table, got {_noun(value)}")
        known = {f.encode_name: f.type for f in t.fields}
        for key, item in value.items():
            if key not in known:
                raise Refused(_unknown(path, label, key, item, known))
            check(item, known[key], (*path, key), label)
    elif isinstance(t, mi.ListType) and _table_type(t.item_type):
        if not isinstance(value, list):
            name = dotted(path)
            raise Refused(f"[{name}] must be an array of tables: write [[{name}]] for each entry")
        for i, item in enumerate(value):
            check(item, t.item_type, (*path, i), label)
    elif isinstance(t, mi.DictType) and _table_type(t.value_type):
        if not isinstance(value, dict):
            raise Refused(f"{where(path, label)} must be a table, got {_noun(value)}")
        for key, item in value.items():
            check(item, t.value_type, (*path, key), label)


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name`` (case, ``_`` and ``-`` ignored), if any is close: the one
    known name that starts it or that it starts (``directory``: ``dir``; ``replay_endpoint``:
    ``replay``), else the best difflib match."""
    by_norm = {_norm(k): k for k in known}
    norm = _norm(name)
    prefixes = [k for n, k in by_norm.items()
                if min(len(n), len(norm)) >= 3 and (n.startswith(norm) or norm.startswith(n))]
    if len(prefixes) == 1:
        return prefixes[0]
    hit = difflib.get_close_matches(norm, list(by_norm), n=1, cutoff=0.6)
    return by_norm[hit[0]] if hit else None


def dotted(path: Path) -> str:
    return ".".join(str(p) if _BARE.match(str(p)) else '"' + str(p).replace('"', '\\"') + '"' for p in path)


def where(path: Path, label: str | None = None) -> str:
    """A table's place: ``[server]``, ``[models."Qwen/Qwen3-8B"]``, ``[[engines]] #2``."""
    if not path:
        return label or "the top level"
    for i, part in enumerate(path):
        if isinstance(part, int):
            head = f"[[{dotted(path[:i])}]] #{part + 1}"
            rest = path[i + 1:]
            return f"{head} {dotted(rest)}" if rest else head
    return f"{label} {dotted(path)}" if label else f"[{dotted(path)}]"


def _unknown(path: Path, label: str | None, key: str, item: Any, known: dict[str, mi.Type]) -> str:
    in_array = any(isinstance(p, int) for p in path)
    if _is_table(item) and not in_array and label is None:
        what = f"unknown table {_table_name((*path, key), item)}"
    else:
        place = "at the top level" if not path and label is None else f"in {where(path, label)}"
        what = f"unknown key {key} {place}"
    hit = closest(key, known)
    if hit is not None:
        as_table = (_table_type(known[hit]) is not None or _is_list_of_tables(known[hit])) and not in_array
        hint = _table_name((*path, hit), known[hit]) if as_table and label is None else hit
        return f"{what} (did you mean {hint}?)"
    if not path:  # a key written above every table header: name the table it belongs to
        for name, t in known.items():
            inner = _table_type(t)
            if isinstance(inner, (mi.StructType, mi.DataclassType)) and key in {f.encode_name for f in inner.fields}:
                return f"{what} (did you mean {key} in [{name}]?)"
    return f"{what} (known: {', '.join(known)})"


def _table_name(path: Path, value: Any) -> str:
    name = dotted(path)
    return f"[[{name}]]" if isinstance(value, list) or _is_list_of_tables(value) else f"[{name}]"


def _explain(exc: msgspec.ValidationError, value: Any, info: mi.Type, path: Path, label: str | None) -> str:
    m = _AT.match(str(exc))
    text, sub = (m.group(1), m.group(2)) if m else (str(exc), "")
    if exc.__cause__ is not None:  # the type's own validation: its message, at the table
        text = str(exc.__cause__)
    full, got = _resolve(value, info, sub)
    full = (*path, *full)
    missing = _MISSING.match(text)
    if missing:
        return f"{where(full, label)} needs {missing.group(1)}"
    expected = _EXPECTED.match(text)
    if expected and full[len(path):]:
        want = " or ".join(_NOUNS.get(w, w) for w in expected.group(1).split(" | ") if w != "null")
        return f"{where(full[:-1], label)} {full[-1]} must be {want}, got {got!r}"
    return f"{where(full, label)}: {text}"


def _resolve(value: Any, t: mi.Type, sub: str) -> tuple[Path, Any]:
    """msgspec's ``.a[0][...]`` as a path (``[...]``, a dict key it does not name, found by retrying)."""
    out: list[str | int] = []
    for name, index, anykey in _SEGMENT.findall(sub):
        t = _table_type(t) or t
        if name:
            fields = {f.encode_name: f.type for f in getattr(t, "fields", ())}
            t = fields.get(name, mi.AnyType())
            value, part = (value.get(name) if isinstance(value, dict) else None), name
        elif index:
            t = getattr(t, "item_type", mi.AnyType())
            part = int(index)
            value = value[part] if isinstance(value, list) and part < len(value) else None
        elif anykey and isinstance(value, dict) and isinstance(t, mi.DictType):
            t = t.value_type
            part = next((k for k, v in value.items() if not _fits(v, t)), "?")
            value = value.get(part)
        else:
            part = "?"
        out.append(part)
    return tuple(out), value


def _fits(value: Any, t: mi.Type) -> bool:
    kind = getattr(_table_type(t), "cls", None)
    if kind is None:
        return True
    try:
        msgspec.convert(value, kind, strict=False)
    except msgspec.ValidationError:
        return False
    return True


def _table_type(t: mi.Type) -> mi.Type | None:
    """The table type behind ``t`` (through ``X | None``), or None when ``t`` is not a table."""
    if isinstance(t, mi.UnionType):
        tables = [x for x in t.types if _table_type(x)]
        return tables[0] if len(tables) == 1 else None
    if isinstance(t, (mi.StructType, mi.DataclassType)):
        return t
    if isinstance(t, mi.DictType) and _table_type(t.value_type):
        return t
    return None


def _is_list_of_tables(t: Any) -> bool:
    return isinstance(t, mi.ListType) and _table_type(t.item_type) is not None


def _is_table(value: Any) -> bool:
    return isinstance(value, dict) or (isinstance(value, list) and bool(value)
                                       and all(isinstance(v, dict) for v in value))


def _noun(value: Any) -> str:
    kind = {bool: "bool", int: "int", float: "float", str: "str", dict: "object", list: "array"}.get(type(value))
    return _NOUNS.get(kind, type(value).__name__) if kind else type(value).__name__


def _norm(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")
