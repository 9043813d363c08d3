"""cProfile the hot paths on a benchmark workload; prints the top functions by own time.

  python benchmarks/hotspots.py ingest --replicas 8     decode + PreciseIndex.apply (in-process)
  python benchmarks/hotspots.py lane --replicas 8       EngineLane.handle (decode, seq, apply, metrics)
  python benchmarks/hotspots.py match --replicas 64     PreciseIndex.match, 512 keys
  python benchmarks/hotspots.py http --replicas 64      the server's side of /query, /query_by_hash, /v1/score
                                                        (aiohttp included) under e2e.py's HTTP client

Workloads come from the same cache as run.py (generated on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import inproc  # noqa: E402

from kvindex import keys as K  # noqa: E402
from kvindex.events import Frame  # noqa: E402


def prof_ingest(wl: common.Workload) -> None:
    """Decode + apply, as run.py measures it."""
    inproc.kvindex_ingest(wl)


def prof_lane(wl: common.Workload) -> None:
    """Every message through a real EngineLane (no socket), as the daemon would handle it."""
    from kvindex.config import Config
    from kvindex.daemon import Daemon

    daemon = Daemon(Config(port=0))

    async def feed() -> None:
        lane = daemon._make_lane(_engine())
        prof = cProfile.Profile()
        prof.enable()
        await _feed(lane, wl)
        prof.disable()
        _print(prof)

    asyncio.run(feed())
    daemon.intake.close()


async def _feed(lane, wl: common.Workload) -> None:  # noqa: ANN001 (an EngineLane)
    """Every message of the workload, in order, through the lane (no socket)."""
    for topic, seq, payload in wl.messages:
        await lane.handle(Frame(topic, seq, payload))


def _engine():
    """The engine config the workload's messages come from (never connected)."""
    from kvindex.config import EngineConfig

    return EngineConfig(endpoint="tcp://127.0.0.1:1", model=common.MODEL, block_size=common.BLOCK_SIZE)


def _queries(wl: common.Workload) -> list[dict]:
    """The 8 deepest 8k-token queries."""
    return common.pick_queries(wl, 8)


def prof_match(wl: common.Workload) -> None:
    """PreciseIndex.match on 512 keys, 50 rounds over 8 queries."""
    index, _ = inproc.kvindex_ingest(wl)
    keys = [K.prompt_keys(K.root_key(common.MODEL), q["token_ids"][:-1], common.BLOCK_SIZE) for q in _queries(wl)]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        for k in keys:
            index.match(k)
    prof.disable()
    _print(prof)


def prof_http(wl: common.Workload, repeat: int = 400) -> None:
    """A real daemon holding the workload (fed through a lane), its HTTP server profiled while
    e2e.py's client (its own process) sends the 8 deepest queries to every endpoint."""
    import e2e

    from kvindex.config import Config
    from kvindex.daemon import Daemon

    qfile = common.RESULTS / "queries_hotspots.json"
    qfile.write_text(json.dumps(_queries(wl)))

    async def serve() -> None:
        daemon = Daemon(Config(host="127.0.0.1", port=0))
        await daemon.start()
        try:
            await _feed(daemon._make_lane(_engine()), wl)
            prof = cProfile.Profile()
            prof.enable()
            await e2e.http_client_async(f"http://127.0.0.1:{daemon.port}", "kvindex", qfile, repeat)
            prof.disable()
            _print(prof)
        finally:
            await daemon.stop()

    common.run_daemon(serve())


def _print(prof: cProfile.Profile, top: int = 25) -> None:
    """Top functions by own time."""
    pstats.Stats(prof).strip_dirs().sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> None:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["ingest", "lane", "match", "http"])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--blocks", type=int, default=1_200_000)
    p.add_argument("--messages", type=int, default=4000, help="profile only the first N messages (ingest, lane; 0 = all)")
    a = p.parse_args(argv)
    wl = common.workload(a.replicas, a.blocks)
    if a.what in ("ingest", "lane"):
        wl = common.Workload(wl.path, wl.replicas, wl.messages[: a.messages or None], wl.sidecar)
        prof = cProfile.Profile()
        prof.enable()
        (prof_ingest if a.what == "ingest" else prof_lane)(wl)
        prof.disable()
        _print(prof)
    else:
        (prof_match if a.what == "match" else prof_http)(wl)


if __name__ == "__main__":
    main()
