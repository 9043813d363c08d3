"""The OpenAI API as a simulated vLLM engine speaks it: requests read and checked, answers built
(JSON and SSE, vLLM's ``usage`` with ``prompt_tokens_details.cached_tokens``), errors in vLLM's
``{"error": {message, type, param, code}}`` shape, and the ``/metrics`` text. No state: the
engine (``kvindex.tools.openai_engine``) owns the cache, the queue and the sockets.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from adapters.llmd_sim import SimTokenizer
from kvindex.tools.engine_sim import Admission

log = logging.getLogger("kvindex.tools.openai_engine")

MAX_MODEL_LEN = 131072
"""What ``/tokenize`` and ``/v1/models`` report; also the largest ``max_tokens`` accepted."""
DEFAULT_MAX_TOKENS = 16
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
          "kilo", "lima", "mike", "november", "oscar", "papa")
_JSON_SEPARATORS = (",", ":")

class ApiError(Exception):
    """A request the engine refuses, answered in vLLM's error shape."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return web.json_response(body, status=self.status)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


@dataclass(frozen=True, slots=True)
class Generation:
    """What a request asks to generate."""

    max_tokens: int
    stream: bool
    include_usage: bool


def parse_generation(body: dict[str, Any], chat: bool) -> Generation:
    """``max_tokens`` (chat: or ``max_completion_tokens``), ``stream``, ``stream_options``."""
    value = body.get("max_tokens")
    if value is None and chat:
        value = body.get("max_completion_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if value is None else value
    if not _is_int(max_tokens) or not 1 <= max_tokens <= MAX_MODEL_LEN:
        raise bad_request(f"max_tokens must be an integer in [1, {MAX_MODEL_LEN}]", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage") is True)
    return Generation(max_tokens, stream, include_usage)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_list(value: list[Any]) -> list[int]:
    """A prompt given as token ids (each a u32)."""
    if not all(_is_int(t) and 0 <= t < 1 << 32 for t in value):
        raise bad_request("a token-id prompt must be a list of integers in [0, 2**32)", "prompt")
    return value


def completion_tokens(tokenizer: SimTokenizer, body: dict[str, Any]) -> Sequence[int]:
    """The prompt tokens of a completions (or /tokenize) body with a ``prompt``."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.tokenize_prompt(prompt)
    if isinstance(prompt, list):
        return token_list(prompt)
    raise bad_request("the request needs a 'prompt': a string or a list of token ids", "prompt")


def chat_tokens(tokenizer: SimTokenizer, body: dict[str, Any]) -> Sequence[int]:
    """The prompt tokens of a chat body, as the simulator renders and tokenizes it."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("the request needs 'messages': a list of message objects", "messages")
    try:
        text = tokenizer.render_chat(messages)
    except (ValueError, TypeError, AttributeError) as exc:
        raise bad_request(f"bad messages: {exc}", "messages") from None
    return tokenizer.tokenize_prompt(text)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object (chunked or not); 400 otherwise."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def word(i: int) -> str:
    """Generated token ``i`` as text (the first without its leading space)."""
    return _WORDS[i % len(_WORDS)] if i == 0 else " " + _WORDS[i % len(_WORDS)]


def answer_text(max_tokens: int) -> str:
    return "".join(word(i) for i in range(max_tokens))


def usage(prompt_tokens: int, cached_tokens: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=_JSON_SEPARATORS)


def sse(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


@dataclass(frozen=True, slots=True)
class Answer:
    """Everything one response is built from."""

    rid: str
    model: str
    created: int
    chat: bool
    gen: Generation
    adm: Admission

    def usage(self) -> dict[str, Any]:
        return usage(self.adm.prompt_tokens, self.adm.cached_tokens, self.gen.max_tokens)

    def full(self) -> dict[str, Any]:
        """The non-streaming body."""
        text = answer_text(self.gen.max_tokens)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": [choice], "usage": self.usage()}

    def chunk(self, i: int) -> dict[str, Any]:
        """Streamed chunk of generated token ``i``."""
        last = i == self.gen.max_tokens - 1
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length" if last else None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": word(i)} if i == 0 else {"content": word(i)}
        else:
            choice["text"] = word(i)
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                "choices": [], "usage": self.usage()}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}


def padding_text(model: str, lines: int) -> str:
    """``lines`` filler samples (one gauge family) to make ``/metrics`` as large as a real vLLM's."""
    if lines == 0:
        return ""
    name = "vllm:sim_padding"
    head = f"# HELP {name} Filler lines of the simulated engine.\n# TYPE {name} gauge\n"
    return head + "".join(f'{name}{{model_name="{model}",line="{i}"}} 0.0\n' for i in range(lines))


def metric(name: str, kind: str, help_text: str, labels: str, value: float) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name}{{{labels}}} {float(value)!r}\n"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """ApiError -> its JSON answer; any other failure -> a 500 in the same shape, logged."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException:
        raise
    except Exception as exc:  # a bug must not take the server down
        log.exception("%s %s failed", request.method, request.path)
        return ApiError(500, f"internal error: {type(exc).__name__}", "InternalServerError").response()
