"""Go-compatible JSON decoding: request bodies decoded as Go's ``encoding/json`` decodes them.

The approximate routers kvindex copies are Go programs; what they hash is what Go decoded. This
module is the one place that knows how Go's decoder differs from Python's.

Invariants:
- Pure functions; no I/O, no module state beyond constants.
- Strings never carry lone surrogates out of this module: ``go_json_loads`` and ``go_utf8`` turn
  them (and invalid UTF-8) into U+FFFD, as Go's ``encoding/json`` does; ``scrub`` is that rule.
- The last duplicate key wins; ``NaN``/``Infinity`` are refused; a negative zero stays ``-0.0``
  and an integer past Python's digit limit is kept as a float, as Go keeps the literal.
- ``go_json_fast`` answers exactly what ``go_json_loads`` answers, faster: msgspec decodes a body
  in which nothing can differ (no surrogate escape, no negative zero integer, no integer of 4,000
  digits; valid UTF-8 and no NaN, else msgspec refuses it), anything else goes to ``go_json_loads``.
- ``RenderError`` (the error of the whole ``kvindex.approx`` package) messages are one line and
  name the field or problem.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

_SURROGATES = re.compile("[\ud800-\udfff]")
# what makes the plain decoder differ from Go's: surrogate escapes, a negative zero, huge integers
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_NEGATIVE_ZERO = re.compile(r"-0(?![.0-9eE])")


MAX_DEPTH = 64  # arrays and objects in a body nest at most this deep (OpenAI bodies: under 10)
_CONTAINERS = frozenset((dict, list))


class RenderError(ValueError):
    """A request body the router would not hash (Kthena answers 404 "prompt not found")."""


class NestingTooDeep(RenderError):
    """JSON nested past the decoder's recursion limit."""


def scrub(text: str) -> str:
    """Replace every surrogate code point (lone escape or escaped raw byte) with U+FFFD."""
    return _SURROGATES.sub("\ufffd", text)


def go_utf8(text: str) -> bytes:
    """UTF-8 bytes of ``text`` as Go would hold them: lone surrogates become U+FFFD."""
    return scrub(text).encode("utf-8")


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Object decoding: keys scrubbed; the last duplicate key wins (as in Go)."""
    return {scrub(key): value for key, value in pairs}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid literal {name}")


def _go_int(text: str) -> int | float:
    try:
        value = int(text)
    except ValueError:  # beyond Python's int-string digit limit; Go keeps the literal
        return float(text)
    return -0.0 if value == 0 and text.startswith("-") else value


def _scrub_tree(value: Any) -> Any:
    """Scrub every string value in a decoded tree, iteratively (no recursion-depth limit)."""
    if isinstance(value, str):
        return scrub(value)
    stack = [value] if isinstance(value, (dict, list)) else []
    while stack:
        node = stack.pop()
        entries = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        for key, item in entries:
            if isinstance(item, str):
                node[key] = scrub(item)
            elif isinstance(item, (dict, list)):
                stack.append(item)
    return value


def go_json_loads(data: bytes | str) -> Any:
    """Decode JSON like Go's ``encoding/json`` into untyped values.

    Invalid UTF-8 bytes (one U+FFFD per byte, like Go) and lone ``\\uD800``-style surrogates
    become U+FFFD; the last duplicate key wins; ``NaN``/``Infinity`` are rejected.
    Raises ``RenderError("malformed JSON: ...")``.
    """
    text = data.decode("utf-8", "surrogateescape") if isinstance(data, (bytes, bytearray)) else data
    scrub = bool(_SURROGATES.search(text) or _ESCAPED_SURROGATE.search(text))
    exact_ints = bool(_NEGATIVE_ZERO.search(text))
    try:
        value = _loads(text, scrub, exact_ints)
    except RenderError:  # NestingTooDeep
        raise
    except ValueError as exc:  # "delimiter" contains "limit": match the digit limit's own words
        if exact_ints or "integer string conversion" not in str(exc):
            raise RenderError(f"malformed JSON: {exc}") from None
        try:
            value = _loads(text, scrub, True)  # an integer past Python's digit limit: Go keeps it
        except ValueError as again:
            raise RenderError(f"malformed JSON: {again}") from None
    # the common case (no surrogates anywhere) skips the walk over every value: bodies carry
    # token arrays of thousands of integers
    return _scrub_tree(value) if scrub else value


_ESCAPED_HIGH = re.compile(rb"\\u[dD][89a-fA-F]")
_MINUS_ZERO = re.compile(rb"-0(?![.0-9eE])")
LONG_DIGITS = 4000  # Python's int digit limit: a longer integer Go keeps exactly
_DIGIT_RUN = re.compile(rb"[0-9]+")
_DIGITS = b"0123456789"


def has_digit_run(data: bytes, n: int = LONG_DIGITS) -> bool:
    """Whether ``data`` holds ``n`` digits in a row, as ``re.search(rb"[0-9]{n}", data)`` says,
    looking at every ``n // 2``-th byte only: the first such position inside a run of ``n`` has
    under ``n // 2`` of it before and the rest after."""
    half = max(1, n // 2)
    for p in range(0, len(data), half):
        m = _DIGIT_RUN.match(data, p)
        if m is None or m.end() - p <= n - half:
            continue
        before = data[max(0, p - half):p]
        if m.end() - p + len(before) - len(before.rstrip(_DIGITS)) >= n:
            return True
    return False


def _has_minus_zero(data: bytes, looks: int = 16) -> bool:
    """``_MINUS_ZERO.search(data)``, by memchr from one ``-`` to the next for the first ``looks``."""
    at = data.find(b"-")
    for _ in range(looks):
        if at < 0:
            return False
        if _MINUS_ZERO.match(data, at):
            return True
        at = data.find(b"-", at + 1)
    return at >= 0 and bool(_MINUS_ZERO.search(data, at))


def may_differ(data: bytes) -> bool:
    """Whether msgspec's answer could differ from Go's for ``data``, if it accepts it: an escaped
    surrogate, a ``-0``, or a run of 4000 digits (past Python's int limit). Each test starts from
    one byte found by memchr or a sparse look, so a body of plain text costs a few microseconds."""
    return bool((b"\\" in data and _ESCAPED_HIGH.search(data)) or _has_minus_zero(data)
                or (len(data) >= LONG_DIGITS and has_digit_run(data)))


def go_json_fast(data: bytes) -> Any:
    """``go_json_loads(data)``, by msgspec when nothing in ``data`` can make them differ."""
    if not may_differ(data):
        try:
            return msgspec.json.decode(data)
        except (msgspec.DecodeError, RecursionError):
            pass  # what msgspec refuses, Go may read (invalid UTF-8) or refuse with its own words
    return go_json_loads(data)


def _loads(text: str, scrub: bool, exact_ints: bool) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook if scrub else None,
                          parse_constant=_reject_constant, parse_int=_go_int if exact_ints else None)
    except RecursionError:
        raise NestingTooDeep("malformed JSON: nesting too deep") from None


def check_nesting(value: Any, text: bytes | None = None) -> Any:
    """``value`` if its arrays and objects nest at most ``MAX_DEPTH`` deep, else ``NestingTooDeep``.
    ``text``: the JSON it was decoded from; with no more brackets than ``MAX_DEPTH`` in it (nearly
    every body) nothing is walked. The walk is level by level (no recursion), and a
    level of scalars (8k token ids) is skipped in C."""
    if text is not None and text.count(b"[") + text.count(b"{") <= MAX_DEPTH:
        return value
    level = [value] if type(value) in _CONTAINERS else []
    for _ in range(MAX_DEPTH):
        below: list[Any] = []
        for node in level:
            items = node.values() if type(node) is dict else node
            if not _CONTAINERS.isdisjoint(map(type, items)):
                below.extend(x for x in items if type(x) in _CONTAINERS)
        if not below:
            return value
        level = below
    raise NestingTooDeep(f"body nests arrays/objects deeper than {MAX_DEPTH}")
