"""GIE v1.5.0's prompt rendering: request body -> the bytes its approx-prefix-cache producer hashes.

Invariants:
- Pure functions of the decoded body; no I/O, no module state beyond constants.
- ``render_gie`` returns exactly the bytes GIE v1.5.0 hashes: the completions prompt (a list is
  joined with ``" "``), Go ``json.Marshal`` of the typed chat messages, or the Responses array
  ``[{"instructions"}?, {"tools"}?, {"input"}]``. Go's encoder is copied where it shows in the
  bytes (``go_marshal``, ``go_string``, ``go_float``): HTML-safe escapes, struct field order,
  always-present media objects, sorted map keys and float64 number formatting.
- Every string leaves as valid UTF-8 (``go_utf8``: lone surrogates become U+FFFD).

Known differences from Go: typed-struct keys (GIE chat ``role``/``content`` and content-part
fields) are matched case-insensitively like Go, but top-level keys (``prompt``, ``messages``,
``input``) only exactly; GIE's type checks of request fields it does not hash (``tools`` in chat,
``chat_template``, ...) are not copied.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

from kvindex.approx.gojson import RenderError, go_utf8, scrub

_GO_HTML_ESCAPES = (
    ("<", "\\u003c"),
    (">", "\\u003e"),
    ("&", "\\u0026"),
    ("\u2028", "\\u2028"),
    ("\u2029", "\\u2029"),
)
_GIE_APIS = (("prompt", "completions"), ("messages", "chat"), ("input", "responses"))


def go_string(text: str) -> str:
    """A JSON string literal exactly as Go's ``json.Marshal`` writes it (HTML-safe escapes)."""
    out = json.dumps(scrub(text), ensure_ascii=False)
    for raw, escaped in _GO_HTML_ESCAPES:
        out = out.replace(raw, escaped)
    return out


def go_float(value: float) -> str:
    """A float64 as Go's encoder writes it: shortest digits, exponent only <1e-6 or >=1e21."""
    if value != value or value in (float("inf"), float("-inf")):
        raise RenderError("number out of range for float64")
    if value == 0:
        return "-0" if str(value).startswith("-") else "0"
    if 1e-6 <= abs(value) < 1e21:
        return format(Decimal(repr(value)).normalize(), "f")
    return re.sub(r"e([+-])0(\d)$", r"e\1\2", repr(value))


def _go_marshal_into(value: Any, out: list[str]) -> None:
    """Append Go's ``json.Marshal`` of an untyped decoded value (maps with sorted keys)."""
    if value is None or isinstance(value, bool):
        out.append({None: "null", True: "true", False: "false"}[value])
    elif isinstance(value, str):
        out.append(go_string(value))
    elif isinstance(value, (int, float)):
        try:
            out.append(go_float(float(value)))
        except OverflowError:
            raise RenderError("number out of range for float64") from None
    elif isinstance(value, list):
        out.append("[")
        for i, item in enumerate(value):
            out.append("," if i else "")
            _go_marshal_into(item, out)
        out.append("]")
    elif isinstance(value, dict):
        out.append("{")
        for i, key in enumerate(sorted(value)):
            out.append(("," if i else "") + go_string(key) + ":")
            _go_marshal_into(value[key], out)
        out.append("}")
    else:
        raise RenderError(f"cannot encode {type(value).__name__} as JSON")


def go_marshal(value: Any) -> str:
    """Go ``json.Marshal`` of an untyped value (``interface{}`` tree) as text."""
    out: list[str] = []
    try:
        _go_marshal_into(value, out)
    except RecursionError:
        raise RenderError("request nesting too deep") from None
    return "".join(out)


# --- GIE v1.5.0 ------------------------------------------------------------------------------


def _field(obj: dict[str, Any], name: str) -> Any:
    """Go struct-field lookup: the last key (document order) equal to ``name`` ignoring case."""
    found = None
    for key, value in obj.items():
        if key.casefold() == name:
            found = value
    return found


def _typed_str(obj: dict[str, Any], name: str, where: str) -> str:
    """A Go ``string`` field: null or missing is ``""``; any other non-string is an error."""
    value = _field(obj, name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RenderError(f"{where}.{name} must be a string")
    return value


def _gie_object(block: dict[str, Any], name: str, fields: tuple[str, ...], where: str) -> str:
    """A nested always-emitted struct (image_url, input_audio, video_url) of omitempty strings."""
    value = _field(block, name)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise RenderError(f"{where}.{name} must be an object")
    members = [(f, _typed_str(value, f, f"{where}.{name}")) for f in fields]
    return "{" + ",".join(f'"{f}":{go_string(v)}' for f, v in members if v) + "}"


def _gie_block(block: Any, where: str) -> str:
    """One ``ContentBlock``: type always, text omitempty, then the three media objects."""
    if block is None:
        block = {}
    if not isinstance(block, dict):
        raise RenderError(f"{where} must be an object")
    text = _typed_str(block, "text", where)
    out = '{"type":' + go_string(_typed_str(block, "type", where))
    if text:
        out += ',"text":' + go_string(text)
    out += ',"image_url":' + _gie_object(block, "image_url", ("url",), where)
    out += ',"input_audio":' + _gie_object(block, "input_audio", ("data", "format"), where)
    return out + ',"video_url":' + _gie_object(block, "video_url", ("url",), where) + "}"


def _gie_content(value: Any, where: str) -> str:
    """GIE's ``Content``: a non-empty string, else a (possibly empty) block list, else ``""``."""
    if value is None or value == "":
        return '""'
    if isinstance(value, str):
        return go_string(value)
    if not isinstance(value, list):
        raise RenderError(f"{where}.content must be a string or a list of content parts")
    blocks = [_gie_block(b, f"{where}.content[{i}]") for i, b in enumerate(value)]
    return "[" + ",".join(blocks) + "]"


def _gie_message(message: Any, where: str) -> str:
    """One ``Message``: role omitempty, content always."""
    if message is None:
        message = {}
    if not isinstance(message, dict):
        raise RenderError(f"{where} must be an object")
    role = _typed_str(message, "role", where)
    head = f'"role":{go_string(role)},' if role else ""
    return "{" + head + '"content":' + _gie_content(_field(message, "content"), where) + "}"


def _gie_chat(messages: Any) -> str:
    if messages is None:
        return "null"
    if not isinstance(messages, list):
        raise RenderError("messages must be a list")
    return "[" + ",".join(_gie_message(m, f"messages[{i}]") for i, m in enumerate(messages)) + "]"


def _gie_prompt(prompt: Any) -> str:
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return " ".join(prompt)
    raise RenderError("prompt must be a string or a list of strings")


def _gie_responses(body: dict[str, Any]) -> str:
    combined: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        combined.append({"instructions": body["instructions"]})
    if body.get("tools") is not None:
        combined.append({"tools": body["tools"]})
    combined.append({"input": body.get("input")})
    return go_marshal(combined)


def _gie_api(body: dict[str, Any]) -> str:
    for key, api in _GIE_APIS:
        if key in body:
            return api
    raise RenderError("no prompt, messages or input in the request")


def render_gie(body: dict[str, Any], *, api: str | None = None) -> bytes:
    """The bytes GIE v1.5.0's approximate prefix producer hashes for ``body``.

    GIE picks the API by URL path; kvindex has none, so ``api`` ("completions", "chat",
    "responses") defaults to the first key present of ``prompt``, ``messages``, ``input``.
    Raises ``RenderError`` where GIE's typed decoding would fail.
    """
    if not isinstance(body, dict):
        raise RenderError("request body must be a JSON object")
    chosen = api if api is not None else _gie_api(body)
    if chosen == "completions":
        return go_utf8(_gie_prompt(body.get("prompt")))
    if chosen == "chat":
        return go_utf8(_gie_chat(body.get("messages")))
    if chosen == "responses":
        return go_utf8(_gie_responses(body))
    raise RenderError(f"api must be completions, chat or responses, not {chosen!r}")
