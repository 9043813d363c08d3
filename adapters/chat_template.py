"""Rendering an OpenAI ``messages`` list with a model's Jinja chat template, as vLLM's chat endpoint does.

Facts carried over (vLLM 0.32 ``renderers/hf.py``, ``renderers/chat_utils.py``; transformers 5
``utils/chat_template_utils.py``, ``tokenization_utils_base.py``), the code is kvindex's own:
- The environment is Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension and a ``{% generation %}`` block tag (rendered as its body);
  ``tojson`` is ``json.dumps`` (``ensure_ascii=False``, ``indent``, ``separators``, no key
  sorting); the globals ``raise_exception(msg)`` (fails the render) and ``strftime_now(fmt)``.
- Variables: ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special tokens
  (``bos_token``, ``eos_token``, ...), then ``chat_template_kwargs`` filtered to the names the
  template uses; the body's own ``add_generation_prompt`` (default true) / ``continue_final_message``
  / ``tools`` / ``documents`` / ``reasoning_effort`` (which also sets ``enable_thinking`` unless the
  kwargs do) win over the same names in ``chat_template_kwargs``; ``chat_template`` or ``tokenize``
  inside ``chat_template_kwargs`` is refused.
- ``chat_template`` (the config's or the body's) is a template, or the name of one of the model's
  named templates; with named templates and no choice, ``tool_use`` when tools are given, else
  ``default``.
- Messages are normalised as vLLM does before rendering: a template that loops over a message's
  ``content`` gets content as a list of ``{"type": "text", "text": ...}`` parts ("openai"
  format), any other template gets one string (text parts joined by newlines, none -> "");
  assistant ``tool_calls`` get their ``arguments`` JSON decoded to an object ({} when empty or
  not an object); an empty ``tool_calls`` is dropped; a tool message's text parts are one string;
  with a template that never names the "developer" role, developer messages become system ones
  and all system messages are merged into the first (joined by blank lines).
- ``tools`` are given to the template as vLLM's request model dumps them: ``{"type": "function",
  "function": {"name", "description", "parameters"[, "strict"][, "defer_loading"]}[,
  "defer_loading"]}``, absent description/parameters as null, other keys dropped.
- ``continue_final_message`` renders the chat with the final message open: the rendered text is cut
  right after that message's content (a template that trims it: cut and right-stripped).
- Anything the template or the messages cannot give raises ``ChatTemplateError`` (a ``ValueError``)
  with a one-line message; a non-text content part (image, audio) is refused, not dropped.
- Compiled templates are kept per template text: the model's own ones always, at most
  ``MAX_REQUEST_COMPILED`` bodies' own ones (the oldest evicted; a 64 KiB one holds ~25 MB).
- A body's own ``chat_template`` text (not the name of one of the model's templates) is refused
  (``UntrustedChatTemplate``, reason ``untrusted_chat_template``) unless the model table trusts
  them (``trust_request_chat_template``, as vLLM's ``--trust-request-chat-template``); a trusted one
  is at most ``MAX_REQUEST_TEMPLATE_CHARS`` characters. Every render, of any template, is bounded
  by ``adapters.template_bounds`` (steps, built values and output).
- ``clock_formats``: the ``strftime_now`` formats a template passes (constants), or None for a
  template whose format is not a constant; a tokenizer cache keys a body by their current values.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes

from adapters.template_bounds import BoundedSandbox, compile_bounded, render_bounded

MAX_REQUEST_COMPILED = 4
MAX_REQUEST_TEMPLATE_CHARS = 64 << 10  # a body's own template: compiling 1 MB took 10 s and ~0.5 GB
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_KEPT_KEYS = ("name", "tool_call_id")


class ChatTemplateError(ValueError):
    """A chat the template cannot render; the message is one line; ``reason``: its rejection label."""

    reason = "untokenizable"


class UntrustedChatTemplate(ChatTemplateError):
    """A body brought its own template and the model table does not trust request templates."""

    reason = "untrusted_chat_template"


def one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: Any) -> None:
    raise jinja2.TemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def clock_epoch(formats: tuple[str, ...] | None) -> str:
    """What ``strftime_now`` gives a template with these ``clock_formats`` now ("" for none; to the
    microsecond when a format is not constant: such a template's render is never reused)."""
    if formats is None:
        return datetime.now().isoformat()
    return "\x1f".join(_strftime_now(f) for f in formats)


def make_environment() -> BoundedSandbox:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _is_content_access(node: jinja2.nodes.Node) -> bool:
    """``x['content']`` or ``x.content``."""
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"


def _loops_over_content(tree: jinja2.nodes.Template) -> bool:
    """Whether the template iterates a message's content (then it wants content parts)."""
    for loop in tree.find_all(jinja2.nodes.For):
        it: jinja2.nodes.Node = loop.iter
        while isinstance(it, jinja2.nodes.Filter) and it.node is not None:
            it = it.node
        if _is_content_access(it):
            return True
    return False


def _clock_formats(tree: jinja2.nodes.Template) -> tuple[str, ...] | None:
    """The constant formats of the template's ``strftime_now(...)`` calls; None if one is not constant."""
    formats = []
    for call in tree.find_all(jinja2.nodes.Call):
        if isinstance(call.node, jinja2.nodes.Name) and call.node.name == "strftime_now":
            arg = call.args[0] if len(call.args) == 1 and not call.kwargs else None
            if not isinstance(arg, jinja2.nodes.Const) or not isinstance(arg.value, str):
                return None
            formats.append(arg.value)
    named = sum(1 for n in tree.find_all(jinja2.nodes.Name) if n.name == "strftime_now")
    return tuple(dict.fromkeys(formats)) if named == len(formats) else None  # else passed around as a value


class CompiledTemplate:
    """One template: compiled, the variables it reads, the content format it wants, its clock formats."""

    def __init__(self, env: BoundedSandbox, source: str) -> None:
        try:
            tree = env.parse(source)
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(tree))
            self.wants_parts = _loops_over_content(tree)
            self.clock_formats = _clock_formats(tree)  # (a global: not among the undeclared variables)
            self.template = compile_bounded(env, tree)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {one_line(str(exc))}") from None
        self.source = source
        self.names_developer = '"developer"' in source or "'developer'" in source


def _text_parts(role: str, content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatTemplateError(f"a {role} message's content must be a string or a list of parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(f"content part of type {kind!r} cannot be tokenized here (text only)")
    return texts


def _decoded_arguments(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def _tool_calls(calls: list[Any]) -> list[Any]:
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict) \
                or call.get("type", "function") != "function":
            raise ChatTemplateError("assistant tool_calls entries must be objects of type 'function'")
        out.append({**call, "function": {**call["function"],
                                         "arguments": _decoded_arguments(call["function"].get("arguments"))}})
    return out


def normalise_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A body's ``tools`` as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them to the template."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatTemplateError("tools must be a list")
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or tool.get("type", "function") != "function":
            raise ChatTemplateError("every tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        defer = tool.get("defer_loading")
        function = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        for key, value in (("strict", fn.get("strict")), ("defer_loading", fn.get("defer_loading", defer))):
            if value is not None:
                function[key] = value
        out.append({"type": "function", "function": function, **({"defer_loading": defer} if defer is not None else {})})
    return out


def normalise_message(message: Any, wants_parts: bool) -> dict[str, Any]:
    """One OpenAI message as the template sees it (see the module's invariants)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ChatTemplateError("every message must be an object with a string 'role'")
    role = message["role"]
    texts = _text_parts(role, message.get("content"))
    content: Any = [{"type": "text", "text": t} for t in texts] if wants_parts else "\n".join(texts)
    if role == "tool" and isinstance(content, list):
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": role, "content": content}
    out.update({k: message[k] for k in _KEPT_KEYS if isinstance(message.get(k), str)})
    if role == "assistant":
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            out["tool_calls"] = _tool_calls(calls)
        if message.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = message["reasoning"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def developer_as_system(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's rewrite for a template that never names the developer role: developer messages become
    system ones, then every system message is merged into one first (texts joined by blank lines)."""
    chat = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
            for m in chat]
    systems = [i for i, m in enumerate(chat) if m["role"] == "system"]
    if not systems or systems == [0]:
        return chat
    texts = []
    for i in systems:
        content = chat[i].get("content")
        text = "\n".join(p.get("text", "") for p in content) if isinstance(content, list) else content
        if text:
            texts.append(text)
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in chat if m["role"] != "system")]


def _continued(rendered: str, final_text: str) -> str:
    """``rendered`` cut right after the tagged final message (transformers' rule)."""
    tag = CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError("continue_final_message: the template does not render the final message as given")
    at = rendered.rindex(tag)
    return rendered[:at] if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else rendered[:at].rstrip()


def _tag_final(messages: list[dict[str, Any]]) -> str:
    """Append the continue tag to the final message's (last) text; return that text."""
    final = messages[-1]
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + CONTINUE_TAG
        return content
    for part in reversed(content or []):
        text = part.get("text")
        if isinstance(text, str):
            part["text"] = text + CONTINUE_TAG
            return text
    raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")


def _request_kwargs(body: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The body's own rendering fields that vLLM merges over ``chat_template_kwargs`` (null = unset)."""
    out = {k: body[k] for k in ("documents", "reasoning_effort") if body.get(k) not in (None, "auto")}
    if body.get("reasoning_effort") is not None and "enable_thinking" not in kwargs:
        out["enable_thinking"] = body["reasoning_effort"] != "none"
    return out


class ChatTemplates:
    """A model's chat templates (one, or named ones) and the rendering of chats with them."""

    def __init__(self, templates: str | dict[str, str] | None, special_tokens: dict[str, Any],
                 trust_request_templates: bool = False) -> None:
        self._env = make_environment()
        self._trust_request = trust_request_templates
        self._named = templates if isinstance(templates, dict) else {}
        self._default = templates if isinstance(templates, str) else None
        self._special = special_tokens
        self._compiled: dict[str, CompiledTemplate] = {}
        for source in ([self._default] if self._default else []) + list(self._named.values()):
            self._compile(source)

    @property
    def compiled(self) -> int:
        """How many compiled templates are held."""
        return len(self._compiled)

    def _compile(self, source: str) -> CompiledTemplate:
        found = self._compiled.get(source)
        if found is None:
            found = CompiledTemplate(self._env, source)
            own = {self._default, *self._named.values()}
            requests = [k for k in self._compiled if k not in own]
            if source not in own and len(requests) >= MAX_REQUEST_COMPILED:  # evict the oldest body template
                self._compiled.pop(requests[0], None)
            self._compiled[source] = found
        return found

    def select(self, chosen: Any, tools: Any) -> CompiledTemplate:
        """The template a request renders with: its ``chat_template`` (text or name) or the model's."""
        if chosen is not None and not isinstance(chosen, str):
            raise ChatTemplateError("chat_template must be a string")
        if chosen in self._named:
            return self._compile(self._named[chosen])
        if chosen is not None:
            if not self._trust_request:
                raise UntrustedChatTemplate("a request's own chat_template is refused: the model table does not set "
                                            "trust_request_chat_template = true")
            if len(chosen) > MAX_REQUEST_TEMPLATE_CHARS:
                raise ChatTemplateError(f"chat_template has {len(chosen)} characters; the limit is "
                                        f"{MAX_REQUEST_TEMPLATE_CHARS}")
            return self._compile(chosen)
        if self._named:
            name = "tool_use" if tools is not None and "tool_use" in self._named else "default"
            if name not in self._named:
                raise ChatTemplateError(f"the model has named chat templates {sorted(self._named)} and no "
                                        f"'default': give chat_template")
            return self._compile(self._named[name])
        if self._default is None:
            raise ChatTemplateError("the model has no chat template (tokenizer_config.json chat_template): "
                                    "give chat_template")
        return self._compile(self._default)

    def epoch(self, body: dict[str, Any]) -> str:
        """The clock values a chat ``body``'s template would read now ("" when none or it cannot render)."""
        try:
            return clock_epoch(self.select(body.get("chat_template"), body.get("tools")).clock_formats)
        except ChatTemplateError:
            return ""

    def render(self, body: dict[str, Any]) -> str:
        """The prompt text of a chat ``body`` (``messages``, ``tools``, ``chat_template``...)."""
        messages, tools = body.get("messages"), normalise_tools(body.get("tools"))
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("'messages' must be a non-empty list")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ChatTemplateError("chat_template_kwargs must be an object")
        if {"chat_template", "tokenize"} & kwargs.keys():
            raise ChatTemplateError("chat_template_kwargs may not set chat_template or tokenize")
        template = self.select(body.get("chat_template"), tools)
        add_prompt = bool(body.get("add_generation_prompt", True))
        continue_final = bool(body.get("continue_final_message", False))
        if add_prompt and continue_final:
            raise ChatTemplateError("continue_final_message needs add_generation_prompt false")
        chat = [normalise_message(m, template.wants_parts) for m in messages]
        if any(m["role"] == "developer" for m in chat) and not template.names_developer:
            chat = developer_as_system(chat)
        final_text = _tag_final(chat) if continue_final else ""
        variables = dict(self._special)  # a chat_template_kwargs of the same name wins (transformers)
        variables.update({k: v for k, v in {**kwargs, **_request_kwargs(body, kwargs)}.items()
                          if k in template.variables})
        variables.update(messages=chat, tools=tools if tools is not None else kwargs.get("tools"),
                         documents=variables.get("documents"), add_generation_prompt=add_prompt)
        try:
            rendered = render_bounded(template.template, variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {one_line(str(exc))}") from None
        except Exception as exc:  # a template is code: any failure of it is the request's
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {one_line(str(exc))}") from None
        return _continued(rendered, final_text) if continue_final else rendered

