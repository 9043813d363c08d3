"""What the what-if costs (issue: shadow policies), measured in one run:

- **the request path**: ``RequestPath.route`` (what a request waits for) and ``finish`` (after its
  answer has passed: where every policy shadows it) on 8k-token chat bodies against 8 engines'
  candidates, with the shadows on and off, interleaved; p50 of each and the difference;
- **per decision**: ``Shadows.shadow`` alone over 8 candidates (all six policies, the what-if
  window and its counters);
- **replay-routing**: the shared Mooncake trace (12,031 requests) through 8 engines of 26,000
  blocks, all six policies, wall seconds.

``python benchmarks/whatif.py``; JSON to ``benchmarks/results/whatif.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zmq.asyncio  # noqa: E402

from benchmarks.common import RESULTS, machine  # noqa: E402
from benchmarks.gateway import MODEL, chat_bodies  # noqa: E402
from kvindex.config import Config, EngineConfig, ModelConfig  # noqa: E402
from kvindex.daemon import Daemon  # noqa: E402
from kvindex.route.scorers import Active, Candidate, Load  # noqa: E402
from kvindex.route.shadows import Shadows  # noqa: E402
from kvindex.route.usage import Usage  # noqa: E402
from kvindex.route.verdicts import Refused  # noqa: E402
from kvindex.settings import RouteSettings  # noqa: E402
from kvindex.tools.openai_engine import EngineOptions, OpenAIEngine  # noqa: E402
from kvindex.tools.replay_routing import ReplayOptions, read_trace, run  # noqa: E402

TRACE = ROOT / "fixtures" / "traces" / "mooncake_conversation_trace.jsonl.gz"


async def request_path(n: int, engines: int) -> dict[str, Any]:
    ctx = zmq.asyncio.Context()
    sims = [OpenAIEngine(EngineOptions(f"sim-{i}", MODEL, cache_blocks=4096), ctx) for i in range(engines)]
    for e in sims:
        await e.start()
    cfg = Config(engines=tuple(EngineConfig(e.kv_endpoint, pod=e.options.pod, model=MODEL, block_size=16,
                                            replay=e.replay_endpoint, url=e.url) for e in sims),
                 models={MODEL: ModelConfig(tokenizer="llmd-sim")}, ext_proc_port=0, port=0, host="127.0.0.1",
                 route=RouteSettings(seed=1))
    d = Daemon(cfg)
    await d.start()
    try:
        await asyncio.sleep(0.5)
        path = d.route.path
        await path.refresh()
        shadows = path.shadows
        bodies = chat_bodies(n, random.Random(1))
        times: dict[str, dict[str, list[float]]] = {k: {"route": [], "finish": []} for k in ("on", "off")}
        for i, body in enumerate(bodies):
            mode = ("on", "off")[i % 2]
            path.shadows = shadows if mode == "on" else None
            t0 = time.perf_counter()
            routed = await path.route(body, None, "pick")
            t1 = time.perf_counter()
            assert not isinstance(routed, Refused) and routed.destination is not None, routed
            address = routed.destination
            await path.finish(routed.id, address, 200, Usage(8000, 0))
            t2 = time.perf_counter()
            if i >= n // 10:  # the first tenth warms up
                times[mode]["route"].append(t1 - t0)
                times[mode]["finish"].append(t2 - t1)
        path.shadows = shadows
        out = {mode: {k: statistics.median(v) * 1e6 for k, v in t.items()} for mode, t in times.items()}
        out["route_added_us"] = out["on"]["route"] - out["off"]["route"]
        out["finish_added_us"] = out["on"]["finish"] - out["off"]["finish"]
        out["candidates"] = len(path.directory.endpoints())
        return out
    finally:
        await d.stop()
        for e in sims:
            await e.close()
        ctx.term()


def per_decision(n: int) -> float:
    from prometheus_client import CollectorRegistry

    shadows = Shadows.create(CollectorRegistry())
    rng = random.Random(2)
    cands = [Candidate(f"pod-{i}", float(rng.randrange(500)), 500, rng.randrange(128), 128, 16,
                       Load(float(rng.randrange(8)), rng.random()), (rng.randrange(500), 0, 0),
                       Active(rng.randrange(100), rng.randrange(400))) for i in range(8)]
    t0 = time.perf_counter()
    for i in range(n):
        shadows.shadow("pick", "precise", "pod-0", cands, i, 8000, 100)
    return (time.perf_counter() - t0) / n * 1e6


def replay_seconds() -> dict[str, Any]:
    trace = read_trace(TRACE)
    t0 = time.perf_counter()
    rows = run(trace, ["precise", "approx", "kthena", "load", "dynamo", "round_robin"], ReplayOptions(), progress=False)
    return {"seconds": time.perf_counter() - t0, "requests": len(trace), "policies": rows}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    return {"machine": machine(), "request_path": await request_path(args.requests, args.engines),
            "shadow_us_per_decision": per_decision(args.decisions), "replay": replay_seconds()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--decisions", type=int, default=20000)
    p.add_argument("--out", type=Path, default=RESULTS / "whatif.json")
    a = p.parse_args()
    r = asyncio.run(main(a))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(r, indent=1) + "\n")
    rp = r["request_path"]
    print(f"request path, {rp['candidates']} engines, 8k-token chats, p50: route {rp['off']['route']:.1f} us without "
          f"shadows, {rp['on']['route']:.1f} us with ({rp['route_added_us']:+.1f} us); finish {rp['off']['finish']:.1f} "
          f"-> {rp['on']['finish']:.1f} us ({rp['finish_added_us']:+.1f} us, after the answer has passed)")
    print(f"one decision shadowed by all six policies (8 candidates): {r['shadow_us_per_decision']:.1f} us")
    rr = r["replay"]
    print(f"replay-routing, {rr['requests']} requests, 8 engines, six policies: {rr['seconds']:.1f} s")
    for row in rr["policies"]:
        print(f"  {row['policy']:<12} hit rate {row['hit_rate']:.4f}  TTFT p50 {row['ttft_p50_s']:.3f} s  "
              f"p99 {row['ttft_p99_s']:.3f} s  requests/engine {row['requests_per_engine_max']}-"
              f"{row['requests_per_engine_min']}")
    print(f"wrote {a.out}")
