"""A chat template is code: what a request's own template may do, and what any render may cost.

- A body's own ``chat_template`` is refused (a counted one-line 400) unless the model table sets
  ``trust_request_chat_template = true``; a trusted one is bounded in size.
- Every render (the model's own template too) is bounded in steps, in the values it builds and in
  its output (``adapters.template_bounds``), and each refusal is one line.
- A template that reads the clock (``strftime_now``) is cached per clock value.
- Tokenizer-specific model keys are refused for the other tokenizers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from adapters import chat_template, template_budget
from adapters.chat_template import ChatTemplates, ChatTemplateError
from adapters.hf_tokenizer import INLINE_CHARS, HFTokenizer, _body_chars
from adapters.template_bounds import MAX_RENDER_CHARS, MAX_RENDER_STEPS
from kvindex.config import Config, ConfigError, ModelConfig
from kvindex.configfile import config_from_toml
from kvindex.tokenize import CachingTokenizer
from tests.conftest import FIXTURES

TINY = FIXTURES / "tiny-model"
HI = [{"role": "user", "content": "hi"}]


def tiny_with(tmp_path: Path, template: str) -> Path:
    folder = tmp_path / "tok"
    shutil.copytree(TINY, folder, dirs_exist_ok=True)
    data = json.loads((TINY / "tokenizer_config.json").read_text())
    data["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(data))
    return folder


async def test_a_body_template_is_refused_unless_the_model_trusts_them(make_harness: Any, tmp_path: Path) -> None:
    folder = str(tiny_with(tmp_path, "{{ messages[0]['content'] }}"))
    h = await make_harness(Config(models={
        "tiny": ModelConfig(tokenizer="hf", tokenizer_path=folder),
        "open": ModelConfig(tokenizer="hf", tokenizer_path=folder, trust_request_chat_template=True)}))
    body = {"messages": HI, "chat_template": "{{ 'x' * 100000000 }}"}
    status, answer = await h.post("/v1/score", {"model": "tiny", **body})
    assert status == 400 and "trust_request_chat_template" in answer["error"] and "\n" not in answer["error"], answer
    status, answer = await h.post("/v1/score", {"model": "open", **body})  # trusted, and still bounded
    assert status == 400 and "8388608" in answer["error"] and "\n" not in answer["error"], answer
    status, ok = await h.post("/v1/score", {"model": "open", "messages": HI, "chat_template": "{{ 'hi' }}"})
    assert status == 200 and ok["prompt_tokens"] == 1, ok
    status, ok = await h.post("/v1/score", {"model": "tiny", "messages": HI})  # the model's own template
    assert status == 200 and ok["prompt_tokens"] == 1, ok
    status, metrics = await h.get("/metrics")
    assert b'kvindex_http_rejections_total{endpoint="/v1/score",reason="untrusted_chat_template"} 1.0' in metrics
    assert b'kvindex_http_rejections_total{endpoint="/v1/score",reason="untokenizable"} 1.0' in metrics


def test_a_named_template_of_the_model_stays_allowed() -> None:
    templates = ChatTemplates({"default": "D", "tool_use": "T"}, {})
    assert templates.render({"messages": HI, "chat_template": "tool_use"}) == "T"
    with pytest.raises(ChatTemplateError, match="trust_request_chat_template"):
        templates.render({"messages": HI, "chat_template": "X"})


def test_a_trusted_body_template_is_bounded_in_size() -> None:
    templates = ChatTemplates("x", {}, trust_request_templates=True)
    big = "y" * (chat_template.MAX_REQUEST_TEMPLATE_CHARS + 1)
    with pytest.raises(ChatTemplateError, match="the limit is 65536"):
        templates.render({"messages": HI, "chat_template": big})
    assert templates.render({"messages": HI, "chat_template": big[:1000]}) == big[:1000]
    for n in range(10):  # a body's templates are compiled per text: only the last few are kept
        assert templates.render({"messages": HI, "chat_template": f"{n}"}) == f"{n}"
    assert templates.select(None, None).source == "x"
    kept = [templates.select(f"{n}", None) for n in range(10)]  # (select compiles what is not kept)
    assert len({id(t) for t in kept}) == 10 and templates.compiled == 1 + chat_template.MAX_REQUEST_COMPILED


A4M = "{% set a = 'x' * 4000000 %}"
COSTLY = [
    ("{{ 'x' * 100000000 }}", "'\\*' would build"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", f"{MAX_RENDER_STEPS} steps"),
    ("{% macro f() %}{% endmacro %}{% for i in range(100000) %}{% for j in range(30) %}{{ f() }}{% endfor %}"
     "{% endfor %}", "steps"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "'~'"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "'\\+'"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
     "printing a container"),
    ("{{ 'x' | center(100000000) }}", "center"),
    ("{{ '%0100000000d' | format(1) }}", "format"),
    ("{{ '%0100000000d' % 1 }}", "'%'"),
    ("{{ '{:>100000000}'.format(1) }}", "format"),
    ("{{ 'x'.ljust(100000000) }}", "ljust"),
    ("{{ ('x' * 1000000) | replace('x', 'xxxxxxxxxxxxxxxxxxxx') }}", "replace"),
    ("{{ 10 ** 100000000 }}", "'\\*\\*'"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "the rendered text"),
    ("{{ __kvindex_render_budget }}", "may not name"),
    # found by review: each of these built 12-20 million characters, or repeated, without bound
    (A4M + "{{ ([a] * 4) | join | length }}", "the filter 'join' would build"),
    (A4M + "{{ ([a] * 4) | join(', ', attribute='x') | length }}", "the filter 'join' would build"),
    (A4M + "{{ ([a] * 4) | map('upper') | join | length }}", "the filter 'join' would build"),
    (A4M + "{{ ''.join([a] * 4) | length }}", "join would build"),
    (A4M + "{{ ''.join(([a] * 4) | map('upper')) | length }}", "join would build"),
    ("{% set l = [1] * 500000 %}{{ [l, l, l, l, l, l] | sum(start=[]) | length }}", "the filter 'sum' would build"),
    (A4M + "{{ [a, a, a] | string | length }}", "the filter 'string' would build"),
    (A4M + "{{ [a, a, a] | pprint | length }}", "No filter named 'pprint'"),  # removed: not bounded by its input
    (A4M + "{{ [a, a, a] | tojson | length }}", "the filter 'tojson' would build"),
    ("{{ [1] | tojson(indent=100000000) }}", "tojson's indent must be from 0 to 64"),
    ("{{ [1] | tojson(false, 100000000) }}", "tojson's indent must be from 0 to 64"),
    ("{{ [1] | tojson(indent=-1) }}", "tojson's indent must be from 0 to 64"),  # HF's: (ensure_ascii, indent)
    ("{% set ns = namespace(l=[1] * 100000) %}{% for i in range(20) %}{% set ns.l = [ns.l] %}{% endfor %}"
     "{{ ns.l | tojson(indent=64) | length }}", "the filter 'tojson' would build"),  # 134M: a line per leaf
    (A4M + "{{ {'k': a, 'j': a, 'l': a} | xmlattr | length }}", "the filter 'xmlattr' would build"),
    ("{% set a = '&' * 4000000 %}{{ a | urlencode | length }}", "the filter 'urlencode' built 12000000"),  # grows 3x at most: checked after
    ("{% set a = '<' * 4000000 %}{{ a | forceescape | length }}", "the filter 'forceescape' built 16000000"),
    ("{{ ('ß' * 5000000) | upper | length }}", "the filter 'upper' built 10000000"),
    ("{{ [1] | batch(100000000, 0) | list | length }}", "the filter 'batch' would build"),
    ("{{ [1] | slice(100000000) | list | length }}", "the filter 'slice' into more than 100000 parts is refused"),
    ("{{ ('x'.encode() * 20000000) | length }}", "'\\*' would build"),
    ("{{ 'x'.encode().center(100000000) | length }}", "center would build"),
    (A4M + "{{ a.translate({120: 'yyy'}) | length }}", "translate would build"),
    (A4M + "{{ '{a}{a}{a}'.format_map({'a': a}) | length }}", "format_map would build"),
    (A4M + "{{ a | wordwrap(1, wrapstring='<br>') | length }}", "the filter 'wordwrap' of more than 262144"),
    ("{{ ('x' * 250000) | wordwrap(1, wrapstring='<br>' * 10) | length }}", "the filter 'wordwrap' would build"),
    ("{{ lipsum(1000000) | length }}", "lipsum would build"),
    ("{{ ('x' * 1000000).encode().replace('x'.encode(), ('y' * 20).encode()) | length }}", "replace would build"),
    ("{{ ('\t' * 1000000).encode().expandtabs(20) | length }}", "expandtabs would build"),
    ("{{ 'see example.com' | urlize }}", "urlize"),
    # found by a second review
    ("{{ lipsum(5, false, 20, 1000000.0) }}", "cannot be interpreted as an integer"),
    ("{% set l = [[1]] * 1000000 %}{{ l | sum(start=[]) | length }}", "the filter 'sum' of 1000000 sequences would copy"),
    ("{% for i in range(2100) recursive %}{% if loop.depth == 1 %}{{ loop(range(1000)) }}{% endif %}{% endfor %}",
     f"{MAX_RENDER_STEPS} steps"),
    ("{% set x = 2 ** 60000 %}{{ (x * x) | string | length }}", "'\\*' would build a number of more than 65536 bits"),
    ("{{ 3 ** 33000000 }}", "'\\*\\*' would build a number of more than 65536 bits"),
    ("{{ '{:>{w}}'.format('x', w=1000000000) }}", "nested"),
    ("{{ '%*d' % (100000000, 1) }}", "'\\*' width is refused"),
    (A4M + "{{ ('ab' * 8) | join(a) | length }}", "the filter 'join' would build"),
    (A4M + "{{ a.join('ab' * 8) | length }}", "join would build"),
    (A4M + "{% set d = {a: 1, a ~ 'y': 2, a ~ 'z': 3} %}{{ d | join | length }}", "the filter 'join' would build"),
    # found by a third review (scaled up to the full size: each built 1-32 GB)
    ("{{ '%(a())1000000000s' % {'a()': 1} }}", "'%' would build"),
    (A4M + "{{ ('%s' % {'a': a, 'b': a, 'c': a}) | length }}", "'%' would build"),
    ("{{ '{0[}]:>1000000000}'.format({'}': 1}) | length }}", "format would build"),
    ("{{ (('%f' * 30000) % ((1e308,) * 30000)) | length }}", "'%' would build"),  # 9.5 MB; 883 MB at 2.8M
    ("{{ ([''] * 1000000) | join(['y' * 1000]) | length }}", "the filter 'join' would build"),
    ("{% set s = ' ' * 8000000 %}{{ ([0] * 1000) | tojson(separators=(s, ':')) }}", "separators must be at most 64"),
    ("{{ ('x' * 10000) | replace('x', 10 ** 4000) | length }}", "the filter 'replace' would build"),
    ("{{ ['x' * 4000000] | replace('x', 'y' * 20) | length }}", "the filter 'replace' would build"),
    ("{{ (['%1000000000s'] | format(1)) | length }}", "the filter 'format' would build"),
    ("{{ ('x' * 1000000).translate(['y' * 200] * 200) | length }}", "translate would build"),
    ("{{ 'abc'.encode('punycode') }}", "codec 'punycode' is refused"),
    ("{% set a = 'x' * 4000000 %}{% set x %}{% for i in range(1000) %}{{ a ~ i }}{% endfor %}{% endset %}",
     "builds more than 134217728 characters or items in all"),
    ("{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% set ns.l = ns.l + ['x' * 8000000] %}{% endfor %}",
     "in all"),
    ("{% set a = 'x' * 8388000 %}{% for i in range(100000) %}{% set b = a ~ 'y' %}{% endfor %}", "in all"),
    ("{% set l = [''] * 4194000 %}{{ ([l] * 8000000) | map('int') | sum }}", "a list of at least 4194000 items"),
    ("{% set l = [''] * 1000000 %}{{ ([l] * 1000) | map('int') | sum }}", "in all"),  # each int() measures l
    # found by a fourth review
    ("{{ ('ab ' * 2000000).split() | length }}", "split would build a list of at least"),
    ("{{ ('\u4e2d' * 2000000) | list | length }}", "the filter 'list' would build a list"),
    ("{{ ('\u4e2d' * 2000000) | sort | length }}", "the filter 'sort' would build a list"),
    ("{% set l = ('\u4e2d' * 1000000) | list %}{% set m = ('\u4e2d' * 1000000) | list %}{% set n = ('x' * 1000000) | list %}",
     "in all"),
    ("{% set a = 'x' * 8000000 %}{% for i in range(20) %}{% for j in range(100000) %}{% if 'y' in a %}{% endif %}"
     "{% endfor %}{% endfor %}", "more than 10 s to render"),  # 2M scans of 8 MB: 200 s
    ("{{ ('x' * 8000000) | map('upper') | unique | list | length }}", f"{MAX_RENDER_STEPS} steps"),
    ("{% macro __kvindex_render_budget(k, it) %}{{ it }}{% endmacro %}{% for c in 'x' * 3000 %}{% endfor %}",
     "may not name"),
]


@pytest.mark.parametrize(("source", "match"), COSTLY)
def test_every_render_is_bounded(source: str, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's own (trusted) template too: each of these ran for minutes or built gigabytes.
    Where the bound expected is not the clock, the 10 s deadline is moved out of the way: on a slow
    machine 2M steps take longer than 10 s, and the clock would answer first."""
    if "s to render" not in match:
        monkeypatch.setattr(template_budget, "MAX_RENDER_SECONDS", 600.0)
    with pytest.raises(ChatTemplateError, match=match) as info:
        ChatTemplates(source, {}).render({"messages": HI})
    assert "\n" not in str(info.value)


A1M = "{% set a = 'x' * 1000000 %}"
BUILT_FIRST = [  # each builds 20-48 MB when its check comes after the value is built
    A1M + "{% set x %}{% for i in range(20) %}{{ a }}{% endfor %}{% endset %}{{ x | length }}",
    A1M + "{% macro m() %}{% for i in range(20) %}{{ a }}{% endfor %}{% endmacro %}{{ m() | length }}",
    A1M + "{{ ('%s' % ([a] * 20,)) | length }}",
    A1M + "{{ (('%(k)s' * 20) % {'k': a}) | length }}",
    A1M + "{{ ('{0}' * 20).format(a) | length }}",
    A1M + "{{ ([a] * 20) | trim | length }}",
    A1M + "{% set ns = namespace(v=a) %}{{ ([ns] * 20) | join | length }}",
    A1M + "{% set d = {'k': [a] * 20} %}{{ (d.values() ~ '') | length }}",
    A1M + "{{ (a | safe).replace('x', 'y' * 20) | length }}",
    A1M + "{{ (a | safe) | replace('x', 'y' * 20) | length }}",
    "{% set s = 'a\n' * 500000 %}{{ s | indent(first=true, width=40) | length }}",
    A1M + "{{ ([a] * 48) | join | length }}",
    A1M + "{{ ''.join([a] * 48) | length }}",
    A1M + "{{ ''.join(([a] * 48) | map('lower')) | length }}",
    A1M + "{% set l = [[1] * 1000000] * 48 %}{{ l | sum(start=[]) | length }}",
    A1M + "{{ ([a] * 48) | string | length }}",
    A1M + "{{ ([a] * 48) | tojson | length }}",
    A1M + "{{ a.translate({120: 'y' * 48}) | length }}",
    A1M + "{{ a | wordwrap(1, wrapstring='y' * 47) | length }}",
]


@pytest.mark.parametrize("source", BUILT_FIRST)
def test_a_costly_value_is_refused_before_it_is_built(source: str) -> None:
    """A check on the result alone would refuse these only once the 48 MB were allocated."""
    import tracemalloc

    template = ChatTemplates(source, {})
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError, match="would build|in all|is refused"):  # measured first
            template.render({"messages": HI})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


BENIGN = [
    "{{ 'abcb' | replace('b', 'X') }}|{{ 'abcb' | replace('b', 'X', 1) }}|{{ 'ab'.replace('b', 'Y') }}",
    "{{ 'the quick brown fox jumps' | wordwrap(9) }}|{{ 'a b c d' | wordwrap(3, wrapstring='<br>') }}",
    "{{ [1, 'a', [2]] | join(', ') }}|{{ [{'x': 'p'}, {'x': 'q'}] | join('-', attribute='x') }}|{{ '+'.join(['u', 'v']) }}",
    "{{ [1, 2, 3] | sum }}|{{ [[1], [2]] | sum(start=[]) }}|{{ [{'n': 2}, {'n': 5}] | sum(attribute='n') }}",
    "{{ {'b': [1, {'c': 'd'}], 'a': None} | tojson }}|{{ [1, [2]] | tojson(indent=2) }}",
    "{{ [1, 'x'] | string }}|{{ {'class': 'm', 'id': 3} | xmlattr }}|{{ {'q': 'a b&c'} | urlencode }}|{{ 'a/b c' | urlencode }}",
    "{{ [1, 2, 3, 4, 5] | batch(2, 0) | list }}|{{ [1, 2, 3, 4, 5] | slice(2, 9) | list }}|{{ 'ab' | list }}",
    "{{ 'a\nb' | indent(2, true) }}|{{ 'x' | center(7) }}|{{ '%s=%05d' | format('k', 42) }}|{{ 'long text here' | truncate(9, true, '..', 0) }}",
    "{{ [3, 1, 2] | sort | list }}|{{ [1, 1, 2] | unique | list }}|{{ [{'r': 'u'}, {'r': 'a'}] | map(attribute='r') | join }}",
    "{{ {'b': 1, 'a': 2} | dictsort }}|{{ [{'g': 1}, {'g': 2}, {'g': 1}] | groupby('g') | map('first') | list }}",
    "{{ [4, 9] | min }}{{ [4, 9] | max }}|{{ [4, 9] | first }}{{ [4, 9] | last }}|{{ '<b>' | e }}{{ '<i>' | forceescape }}",
    "{{ 'ab'.center(6, '*') }}|{{ 'a\tb'.expandtabs(4) }}|{{ 'abc'.translate({97: 'zz'}) }}|{{ '{}-{x}'.format(1, x=2) }}",
    "{{ 'x'.encode() * 3 }}|{{ '%d'.encode() % 5 }}|{{ 'ab'.encode().center(6) }}|{{ 'Title me' | title }}{{ 'up' | upper }}",
    "{{ 'a\tb'.encode().expandtabs(4) }}|{{ 'abcb'.encode().replace('b'.encode(), 'XY'.encode()) }}|{{ 'x\ny' | indent('> ') }}",
]


@pytest.mark.parametrize("source", BENIGN)
def test_the_bounds_change_no_answer(source: str) -> None:
    """Differential: every filter and method the bounds wrap renders exactly as Jinja's own
    sandbox renders it (a wrapper once dropped the environment argument of ``replace`` and
    ``wordwrap``: ``| replace(...)`` failed in every template that used it)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from adapters.template_bounds import BoundedSandbox, compile_bounded, render_bounded

    options = {"trim_blocks": True, "lstrip_blocks": True}
    env = BoundedSandbox(**options)
    want = ImmutableSandboxedEnvironment(**options).from_string(source).render()
    assert render_bounded(compile_bounded(env, env.parse(source)), {}) == want


def test_the_chat_tojson_is_bounded_and_answers_as_json_dumps() -> None:
    """The chat environment's ``tojson`` (HF's signature, set after the sandbox is made) is bounded
    like every filter and answers ``json.dumps``'s text."""
    value = {"b": [1, {"c": "é"}], "a": None}
    source = "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ v | tojson(true, 1, sort_keys=true) }}"
    want = "|".join((json.dumps(value, ensure_ascii=False), json.dumps(value, ensure_ascii=False, indent=2),
                     json.dumps(value, ensure_ascii=True, indent=1, sort_keys=True)))
    assert ChatTemplates("{% set v = " + json.dumps(value).replace("null", "none") + " %}" + source, {}).render(
        {"messages": HI}) == want


def test_the_bounds_leave_large_real_chats_alone(tmp_path: Path) -> None:
    tok = HFTokenizer.load(TINY)
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello " * 20} for i in range(20_000)]
    text = tok.render({"messages": many})
    assert len(text) > 2_000_000 and text.count("<|user|>") == 10_000
    assert MAX_RENDER_CHARS == 8 << 20


def test_a_body_template_counts_into_the_inline_threshold() -> None:
    body = {"messages": HI, "chat_template": "{# #}" * INLINE_CHARS}
    assert _body_chars(body) > INLINE_CHARS >= _body_chars({"messages": HI})


class Clock:
    """``strftime_now``'s clock, set by the test (the module's ``datetime``, replaced)."""

    def __init__(self, now: str) -> None:
        self.at = now

    def now(self) -> Any:
        from datetime import datetime
        return datetime.fromisoformat(self.at)


async def test_a_template_that_reads_the_date_is_cached_per_date(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock("2026-12-01T23:59:00")
    monkeypatch.setattr(chat_template, "datetime", clock)  # the clock, not the unit under test
    dated = HFTokenizer.load(tiny_with(tmp_path, "Today: {{ strftime_now('%d %b %Y') }} {{ messages[0]['content'] }}"))
    cached = CachingTokenizer(dated)
    before = await cached.tokenize("tiny", {"messages": HI})
    assert await cached.tokenize("tiny", {"messages": HI}) == before and cached.hits == 1
    clock.at = "2026-12-02T00:00:01"
    after = await cached.tokenize("tiny", {"messages": HI})
    assert after != before and after == dated.tokenize_now({"messages": HI}) and cached.misses == 2
    assert dated.cache_epoch("tiny", {"messages": HI}) == "02 Dec 2026"
    assert dated.cache_epoch("tiny", {"prompt": "x"}) == ""
    plain = HFTokenizer.load(TINY)
    assert plain.cache_epoch("tiny", {"messages": HI}) == ""  # no clock: one key for ever


@pytest.mark.parametrize(("table", "key"), [
    ({"tokenizer_path": "/nonexist"}, "tokenizer_path"),
    ({"tokenizer": "engine", "tokenize_url": "http://h:1", "tokenizer_path": "/x"}, "tokenizer_path"),
    ({"tokenizer": "llmd-sim", "trust_request_chat_template": True}, "trust_request_chat_template"),
    ({"tokenizer": "render", "tokenize_url": "http://h:1", "trust_request_chat_template": True},
     "trust_request_chat_template"),
])
def test_hf_keys_are_refused_for_other_tokenizers(table: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=rf'\[models\.x\].*{key} is read only by tokenizer = "hf"'):
        config_from_toml({"models": {"x": table}})


def test_trust_request_chat_template_is_read_and_typed() -> None:
    cfg = config_from_toml({"models": {"x": {"tokenizer": "hf", "tokenizer_path": str(TINY),
                                             "trust_request_chat_template": True}}})
    assert cfg.models["x"].trust_request_chat_template is True
    assert ModelConfig().trust_request_chat_template is False
    with pytest.raises(ConfigError, match="trust_request_chat_template"):
        config_from_toml({"models": {"x": {"tokenizer": "hf", "tokenizer_path": str(TINY),
                                           "trust_request_chat_template": "yes"}}})
