"""llm-d-inference-sim's built-in ("dummy") tokenizer, reproduced exactly.

The simulator uses it for unknown models or with ``--force-dummy-tokenizer``; its KV events carry
these token ids, so kvindex must produce the same ids to key the simulator's blocks.

Invariants:
- Splitting is the simulator's Go regex (wire-format.md §3)
  ``(\\{|\\}|:|,|-|\\.|\\?|\\!|;|@|#|\\$|%|\\^|&|\\*|\\(|\\)|\\+|\\-|_|~|/|\\\\|>|<|\\[|\\]|=|"|'|\\w+)(\\s*)``
  with Go (RE2) semantics: ``\\w`` is ASCII ``[0-9A-Za-z_]``, ``\\s`` is ``[\\t\\n\\f\\r ]`` (no
  ``\\v``), leftmost-first alternation, non-overlapping matches left to right. Characters no match
  covers (any non-ASCII letter, ``\\v``, a leading space, ...) are dropped.
- A token is one match *including* its trailing whitespace; its id is FNV-1a-32 of its UTF-8 bytes
  (all matches are ASCII). So ``"### "`` is three tokens ``"#"``, ``"#"``, ``"# "`` — the first
  two ids equal.
- Chat rendering, per message: ``"### " + role + ["(" + tool_call_id + ")"] + ": " + content +
  "[" + name + "(" + arguments + ")]" per tool call that has a name + "\\n"``. A string content is
  used as is; a list content is its parts joined by ``"\\n"``: text parts as their text,
  ``image_url`` as ``"image: <url>"``, ``audio_url`` as ``"audio: <url>"``, ``input_audio`` as
  ``"input_audio: <format>"``, ``video_url`` as ``"video: <url>"``; other parts (or media parts
  without a url/format object) are skipped. Missing or null fields render as ``""``. (The
  audio/video parts follow the simulator's current main; the version pinned in wire-format.md
  renders text and images the same way.)
- Token ids: ``py_tokenize_prompt`` (``[fnv1a_32(tok) for tok in split_tokens(text)]``) is the
  definition. ``tokenize_ids`` gives the same ids as one ``array("I")``, from the C twin
  ``adapters._llmd_sim`` when ``kvindex.native`` loads it (chosen once, at import; ~100x faster),
  else from the definition. A str the twin cannot encode as UTF-8 (a lone surrogate: the C reads
  UTF-8 bytes) is tokenized by the definition, which drops that character like any non-ASCII
  one. tests/test_llmd_sim_native.py holds the two equal.
- ``SimTokenizer.tokenize_prompt`` answers a ``list[int]``; ``SimTokenizer.tokenize`` (the
  ``Tokenizer`` protocol) the packed ``array("I")`` of ``tokenize_ids``: tokenizing is cheaper
  than a cache key, so kvindex does not cache this tokenizer's answers.
- Pure functions of the input: no state, safe to share.
"""

from __future__ import annotations

import re
from array import array
from typing import Any

from kvindex import native

_PUNCT = r"\{|\}|:|,|-|\.|\?|!|;|@|#|\$|%|\^|&|\*|\(|\)|\+|-|_|~|/|\\|>|<|\[|\]|=|\"|'"
_TOKEN_RE = re.compile(r"(" + _PUNCT + r"|[0-9A-Za-z_]+)([\t\n\f\r ]*)")
"""The simulator's regex in Python syntax with the Go character classes spelled out."""

_C = native.load("adapters._llmd_sim")

_FNV32_OFFSET = 0x811C9DC5
_FNV32_PRIME = 0x01000193

_MEDIA_PARTS = {
    "image_url": ("image: ", "url"),
    "audio_url": ("audio: ", "url"),
    "video_url": ("video: ", "url"),
    "input_audio": ("input_audio: ", "format"),
}
"""content part type -> (rendered prefix, key inside the part's object)."""


def fnv1a_32(data: bytes) -> int:
    """FNV-1a, 32 bits (Go's ``hash/fnv.New32a``)."""
    h = _FNV32_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV32_PRIME) & 0xFFFFFFFF
    return h


def split_tokens(text: str) -> list[str]:
    """The simulator's string tokens of ``text`` (each with its trailing whitespace)."""
    return [m.group(0) for m in _TOKEN_RE.finditer(text)]


def py_tokenize_prompt(text: str) -> list[int]:
    """The simulator's token ids of ``text``: the definition the C twin is held to."""
    return [fnv1a_32(tok.encode("utf-8")) for tok in split_tokens(text)]


if _C is None:

    def tokenize_ids(text: str) -> array:
        """The token ids of ``text`` as one ``array("I")`` (here from ``py_tokenize_prompt``)."""
        return array("I", py_tokenize_prompt(text))

    def _tokenize_list(text: str) -> list[int]:
        return py_tokenize_prompt(text)

else:
    _c_tokenize = _C.tokenize

    def tokenize_ids(text: str) -> array:
        """The token ids of ``text`` as one ``array("I")``, from the C twin."""
        try:
            return _c_tokenize(text)
        except UnicodeEncodeError:  # a lone surrogate: no UTF-8 bytes for the C to read
            return array("I", py_tokenize_prompt(text))

    def _tokenize_list(text: str) -> list[int]:
        try:
            return _c_tokenize(text).tolist()
        except UnicodeEncodeError:
            return py_tokenize_prompt(text)


def _str(value: Any) -> str:
    """A JSON string field as Go decodes it into a string: null/missing -> ""."""
    return value if isinstance(value, str) else ""


def _render_part(part: Any) -> str | None:
    """One list-content part, or None if the simulator skips it."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "text":
        return _str(part.get("text"))
    if kind in _MEDIA_PARTS:
        prefix, key = _MEDIA_PARTS[kind]
        inner = part.get(kind)
        if isinstance(inner, dict):
            return prefix + _str(inner.get(key))
    return None


def _render_content(content: Any) -> str:
    """A message's content: a string as is, a list as its rendered parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p for p in (_render_part(x) for x in content) if p is not None]
        return "\n".join(parts)
    return ""


def _render_tool_calls(tool_calls: Any) -> str:
    """``[name(arguments)]`` for each tool call whose function has a (string) name."""
    if not isinstance(tool_calls, list):
        return ""
    out = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.append("[" + fn["name"] + "(" + _str(fn.get("arguments")) + ")]")
    return "".join(out)


def render_message(message: dict[str, Any]) -> str:
    """One chat message as the simulator renders it, including ``"### "`` and the final newline."""
    head = "### " + _str(message.get("role"))
    tool_call_id = _str(message.get("tool_call_id"))
    if tool_call_id:
        head += "(" + tool_call_id + ")"
    body = _render_content(message.get("content")) + _render_tool_calls(message.get("tool_calls"))
    return head + ": " + body + "\n"


class SimTokenizer:
    """The simulator's dummy tokenizer; ``model`` is ignored (the simulator ignores it too)."""

    def tokenize_prompt(self, text: str) -> list[int]:
        """Token ids of a plain prompt (``py_tokenize_prompt``'s, through the C twin when built)."""
        return _tokenize_list(text)

    def render_chat(self, messages: list[Any]) -> str:
        """The text the simulator tokenizes for a chat request; ``ValueError`` on a non-object."""
        out = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"messages[{i}] must be an object")
            out.append(render_message(message))
        return "".join(out)

    async def tokenize(self, model: str, body: dict[str, Any]) -> array:
        """Token ids of a completions body (``prompt`` string) or chat body (``messages`` list),
        packed (``tokenize_ids``: on the request path no per-token object is made)."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return tokenize_ids(prompt)
        messages = body.get("messages")
        if isinstance(messages, list):
            return tokenize_ids(self.render_chat(messages))
        raise ValueError("request body needs a string 'prompt' or a list 'messages'")
