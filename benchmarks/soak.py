"""kvindex soak: 64 simulated engine replicas under steady load for ten minutes; RSS over time, lag, drift.

One ``kvindex serve`` process subscribes to N simulated vLLM engines (the block-cache simulator of
kvindex/engine_sim.py behind a real ZeroMQ PUB socket and replay endpoint each, in this process).
A router loop sends requests from a tenant-shaped prompt mix: it scores each one (``/v1/score``),
routes it to the pod with the best approximate score (ties: round robin), the chosen engine admits
it (publishing its KV events), and the router reports the decision (``/v1/decisions``) with the
engine's ``cached_tokens``. Every ``--sample`` seconds it records the daemon's RSS, open fds, the
worst ingest lag (``kvindex_ingest_lag_seconds``), how far each pod's last applied seq trails the
engine's, and the drift summary. Once the engines' caches and the approximate LRUs are full, RSS
must stay flat: the report compares the first and the last minute.

    python benchmarks/soak.py                      # 64 replicas, 10 minutes
    python benchmarks/soak.py --replicas 8 --minutes 1 --out soak.json

Results: benchmarks/results/soak-<timestamp>.json (or --out) and a summary on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import zmq.asyncio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvindex.tools.engine_sim import SimulatedCache, encode_batch
from kvindex.tools.fake_engine import FakeEngine

BLOCK = 16
MODEL = "soak"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=64, help="simulated engines (default 64)")
    p.add_argument("--minutes", type=float, default=10.0, help="duration (default 10)")
    p.add_argument("--rps", type=float, default=200.0, help="router requests per second, all pods (default 200)")
    p.add_argument("--num-blocks", type=int, default=2000, help="KV blocks per engine (default 2000)")
    p.add_argument("--lru", type=int, default=5000, help="approximate index maxHashCacheSize per pod (default 5000)")
    p.add_argument("--sample", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/soak-<timestamp>.json)")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Engine:
    """One simulated replica: its block cache and its publisher."""

    def __init__(self, i: int, num_blocks: int, ctx: zmq.asyncio.Context) -> None:
        self.pod = f"soak-{i}"
        self.cache = SimulatedCache(num_blocks, BLOCK, hash_seed=0)
        self.pub_port, self.rep_port = free_port(), free_port()
        self.fake = FakeEngine(f"tcp://127.0.0.1:{self.pub_port}", replay_endpoint=f"tcp://127.0.0.1:{self.rep_port}",
                               context=ctx)
        self.topic = f"kv@{self.pod}@{MODEL}".encode()
        self.seq = -1

    async def admit(self, tokens: list[int]) -> int:
        adm = self.cache.admit(tokens)
        if adm.events:
            self.seq += 1
            await self.fake.publish((self.topic, self.seq.to_bytes(8, "big"), encode_batch(adm.events, time.time())))
        return adm.cached_tokens


class Prompts:
    """Tenants with long system prompts, each with a few multi-turn conversations that grow."""

    def __init__(self, seed: int = 0, tenants: int = 40) -> None:
        self.rng = random.Random(seed)
        self.systems = [[self.rng.randrange(10, 30000) for _ in range(self.rng.randrange(200, 1200))]
                        for _ in range(tenants)]
        self.chats: list[list[int]] = []

    def next(self) -> list[int]:
        r = self.rng.random()
        if self.chats and r < 0.5:  # continue a conversation
            i = self.rng.randrange(len(self.chats))
            self.chats[i] = self.chats[i] + [self.rng.randrange(10, 30000) for _ in range(self.rng.randrange(20, 200))]
            if len(self.chats[i]) > 6000:
                self.chats[i] = self.chats[i][:1000]
            return self.chats[i]
        prompt = self.rng.choice(self.systems) + [self.rng.randrange(10, 30000) for _ in range(self.rng.randrange(20, 400))]
        if r < 0.8:
            self.chats.append(prompt)
            if len(self.chats) > 500:
                self.chats.pop(0)
        return prompt


def metric_max(text: str, name: str) -> float | None:
    vals = [float(m.group(1)) for m in re.finditer(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)]
    return max(vals) if vals else None


async def run(a: argparse.Namespace) -> dict:
    ctx = zmq.asyncio.Context()
    engines = [Engine(i, a.num_blocks, ctx) for i in range(a.replicas)]
    for e in engines:
        await e.fake.start()
    port = free_port()
    cfg = Path(f"/tmp/kvindex-soak-{os.getpid()}.toml")
    lines = ["[server]", f"port = {port}", "", f'[approx]\nmaxHashCacheSize = {a.lru}', "",
             f'[models."{MODEL}"]', f"block_size = {BLOCK}", ""]
    for e in engines:
        lines += ["[[engines]]", f'endpoint = "tcp://127.0.0.1:{e.pub_port}"',
                  f'replay = "tcp://127.0.0.1:{e.rep_port}"', f"block_size = {BLOCK}", ""]
    cfg.write_text("\n".join(lines))
    daemon = subprocess.Popen([sys.executable, "-m", "kvindex", "--log-level", "WARNING", "serve", "--config", str(cfg)],
                              cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    samples: list[dict] = []
    sent = 0
    prompts = Prompts()
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(url + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.5)  # engines connected, subscriptions through (slow joiner)
            t0 = time.monotonic()
            next_sample = t0
            pods = [e.pod for e in engines]
            rr = 0
            while (now := time.monotonic()) - t0 < a.minutes * 60:
                if now >= next_sample:
                    samples.append(await sample(s, url, daemon.pid, engines, now - t0, sent))
                    last = samples[-1]
                    print(f"t={last['t']:6.0f}s rss={last['rss_mib']:7.1f} MiB fds={last['fds']} "
                          f"lag={last['lag_seconds']} behind={last['max_seq_behind']} drift={last['drift_mean']}",
                          flush=True)
                    next_sample += a.sample
                tokens = prompts.next()
                async with s.post(url + "/v1/score", json={"model": MODEL, "token_ids": tokens,
                                                           "prompt": " ".join(map(str, tokens[:2000]))}) as r:
                    answer = await r.json()
                best = max(pods, key=lambda p: (answer["pods"].get(p, {}).get("approx", {}).get("score", 0),
                                                -((pods.index(p) - rr) % len(pods))))
                rr += 1
                engine = engines[pods.index(best)]
                cached = await engine.admit(tokens)
                async with s.post(url + "/v1/decisions", json={
                        "pod": best, "request": {"model": MODEL, "prompt": " ".join(map(str, tokens[:2000]))},
                        "token_ids": tokens, "cached_tokens": cached, "prompt_tokens": len(tokens)}) as r:
                    await r.read()
                sent += 1
                await asyncio.sleep(max(0.0, t0 + sent / a.rps - time.monotonic()))
            samples.append(await sample(s, url, daemon.pid, engines, time.monotonic() - t0, sent))
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        for e in engines:
            await e.fake.close()
        ctx.term()
        cfg.unlink(missing_ok=True)
    return report(a, samples, sent)


async def sample(s: aiohttp.ClientSession, url: str, pid: int, engines: list[Engine], t: float, sent: int) -> dict:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    async with s.get(url + "/v1/pods") as r:
        pods = {p["pod"]: p for p in (await r.json())["pods"]}
    async with s.get(url + "/v1/drift?window=60") as r:
        drift = await r.json()
    behind = [e.seq - (pods.get(e.pod, {}).get("last_seq") or -1) for e in engines if e.seq >= 0]
    overall = drift.get("overall", {})
    return {"t": round(t, 1), "requests": sent, "rss_mib": round(rss_kib(pid) / 1024, 1),
            "fds": len(os.listdir(f"/proc/{pid}/fd")), "lag_seconds": metric_max(text, "kvindex_ingest_lag_seconds"),
            "max_seq_behind": max(behind, default=0), "unsynced": sum(not p.get("synced", True) for p in pods.values()),
            "blocks_gpu": sum(p["blocks"]["gpu"] for p in pods.values()),
            "approx_entries": sum(p["approx_entries"] for p in pods.values()),
            "drift_mean": overall.get("drift"), "stale_fraction": overall.get("stale_fraction"),
            "drift": overall}


def report(a: argparse.Namespace, samples: list[dict], sent: int) -> dict:
    def window(lo: float, hi: float) -> list[float]:
        return [x["rss_mib"] for x in samples if lo <= x["t"] <= hi]

    end = samples[-1]["t"] if samples else 0
    first, last = window(0, 60), window(end - 60, end)
    doc = {"args": {k: str(v) for k, v in vars(a).items()}, "requests": sent, "samples": samples,
           "rss_first_minute_mib": first, "rss_last_minute_mib": last,
           "rss_growth_last_minute_mib": round(max(last) - min(last), 1) if last else None}
    print(f"\nRSS first minute (MiB): {first}\nRSS last minute (MiB):  {last}")
    print(f"requests {sent}; max lag {max((x['lag_seconds'] or 0) for x in samples):.3f}s; "
          f"max seq behind {max(x['max_seq_behind'] for x in samples)}; unsynced at end {samples[-1]['unsynced']}")
    return doc


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    doc = asyncio.run(run(a))
    out = a.out or ROOT / "benchmarks" / "results" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
