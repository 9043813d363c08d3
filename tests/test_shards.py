"""Sharded ingest (``kvindex serve --workers 2``): real processes, real ZeroMQ sockets.

Fake engines replay the recorded real-vLLM capture; the same engines feed a single-process daemon
(in this process) and a ``kvindex serve --workers 2`` process. Every answer of the sharded one
must equal the single process's and the engine's own ``cached_tokens``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from kvindex.config import Config, ConfigError
from kvindex.configfile import config_from_toml
from kvindex.index.protocol import StoreUnavailable
from kvindex.shard import channel as ch
from kvindex.shard.channel import WorkerSettings, owner_of
from kvindex.shard.supervisor import ShardedFleet, Shards
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, ROOT, engine_config, ipc_endpoint
from tests.test_precise_fixtures import requests_in_order

LISTENING = re.compile(r"kvindex listening on http://127\.0\.0\.1:(\d+)")
PER_WORKER = 2
WORKERS = 2  # serve_sharded's --workers


class Served:
    """A ``kvindex serve`` child process, its HTTP port and its log."""

    def __init__(self, proc: asyncio.subprocess.Process, session: aiohttp.ClientSession) -> None:
        self.proc = proc
        self.session = session
        self.port = 0
        self.log: list[str] = []
        self._drain: asyncio.Task[None] | None = None

    async def wait_listening(self) -> None:
        assert self.proc.stderr is not None
        while not self.port:
            line = (await asyncio.wait_for(self.proc.stderr.readline(), 30)).decode()
            assert line, "kvindex exited before listening:\n" + "".join(self.log)
            self.log.append(line)
            if m := LISTENING.search(line):
                self.port = int(m.group(1))
        self._drain = asyncio.create_task(self._read_rest())

    async def _read_rest(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.log.append(line.decode())

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.session.request(method, f"http://127.0.0.1:{self.port}{path}", json=body) as r:
            return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

    def workers(self) -> list[int]:
        """The pids of this process's children (its workers)."""
        pid = self.proc.pid
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def serve_sharded(engines: list[Any], session: aiohttp.ClientSession) -> Served:
    specs = [a for i, e in enumerate(engines)
             for a in ("--engine", f"endpoint={e.endpoint},replay={e.replay_address},pod=e{i}")]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvindex", "serve", "--workers", str(WORKERS), "--port", "0", *specs,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    served = Served(proc, session)
    await served.wait_listening()
    return served


async def start_engines(make_engine: Any, tmp_path: Path) -> list[Any]:
    """Two engines per worker, each with a replay endpoint: engine i runs on worker i % WORKERS
    (configured engines are dealt out in order)."""
    return [await make_engine(ipc_endpoint(tmp_path, f"pub{i}"), replay_endpoint=ipc_endpoint(tmp_path, f"rep{i}"))
            for i in range(PER_WORKER * WORKERS)]


async def pod_seqs(served: Served) -> dict[str, int | None]:
    status, body = await served.request("GET", "/v1/pods")
    assert status == 200, body
    return {v["pod"]: v["last_seq"] for v in body["pods"]}


async def wait_seq_everywhere(single: Any, served: Served, pods: list[str], seq: int) -> None:
    for pod in pods:
        await single.wait_seq(pod, seq)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while any(seqs.get(p) != seq for seqs in [await pod_seqs(served)] for p in pods):
        assert loop.time() < deadline, f"sharded kvindex did not apply seq {seq}: {await pod_seqs(served)}"
        await asyncio.sleep(0.01)


async def both(single: Any, served: Served, path: str, body: Any) -> tuple[Any, Any]:
    s1, a1 = await single.post(path, body)
    s2, a2 = await served.request("POST", path, body)
    assert s1 == s2 == 200, (a1, a2)
    return a1, a2


@pytest.fixture
async def cluster(make_harness: Any, make_engine: Any, tmp_path: Path) -> Any:
    engines = await start_engines(make_engine, tmp_path)
    pods = [f"e{i}" for i in range(len(engines))]
    single = await make_harness(Config(engines=tuple(engine_config(e, pod=p) for e, p in zip(engines, pods))))
    session = aiohttp.ClientSession()
    served = await serve_sharded(engines, session)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while (await served.request("GET", "/readyz"))[0] != 200:
            assert loop.time() < deadline, await served.request("GET", "/readyz")
            await asyncio.sleep(0.05)
        await single.wait_connected(others=1)  # and the sharded kvindex's worker subscribed to each engine too
        yield engines, pods, single, served
    finally:
        if served.proc.returncode is None:
            served.proc.kill()
        await served.proc.wait()
        await session.close()


async def test_sharded_answers_equal_single_process_and_engine(cluster: Any) -> None:
    engines, pods, single, served = cluster
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    pos = checked = 0
    for r in requests_in_order("small"):
        while pos < len(captured) and captured[pos].t < r["t_sent"]:
            for e in engines:
                await e.publish(captured[pos].frames)
            await wait_seq_everywhere(single, served, pods, int.from_bytes(captured[pos].frames[1], "big"))
            pos += 1
        q1, q2 = await both(single, served, "/query", {"token_ids": r["prompt_token_ids"], "model_name": "tiny"})
        assert q2 == q1
        assert {p: q2["instances"].get(p, {}).get("longest_matched", 0) for p in pods} == \
            {p: r["cached_tokens"] for p in pods}, r["i"]
        s1, s2 = await both(single, served, "/v1/score", {"model": "tiny", "token_ids": r["prompt_token_ids"]})
        assert s2 == s1 and s2["prompt_tokens"] == r["prompt_tokens"]
        checked += 1
    assert checked == 20
    status, body = await served.request("GET", "/v1/pods")
    assert status == 200, body
    views = {v["pod"]: v for v in body["pods"]}
    assert sorted(views) == pods and all(v["synced"] and v["connected"] for v in views.values())
    _, single_body = await single.get("/v1/pods")
    assert {v["pod"]: v["blocks"] for v in single_body["pods"]} == {p: v["blocks"] for p, v in views.items()}
    _, metrics = await served.request("GET", "/metrics")
    for p in pods:  # both workers' ingest counters, merged into the parent's families
        assert f'kvindex_events_applied_total{{pod="{p}",type="BlockStored"}}' in metrics
    assert metrics.count("# TYPE kvindex_events_applied_total counter") == 1
    workers = served.workers()
    assert len(workers) == 2
    served.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(served.proc.wait(), 15) == 0
    assert not any(Path(f"/proc/{w}").exists() for w in workers), "a worker outlived kvindex"


async def register_and_compare(served: Served, make_engine: Any, tmp_path: Path, captured: list[Any]) -> None:
    """An engine registered at runtime (POST /register) is ingested by its worker like the others."""
    engine = await make_engine(ipc_endpoint(tmp_path, "late"), replay_endpoint=ipc_endpoint(tmp_path, "late-rep"))
    status, body = await served.request("POST", "/register", {
        "instance_id": 77, "endpoint": engine.endpoint, "replay_endpoint": engine.replay_address,
        "model_name": "tiny", "block_size": 32})
    assert status == 201, body
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (await served.request("GET", "/workers"))[1][0]["status"] != "active":
        assert loop.time() < deadline, await served.request("GET", "/workers")
        await asyncio.sleep(0.05)
    await engine.wait_subscribers(1)  # the worker's subscription reached the engine: nothing below is lost
    for c in captured:
        await engine.publish(c.frames)
    while (await pod_seqs(served)).get("77") != int.from_bytes(captured[-1].frames[1], "big"):
        assert loop.time() < deadline + 10, await pod_seqs(served)
        await asyncio.sleep(0.01)
    prompt = requests_in_order("small")[-1]["prompt_token_ids"]
    status, q = await served.request("POST", "/query", {"token_ids": prompt, "model_name": "tiny"})
    assert status == 200 and q["instances"]["77"] == q["instances"]["e0"] and q["instances"]["77"]["gpu"] > 0, q


async def test_a_killed_worker_is_reported_and_never_answers_wrong(cluster: Any, make_engine: Any,
                                                                  tmp_path: Path) -> None:
    engines, pods, single, served = cluster
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    for c in captured:
        for e in engines:
            await e.publish(c.frames)
    await wait_seq_everywhere(single, served, pods, int.from_bytes(captured[-1].frames[1], "big"))
    await register_and_compare(served, make_engine, tmp_path, captured)
    workers = served.workers()
    os.kill(workers[1], signal.SIGKILL)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (ready := await served.request("GET", "/readyz"))[0] == 200:
        assert loop.time() < deadline, "the dead worker was never reported"
        await asyncio.sleep(0.05)
    status, body = ready
    assert status == 503 and any("exited with code -9" in r for r in body["reasons"]), body
    prompt = requests_in_order("small")[-1]["prompt_token_ids"]
    for path, req in (("/query", {"token_ids": prompt, "model_name": "tiny"}),
                      ("/v1/score", {"model": "tiny", "token_ids": prompt})):
        status, answer = await served.request("POST", path, req)
        assert status == 503 and "exited with code -9" in answer["error"], answer
    status, _ = await served.request("GET", "/v1/pods")
    assert status == 503
    assert await asyncio.wait_for(served.proc.wait(), 20) == 1  # it exits for its supervisor to restart it
    assert not any(Path(f"/proc/{w}").exists() for w in workers), "a worker outlived kvindex"
    assert any("exited with code -9" in line for line in served.log)


async def test_workers_never_outlive_a_killed_parent() -> None:
    async with aiohttp.ClientSession() as session:
        served = await serve_sharded([], session)
        workers = served.workers()
        assert len(workers) == 2
        channel = Path(f"/proc/{workers[0]}/cmdline").read_bytes().split(b"\0")
        channel_dir = Path(channel[channel.index(b"--channel") + 1].decode().removeprefix("ipc://")).parent
        assert channel_dir.is_dir()
        served.proc.kill()
        await served.proc.wait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while any(Path(f"/proc/{w}").exists() and "Z" not in _state(w) for w in workers):
            assert loop.time() < deadline, "a worker outlived its killed parent"
            await asyncio.sleep(0.1)
        assert not channel_dir.exists(), "the workers left their ipc sockets behind"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_workers_refuse_a_shared_store_and_state(tmp_path: Path) -> None:
    assert config_from_toml({"server": {"workers": 2}}).workers == 2
    for kw in ({"store": "redis://127.0.0.1:6379/0"}, {"state_dir": tmp_path}, {"peer": "http://127.0.0.1:1"}):
        with pytest.raises(ConfigError, match="--workers 2 cannot be used with"):
            Config(workers=2, **kw)
    with pytest.raises(ConfigError, match="workers must be"):
        Config(workers=0)


@pytest.mark.timeout(120)
def test_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/shards.py --smoke runs end to end: every batch ingested with 1 and 2 workers, and
    the same matched tokens from both (no timing is checked)."""
    import json
    import subprocess

    out = tmp_path / "shards.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "shards.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=ROOT, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    for r in doc["replicas"].values():
        assert set(r["runs"]) == {"1", "2"}
        for run in r["runs"].values():
            assert run["messages"] == run["expected_messages"] and run["gaps"] == 0
    http = next(iter(doc["replicas"].values()))["runs"]
    assert http["2"]["matched_mismatches_vs_first"] == 0
    assert "replicas carried at 5k/s" in proc.stdout


async def test_the_channel_drops_garbage_and_answers_a_failure_in_one_line() -> None:
    """A request that is no ``REQUESTS`` member is dropped (the worker keeps answering); a request
    that fails comes back as ``StoreUnavailable`` naming the worker, in one line; a connection whose
    framing breaks is closed, and the worker goes on answering the others."""
    from kvindex.shard.frames import framed, read_message

    shards = Shards(2, WorkerSettings())
    await shards.start()
    try:
        reader, writer = await asyncio.open_unix_connection(shards.channels[0].path)
        for frames in ([b"1", b"\xc1"], [b"2", msgpack.packb(["no_such_op"])], [b"3", msgpack.packb(["match", None])],
                       [b"5", msgpack.packb(["add", "k", {"endpoint": "ipc:///x", "dialect": "no-such-dialect"}])],
                       [b"4"]):
            writer.write(framed(frames))
        writer.write(framed([b"9", ch.encode(ch.Ping())]))  # answered in order: after the garbage
        rid, reply = await asyncio.wait_for(read_message(reader), 10)
        assert rid == b"9" and ch.decode_reply(ch.Ping, reply) == shards.procs[0].pid
        writer.write(b"\x00" + framed([b"10", ch.encode(ch.Ping())]))  # a message of 0 frames: unframed
        assert await asyncio.wait_for(reader.read(), 10) == b""  # the worker closed this connection
        writer.close()
        first = shards.channels[0]
        with pytest.raises(StoreUnavailable, match=r"^worker 0: ValueError: [^\n]+$"):
            await first.request(ch.Match(None, None), extra=b"not eight bytes per key")
        assert await first.request(ch.Lanes()) == {}
    finally:
        await shards.stop()


async def test_a_worker_that_stops_reading_has_requests_refused_not_buffered() -> None:
    """A worker that stops reading its channel (here SIGSTOP) gets requests only until
    ``max_unsent_bytes`` wait unread; then each is refused at once, in one line, and the parent's
    memory stops growing. Once it reads again, what was written is answered."""
    from kvindex.shard.client import ShardChannel

    shards = Shards(1, WorkerSettings())
    await shards.start()
    pid = shards.procs[0].pid
    chan = ShardChannel(0, shards.channels[0].path, timeout=60, max_unsent_bytes=1 << 20)
    chan.start()
    pending: list[asyncio.Future[Any]] = []
    try:
        assert await chan.request(ch.Ping()) == pid
        os.kill(pid, signal.SIGSTOP)
        keys = ch.pack_keys(range(1, 1 << 16))  # 512 KB a request
        with pytest.raises(StoreUnavailable, match=r"^worker 0: not reading its channel \(\d+ MB of requests unread\)$"):
            for _ in range(64):  # 32 MB: far past what the sockets' kernel buffers take
                pending.append(asyncio.ensure_future(chan.request(ch.Match(None, None), extra=keys)))
                await asyncio.sleep(0)  # written (or refused)
                if pending[-1].done():
                    pending.pop().result()
        assert 2 <= len(pending) < 16
        os.kill(pid, signal.SIGCONT)
        assert all(answer == {} for answer in await asyncio.wait_for(asyncio.gather(*pending), 30))
        assert await chan.request(ch.Ping()) == pid
    finally:
        os.kill(pid, signal.SIGCONT)
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await chan.close()
        await shards.stop()


async def test_engines_are_dealt_out_evenly_over_the_workers(tmp_path: Path) -> None:
    """Lanes go round the workers in the order they are added (never by the luck of a hash of
    their endpoints, which left 8 engines split 6 / 2 as often as 4 / 4); a lane added after one
    was removed goes to the worker that then runs the fewest. Asked of the real workers."""
    from kvindex.config import EngineConfig

    shards = Shards(2, WorkerSettings())
    await shards.start()
    fleet = ShardedFleet(shards)

    async def lanes() -> list[set[str]]:
        return [set(await c.request(ch.Lanes())) for c in shards.channels]

    try:
        keys = [f"config:{ipc_endpoint(tmp_path, f'pub{i}')}" for i in range(6)]
        for key in keys[:5]:
            fleet.add(key, EngineConfig(endpoint=key.removeprefix("config:"), pod=key[-6:]))
        await fleet.added()
        assert await lanes() == [{keys[0], keys[2], keys[4]}, {keys[1], keys[3]}]
        await fleet.remove(keys[0])
        await fleet.remove(keys[2])  # worker 0 now runs one lane, worker 1 two
        fleet.add(keys[5], EngineConfig(endpoint=keys[5].removeprefix("config:"), pod="last"))
        await fleet.added()
        assert await lanes() == [{keys[4], keys[5]}, {keys[1], keys[3]}]
    finally:
        await fleet.close()
        await shards.stop()


@contextlib.asynccontextmanager
async def two_worker_store() -> AsyncIterator[tuple[Any, list[str], Callable[..., Awaitable[None]]]]:
    """A ``ShardedPreciseStore`` over two real worker processes, a pod each worker owns, and
    ``store_blocks(worker, bs, epoch=0)``: one ``BlockStored`` of model m (tokens 1..bs) from its pod."""
    from array import array

    from kvindex.events import BlockStored
    from kvindex.sequence import StreamRef
    from kvindex.shard.client import ShardChannel
    from kvindex.shard.store import ShardedPreciseStore

    shards = Shards(2, WorkerSettings())
    await shards.start()
    channels = [ShardChannel(c.index, c.path) for c in shards.channels]
    for c in channels:
        c.start()
    store = ShardedPreciseStore(channels)
    pods = [next(f"p{i}" for i in range(100) if owner_of(f"p{i}", 2) == w) for w in (0, 1)]
    seqs = dict.fromkeys(pods, 0)

    async def store_blocks(worker: int, bs: int, epoch: int = 0) -> None:
        pod = pods[worker]
        if epoch:  # the engine's new life: its stream starts again
            seqs[pod] = 0
        ev = BlockStored((seqs[pod] + 1,), None, array("I", range(1, bs + 1)), bs)
        done = await store.apply(StreamRef.of(pod, f"kv@{pod}@m", "m"), seqs[pod], epoch, 0, (ev,))
        assert done.applied is not None and done.applied.orphans == 0
        seqs[pod] += 1

    try:
        yield store, pods, store_blocks
    finally:
        await store.close()
        await shards.stop()


async def test_workers_whose_engines_run_different_block_sizes_never_answer_one_s_keys_for_all() -> None:
    """Each worker's index follows its own engines' block size. Workers that disagree were merged
    last-wins: a query chunked by one size, the other worker's pods silently 0. Now a size every
    worker takes is agreed (a worker holding none of the model's blocks follows), workers whose
    engines hold different sizes answer 503 saying so, and a worker whose size moved on since
    ``block_size`` answered makes ``match`` raise ``BlockSizeChanged`` (the query asks again)."""
    from kvindex import keys as K
    from kvindex.index.protocol import BlockSizeChanged
    from kvindex.sequence import StreamRef

    tokens = list(range(1, 17))
    async with two_worker_store() as (store, (p, q), store_blocks):
        await store_blocks(0, 4)
        await store_blocks(1, 8)
        with pytest.raises(StoreUnavailable, match=r"^model 'm': .*different block sizes \(4 on worker 0, 8 on "
                                                   r"worker 1\); its queries answer 503 until they agree$"):
            await store.block_size("m")
        with pytest.raises(StoreUnavailable):
            await store.block_sizes()
        await store.restart(StreamRef.of(q, f"kv@{q}@m", "m"), 0, None)  # q's engine restarted: cleared
        assert await store.block_size("m") == 4 and await store.block_sizes() == {"m": 4}  # worker 1 follows
        assert (await store.match(K.prompt_keys(K.root_key("m"), tokens, 4), model="m"))[p].gpu == 1
        await store_blocks(1, 8, epoch=1)  # worker 1 (nobody holds its 4) follows its engine's new life
        assert await store.block_size("m") == 4  # remembered: the walk is what finds out
        with pytest.raises(BlockSizeChanged):
            await store.match(K.prompt_keys(K.root_key("m"), tokens, 4), model="m")
        with pytest.raises(StoreUnavailable, match="4 on worker 0, 8 on worker 1"):
            await store.block_size("m")


async def test_a_query_of_a_known_block_size_is_one_round_trip_per_worker() -> None:
    """Asking every worker the model's block size before every walk doubled a sharded query's
    latency (~130 µs per round trip here). Once agreed, the size is remembered: a query sends one
    ``Match`` per worker; an engine's new size is found by that walk and the query asks again."""
    from kvindex import keys as K
    from kvindex.index.protocol import BlockSizeChanged
    from kvindex.sequence import StreamRef

    async with two_worker_store() as (store, (p, _), store_blocks):
        await store_blocks(0, 4)
        assert await store.block_size("m") == 4
        sent = [c.sent for c in store.channels]
        for _ in range(3):
            keys = K.prompt_keys(K.root_key("m"), list(range(1, 17)), await store.block_size("m"))
            assert sum(m.gpu for m in (await store.match(keys, model="m")).values()) == 1
        assert [c.sent - s for c, s in zip(store.channels, sent)] == [3, 3]
        await store.restart(StreamRef.of(p, f"kv@{p}@m", "m"), 0, None)  # the engine restarted
        await store_blocks(0, 8, epoch=1)  # its new life, another size
        with pytest.raises(BlockSizeChanged):
            await store.match(keys, model="m")
        assert await store.block_size("m") == 8  # asked again


async def test_a_sharded_daemon_whose_workers_engines_disagree_answers_503(make_engine: Any, tmp_path: Path) -> None:
    """``kvindex serve --workers 2``: an engine on worker 0 publishes model m at block size 16, one on
    worker 1 at 32. A query of m answered with one worker's size (the other's pods silently 0); now
    503 naming both sizes, until the engine of the other size is gone (cleared) — then exact again."""
    from tests.test_block_sizes import cached, life

    engines = await start_engines(make_engine, tmp_path)
    first, second = engines[0], engines[1]  # one of worker 0, one of worker 1
    async with aiohttp.ClientSession() as session:
        served = await serve_sharded(engines, session)
        try:
            for e in engines:
                await e.wait_subscribers(1, 10)
            frames16, _, prompt = life(4, 16, seed=5, pod="e0")
            frames32, _, _ = life(4, 32, seed=6, pod="e1")
            for f in frames16:
                await first.publish(f)
            for f in frames32:
                await second.publish(f)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while (seqs := await pod_seqs(served)).get("e0") != 3 or seqs.get("e1") != 3:
                assert loop.time() < deadline, seqs
                await asyncio.sleep(0.02)
            status, body = await served.request("POST", "/query", {"model_name": "m", "token_ids": prompt})
            assert status == 503 and "different block sizes (16 on worker 0, 32 on worker 1)" in body["error"], body
            status, body = await served.request("DELETE", "/v1/pods/e1")  # its blocks gone
            assert status == 200, body
            status, body = await served.request("POST", "/query", {"model_name": "m", "token_ids": prompt})
            assert status == 200, body
            assert sum(body["scores"].get("e0", {}).values()) == cached(prompt, 16)
        finally:
            if served.proc.returncode is None:
                served.proc.kill()
            await served.proc.wait()


async def test_a_score_asks_for_the_workers_pods_beside_its_walk(make_harness: Any, make_engine: Any,
                                                                 tmp_path: Path) -> None:
    """``/v1/score`` with no pods named answers every pod known: with workers, that is a ``Pods``
    request besides the ``Match``. Both go out at once (one round trip, not two in a row): while
    the workers are stopped, each channel holds both unanswered; then the answer is exact."""
    from tests.conftest import wait_for
    from tests.test_block_sizes import cached, life

    engine = await make_engine(ipc_endpoint(tmp_path, "pub"))
    h = await make_harness(Config(workers=2, engines=(engine_config(engine, pod="e0"),)))
    await engine.wait_subscribers(1, 10)
    frames, _, prompt = life(4, 16, seed=5, pod="e0")
    for f in frames:
        await engine.publish(f)
    await wait_for(lambda: h.daemon.shards is not None, 10, "the workers")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (await h.get("/v1/pods"))[1]["pods"][0]["last_seq"] != 3:
        assert loop.time() < deadline
        await asyncio.sleep(0.02)
    body = {"model": "m", "token_ids": prompt}
    status, warm = await h.post("/v1/score", body)  # the model's block size agreed (remembered)
    assert status == 200, warm
    channels, pids = h.daemon.shards.channels, [p.pid for p in h.daemon.shards.procs]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        scored = asyncio.ensure_future(h.post("/v1/score", body))
        await wait_for(lambda: all({"match", "pods"} <= set(c.in_flight()) for c in channels), 5,
                       "Match and Pods in flight on every worker")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    status, answer = await asyncio.wait_for(scored, 10)
    assert status == 200 and answer == warm
    assert answer["pods"]["e0"]["precise"]["tokens"] == cached(prompt, 16)
