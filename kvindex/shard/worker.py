"""A shard worker process (``kvindex serve --workers N``, N >= 2): owns some engines' lanes.

``python -m kvindex.shard.worker --channel ipc://PATH --settings JSON`` runs one worker. It binds a
ROUTER socket at ``--channel`` and answers the parent's requests (``kvindex.index.sharded``):
add or remove an engine lane, the precise index's read side (``match``, ``pods``, ...), writes
that come from HTTP (``clear_pod``, ``resync``), the pods' views and readiness problems, and its
own metrics as Prometheus text.

Invariants:
- A worker owns a ``MemoryPreciseStore`` and the lanes the parent added to it (ZeroMQ SUB,
  decode, apply: the same ``EngineLane`` code as the single process). Nothing else writes its
  index, so the pods it holds are exactly those its lanes feed.
- Frames: request ``[request id, msgpack [op, args]]`` plus ``match``'s keys as one raw frame of
  packed little-endian u64; reply ``[request id, msgpack {"ok": value} | {"error": "one line"}]``.
  Requests are answered in arrival order, except ``resync`` (it awaits the engine's replay),
  which runs in its own task.
- The worker exits when the parent asks (SIGTERM; SIGINT is left to the parent), and on its own
  when the parent is gone (its parent pid changed): it never outlives the daemon that started it,
  and then removes its ipc socket (and the channel directory, the last one out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import zlib
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest

from adapters import DIALECTS
from kvindex import loops
from kvindex.config import EngineConfig
from kvindex.drift import DriftAudit, DriftSettings
from kvindex.index.approx import ApproxConfig, ApproxIndex, ApproxSettings
from kvindex.index.memory import MemoryApproxStore, MemoryPreciseStore
from kvindex.ingest.fleet import Fleet
from kvindex.ingest.lane import EngineLane
from kvindex.ingest.streams import LaneSettings
from kvindex.logs import BurstLog
from kvindex.metrics import Metrics
from kvindex.pods import PodDirectory
from kvindex.sequence import StreamRef

log = logging.getLogger("kvindex.shard.worker")
PARENT_CHECK_SECONDS = 1.0


def owner_of(lane_key: str, workers: int) -> int:
    """The worker that owns a lane: stable across restarts and processes (CRC-32 of the key)."""
    return zlib.crc32(lane_key.encode()) % workers


def pack_keys(keys: Any) -> bytes:
    return array("Q", keys).tobytes()


def unpack_keys(raw: bytes) -> array:
    keys = array("Q")
    keys.frombytes(raw)
    return keys


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What a worker needs of the daemon's configuration (passed as JSON on its command line)."""

    replay_timeout: float = 2.0
    rcvhwm: int = 1_000_000
    store_buffer: int = 10_000
    max_message_bytes: int = 64 << 20

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSettings:
        return cls(**json.loads(text))


class Worker:
    """One worker: its lanes, its memory store, and the ROUTER socket answering the parent."""

    def __init__(self, channel: str, settings: WorkerSettings) -> None:
        self.channel = channel
        self.settings = settings
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.store = MemoryPreciseStore()
        self.ctx = zmq.asyncio.Context()
        self.ctx.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes)
        self._burst = BurstLog(logging.getLogger("kvindex.ingest.lane"))
        self.fleet = Fleet(self._make_lane)
        approx = MemoryApproxStore(ApproxIndex(ApproxConfig(ApproxSettings(), {})))
        self.pods = PodDirectory(self.fleet, self.store, approx, DriftAudit(self.store, approx, DriftSettings()))
        self._tasks: set[asyncio.Task[None]] = set()
        self._ops: dict[str, Callable[..., Awaitable[Any]]] = {
            "ping": self._ping, "add": self._add, "remove": self._remove, "pods": self._pods,
            "set_block_size": self.store.set_block_size, "block_size": self.store.block_size,
            "block_sizes": self.store.block_sizes, "blocks_held": self.store.blocks_held,
            "engine_hashes": self.store.engine_hashes, "clear_pod": self.store.clear_pod,
            "position": self._position, "views": self.pods.views, "problems": self.pods.readiness_problems,
            "lanes": self._lanes, "metrics": self._metrics, "stats": self._stats, "resync": self.fleet.resync,
        }

    def _make_lane(self, engine: EngineConfig) -> EngineLane:
        dialect = DIALECTS[engine.dialect]
        s = self.settings
        return EngineLane(engine, ctx=self.ctx, decoder=dialect.decoder(), first_seq=dialect.first_seq,
                          store=self.store, metrics=self.metrics,
                          settings=LaneSettings(replay_timeout=s.replay_timeout, rcvhwm=s.rcvhwm,
                                                store_buffer=s.store_buffer), burst=self._burst)

    # -- operations ----------------------------------------------------------------------------
    async def _ping(self) -> int:
        return os.getpid()

    async def _add(self, key: str, engine: dict[str, Any]) -> None:
        if key not in self.fleet.lanes():
            self.fleet.add(key, EngineConfig(**engine))

    async def _remove(self, key: str) -> bool:
        return await self.fleet.remove(key) is not None

    async def _pods(self) -> list[str]:
        return await self.store.pods()

    async def _position(self, ref: list[str]) -> list[Any] | None:
        pos = await self.store.position(StreamRef(*ref))
        return None if pos is None else [pos.last_seq, pos.epoch, pos.synced, pos.reason]

    async def _lanes(self) -> dict[str, dict[str, Any]]:
        """Per lane: connected, the listener's failure, the models it is behind on."""
        return {key: {"connected": lane.state.connected_peers, "failure": self.fleet.lane_task_failed(key),
                      "behind": sorted({st.model for st in lane.state.streams.values() if lane.behind(st.model)})}
                for key, lane in self.fleet.lanes().items()}

    async def _metrics(self) -> bytes:
        self.fleet.flush_metrics()
        return generate_latest(self.registry)

    async def _stats(self) -> dict[str, Any]:
        """Ingest totals (benchmarks): batches applied and the wall clock of the last one."""
        sts = [st for lane in self.fleet.lanes().values() for st in lane.state.streams.values()]
        return {"batches": sum(st.batches for st in sts), "gaps": sum(st.gaps for st in sts),
                "last_applied": max((st.last_applied or 0.0 for st in sts), default=0.0)}

    async def _match(self, keys: bytes, pods: list[str] | None, model: str | None) -> dict[str, list[Any]]:
        found = await self.store.match(unpack_keys(keys), pods, model=model)
        return {pod: [m.gpu, m.cpu, m.disk, m.dp] for pod, m in found.items()}

    # -- the channel ---------------------------------------------------------------------------
    async def _answer(self, sock: zmq.asyncio.Socket, frames: list[bytes], op: str, args: list[Any]) -> None:
        ident, rid = frames[0], frames[1]
        try:
            if op == "match":
                value = await self._match(frames[3], *args)
            else:
                value = await self._ops[op](*args)
            reply: dict[str, Any] = {"ok": value}
        except Exception as exc:  # every failure goes back to the parent as one line
            log.exception("worker request failed")
            reply = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        await sock.send_multipart([ident, rid, msgpack.packb(reply)])

    async def serve(self, stop: asyncio.Event) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.channel)
        watchdog = asyncio.create_task(_parent_watch(stop), name="parent watch")
        receiver = asyncio.create_task(self._receive(sock), name="parent requests")
        try:
            await stop.wait()
        finally:
            receiver.cancel()
            watchdog.cancel()
            await asyncio.gather(receiver, watchdog, return_exceptions=True)
            await self.fleet.close()
            for task in list(self._tasks):
                task.cancel()
            sock.close(linger=0)
            self.ctx.term()
            if watchdog.done() and not watchdog.cancelled():  # the parent is gone: nobody else cleans up
                _remove_channel(self.channel)

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                op, args = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
            except (IndexError, ValueError, msgpack.UnpackException):
                log.warning("worker: a malformed request (%d frames) ignored", len(frames))
                continue
            if op == "resync":  # awaits the engine's replay: the channel keeps answering meanwhile
                task = asyncio.create_task(self._answer(sock, frames, op, args))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                await self._answer(sock, frames, op, args)


def _remove_channel(channel: str) -> None:
    """The ipc socket file, and its directory once the last worker left it."""
    path = Path(channel.removeprefix("ipc://"))
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass  # another worker's socket is still there: the last one to leave removes it


async def _parent_watch(stop: asyncio.Event) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_SECONDS)
    log.error("the parent kvindex (pid %d) is gone: exiting", parent)
    stop.set()


async def run(channel: str, settings: WorkerSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # Ctrl-C reaches the whole process group: the parent handles it and stops its workers in order
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    await Worker(channel, settings).serve(stop)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvindex.shard.worker", description="a kvindex shard worker (internal: "
                                "started by kvindex serve --workers N)")
    p.add_argument("--channel", required=True, help="ipc:// endpoint to bind the ROUTER socket at")
    p.add_argument("--settings", default="{}", help="WorkerSettings as JSON")
    p.add_argument("--index", type=int, default=0, help="this worker's number (for logs)")
    p.add_argument("--log-level", default=os.environ.get("KVINDEX_LOG_LEVEL", "INFO"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s worker-{a.index} %(name)s: %(message)s")
    loops.run(run(a.channel, WorkerSettings.from_json(a.settings)), os.environ.get(loops.ENV, "auto"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
