"""``python -m kvindex.tools.openai_fleet --replicas N --model M ...``: N simulated vLLM engines
(``kvindex.tools.openai_engine``) in one process (uvloop when importable), printed as one JSON
line ``{"model", "engines": [{"pod", "url", "address", "kv_endpoint", "replay_endpoint"}]}``,
running until SIGINT or SIGTERM; every engine and the ZeroMQ context closed on the way out."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence

import zmq.asyncio

from kvindex import loops
from kvindex.tools.demo_replica import BLOCK_SIZE
from kvindex.tools.openai_api import dumps
from kvindex.tools.openai_engine import EngineOptions, OpenAIEngine

log = logging.getLogger("kvindex.tools.openai_fleet")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvindex.tools.openai_fleet",
                                description="Simulated vLLM engines: OpenAI HTTP API plus KV events over ZeroMQ.")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--model", required=True)
    p.add_argument("--cache-blocks", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    p.add_argument("--prefill-us-per-token", type=float, default=0.0)
    p.add_argument("--decode-us-per-token", type=float, default=0.0)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--metrics-padding-lines", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port-base", type=int, default=0, help="engine i listens on PORT_BASE+i (0: free ports)")
    p.add_argument("--pod-prefix", default="sim", help="engine i is pod PREFIX-i")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    return args


def cli_options(args: argparse.Namespace, i: int) -> EngineOptions:
    return EngineOptions(
        pod=f"{args.pod_prefix}-{i}", model=args.model, cache_blocks=args.cache_blocks, block_size=args.block_size,
        host=args.host, port=args.port_base + i if args.port_base else 0,
        prefill_seconds_per_token=args.prefill_us_per_token / 1e6,
        decode_seconds_per_token=args.decode_us_per_token / 1e6,
        max_running=args.max_running, metrics_padding_lines=args.metrics_padding_lines)


@contextlib.asynccontextmanager
async def running_engines(args: argparse.Namespace) -> AsyncIterator[list[OpenAIEngine]]:
    """Every engine of ``args`` started; all closed (and the context terminated) on the way out."""
    ctx = zmq.asyncio.Context()
    engines: list[OpenAIEngine] = []
    try:
        for i in range(args.replicas):
            engine = OpenAIEngine(cli_options(args, i), ctx)
            engines.append(engine)
            await engine.start()
        yield engines
    finally:
        for engine in engines:
            await engine.close()
        ctx.destroy(linger=0)


async def wait_for_signal() -> None:
    """Until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    sigs = (signal.SIGINT, signal.SIGTERM)
    for sig in sigs:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)


async def serve(args: argparse.Namespace) -> int:
    """Start the engines, print them as one JSON line, run until a signal. 1 if one cannot start."""
    try:
        async with running_engines(args) as engines:
            line = {"model": args.model, "engines": [e.describe() for e in engines]}
            sys.stdout.write(dumps(line) + "\n")
            sys.stdout.flush()
            await wait_for_signal()
    except (OSError, zmq.ZMQError, ValueError) as exc:
        log.error("cannot start the engines: %s", exc)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    with asyncio.Runner(loop_factory=loops.factory("auto")[1]) as runner:
        return runner.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
