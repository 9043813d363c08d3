"""A shard worker process (``kvindex serve --workers N``, N >= 2): owns some engines' lanes.

``python -m kvindex.shard.worker --channel PATH --settings JSON`` runs one worker. It listens on
the Unix socket ``--channel`` and answers the parent's requests (``kvindex.shard.channel``; the
parent's side is ``kvindex.shard.store`` and ``kvindex.shard.supervisor``): add or remove an engine
lane, every operation of the precise store (``Match``, ``Pods``, ..., ``Apply``, ``Restart``), the
pods' views and readiness problems, an operator's resync, and its own metrics as Prometheus text.

Invariants:
- A worker owns a ``MemoryPreciseStore`` and the lanes the parent added to it (ZeroMQ SUB,
  decode, apply: the same ``EngineLane`` code as the single process). Nothing else writes its
  index, so the pods it holds are exactly those its lanes feed.
- Messages are ``kvindex.shard.channel``'s, framed by ``kvindex.shard.frames``: a request that
  does not decode as one of ``REQUESTS`` is logged and dropped (its sender times out); a failing
  one is answered with ``Failed`` (one line); a connection whose framing breaks is logged and
  closed. Each connection's requests are answered in arrival order, except ``Resync`` (it awaits
  the engine's replay), which runs in its own task. When the worker stops, every connection is
  closed and its reader awaited; ``Resync`` answers are cancelled and awaited.
- The worker exits when the parent asks (SIGTERM; SIGINT is left to the parent), and on its own
  when the parent is gone (its parent pid changed): it never outlives the daemon that started it,
  and then removes its Unix socket (and the channel directory, the last one out).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest

from adapters.dialects import DIALECTS
from kvindex import loops
from kvindex.config import EngineConfig
from kvindex.query.drift import DriftAudit
from kvindex.index.approx import ApproxIndex
from kvindex.index.memory import MemoryApproxStore, MemoryPreciseStore
from kvindex.ingest.fleet import Fleet
from kvindex.ingest.lane import EngineLane
from kvindex.ingest.streams import LaneSettings
from kvindex.ingest.intake import Intake
from kvindex.logs import BurstLog, one_line_logs
from kvindex.lora import MAX_LEARNED_ADAPTERS
from kvindex.metrics import Metrics
from kvindex.pods import PodDirectory
from kvindex.sequence import Position
from kvindex.settings import ApproxConfig, ApproxSettings, DriftSettings
from kvindex.shard import channel as ch
from kvindex.shard.channel import WorkerSettings, unpack_keys
from kvindex.shard.frames import BrokenFraming, framed, read_message
from kvindex.types import PodMatch

log = logging.getLogger("kvindex.shard.worker")
PARENT_CHECK_SECONDS = 1.0


class Worker:
    """One worker: its lanes, its memory store, and the Unix socket answering the parent."""

    def __init__(self, channel: str, settings: WorkerSettings) -> None:
        self.channel = channel
        self.settings = settings
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.store = MemoryPreciseStore()
        self.intake = Intake.for_process(settings.max_message_bytes)  # the lanes' ZeroMQ context and SUB sockets
        self._burst = BurstLog(logging.getLogger("kvindex.ingest.lane"))
        self.fleet = Fleet(self._make_lane)
        approx = MemoryApproxStore(ApproxIndex(ApproxConfig(ApproxSettings(), {})))
        self.pods = PodDirectory(self.fleet, self.store, approx, DriftAudit(self.store, approx, DriftSettings()))
        self._tasks: set[asyncio.Task[None]] = set()  # Resync answers
        self._connections: dict[asyncio.StreamWriter, asyncio.Task[Any]] = {}  # each with its reader task
        self._lora: dict[EngineConfig, dict[tuple[str, str, str], None]] = {}  # per lane: its events' lora_names
        st = self.store
        self._ops: dict[type, Callable[[Any], Awaitable[Any]]] = {
            ch.Ping: self._ping, ch.AddLane: self._add, ch.RemoveLane: self._remove, ch.Lanes: self._lanes,
            ch.Resync: lambda r: self.fleet.resync(r.pod), ch.Views: lambda r: self.pods.views(),
            ch.Problems: lambda r: self.pods.readiness_problems(), ch.Metrics: self._metrics, ch.Stats: self._stats,
            ch.Apply: lambda r: st.apply(r.stream, r.seq, r.epoch, r.dp_rank, [ch.from_wire(e) for e in r.events],
                                         force=r.force),
            ch.Restart: self._restart, ch.GetPosition: lambda r: st.position(r.stream),
            ch.SetPosition: lambda r: st.set_position(r.stream, r.position),
            ch.ClearPod: lambda r: st.clear_pod(r.pod, r.dp_rank),
            ch.SetBlockSize: lambda r: st.set_block_size(r.model, r.block_size),
            ch.BlockSize: lambda r: st.block_size(r.model), ch.BlockSizes: lambda r: st.block_sizes(),
            ch.Pods: lambda r: st.pods(), ch.BlocksHeld: lambda r: st.blocks_held(r.pod),
            ch.EngineHashes: lambda r: st.engine_hashes(r.pod), ch.ExportEntries: lambda r: st.export_entries(),
            ch.LoadEntries: lambda r: st.load_entries(r.entries),
        }

    def _make_lane(self, engine: EngineConfig) -> EngineLane:
        dialect = DIALECTS[engine.dialect]
        s = self.settings
        seen = self._lora.setdefault(engine, {})
        lane = EngineLane(engine, intake=self.intake, decoder=dialect.decoder(), first_seq=dialect.first_seq,
                          store=self.store, metrics=self.metrics,
                          settings=LaneSettings(**msgspec.structs.asdict(s)),
                          burst=self._burst)
        lane.writer.on_lora = lambda pod, model, names: seen.update(  # no names: "" (the stream's model, a base)
            dict.fromkeys((pod, model, n) for n in (names or ("",)) if len(seen) < MAX_LEARNED_ADAPTERS))
        return lane

    # -- operations ----------------------------------------------------------------------------
    async def _ping(self, req: ch.Ping) -> int:
        return os.getpid()

    async def _add(self, req: ch.AddLane) -> None:
        if req.key not in self.fleet.lanes():
            self.fleet.add(req.key, req.engine)

    async def _remove(self, req: ch.RemoveLane) -> bool:
        lane = await self.fleet.remove(req.key)
        if lane is not None:
            self._lora.pop(lane.engine, None)
        return lane is not None

    async def _restart(self, req: ch.Restart) -> ch.Restarted:
        before = await self.store.position(req.stream) or Position()
        after = await self.store.restart(req.stream, req.seen_epoch, req.ranks)
        return ch.Restarted(after, before.epoch == req.seen_epoch)

    async def _lanes(self, req: ch.Lanes) -> dict[str, ch.LaneStatus]:
        """Per lane: connected, the listener's failure, the models it is behind on."""
        return {key: ch.LaneStatus(lane.state.connected_peers, self.fleet.lane_task_failed(key),
                                   tuple(sorted({st.model for st in lane.state.streams.values()
                                                 if lane.behind(st.model)})), tuple(self._lora.get(lane.engine, ())))
                for key, lane in self.fleet.lanes().items()}

    async def _metrics(self, req: ch.Metrics) -> bytes:
        self.fleet.flush_metrics()
        return generate_latest(self.registry)

    async def _stats(self, req: ch.Stats) -> dict[str, float]:
        """Ingest totals (benchmarks): batches applied and the wall clock of the last one."""
        sts = [st for lane in self.fleet.lanes().values() for st in lane.state.streams.values()]
        return {"batches": sum(st.batches for st in sts), "gaps": sum(st.gaps for st in sts),
                "last_applied": max((st.last_applied or 0.0 for st in sts), default=0.0)}

    async def _match(self, req: ch.Match, keys: bytes) -> dict[str, PodMatch] | None:
        """None when this worker's block size of the model is not the one the keys were chunked by."""
        if req.model is not None and req.block_size is not None:
            own = await self.store.block_size(req.model)
            if own is not None and own != req.block_size:
                return None
        return await self.store.match(unpack_keys(keys), req.pods, model=req.model)

    # -- the channel ---------------------------------------------------------------------------
    async def _answer(self, writer: asyncio.StreamWriter, frames: list[bytes], req: ch.Request[Any]) -> None:
        rid = frames[0]
        try:
            if isinstance(req, ch.Match):
                value = await self._match(req, frames[2])
            else:
                value = await self._ops[type(req)](req)
            reply: ch.Ok[Any] | ch.Failed = ch.Ok(value)
        except Exception as exc:  # every failure goes back to the parent as one line
            log.exception("worker request failed")
            reply = ch.Failed(f"{type(exc).__name__}: {exc}".splitlines()[0])
        if not writer.is_closing():
            writer.write(framed([rid, ch.encode(reply)]))

    async def serve(self, stop: asyncio.Event) -> None:
        server = await asyncio.start_unix_server(self._connection, path=self.channel)
        os.chmod(self.channel, 0o600)  # the parent's user only (its directory is the parent's mkdtemp)
        watchdog = asyncio.create_task(_parent_watch(stop), name="parent watch")
        try:
            await stop.wait()
        finally:
            server.close()
            watchdog.cancel()
            for task in list(self._tasks):  # Resync answers
                task.cancel()
            readers = list(self._connections.values())
            for writer in self._connections:  # each reader then sees the end of its stream and returns
                writer.close()
            await asyncio.gather(watchdog, *self._tasks, *readers, return_exceptions=True)
            await self.fleet.close()
            self.intake.close()
            if watchdog.done() and not watchdog.cancelled():  # the parent is gone: nobody else cleans up
                _remove_channel(self.channel)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One parent-side client's requests, answered in arrival order (``Resync`` in its own task)."""
        me = asyncio.current_task()
        assert me is not None
        self._connections[writer] = me  # closed at stop, not cancelled: asyncio's server logs a cancelled one
        try:
            while True:
                frames = await read_message(reader)
                if (req := self._decoded(frames)) is None:
                    continue
                if isinstance(req, ch.Resync):  # awaits the engine's replay: the channel keeps answering meanwhile
                    task = asyncio.create_task(self._answer(writer, frames, req))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    await self._answer(writer, frames, req)
        except asyncio.IncompleteReadError:
            pass  # the client closed its connection
        except (BrokenFraming, ConnectionError) as exc:
            log.warning("worker: a connection closed: %s", exc)
        finally:
            writer.close()
            del self._connections[writer]

    @staticmethod
    def _decoded(frames: list[bytes]) -> ch.Request[Any] | None:
        """The request, or None (logged) when it is none: the sender times out, the channel goes on."""
        try:
            if len(frames) < 2:
                raise ValueError("no request frame")
            req = ch.request_decoder.decode(frames[1])
            if isinstance(req, ch.Match) and len(frames) != 3:
                raise ValueError("Match without its keys frame")
            return req
        except Exception as exc:  # not a request (a decoder's own failure included): never the loop's end
            log.warning("worker: a malformed request (%d frames) ignored: %s", len(frames), exc)
            return None


def _remove_channel(channel: str) -> None:
    """The Unix socket file, and its directory once the last worker left it."""
    path = Path(channel)
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
    p.add_argument("--channel", required=True, help="the Unix socket path to listen on for the parent")
    p.add_argument("--settings", default="{}", help="WorkerSettings as JSON")
    p.add_argument("--index", type=int, default=0, help="this worker's number (for logs)")
    p.add_argument("--log-level", default=os.environ.get("KVINDEX_LOG_LEVEL", "INFO"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s worker-{a.index} %(name)s: %(message)s")
    one_line_logs()
    loops.run(run(a.channel, WorkerSettings.from_json(a.settings)), os.environ.get(loops.ENV, "auto"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
