"""Traffic for the docker-compose deployment: a router in front of OpenAI-compatible engines.

For each request it asks kvindex (``POST /v1/score``) about every engine, sends the request to the
one with the highest approximate score (ties: the least recently used), and reports the decision
to kvindex (``POST /v1/decisions``) with the engine's ``usage.prompt_tokens_details.cached_tokens``
when the response has it. The prompts come from a few tenants with long shared system prompts,
multi-turn chats that grow, and one-off prompts, so caches fill, hit and evict.

usage: python deploy/traffic.py --kvindex http://kvindex:8080 --model sim-model \\
           --engine http://172.28.0.11:8000 --engine http://172.28.0.12:8000 [--rate 5] [--requests N]

An engine's pod id in kvindex is ``host:port`` of its URL, which is what llm-d-inference-sim and
vLLM put in their topic ``kv@<pod>@<model>`` when the topic names the pod that way (use --pod to
give another id: ``--engine URL=POD``). Standard library only; it runs in the kvindex image.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

WORDS = ("alpha bridge cable delta engine falcon garden harbor island jungle kettle lantern meadow needle orbit "
         "pepper quartz river saddle timber umbrella valley window yonder zephyr anchor beacon canyon dollar "
         "ember fabric glacier hollow ivory jasper kernel ledger marble nectar oyster pillar quiver ribbon "
         "summit thistle upland velvet willow").split()


def post(url: str, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Prompts:
    def __init__(self, tenants: int, seed: int, system_words: int) -> None:
        self.rng = random.Random(seed)
        self.systems = [f"You are the assistant of tenant {t}. " + self.words(system_words) for t in range(tenants)]
        self.chats: dict[int, str] = {}

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def next(self) -> str:
        roll = self.rng.random()
        if roll < 0.2:
            return "One-off question: " + self.words(self.rng.randint(40, 200))
        t = self.rng.randrange(len(self.systems))
        chat = self.chats.get(t, self.systems[t]) if roll < 0.7 else self.systems[t]
        prompt = f"{chat}\nUser: {self.words(self.rng.randint(5, 30))}\nAssistant:"
        self.chats[t] = prompt + " " + self.words(10) if len(prompt) < 6000 else self.systems[t]
        return prompt


class Router:
    def __init__(self, kvindex: str, model: str, engines: dict[str, str]) -> None:
        self.kvindex = kvindex.rstrip("/")
        self.model = model
        self.engines = engines  # pod id -> base URL
        self.last_used = {pod: 0.0 for pod in engines}

    def choose(self, prompt: str) -> tuple[str, dict[str, Any]]:
        pods = sorted(self.engines)
        try:
            answer = post(self.kvindex + "/v1/score", {"model": self.model, "prompt": prompt, "pods": pods})["pods"]
        except (OSError, ValueError, KeyError) as exc:  # kvindex down: route by recency alone
            print(f"traffic: score failed ({exc}); least recently used pod", file=sys.stderr)
            answer = {}

        def approx(p: str) -> float:
            return float(answer.get(p, {}).get("approx", {}).get("score", 0))

        pod = max(pods, key=lambda p: (approx(p), -self.last_used[p]))
        return pod, answer.get(pod, {})

    def send(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        pod, predicted = self.choose(prompt)
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens}
        usage = post(self.engines[pod] + "/v1/completions", body).get("usage") or {}
        self.last_used[pod] = time.monotonic()
        decision: dict[str, Any] = {"pod": pod, "request": {"model": self.model, "prompt": prompt}}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if isinstance(cached, int):
            decision["cached_tokens"] = cached
        if isinstance(usage.get("prompt_tokens"), int):
            decision["prompt_tokens"] = usage["prompt_tokens"]
        try:
            post(self.kvindex + "/v1/decisions", decision)
        except (OSError, ValueError) as exc:
            print(f"traffic: decision not recorded ({exc})", file=sys.stderr)
        return {"pod": pod, "cached": cached, "prompt_tokens": usage.get("prompt_tokens"),
                "predicted": (predicted.get("precise") or {}).get("tokens")}


def parse_engine(spec: str) -> tuple[str, str]:
    url, _, pod = spec.partition("=")
    parsed = urllib.parse.urlsplit(url)
    if not parsed.scheme or not parsed.netloc:
        raise argparse.ArgumentTypeError(f"engine {spec!r}: expected http://host:port[=pod]")
    return pod or parsed.netloc, url.rstrip("/")


def wait_ready(url: str, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=3) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"traffic: {what} not ready at {url} after {timeout:.0f}s")
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kvindex", required=True, help="kvindex base URL")
    p.add_argument("--model", required=True, help="model name the engines serve")
    p.add_argument("--engine", action="append", type=parse_engine, required=True, help="engine URL[=pod id]; repeatable")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (sequential; default 2)")
    p.add_argument("--requests", type=int, default=0, help="stop after this many (default: run forever)")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--system-words", type=int, default=300, help="length of each tenant's system prompt")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--wait", type=float, default=300, help="seconds to wait for kvindex and the engines")
    args = p.parse_args(argv)

    engines = dict(args.engine)
    wait_ready(args.kvindex.rstrip("/") + "/healthz", "kvindex", args.wait)
    for pod, url in engines.items():
        wait_ready(url + "/health", f"engine {pod}", args.wait)
    router = Router(args.kvindex, args.model, engines)
    prompts = Prompts(args.tenants, args.seed, args.system_words)
    sent = hits = 0
    while not args.requests or sent < args.requests:
        t0 = time.monotonic()
        try:
            r = router.send(prompts.next(), args.max_tokens)
        except (OSError, ValueError) as exc:
            print(f"traffic: request failed: {exc}", file=sys.stderr)
            time.sleep(1)
            continue
        sent += 1
        hits += bool(r["cached"])
        if sent % 20 == 0 or sent == args.requests:
            print(f"traffic: {sent} requests, {hits} with cached tokens; last: {r}", flush=True)
        time.sleep(max(0.0, 1.0 / args.rate - (time.monotonic() - t0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
