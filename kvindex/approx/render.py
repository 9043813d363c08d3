"""Request body -> the prompt an approximate router hashes (Kthena main, GIE v1.5.0).

Invariants:
- Pure functions of the decoded body; no I/O, no module state beyond constants.
- ``render_kthena`` returns exactly the string Kthena main's ``ParsePrompt``/``GetPromptString``
  produce: ``prompt`` first (even ``""``), else ``messages`` (ChatML), else Responses
  ``instructions`` + ``input``. Every body Kthena answers with 404 "prompt not found" raises
  ``RenderError`` here instead.
- ``render_gie`` returns exactly the bytes GIE v1.5.0 hashes: the completions prompt (a list is
  joined with ``" "``), Go ``json.Marshal`` of the typed chat messages, or the Responses array
  ``[{"instructions"}?, {"tools"}?, {"input"}]``. Go's encoder is copied where it shows in the
  bytes: HTML-safe escapes, struct field order, always-present media objects, sorted map keys and
  float64 number formatting.
- Strings never carry lone surrogates out of this module: ``go_json_loads`` and ``go_utf8`` turn
  them (and invalid UTF-8) into U+FFFD, as Go's ``encoding/json`` does.
- ``RenderError`` messages are one line and name the field or problem.

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

_SURROGATES = re.compile("[\ud800-\udfff]")
# what makes the plain decoder differ from Go's: surrogate escapes, a negative zero, huge integers
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_NEGATIVE_ZERO = re.compile(r"-0(?![.0-9eE])")
_KTHENA_TEXT_TYPES = frozenset({"text", "input_text", "output_text"})
_GO_HTML_ESCAPES = (
    ("<", "\\u003c"),
    (">", "\\u003e"),
    ("&", "\\u0026"),
    ("\u2028", "\\u2028"),
    ("\u2029", "\\u2029"),
)
_GIE_APIS = (("prompt", "completions"), ("messages", "chat"), ("input", "responses"))


class RenderError(ValueError):
    """A request body the router would not hash (Kthena answers 404 "prompt not found")."""


# --- Go encoding/json decoding -------------------------------------------------------------


def _scrub(text: str) -> str:
    """Replace every surrogate code point (lone escape or escaped raw byte) with U+FFFD."""
    return _SURROGATES.sub("\ufffd", text)


def go_utf8(text: str) -> bytes:
    """UTF-8 bytes of ``text`` as Go would hold them: lone surrogates become U+FFFD."""
    return _scrub(text).encode("utf-8")


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Object decoding: keys scrubbed; the last duplicate key wins (as in Go)."""
    return {_scrub(key): value for key, value in pairs}


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
        return _scrub(value)
    stack = [value] if isinstance(value, (dict, list)) else []
    while stack:
        node = stack.pop()
        entries = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        for key, item in entries:
            if isinstance(item, str):
                node[key] = _scrub(item)
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
    except RenderError:
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
        raise RenderError("malformed JSON: nesting too deep") from None


# --- Kthena main ----------------------------------------------------------------------------


def _kthena_part_text(part: Any) -> str | None:
    """A content part's text, or None when Kthena skips the part."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if isinstance(kind, str) and kind not in _KTHENA_TEXT_TYPES:
        return None
    text = part.get("text")
    return text if isinstance(text, str) else None


def _kthena_content(value: Any) -> str | None:
    """Kthena's content parsing: a string as-is, a list's text parts joined by newlines.

    None means "does not parse" (the message is dropped): null, other types, or a list with
    no kept part.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        return None
    texts = [text for text in map(_kthena_part_text, value) if text is not None]
    return "\n".join(texts) if texts else None


def _kthena_chat(body: dict[str, Any]) -> list[tuple[str, str]]:
    messages = body["messages"]
    if not isinstance(messages, list):
        raise RenderError("messages must be a list")
    out: list[tuple[str, str]] = []
    system = _kthena_content(body.get("system"))
    if system is not None:
        out.append(("system", system))
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            continue
        content = _kthena_content(message.get("content"))
        if content is not None:
            out.append((message["role"], content))
    return out


def _kthena_input_item(item: Any) -> tuple[str, str] | None:
    """One Responses ``input`` list item as (role, content), or None when Kthena skips it."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if isinstance(kind, str) and kind not in ("", "message"):
        return None
    role = item.get("role")
    if not isinstance(role, str) or not role:
        return None
    content = _kthena_content(item.get("content"))
    return None if content is None else (role, content)


def _kthena_responses(body: dict[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append(("developer", instructions))
    value = body["input"]
    if isinstance(value, str):
        out.append(("user", value))
    elif isinstance(value, list):
        out.extend(msg for msg in map(_kthena_input_item, value) if msg is not None)
    else:
        raise RenderError("input must be a string or a list")
    return out


def render_kthena(body: dict[str, Any]) -> str:
    """The prompt string Kthena main hashes for ``body``.

    ``prompt`` (key present, even null) must be a string and wins over everything; else
    ``messages`` (must be a list; top-level ``system`` prepended when it parses); else ``input``
    (Responses API, ``instructions`` first as a ``developer`` message). Messages render as
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, concatenated, no generation prompt.
    Raises ``RenderError`` for every body Kthena rejects with 404.
    """
    if not isinstance(body, dict):
        raise RenderError("request body must be a JSON object")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise RenderError("prompt must be a string")
        return body["prompt"]
    if "messages" in body:
        messages = _kthena_chat(body)
    elif "input" in body:
        messages = _kthena_responses(body)
    else:
        raise RenderError("no prompt, messages or input in the request")
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)


# --- Go encoding/json encoding ---------------------------------------------------------------


def go_string(text: str) -> str:
    """A JSON string literal exactly as Go's ``json.Marshal`` writes it (HTML-safe escapes)."""
    out = json.dumps(_scrub(text), ensure_ascii=False)
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
