"""cProfile the hot paths on a benchmark workload; prints the top functions by own time.

  python benchmarks/hotspots.py ingest --replicas 8     decode + PreciseIndex.apply (in-process)
  python benchmarks/hotspots.py lane --replicas 8       EngineLane.handle (decode, seq, apply, metrics)
  python benchmarks/hotspots.py match --replicas 64     PreciseIndex.match, 512 keys
  python benchmarks/hotspots.py http --replicas 64      the /query and /query_by_hash handlers' work

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
    from kvindex.config import Config, EngineConfig
    from kvindex.daemon import Daemon

    daemon = Daemon(Config(port=0))
    engine = EngineConfig(endpoint="tcp://127.0.0.1:1", model=common.MODEL, block_size=common.BLOCK_SIZE)
    lane = daemon._make_lane(engine)

    async def feed() -> None:
        """Every message, in order, through the lane."""
        for topic, seq, payload in wl.messages:
            await lane.handle(Frame(topic, seq, payload))

    asyncio.run(feed())
    daemon.intake.ctx.term()


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


def prof_http(wl: common.Workload) -> None:
    """What /query and /query_by_hash do per request, minus aiohttp: parse, validate, key, match, answer."""
    from kvindex.approx.gojson import go_json_loads
    from kvindex.http.dynamo import query_answer
    from kvindex.index.approx import ApproxIndex
    from kvindex.index.memory import MemoryApproxStore, MemoryPreciseStore
    from kvindex.query import QueryService
    from kvindex.settings import ApproxConfig

    index, _ = inproc.kvindex_ingest(wl)
    qs = QueryService(MemoryPreciseStore(index), MemoryApproxStore(ApproxIndex(ApproxConfig())), lambda m: None, 1 << 20)
    bodies = [json.dumps({"token_ids": q["token_ids"], "model_name": common.MODEL}).encode() for q in _queries(wl)]

    async def answer_all() -> None:
        for _ in range(20):
            for raw in bodies:
                body = go_json_loads(raw)
                tokens = qs.check_token_ids(body["token_ids"])
                json.dumps(query_answer(await qs.precise(common.MODEL, tokens, None)))

    prof = cProfile.Profile()
    prof.enable()
    asyncio.run(answer_all())
    prof.disable()
    _print(prof)


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
