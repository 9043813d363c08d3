"""What requests name cannot grow /metrics or the memory kvindex keeps.

- Labels: a model or pod id a request carries is a label value only when it is known (configured,
  registered, seen in an engine's events, or one of a few pods decisions named); every other is
  counted under "other". Checked with many distinct huge names through the HTTP API.
- Bytes: every cache and memory a request feeds is bounded by bytes (``kvindex.budget``), checked
  on a real ``kvindex serve`` (its RSS, /proc/PID/status) and by the caches' own accounting.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from adapters.llmd_sim import SimTokenizer
from kvindex.budget import ByteLRU
from kvindex.config import Config, ModelConfig
from kvindex.limits import MAX_ID_CHARS, MAX_MODEL_CHARS
from kvindex.metrics import MAX_LABEL_CHARS, OTHER
from kvindex.query.service import SCORE_MEMORY_BYTES
from kvindex.tokenize import CachingTokenizer
from tests.conftest import engine_config, ipc_endpoint
from tests.test_cli import KVINDEX, free_port

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # several approximate blocks


async def post_json(h: Any, path: str, body: Any) -> tuple[int, Any]:
    """A body over aiohttp's 1 MiB "large body" warning, streamed from a buffer."""
    data = io.BytesIO(json.dumps(body).encode())
    async with h.session.post(h.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, json.loads(await r.read())


async def post_big(h: Any, path: str, body: Any) -> int:
    return (await post_json(h, path, body))[0]


def label_values(text: str, name: str) -> set[str]:
    return {s.labels[name] for fam in text_string_to_metric_families(text) for s in fam.samples if name in s.labels}


async def test_request_named_models_and_pods_do_not_become_labels(make_harness: Any, make_engine: Any,
                                                                  tmp_path: Path) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    cfg = Config(engines=(engine_config(engine, pod="engine-pod", model="engine-model"),),
                 models={"known-model": ModelConfig()})
    h = await make_harness(cfg)
    big_model, big_pod = MAX_MODEL_CHARS, MAX_ID_CHARS  # the longest names accepted (kvindex.limits)
    for i in range(20):  # unauthenticated scores naming huge unknown models (and pods)
        status, _ = await h.post("/v1/score", {"model": f"{i}".ljust(big_model, "m"), "prompt": PROMPT,
                                               "token_ids": [1, 2, 3], "pods": [f"{i}".ljust(big_pod, "p")]})
        assert status == 200
    for model in ("known-model", "engine-model"):
        status, _ = await h.post("/v1/score", {"model": model, "prompt": PROMPT})
        assert status == 200
    for i in range(20):  # decisions (no token configured: anyone may write) naming huge pods and models
        status, d = await h.post("/v1/decisions", {"pod": f"{i}".ljust(big_pod, "d"),
                                                   "request": {"model": f"{i}".ljust(big_model, "n"), "prompt": PROMPT},
                                                   "cached_tokens": 3, "prompt_tokens": 10})
        assert status == 200, d
    for i in range(230):  # many distinct short pods (within the 256 decisions may add): only the first few are labels
        status, d = await h.post("/v1/decisions", {"pod": f"router-pod-{i}", "request": {"model": "m", "prompt": PROMPT},
                                                   "cached_tokens": 3, "prompt_tokens": 10})
        assert status == 200, d
    status, text = await h.get("/metrics")
    assert status == 200
    print(f"/metrics: {len(text)} bytes after 40 long-named requests and 250 decisions")
    assert len(text) < 1 << 20, len(text)  # before: every name on every bucket line (78 MB)
    body = text.decode()
    models, pods = label_values(body, "model"), label_values(body, "pod")
    assert {"known-model", "engine-model", OTHER} <= models and len(models) <= 4, models  # 4: decisions' "m"
    assert OTHER in pods and len(pods) <= 64 + 2, len(pods)
    assert max(len(v) for v in models | pods) <= MAX_LABEL_CHARS
    ratio = {s.labels["model"] for fam in text_string_to_metric_families(body) if fam.name == "kvindex_approx_match_ratio"
             for s in fam.samples}
    assert ratio == {"known-model", "engine-model", OTHER}, ratio
    # what the API answers still names the request's own ids
    status, s = await h.post("/v1/score", {"model": "x" * MAX_MODEL_CHARS, "prompt": PROMPT, "pods": ["y" * MAX_ID_CHARS]})
    assert status == 200 and s["model"] == "x" * MAX_MODEL_CHARS and list(s["pods"]) == ["y" * MAX_ID_CHARS]


async def test_the_score_memory_keeps_a_byte_budget(make_harness: Any) -> None:
    h = await make_harness(Config())
    pods = [f"{i:05d}".ljust(MAX_ID_CHARS, "p") for i in range(10_000)]  # 10k long pod names per request (~2.5 MB)
    for i in range(20):
        assert await post_big(h, "/v1/score", {"model": "m", "token_ids": [i, 1, 2, 3], "pods": pods}) == 200
    memory = h.daemon.query.scores
    assert 0 < memory.bytes <= SCORE_MEMORY_BYTES and len(memory) < 20
    for i in range(50):  # small answers are still remembered next to the big ones
        await h.post("/v1/score", {"model": "m", "token_ids": [i, 9, 9, 9], "pods": ["a"]})
    assert memory.bytes <= SCORE_MEMORY_BYTES and len(memory) >= 50


async def test_the_tokenizer_cache_keeps_a_byte_budget() -> None:
    tok = CachingTokenizer(SimTokenizer(), budget=4 << 20)  # the real adapter behind it
    prompt = "word " * 20_000  # ~100 KB of text, 20k tokens: ~0.9 MB an entry
    for i in range(30):
        await tok.tokenize(f"model-{i}", {"prompt": prompt + str(i)})
    assert tok.bytes <= 4 << 20 and 0 < len(tok) < 30
    assert await tok.tokenize("model-29", {"prompt": prompt + "29"}) == SimTokenizer().tokenize_prompt(prompt + "29")
    assert tok.hits == 1


def test_byte_lru_evicts_least_recent_and_refuses_what_cannot_fit() -> None:
    lru: ByteLRU[str, int] = ByteLRU(budget=100, max_entries=10)
    for k in "abcd":
        assert lru.put(k, 1, 30)
    assert len(lru) == 3 and lru.bytes == 90 and lru.get("a") is None  # a was least recent
    assert lru.get("b") == 1  # b is now the most recent: c goes next
    assert lru.put("e", 1, 30) and lru.get("c") is None and lru.get("b") == 1
    assert not lru.put("b", 2, 101) and lru.get("b") is None and lru.bytes == 60  # too big: not kept, old dropped
    for i in range(20):
        lru.put(str(i), i, 1)
    assert len(lru) == 10 and lru.bytes == 10


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def post(url: str, body: Any) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
        return r.status


def test_hostile_names_do_not_grow_a_real_daemons_memory() -> None:
    """Huge model names (the key-root cache, the score memory's keys, the tokenizers) and 10k long
    pod names (the score memory): a real ``kvindex serve`` keeps its RSS within a fixed bound.
    Before: +306 MB after 40 huge model names, +282 MB after 30 requests with 10k long pods."""
    port = free_port()
    p = subprocess.Popen(KVINDEX + ["serve", "--port", str(port)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None, "serve did not come up"
                time.sleep(0.1)
        for i in range(3):  # warm up: the allocator's arenas for bodies this size
            post(base + "/v1/score", {"model": f"w{i}".ljust(MAX_MODEL_CHARS, "w"), "token_ids": [1, 2, 3]})
        before = rss_kib(p.pid)
        for i in range(2000):  # distinct model names of the longest length accepted
            assert post(base + "/v1/score", {"model": f"{i}".ljust(MAX_MODEL_CHARS, "m"), "token_ids": [1, 2, 3]}) == 200
        pods = [f"{j:05d}".ljust(MAX_ID_CHARS, "p") for j in range(10_000)]
        for i in range(30):
            assert post(base + "/v1/score", {"model": "m", "token_ids": [i, 1, 2, 3], "pods": pods}) == 200
        grown = (rss_kib(p.pid) - before) / 1024
        print(f"RSS grew {grown:.1f} MiB after 2000 long model names and 30 x 10k long pods")
        assert grown < 48 + SCORE_MEMORY_BYTES / (1 << 20), grown  # the score memory's budget plus slack
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


def refused(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


HUGE_NAME_BODIES = {  # endpoint -> a body naming a model of ``n`` characters (each refused with a 400)
    "/v1/score": lambda m: {"model": m, "token_ids": [1, 2, 3]},
    "/v1/approx/explain": lambda m: {"model": m, "prompt": PROMPT},
    "/v1/decisions": lambda m: {"pod": "p", "request": {"model": m, "prompt": PROMPT}},
    "/register": lambda m: {"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": m, "block_size": 16},
    "/query": lambda m: {"model_name": m, "token_ids": [1, 2, 3]},
}


def test_refused_huge_names_are_freed_with_their_answer() -> None:
    """7 MiB model names, each refused with a 400, on a real ``kvindex serve`` (uvloop, the
    collector paced for a server): the refused bodies are freed when the answer is sent.
    Before: the refusal kept its traceback, a cycle through the middleware's frame holding the
    request and its decoded body until the next collection (10 000 allocations away): RSS
    50 -> 759 MiB after 60 such /v1/score bodies, ~12 MiB a request."""
    port = free_port()
    p = subprocess.Popen(KVINDEX + ["serve", "--port", str(port)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None, "serve did not come up"
                time.sleep(0.1)
        before = rss_kib(p.pid)
        grown: dict[str, float] = {}
        for path, shape in HUGE_NAME_BODIES.items():
            for i in range(12):
                body = json.dumps(shape(f"{path}{i}".ljust(7 << 20, "m"))).encode()
                assert refused(base + path, body) == 400
            grown[path] = (rss_kib(p.pid) - before) / 1024
        print("RSS growth (MiB) after 12 refused 7 MiB model names per endpoint, cumulative:",
              {k: round(v, 1) for k, v in grown.items()})
        assert max(grown.values()) < 64, grown  # a few bodies' worth in flight at most, never one per request
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


async def test_queries_for_unknown_models_register_nothing_in_redis(make_harness: Any, redis_url: str) -> None:
    """Before: every model name a /v1/score or /query carried got a model id in Redis (and a cached
    key prefix in every replica), forever; now a model is registered only by what writes it."""
    import redis.asyncio as aioredis

    h = await make_harness(Config(store=redis_url))
    for i in range(200):
        status, _ = await h.post("/v1/score", {"model": f"junk-{i}".ljust(MAX_MODEL_CHARS, "j"), "token_ids": [1, 2, 3]})
        assert status == 200
        status, _ = await h.post("/query", {"model_name": f"junk-q-{i}", "token_ids": [1, 2, 3]})
        assert status == 200
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.hlen("kvi:mid") == 0
        await h.daemon.store.set_block_size("real", 16)  # what writes a model still registers it
        assert await client.hlen("kvi:mid") == 1
        status, s = await h.post("/v1/score", {"model": "real", "token_ids": list(range(40)), "pods": ["p"]})
        assert status == 200 and s["block_size"] == 16
    finally:
        await client.aclose()


async def test_the_drift_sample_keeps_a_byte_budget(make_harness: Any) -> None:
    """A decision keeps its prompt's token ids until the model's block size is known (no engine
    yet): 1M of them are 4 MB. The sample is bounded by bytes, the oldest leaving first."""
    h = await make_harness(Config())
    drift = h.daemon.drift
    drift.max_bytes = 16 << 20  # a small budget for the test (the default is DRIFT_SAMPLE_BYTES)
    tokens = list(range(1 << 20))
    for i in range(12):
        status, d = await post_json(h, "/v1/decisions", {"pod": f"p{i}", "request": {"model": "m", "prompt": PROMPT},
                                                         "token_ids": tokens, "cached_tokens": 0})
        assert status == 200, d
    assert 0 < drift.sample_bytes <= 16 << 20
    sampled = drift.decisions()
    assert 0 < len(sampled) < 12 and sampled[-1].pod == "p11"  # the newest stay
    for i in range(100):  # small decisions are sampled next to them, within the same budget
        await h.post("/v1/decisions", {"pod": "small", "request": {"model": "m", "prompt": PROMPT}})
    assert drift.sample_bytes <= 16 << 20 and drift.decisions()[-1].pod == "small"
