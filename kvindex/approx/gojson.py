"""Go-compatible JSON decoding: request bodies decoded as Go's ``encoding/json`` decodes them.

The approximate routers kvindex copies are Go programs; what they hash is what Go decoded. This
module is the one place that knows how Go's decoder differs from Python's.

Invariants:
- Pure functions; no I/O, no module state beyond constants.
- Strings never carry lone surrogates out of this module: ``go_json_loads`` and ``go_utf8`` turn
  them (and invalid UTF-8) into U+FFFD, as Go's ``encoding/json`` does; ``scrub`` is that rule.
- The last duplicate key wins; ``NaN``/``Infinity`` are refused; a negative zero stays ``-0.0``
  and an integer past Python's digit limit is kept as a float, as Go keeps the literal.
- ``RenderError`` (the error of the whole ``kvindex.approx`` package) messages are one line and
  name the field or problem.
"""

from __future__ import annotations

import json
import re
from typing import Any

_SURROGATES = re.compile("[\ud800-\udfff]")
# what makes the plain decoder differ from Go's: surrogate escapes, a negative zero, huge integers
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_NEGATIVE_ZERO = re.compile(r"-0(?![.0-9eE])")


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


def _loads(text: str, scrub: bool, exact_ints: bool) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook if scrub else None,
                          parse_constant=_reject_constant, parse_int=_go_int if exact_ints else None)
    except RecursionError:
        raise NestingTooDeep("malformed JSON: nesting too deep") from None
