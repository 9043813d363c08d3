"""Kthena main's prompt rendering: request body -> the prompt string Kthena's prefix-cache plugin hashes.

Invariants:
- Pure functions of the decoded body; no I/O, no module state beyond constants.
- ``render_kthena`` returns exactly the string Kthena main's ``ParsePrompt``/``GetPromptString``
  produce: ``prompt`` first (even ``""``), else ``messages`` (ChatML), else Responses
  ``instructions`` + ``input``. Every body Kthena answers with 404 "prompt not found" raises
  ``RenderError`` here instead.
"""

from __future__ import annotations

from typing import Any

from kvindex.approx.gojson import RenderError

_KTHENA_TEXT_TYPES = frozenset({"text", "input_text", "output_text"})


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
