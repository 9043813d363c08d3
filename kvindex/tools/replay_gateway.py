"""``kvindex replay-routing --gateway URL``: the trace's requests through a running ``kvindex
gateway`` (or any OpenAI endpoint) to real engines, with the engines' realized ``cached_tokens``.

Invariants:
- A request's prompt follows its ``hash_ids``: each id becomes the same ``WORDS_PER_BLOCK`` words
  every time (``h<id>w<j>``), so requests that share a prefix of ids share a prefix of text, and
  of tokens under any tokenizer that splits on spaces (llm-d-inference-sim's, kvindex's
  ``llmd-sim``). The prompt is that many words per block, not 512 tokens: the trace's sharing,
  scaled down.
- Sequential (one request at a time, in trace order, paced by ``speed`` when > 0): an answer that is
  not 200 is counted and the replay goes on.
- With ``kvindex`` (the gateway's kvindex HTTP URL) the what-if of the run follows the table:
  what every policy would have picked for the same requests (``GET /v1/whatif``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvindex.tools.replay_routing import TraceRequest, quantile

WORDS_PER_BLOCK = 32


def prompt_of(req: TraceRequest) -> str:
    return " ".join(f"h{h}w{j}" for h in req.hash_ids for j in range(WORDS_PER_BLOCK))


async def send_all(trace: Sequence[TraceRequest], url: str, model: str, speed: float = 0.0) -> dict[str, Any]:
    """Every request through ``url`` (an OpenAI base URL ending in /v1, or the server's root)."""
    base = url.rstrip("/")
    endpoint = base + ("/completions" if base.endswith("/v1") else "/v1/completions")
    prompt = cached = errors = 0
    latency: list[float] = []
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with aiohttp.ClientSession() as session:
        for req in trace:
            if speed > 0:
                await asyncio.sleep(max(0.0, start + req.t / speed - loop.time()))
            t0 = time.perf_counter()
            try:
                async with session.post(endpoint, json={"model": model, "prompt": prompt_of(req), "max_tokens": 1}) as r:
                    answer = await r.json(content_type=None) if r.status == 200 else None
            except (aiohttp.ClientError, ValueError):
                answer = None
            if not isinstance(answer, dict) or not isinstance(answer.get("usage"), dict):
                errors += 1
                continue
            latency.append(time.perf_counter() - t0)
            usage = answer["usage"]
            prompt += int(usage.get("prompt_tokens") or 0)
            cached += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    latency.sort()
    return {"requests": len(trace), "answered": len(latency), "errors": errors, "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": round(cached / prompt, 6) if prompt else None,
            "latency_p50_s": round(quantile(latency, 0.5), 6), "latency_p99_s": round(quantile(latency, 0.99), 6)}


async def whatif_of(kvindex: str, settle: float = 0.3, most: float = 5.0) -> dict[str, Any]:
    """The gateway's what-if once its count of decisions has not moved for ``settle`` seconds (an
    observer records a request just after its answer has passed), at most ``most`` seconds."""
    loop = asyncio.get_running_loop()
    deadline, last, doc = loop.time() + most, None, {}
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(kvindex.rstrip("/") + "/v1/whatif?window=86400") as r:
                doc = await r.json()
            if doc.get("decisions") == last or loop.time() > deadline:
                return doc
            last = doc.get("decisions")
            await asyncio.sleep(settle)


def whatif_table(w: dict[str, Any]) -> str:
    lines = [f"what-if over {w.get('decisions', 0)} decisions (predicted: the precise index's tokens on each "
             f"policy's pick at decision time):",
             f"  {'policy':<12} {'agrees':>8} {'hit rate':>9}"]
    actual = w.get("actual") or {}
    lines.append(f"  {'actual':<12} {'':>8} {actual.get('realized_hit_rate') or 0:9.4f}  (realized)")
    for name, row in (w.get("policies") or {}).items():
        lines.append(f"  {name:<12} {row['agreement'] or 0:8.1%} {row['predicted_hit_rate'] or 0:9.4f}")
    regret = w.get("regret") or {}
    lines.append(f"  regret of the actual picks: {regret.get('tokens', 0)} tokens "
                 f"({regret.get('fraction_of_prompt') or 0:.1%} of the prompt tokens)")
    return "\n".join(lines)


async def gateway_run(trace: Sequence[TraceRequest], url: str, model: str, speed: float,
                      kvindex: str | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    result = await send_all(trace, url, model, speed)
    return result, (await whatif_of(kvindex) if kvindex else None)
