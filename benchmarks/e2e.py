"""End-to-end measurements over ZeroMQ and HTTP, and the subprocesses they use.

- ``publish``: binds one PUB socket per replica on tcp://127.0.0.1 (random ports, SNDHWM large),
  prints the endpoints as one JSON line, sends every message of the workload as fast as the
  sockets allow when a line arrives on stdin, prints ``sent``, and exits at the next line / EOF.
- ``http-client``: sequential keep-alive requests to ``/query``, ``/query_by_hash`` (and
  ``/v1/score`` for kvindex), plus ``GET /health`` as the HTTP round-trip baseline; prints JSON
  with latencies and the matched tokens per instance for every query.
- ``floor-server``: a bare aiohttp app on kvindex's event loop whose /query and /query_by_hash
  only read the body: the same client against it gives the HTTP floor under any aiohttp handler.
- ``kvindex_e2e`` runs a real ``kvindex.daemon.Daemon`` (one engine lane per replica) in this
  process; ``reference_e2e`` is the plain pyzmq + msgpack + dict loop on the same bytes.
Only 127.0.0.1 addresses are ever used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BLOCK_SIZE, MODEL, RSS_SETTLE_SECONDS, Workload, latency_summary, rss_bytes  # noqa: E402

from kvindex import keys as K  # noqa: E402
from kvindex.config import Config  # noqa: E402
from kvindex.ingest.backlog import trimmer  # noqa: E402
from kvindex.tools.workload import read_messages, seq_frame

HWM = 10_000_000
HERE = Path(__file__).resolve().parent


# -- publisher (runs in its own process) ----------------------------------------------------------
def publish(path: Path) -> None:
    """The publisher process: bind, report endpoints, wait for 'go', send everything."""
    messages = [(t.encode(), seq_frame(s), p) for t, s, p in read_messages(path)]
    topics = list(dict.fromkeys(t for t, _, _ in messages))
    ctx = zmq.Context()
    socks = {}
    for t in topics:
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, HWM)
        s.bind("tcp://127.0.0.1:*")
        socks[t] = s
    eps = [socks[t].getsockopt(zmq.LAST_ENDPOINT).decode() for t in topics]
    print(json.dumps({"topics": [t.decode() for t in topics], "endpoints": eps}), flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    for topic, seq, payload in messages:
        socks[topic].send_multipart([topic, seq, payload])
    print(json.dumps({"sent": len(messages), "seconds": time.perf_counter() - t0}), flush=True)
    sys.stdin.readline()
    for s in socks.values():
        s.close(linger=1000)
    ctx.term()


class Publisher:
    """Handle on a publisher subprocess."""

    def __init__(self, path: Path, prefix: list[str] | None = None) -> None:
        cmd = [*(prefix or []), sys.executable, str(HERE / "e2e.py"), "publish", "--workload", str(path)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]
        self.topics: list[str] = info["topics"]
        self.endpoints: list[str] = info["endpoints"]

    def go(self) -> None:
        """Start sending."""
        self.proc.stdin.write("go\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def sent(self) -> dict:
        """Blocks until the publisher has written every message; its own timing."""
        return json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        """Let the publisher exit; kill it if it does not."""
        try:
            self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
            self.proc.stdin.close()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- reference consumer ---------------------------------------------------------------------------
def reference_e2e(wl: Workload, timeout: float = 300.0) -> dict:
    """Plain loop: one SUB socket connected to every publisher, msgpack, per-replica dicts."""
    pub = Publisher(wl.path)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, HWM)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for ep in pub.endpoints:
        sub.connect(ep)
    time.sleep(1.0)  # connections and subscriptions propagate
    try:
        t_go = time.perf_counter()
        pub.go()
        out = _reference_loop(sub, wl, timeout, t_go)
        out["publisher"] = pub.sent()
        return out
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.close()


def _reference_loop(sub: zmq.Socket, wl: Workload, timeout: float, t_go: float) -> dict:
    """Receive, check seq, decode and apply until every message arrived; timed from the go."""
    held: dict[bytes, dict[int, int]] = {}
    last: dict[bytes, int] = {}
    gaps = got = 0
    total = len(wl.messages)
    sub.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    unpack = msgpack.unpackb
    while got < total:
        topic, seq8, payload = sub.recv_multipart()
        seq = int.from_bytes(seq8, "big")
        gaps += seq != last.get(topic, -1) + 1
        last[topic] = seq
        d = held.setdefault(topic, {})
        for ev in unpack(payload)[1]:
            hs = ev["block_hashes"]
            if ev["type"] == "BlockStored":
                for h in hs:
                    d[h] = d.get(h, 0) + 1
            else:
                for h in hs:
                    n = d.get(h, 0) - 1
                    if n > 0:
                        d[h] = n
                    else:
                        d.pop(h, None)
        got += 1
    secs = time.perf_counter() - t_go
    return {"messages": got, "gaps": gaps, "seconds": secs, "blocks_per_s": wl.block_ops / secs}


# -- kvindex daemon ---------------------------------------------------------------------------------
def daemon_config(endpoints: list[str]) -> "Config":
    """One engine lane per publisher endpoint; pods are "1".."N" (the Dynamo worker ids)."""
    from kvindex.config import EngineConfig

    engines = tuple(EngineConfig(endpoint=ep, pod=str(i + 1), model=MODEL, block_size=BLOCK_SIZE)
                    for i, ep in enumerate(endpoints))
    return Config(host="127.0.0.1", port=0, engines=engines, receive_queue_messages=HWM)


async def wait_connected(daemon, count: int, timeout: float | None = None) -> None:
    """Until every lane's SUB socket is connected, then a little for subscriptions to land.

    The default wait grows with the lanes (20 s, or 0.2 s per lane): on a busy 2-core machine 512
    lanes were not all connected after 20 s."""
    deadline = time.monotonic() + (timeout if timeout is not None else max(20.0, 0.2 * count))
    while (n := sum(1 for lane in daemon.fleet.lanes().values() if lane.state.connected_peers)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"kvindex lanes did not connect: {n} of {count}")
        await asyncio.sleep(0.02)
    await asyncio.sleep(1.0)


def _streams(daemon) -> list:
    """Every stream of every lane."""
    return [st for lane in daemon.fleet.lanes().values() for st in lane.state.streams.values()]


def record_first_apply(daemon) -> dict[str, float]:
    """Wraps each lane's ``writer.apply`` until its first call, to stamp the first message applied.

    The wrapper removes itself on that first call, so it costs nothing afterwards.
    """
    first: dict[str, float] = {}
    for key, lane in daemon.fleet.lanes().items():
        writer = lane.writer
        original = writer.apply

        def once(*args, _writer=writer, _key=key, _orig=original) -> None:  # noqa: ANN001
            first[_key] = time.time()
            del _writer.apply
            return _orig(*args)

        writer.apply = once
    return first


async def wait_ingested(daemon, t_go: float, first: dict[str, float], total: int, timeout: float) -> dict:
    """Polls the lanes' streams (10 ms) until ``total`` messages are applied, or ``timeout``.

    ``seconds`` runs from the publisher's go (``t_go``) to the last batch applied, as Dynamo's
    and the reference's; ``seconds_from_first_apply`` from the first batch applied instead."""
    deadline = time.monotonic() + timeout
    while sum(st.batches for st in _streams(daemon)) < total and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    sts = _streams(daemon)
    t_last = max(st.last_applied or 0.0 for st in sts)
    return {"messages": sum(st.batches for st in sts), "expected_messages": total,
            "gaps": sum(st.gaps for st in sts), "unsynced": sum(not st.synced for st in sts),
            "restarts": sum(st.restarts for st in sts), "seconds": t_last - t_go,
            "seconds_from_first_apply": t_last - min(first.values(), default=t_last)}


async def kvindex_e2e(wl: Workload, queries_file: Path, repeat: int, timeout: float = 300.0) -> dict:
    """Publisher process -> Daemon lanes; then the HTTP client process against the daemon."""
    from kvindex.daemon import Daemon

    pub = Publisher(wl.path)
    daemon = Daemon(daemon_config(pub.endpoints))
    await daemon.start()
    try:
        await wait_connected(daemon, len(pub.endpoints))
        first = record_first_apply(daemon)
        if (trim := trimmer()) is not None:  # the baseline without the harness's freed memory (the
            trim()  # workload it loaded is in this process), as the daemon trims after a backlog
        rss0 = rss_bytes()
        t_go = time.time()  # the lanes stamp batches with time.time()
        pub.go()
        ingest = await wait_ingested(daemon, t_go, first, len(wl.messages), timeout)
        ingest["blocks_per_s"] = wl.block_ops / ingest["seconds"]
        await asyncio.sleep(RSS_SETTLE_SECONDS)
        ingest["rss_delta_bytes"] = rss_bytes() - rss0
        ingest["publisher"] = await asyncio.to_thread(pub.sent)
        http = await http_client_async(f"http://127.0.0.1:{daemon.port}", "kvindex", queries_file, repeat)
        return {"ingest": ingest, "http": http}
    finally:
        await daemon.stop()
        pub.close()


# -- HTTP client (runs in its own process) ----------------------------------------------------------
async def http_client_async(url: str, flavor: str, queries_file: Path, repeat: int, prefix: list[str] | None = None) -> dict:
    """Runs the ``http-client`` subprocess and returns its JSON."""
    cmd = [*(prefix or []), sys.executable, str(HERE / "e2e.py"), "http-client", "--url", url,
           "--flavor", flavor, "--queries", str(queries_file), "--repeat", str(repeat)]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"http client exited {proc.returncode}")
    return json.loads(out)


# -- the HTTP floor: the same client and bodies against a handler that does nothing ------------------
def floor_server(port_file: Path) -> None:
    """A bare aiohttp app on kvindex's event loop: POST /query, /query_by_hash read the body and
    answer an empty Dynamo answer; GET /health. What any aiohttp handler costs before its work."""
    from aiohttp import web

    from kvindex import loops

    async def empty(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b'{"scores":{},"frequencies":[],"instances":{}}', content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def serve() -> None:
        app = web.Application()
        app.add_routes([web.post("/query", empty), web.post("/query_by_hash", empty), web.get("/health", health),
                        web.get("/metrics", health)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_file.write_text(str(site._server.sockets[0].getsockname()[1]))  # type: ignore[union-attr]
        await asyncio.Event().wait()

    loops.run(serve(), os.environ.get(loops.ENV, "auto"))


async def floor_http(queries_file: Path, repeat: int) -> dict:
    """The client's round trips against ``floor_server`` (its own process, as kvindex's server is)."""
    port_file = queries_file.with_suffix(".floor-port")
    port_file.unlink(missing_ok=True)
    proc = await asyncio.create_subprocess_exec(sys.executable, str(HERE / "e2e.py"), "floor-server",
                                                "--port-file", str(port_file))
    try:
        for _ in range(200):
            if port_file.exists() and port_file.read_text():
                break
            await asyncio.sleep(0.05)
        return await http_client_async(f"http://127.0.0.1:{port_file.read_text()}", "floor", queries_file, repeat)
    finally:
        proc.kill()
        await proc.wait()
        port_file.unlink(missing_ok=True)


def request_bodies(flavor: str, token_ids: list[int]) -> dict[str, bytes]:
    """Pre-encoded request bodies per endpoint for one query."""
    local = [h - (1 << 64) if h >= 1 << 63 else h for h in K.local_hashes(token_ids, BLOCK_SIZE)]
    out = {"/query": {"token_ids": token_ids, "model_name": MODEL},
           "/query_by_hash": {"block_hashes": local, "model_name": MODEL}}
    if flavor == "kvindex":
        out["/v1/score"] = {"model": MODEL, "token_ids": token_ids}
    return {k: json.dumps(v).encode() for k, v in out.items()}


def matched_tokens(endpoint: str, doc: dict) -> dict[str, int]:
    """Matched tokens per instance (max over dp ranks), non-zero only."""
    if endpoint == "/v1/score":
        return {p: v["precise"]["tokens"] for p, v in doc["pods"].items() if v["precise"]["tokens"]}
    if "scores" not in doc:
        return {}
    return {str(i): max(r.values()) for i, r in doc["scores"].items() if r and max(r.values())}


async def _match_pass(s, url: str, bodies: list[dict[str, bytes]]) -> dict[str, list[dict[str, int]]]:
    """One untimed request per query and endpoint: matched tokens per instance."""
    hdr = {"Content-Type": "application/json"}
    out: dict[str, list[dict[str, int]]] = {ep: [] for ep in bodies[0]}
    for b in bodies:
        for ep, data in b.items():
            async with s.post(url + ep, data=data, headers=hdr) as r:
                out[ep].append(matched_tokens(ep, json.loads(await r.read())))
    return out


async def _timed_pass(s, url: str, bodies: list[dict[str, bytes]], times: dict[str, list[float]]) -> None:
    """Each query on each endpoint, then GET /health; appends wall seconds per request."""
    hdr = {"Content-Type": "application/json"}
    for b in bodies:
        for ep, data in b.items():
            t0 = time.perf_counter()
            async with s.post(url + ep, data=data, headers=hdr) as r:
                await r.read()
            times.setdefault(ep, []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        async with s.get(url + "/health") as r:
            await r.read()
        times.setdefault("GET /health", []).append(time.perf_counter() - t0)


SERVER_METRIC = re.compile(r'^(?:kvindex_query_duration_seconds|dynamo_kvindexer_request_duration_seconds)'
                           r'_(sum|count)\{[^}]*endpoint="([^"]+)"[^}]*\}\s+(\S+)', re.M)


def server_means(text: str) -> dict[str, float]:
    """Mean server-side seconds per endpoint from the server's own latency histogram, in µs.

    kvindex observes before serialising the answer; Dynamo's covers its whole handler."""
    acc: dict[str, dict[str, float]] = {}
    for kind, ep, value in SERVER_METRIC.findall(text):
        acc.setdefault(ep, {})[kind] = acc.get(ep, {}).get(kind, 0.0) + float(value)
    return {ep: v["sum"] / v["count"] * 1e6 for ep, v in acc.items() if v.get("count")}


async def _run_client(url: str, flavor: str, queries: list[dict], repeat: int) -> dict:
    """Matched tokens right after ingest and again after the timed passes (they must agree)."""
    import aiohttp

    bodies = [request_bodies(flavor, q["token_ids"]) for q in queries]
    times: dict[str, list[float]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        first = await _match_pass(s, url, bodies)
        for _ in range(max(1, repeat // len(bodies))):
            await _timed_pass(s, url, bodies, times)
        final = await _match_pass(s, url, bodies)
        async with s.get(url + "/metrics") as r:
            server = server_means(await r.text())
    return {"latency": {ep: latency_summary(t) for ep, t in times.items()}, "matched": final, "server_mean_us": server,
            "matched_first": first, "changed_after_ingest": sum(a != b for ep in final for a, b in zip(first[ep], final[ep]))}


def main(argv: list[str] | None = None) -> None:
    """Subprocess entry points: ``publish``, ``http-client`` and ``floor-server``."""
    p = argparse.ArgumentParser(description="end-to-end benchmark children (publisher, HTTP client)")
    p.add_argument("what", choices=["publish", "http-client", "floor-server"])
    p.add_argument("--workload", type=Path)
    p.add_argument("--url")
    p.add_argument("--port-file", type=Path, help="floor-server: write the port it listens on here")
    p.add_argument("--flavor", choices=["kvindex", "dynamo", "floor"], default="kvindex")
    p.add_argument("--queries", type=Path)
    p.add_argument("--repeat", type=int, default=200)
    a = p.parse_args(argv)
    if a.what == "publish":
        publish(a.workload)
    elif a.what == "floor-server":
        floor_server(a.port_file)
    else:
        queries = json.loads(a.queries.read_text())
        print(json.dumps(asyncio.run(_run_client(a.url, a.flavor, queries, a.repeat))))


if __name__ == "__main__":
    main()
