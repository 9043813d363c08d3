"""Tokenizing in process with the model's own tokenizer files (``tokenizer = "hf"``).

Invariants:
- ``HFTokenizer.load(dir, model)`` reads ``tokenizer.json`` (Hugging Face ``tokenizers``) and
  ``tokenizer_config.json`` (special tokens, ``add_bos_token``/``add_eos_token``, ``chat_template``;
  a ``chat_template.jinja`` beside them wins over the config's, as transformers loads it); any
  missing or unreadable file raises ``ConfigError`` naming ``tokenizer_path``.
- Special tokens added to a completion follow transformers 5 (what vLLM 0.32 runs): when the config
  names ``add_bos_token`` or ``add_eos_token`` (or tokenizer.json has no post-processor), the
  post-processor becomes ``[bos] $A [eos]`` per those flags (absent = false); otherwise
  tokenizer.json's own post-processor is kept.
- A completions body (string ``prompt``) is encoded with special tokens unless its
  ``add_special_tokens`` is false (vLLM's /v1/completions default: true). A chat body
  (``messages``) is rendered by ``adapters.chat_template`` and encoded with
  ``add_special_tokens`` default **false** (vLLM's /v1/chat/completions default: the template
  writes BOS itself, so it is never doubled; a body that sets it true gets what vLLM gives it).
- A completion body (``prompt``) of at most ``INLINE_CHARS`` characters is tokenized on the event
  loop; a longer one in the loop's default executor with ``encode_batch``, which releases the GIL
  (``encode`` does not: in a thread it would stall the loop as much), so a long body never stalls
  the loop (measured in benchmarks/tokenizer.py).
- A chat body (``messages``) is always rendered and encoded there, whatever its length: a template
  is code, and what it costs is not bounded by the body's size (97 characters may scan an 8 MiB
  string for the whole ``MAX_RENDER_SECONDS``). At most ``RENDER_THREADS`` of one tokenizer's
  renders run at once (more wait, each its own request's time); each keeps its own bounds
  (``adapters.template_bounds``, the 10 s one included). The loop then waits at most for the GIL
  between two of a render's bytecodes (the switch interval, 5 ms), or one C call of it (a
  ``sort`` of the largest list a template may build).
- A body that cannot be tokenized raises ``ValueError`` (``ChatTemplateError``), one line.
- A body's own ``chat_template`` counts into its size (it is compiled and rendered in the same call).
- ``cache_epoch(model, body)``: the ``strftime_now`` values the body's template reads now ("" for a
  template that reads none), which ``CachingTokenizer`` adds to its key (a date in the prompt).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvindex.config import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFBackend

    from adapters.chat_template import ChatTemplates

INLINE_CHARS = 2048  # below this, a thread hop costs more than the tokenization itself
RENDER_THREADS = 2  # chat renders of one tokenizer at once, each in a thread of the loop's default executor
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
EXTRA_HINT = 'tokenizer = "hf" needs the optional libraries: pip install "kvindex[hf]"'


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path.name}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what}: {path.name} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path.name} is not a JSON object")
    return data


def _templates(config: dict[str, Any], folder: Path, what: str) -> str | dict[str, str] | None:
    """The model's chat template(s): ``chat_template.jinja``, else the config's string or named list."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    found = config.get("chat_template")
    if found is None or isinstance(found, str):
        return found
    if isinstance(found, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in found):
        return {t["name"]: t["template"] for t in found}
    raise ConfigError(f"{what}: tokenizer_config.json chat_template must be a string or a list of "
                      f"{{name, template}} objects")


def _special_tokens(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The template's special-token variables (tokenizer_config, then special_tokens_map.json)."""
    fallback: dict[str, Any] = {}
    map_file = folder / "special_tokens_map.json"
    if map_file.is_file():
        try:
            fallback = json.loads(map_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            fallback = {}
    out: dict[str, Any] = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name, fallback.get(name) if isinstance(fallback, dict) else None))
        if text is not None:
            out[name] = text
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    return out


def _set_post_processor(backend: HFBackend, config: dict[str, Any], special: dict[str, Any]) -> None:
    """transformers 5's rule for the special tokens of an encode (module invariants)."""
    explicit = "add_bos_token" in config or "add_eos_token" in config
    if not explicit and backend.post_processor is not None:
        return
    ends: dict[str, tuple[str, int] | None] = {}
    for flag, name in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        token = special.get(name) if config.get(flag) else None
        token_id = backend.token_to_id(token) if token is not None else None
        ends[name] = (token, token_id) if token is not None and token_id is not None else None
    bos, eos = ends["bos_token"], ends["eos_token"]

    def side(seq: str, type_id: int) -> str:
        return " ".join(([f"{bos[0]}:{type_id}"] if bos else []) + [f"{seq}:{type_id}"]
                        + ([f"{eos[0]}:{type_id}"] if eos else []))

    from tokenizers import processors

    backend.post_processor = processors.TemplateProcessing(
        single=side("$A", 0), pair=side("$A", 0) + " " + side("$B", 1),
        special_tokens=list(dict.fromkeys(e for e in (bos, eos) if e is not None)))


class HFTokenizer:
    """A model's tokenizer files, tokenizing OpenAI bodies as vLLM's endpoints do."""

    def __init__(self, backend: HFBackend, templates: ChatTemplates) -> None:
        self._backend = backend
        self._templates = templates
        self._render_slots = asyncio.Semaphore(RENDER_THREADS)  # bound to a loop when first awaited

    @classmethod
    def load(cls, folder: str | Path, model: str = "*", trust_request_templates: bool = False) -> HFTokenizer:
        where = Path(folder).expanduser()
        what = f'[models."{model}"] tokenizer_path {str(folder)!r}'
        if not where.is_dir():
            raise ConfigError(f"{what}: no such directory")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (where / name).is_file():
                raise ConfigError(f"{what}: no {name} there (a model repository or Hugging Face snapshot folder)")
        config = _read_json(where / "tokenizer_config.json", what)
        try:  # the optional [hf] extra, imported only by a model that uses it
            from tokenizers import Tokenizer as Backend

            from adapters.chat_template import ChatTemplateError, ChatTemplates
        except ImportError as exc:
            raise ConfigError(f"{what}: {EXTRA_HINT} ({exc})") from None
        try:
            backend = Backend.from_file(str(where / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises its own Exception type
            raise ConfigError(f"{what}: tokenizer.json cannot be loaded: {' '.join(str(exc).split())[:200]}") from None
        special = _special_tokens(config, where)
        _set_post_processor(backend, config, special)
        try:
            templates = ChatTemplates(_templates(config, where, what), special, trust_request_templates)
        except ChatTemplateError as exc:
            raise ConfigError(f"{what}: {exc}") from None
        return cls(backend, templates)

    def encode(self, text: str, add_special_tokens: bool, release_gil: bool = False) -> list[int]:
        """Token ids of ``text``. ``tokenizers``' ``encode`` holds the GIL throughout (a thread running
        it stalls the event loop just the same); ``encode_batch`` releases it: off the loop, use that."""
        if release_gil:
            return list(self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def render(self, body: dict[str, Any]) -> str:
        """A chat body's prompt text (``ChatTemplateError`` when the template cannot render it)."""
        return self._templates.render(body)

    def cache_epoch(self, model: str, body: dict[str, Any]) -> str:
        """What besides ``tokenize_input(body)`` decides the tokens now: the template's clock values."""
        return self._templates.epoch(body) if isinstance(body.get("messages"), list) else ""

    def tokenize_now(self, body: dict[str, Any], release_gil: bool = False) -> list[int]:
        """``body``'s token ids, computed in the calling thread."""
        specials = body.get("add_special_tokens")
        if specials is not None and not isinstance(specials, bool):
            raise ValueError("add_special_tokens must be true or false")
        prompt, messages = body.get("prompt"), body.get("messages")
        if isinstance(prompt, str):
            return self.encode(prompt, True if specials is None else specials, release_gil)
        if isinstance(messages, list):
            return self.encode(self.render(body), bool(specials), release_gil)
        raise ValueError("request body needs a string 'prompt' or a list 'messages'")

    async def tokenize(self, model: str, body: dict[str, Any]) -> list[int]:
        """``Tokenizer`` protocol: chats and long prompts are tokenized off the event loop."""
        loop = asyncio.get_running_loop()
        if not isinstance(body.get("messages"), list):
            if _body_chars(body) <= INLINE_CHARS:
                return self.tokenize_now(body)
            return await loop.run_in_executor(None, self.tokenize_now, body, True)
        async with self._render_slots:
            return await loop.run_in_executor(None, self.tokenize_now, body, True)


def _body_chars(body: dict[str, Any]) -> int:
    """A cheap size of what is to be tokenized: the prompt's length or the messages' text and the body's template."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    template = body.get("chat_template")
    total = len(template) if isinstance(template, str) else 0
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict)
                         and isinstance(p.get("text"), str))
    return total
