"""The query path's HTTP stacks side by side: the same handlers and index, six servers, and Dynamo (issue 16 part 3).

Stacks (each its own server process on uvloop, the same index content built from the same workload):
- ``aiohttp``: kvindex's app as ``kvindex serve`` runs it (``Daemon.start``: middleware, connection
  cap) at the git revision ``--baseline`` (default ``main``; ``git archive`` into a temporary tree
  with this tree's built extensions: pass ``$(git merge-base main HEAD)`` once main has moved on);
- ``aiohttp-tuned``: the same, from this tree (whatever tuning ``kvindex.http`` has here);
- ``granian-rsgi`` / ``granian-asgi``: granian (Rust HTTP server) embedded in the same loop,
  serving the same handlers through a thin adapter (``AdaptedRequest``, written here);
- ``uvicorn``: uvicorn + httptools (ASGI) through the same adapter;
- ``httptools``: no server at all, a bound: a bare asyncio protocol on httptools' parser calling the
  same adapter (``BareProtocol``: no timeouts, no caps, no pipelining order, no refusal rules). No
  production stack can be leaner in a Python process; it is measured to bound the others, never
  a candidate (it does none of what a server owes its callers);
- ``dynamo`` (with ``--dynamo-python``): Dynamo's standalone indexer itself (``python -m
  dynamo.indexer``, ``--threads 2``) holding the same workload, sent to it over ZeroMQ as vLLM
  publishes it: the peer every stack's ``/query`` is compared with (``p50 ×Dynamo``). It binds
  0.0.0.0, so the whole run then re-executes itself inside ``unshare -n`` (loopback only).
The adapter serves only the measured routes (``/query``, ``/query_by_hash``, ``/v1/score``,
``/health``) with kvindex's refusal shape; it is not a port of kvindex's HTTP layer.

Client: ``wrk`` (C, one thread) in its own process, one keep-alive connection (``seq``) and
``--connections`` concurrent ones, the same pre-built 8k-token body per endpoint. Its own cost is
reported as its CPU time per request (``client_cpu_us``), the server's as its process CPU time per
request (``server_cpu_us``, every thread). Before timing, every stack's answers are checked equal
to ``aiohttp``'s (Dynamo's: the matched tokens per replica of ``/query`` and ``/query_by_hash``).
``handlers``: each handler called in-process with no HTTP (the floor of every stack).

Figures are ratios in the same run: each stack against ``aiohttp`` (1.0) and against Dynamo, and each
endpoint against the stack's own ``/health``. Every server is up at once; each (endpoint, mode) runs
on every stack back to back in an order that rotates; medians and spread (min..max) over rounds.
Needs ``pip install granian uvicorn httptools`` and ``wrk`` (``apt-get install wrk``).

``python benchmarks/http_stacks.py [--rounds 3] [--seconds 3] [--connections 16] [--dynamo-python D/bin/python] [--out F]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from http import HTTPStatus
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import BLOCK_SIZE, MODEL  # noqa: E402

from kvindex import keys as K  # noqa: E402

STACKS = ("aiohttp", "aiohttp-tuned", "granian-rsgi", "granian-asgi", "uvicorn", "httptools")
NETNS_ENV = "KVINDEX_HTTP_STACKS_NETNS"  # set when this run re-executed itself inside ``unshare -n``
ENDPOINTS = ("/query", "/query_by_hash", "/v1/score", "/health")
REPLICAS = 8
HERE = Path(__file__).resolve()


# -- the index content (the same in every server process) ---------------------------------------
async def filled_daemon(blocks: int, queries: int, cache: Path | None = None) -> Any:
    """A Daemon (not started) whose in-memory index holds the workload's events, as lanes apply them."""
    from adapters.dialects import DIALECTS
    from kvindex.config import Config
    from kvindex.daemon import Daemon
    from kvindex.ingest.streams import split_topic

    wl = common.workload(REPLICAS, blocks, queries, cache=cache)
    daemon = Daemon(Config(host="127.0.0.1", port=0))
    await daemon.store.set_block_size(MODEL, BLOCK_SIZE, configured=True)
    decode, index = DIALECTS["vllm"].decoder().decode, daemon.index
    for topic, _seq, payload in wl.messages:
        batch, pod = decode(payload), split_topic(topic)[0]
        for ev in batch.events:
            index.apply(pod, MODEL, batch.dp_rank, ev)
    return daemon


# -- the adapter: kvindex's handlers behind ASGI / RSGI ------------------------------------------
class AdaptedRequest:
    """What the measured handlers read of an aiohttp request: the app's services, the body, two headers."""

    __slots__ = ("app", "content_type", "headers", "_body")

    def __init__(self, app: dict, content_type: str, authorization: str | None, body: bytes) -> None:
        self.app = app
        self.content_type = content_type.partition(";")[0].strip().lower()
        self.headers = {"Authorization": authorization} if authorization else {}
        self._body = body

    @property
    def body_exists(self) -> bool:
        return bool(self._body)

    def get(self, key: object, default: object = None) -> bytes:
        """The body read whole (what ``kvindex.http.server.body_bytes`` asks for)."""
        return self._body

    async def read(self) -> bytes:
        return self._body


def adapter_routes() -> dict[tuple[str, str], Any]:
    from kvindex.http import dynamo, native
    return {("POST", "/query"): dynamo.query, ("POST", "/query_by_hash"): dynamo.query_by_hash,
            ("POST", "/v1/score"): native.score, ("GET", "/health"): dynamo.health}


async def answer(routes: dict, method: str, path: str, request: AdaptedRequest) -> tuple[int, str, bytes]:
    """(status, content type, body) of the route's handler; refusals in kvindex's shape."""
    from kvindex.query.answers import QueryError
    from kvindex.http.errors import ApiError

    handler = routes.get((method, path))
    try:
        if handler is None:
            raise ApiError(f"no route {method} {path}", status=404, reason="no_route")
        resp = await handler(request)
        return resp.status, resp.content_type, resp.body
    except QueryError as exc:
        err = ApiError(str(exc), field=exc.field, status=exc.status, reason=exc.reason)
    except ApiError as exc:
        err = exc
    return err.status_code, "application/json", err.text.encode()


def rsgi_app(app: dict) -> Any:
    routes = adapter_routes()

    async def serve(scope: Any, proto: Any) -> None:
        method = scope.method
        body = await proto() if method == "POST" else b""
        req = AdaptedRequest(app, scope.headers.get("content-type") or "", scope.headers.get("authorization"), body)
        status, ctype, out = await answer(routes, method, scope.path, req)
        proto.response_bytes(status, [("content-type", ctype)], out)
    return serve


def asgi_app(app: dict) -> Any:
    routes = adapter_routes()

    async def serve(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization")
        req = AdaptedRequest(app, headers.get(b"content-type", b"").decode("latin-1"),
                             auth.decode("latin-1") if auth else None, b"".join(chunks))
        status, ctype, out = await answer(routes, scope["method"], scope["path"], req)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})
    return serve


class BareProtocol(asyncio.Protocol):
    """The ``httptools`` bound: httptools' parser (llhttp) feeding the adapter, one task per request,
    the answer written in one call. Nothing a server owes its callers is here (timeouts, caps,
    answers in pipelined order, refusals of bad framing beyond closing): the least any Python
    server can do per request, measured to bound the stacks."""

    def __init__(self, app: dict, routes: dict) -> None:
        import httptools

        self._app, self._routes = app, routes
        self._parser = httptools.HttpRequestParser(self)
        self._errors, self._parse_url = httptools.HttpParserError, httptools.parse_url
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a TCP server's transports are Transports

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except self._errors:
            self._transport.close()  # type: ignore[union-attr]

    # httptools' callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        headers, body, url = self._headers, b"".join(self._body), self._url
        self._headers, self._body, self._url = {}, [], b""
        auth = headers.get(b"authorization")
        req = AdaptedRequest(self._app, headers.get(b"content-type", b"").decode("latin-1"),
                             auth.decode("latin-1") if auth else None, body)
        method, path = self._parser.get_method().decode(), self._parse_url(url).path.decode()
        asyncio.get_running_loop().create_task(self._answer(method, path, req, self._parser.should_keep_alive()))

    async def _answer(self, method: str, path: str, req: AdaptedRequest, keep_alive: bool) -> None:
        status, ctype, out = await answer(self._routes, method, path, req)
        head = "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
            status, HTTPStatus(status).phrase, ctype, len(out))
        transport = self._transport
        assert transport is not None
        if transport.is_closing():  # the client left first (wrk at the end of its run)
            return
        transport.write(head.encode("latin-1") + out)
        if not keep_alive:
            transport.close()


async def handler_times(blocks: int, queries: int, cache: Path | None, calls: int = 2000) -> dict[str, float]:
    """Each measured handler called in-process (no HTTP at all): its median µs, the floor of every stack."""
    from kvindex.http.app import SERVICES

    daemon = await filled_daemon(blocks, queries, cache)
    app, routes, reqs = {SERVICES: daemon.services}, adapter_routes(), bodies(blocks, queries, cache)
    out = {}
    for ep in ENDPOINTS:
        method = "POST" if ep in reqs else "GET"
        times = []
        for _ in range(calls):
            req = AdaptedRequest(app, "application/json", None, reqs.get(ep, b""))
            t0 = time.perf_counter()
            await answer(routes, method, ep, req)
            times.append(time.perf_counter() - t0)
        out[ep] = statistics.median(times) * 1e6
    return out


def baseline_tree(rev: str, tmp: Path) -> Path:
    """kvindex (and its benchmark helpers) at ``rev``, with this tree's built extensions and this script."""
    tree = tmp / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(common.ROOT), "archive", rev, "kvindex", "adapters", "benchmarks/common.py",
                              "benchmarks/gen_workload.py"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    for so in [*common.ROOT.glob("kvindex/**/*.so"), *common.ROOT.glob("adapters/**/*.so")]:  # every extension
        shutil.copy(so, tree / so.relative_to(common.ROOT))
    shutil.copy(HERE, tree / "benchmarks" / HERE.name)
    return tree


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve(stack: str, blocks: int, queries: int, port_file: Path, cache: Path | None) -> None:
    """One stack's server on the filled index; writes its port to ``port_file``, then serves until killed."""
    from kvindex.http.app import SERVICES

    daemon = await filled_daemon(blocks, queries, cache)
    app = {SERVICES: daemon.services}
    if stack.startswith("aiohttp"):
        await daemon.start()
        port = daemon.port
    elif stack.startswith("granian"):
        from granian.constants import HTTPModes, Interfaces
        from granian.server.embed import Server
        port = free_port()
        iface = Interfaces.RSGI if stack == "granian-rsgi" else Interfaces.ASGINL
        target = rsgi_app(app) if stack == "granian-rsgi" else asgi_app(app)
        server = Server(target, address="127.0.0.1", port=port, interface=iface, http=HTTPModes.http1,
                        websockets=False, log_enabled=False, backlog=512)
        asyncio.get_running_loop().create_task(server.serve())
        await asyncio.sleep(0.5)
    elif stack == "httptools":
        routes = adapter_routes()
        server = await asyncio.get_running_loop().create_server(lambda: BareProtocol(app, routes), "127.0.0.1", 0)
        port = int(server.sockets[0].getsockname()[1])
    else:
        import uvicorn
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
        config = uvicorn.Config(asgi_app(app), loop="none", http="httptools", lifespan="off", access_log=False,
                                log_level="warning", ws="none")
        asyncio.get_running_loop().create_task(uvicorn.Server(config).serve(sockets=[sock]))
        await asyncio.sleep(0.5)
    port_file.write_text(str(port))
    await asyncio.Event().wait()


# -- the client side -------------------------------------------------------------------------------
def bodies(blocks: int, queries: int, cache: Path | None = None) -> dict[str, bytes]:
    """The request body per endpoint: the workload's deepest 8k-token query."""
    wl = common.workload(REPLICAS, blocks, queries, cache=cache)
    tokens = common.pick_queries(wl, 1)[0]["token_ids"]
    local = [h - (1 << 64) if h >= 1 << 63 else h for h in K.local_hashes(tokens, BLOCK_SIZE)]
    return {"/query": json.dumps({"token_ids": tokens, "model_name": MODEL}).encode(),
            "/query_by_hash": json.dumps({"block_hashes": local, "model_name": MODEL}).encode(),
            "/v1/score": json.dumps({"model": MODEL, "token_ids": tokens}).encode()}


def fetch(port: int, endpoint: str, body: bytes | None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{endpoint}", data=body,
                                 headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def answers(port: int, reqs: dict[str, bytes]) -> dict[str, Any]:
    """Each endpoint's decoded answer (the check that every stack answers the same)."""
    out: dict[str, Any] = {}
    for ep in ENDPOINTS:
        status, data = fetch(port, ep, reqs.get(ep))
        out[ep] = [status, data.decode() if ep == "/health" else json.loads(data)]
    return out


_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}


def wrk(port: int, endpoint: str, body_file: Path | None, connections: int, seconds: float) -> dict[str, float]:
    """One wrk run: p50/p99 (µs), requests/s, and wrk's own CPU µs per request."""
    script = body_file.with_suffix(".lua") if body_file else None
    if script is not None:
        script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                          f'local f = io.open("{body_file}", "rb")\nwrk.body = f:read("*a")\nf:close()\n')
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s",
           *(["-s", str(script)] if script else []), f"http://127.0.0.1:{port}{endpoint}"]
    before = os.times()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    after = os.times()
    pcts = {p: float(v) * _UNITS[u] for p, v, u in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)}
    if "50" not in pcts or "99" not in pcts:
        raise RuntimeError(f"wrk printed no latency distribution:\n{out}")
    requests = int(re.search(r"^\s+(\d+) requests in", out, re.M)[1])
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)$", out, re.M)
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"p50_us": pcts["50"], "p99_us": pcts["99"], "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1]),
            "client_cpu_us": cpu / max(requests, 1) * 1e6, "non_2xx": int(bad[1]) if bad else 0,
            "socket_errors": errors[1] if errors else ""}


def server_cpu(pid: int) -> float:
    """The process's user+system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(stack: str, a: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen, int]:
    """The stack's server process (the baseline's from its own tree), once it listens: (process, port)."""
    port_file = tmp / f"{stack}.port"
    script = tmp / "baseline" / "benchmarks" / HERE.name if stack == "aiohttp" else HERE
    proc = subprocess.Popen([sys.executable, str(script), "serve", "--stack", stack, "--blocks", str(a.blocks),
                             "--queries", str(a.queries), "--port-file", str(port_file),
                             "--cache", str(common.RESULTS / "workloads")])
    deadline = time.monotonic() + 300
    while not (port_file.exists() and port_file.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{stack} server did not start")
        time.sleep(0.1)
    return proc, int(port_file.read_text())


class DynamoServer:
    """Dynamo's standalone indexer on the workload's bytes (published over ZeroMQ, as vLLM sends them),
    once every event is applied; ``pods`` maps its worker ids to kvindex's pod names."""

    def __init__(self, a: argparse.Namespace, tmp: Path) -> None:
        from dynamo_peer import count_events, start_indexer, wait_active, wait_applied
        from e2e import Publisher

        from kvindex.ingest.streams import split_topic

        wl = common.workload(REPLICAS, a.blocks, a.queries, cache=common.RESULTS / "workloads")
        self.publisher = Publisher(wl.path)
        port, log = free_port(), tmp / "dynamo-indexer.log"
        self.proc = start_indexer(a.dynamo_python, port, self.publisher.endpoints, 2, log)
        self.server = (self.proc, port)
        self.pods = {str(i + 1): split_topic(t)[0] for i, t in enumerate(self.publisher.topics)}
        try:
            wait_active(port, len(self.publisher.endpoints))
            t_go = time.perf_counter()
            self.publisher.go()
            applied = wait_applied(port, count_events(wl.path), 300.0, self.proc, log, t_go)
        except BaseException:
            self.close()
            raise
        if applied["events_ok"] < applied["expected_events"]:
            self.close()
            raise RuntimeError(f"Dynamo applied {applied['events_ok']:.0f} of {applied['expected_events']} events")

    def matched(self, reqs: dict[str, bytes]) -> dict[str, dict[str, int]]:
        """Matched tokens per kvindex pod name on ``/query`` and ``/query_by_hash``."""
        from e2e import matched_tokens

        out = {}
        for ep in DYNAMO_ENDPOINTS:
            status, data = fetch(self.server[1], ep, reqs[ep])
            if status != 200:
                raise RuntimeError(f"Dynamo's {ep} answered {status}: {data[:200]!r}")
            out[ep] = {self.pods[i]: n for i, n in matched_tokens(ep, json.loads(data)).items()}
        return out

    def close(self) -> None:
        from dynamo_peer import stop_indexer

        stop_indexer(self.proc)
        self.publisher.close()


DYNAMO_ENDPOINTS = ("/query", "/query_by_hash")  # what Dynamo serves of ENDPOINTS (and /health)


def served(stack: str, ep: str) -> bool:
    return stack != "dynamo" or ep in DYNAMO_ENDPOINTS or ep == "/health"


def measure(server: tuple[subprocess.Popen, int], ep: str, body_file: Path | None, conns: int, seconds: int) -> dict:
    """One wrk run against one server, with the server's CPU µs per request."""
    proc, port = server
    cpu0 = server_cpu(proc.pid)
    r = wrk(port, ep, body_file, conns, seconds)
    r["server_cpu_us"] = (server_cpu(proc.pid) - cpu0) / max(r["rps"] * seconds, 1) * 1e6
    return r


def summarize(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per stack and endpoint/mode: medians and spread over rounds, ratios against aiohttp, Dynamo
    (when it ran) and the stack's own /health."""
    out: dict[str, dict] = {}
    for stack in rounds[0]:
        out[stack] = {}
        for key in rounds[0][stack]:
            ep, mode = key.rsplit(" ", 1)
            health = f"/health {mode}"
            row: dict[str, Any] = {}
            for metric in ("p50_us", "p99_us", "rps", "client_cpu_us", "server_cpu_us"):
                vals = [r[stack][key][metric] for r in rounds]
                row[metric] = statistics.median(vals)
                row[metric + "_spread"] = [min(vals), max(vals)]
            for peer in ("aiohttp", "dynamo"):
                if key in rounds[0].get(peer, {}):
                    row[f"p50_vs_{peer}"] = statistics.median(r[stack][key]["p50_us"] / r[peer][key]["p50_us"] for r in rounds)
                    row[f"p99_vs_{peer}"] = statistics.median(r[stack][key]["p99_us"] / r[peer][key]["p99_us"] for r in rounds)
                    row[f"rps_vs_{peer}"] = statistics.median(r[stack][key]["rps"] / r[peer][key]["rps"] for r in rounds)
            row["p50_vs_own_health"] = statistics.median(r[stack][key]["p50_us"] / r[stack][health]["p50_us"] for r in rounds)
            row["non_2xx"] = sum(r[stack][key]["non_2xx"] for r in rounds)
            out[stack][key] = row
    return out


def print_table(summary: dict[str, dict]) -> None:
    print(f"{'stack':14} {'endpoint':22} {'p50 µs':>8} {'p99 µs':>8} {'req/s':>8} {'p50 ×a':>7} {'rps ×a':>7} "
          f"{'p50 ×D':>7} {'p99 ×D':>7} {'×health':>7} {'srv µs/req':>10} {'wrk µs/req':>10} {'p50 spread':>16}")
    for stack, rows in summary.items():
        for key, r in rows.items():
            lo, hi = r["p50_us_spread"]
            vs = {k: f"{r[k]:7.2f}" if k in r else f"{'-':>7}"
                  for k in ("p50_vs_aiohttp", "rps_vs_aiohttp", "p50_vs_dynamo", "p99_vs_dynamo")}
            print(f"{stack:14} {key:22} {r['p50_us']:8.0f} {r['p99_us']:8.0f} {r['rps']:8.0f} {vs['p50_vs_aiohttp']} "
                  f"{vs['rps_vs_aiohttp']} {vs['p50_vs_dynamo']} {vs['p99_vs_dynamo']} {r['p50_vs_own_health']:7.2f} "
                  f"{r['server_cpu_us']:10.0f} {r['client_cpu_us']:10.1f} {lo:7.0f}..{hi:<7.0f}")


def check_answers(servers: dict[str, tuple[subprocess.Popen, int]], reqs: dict[str, bytes],
                  dynamo: DynamoServer | None) -> None:
    """Every stack answers as ``aiohttp`` does; Dynamo matches the same tokens per replica."""
    reference = answers(servers["aiohttp"][1], reqs)
    for stack, (_, port) in servers.items():
        if stack not in ("aiohttp", "dynamo") and (got := answers(port, reqs)) != reference:
            raise SystemExit(f"{stack} answers differ from aiohttp's on {[e for e in ENDPOINTS if got[e] != reference[e]]}")
    if dynamo is not None:
        from e2e import matched_tokens

        ours = {ep: matched_tokens(ep, reference[ep][1]) for ep in DYNAMO_ENDPOINTS}
        if (theirs := dynamo.matched(reqs)) != ours:
            raise SystemExit(f"Dynamo's matched tokens differ from kvindex's: {theirs} vs {ours}")


def run(a: argparse.Namespace) -> None:
    stacks = [s for s in a.stacks.split(",") if s]
    if stacks[0] != "aiohttp":
        raise SystemExit("--stacks must start with aiohttp (the baseline)")
    if a.dynamo_python:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)  # this namespace's loopback (see main)
    reqs = bodies(a.blocks, a.queries)
    rounds: list[dict[str, dict]] = []
    handlers: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvindex-http-") as d:
        tmp = Path(d)
        baseline_tree(a.baseline, tmp)
        files = {ep: tmp / f"body{n}.json" for n, ep in enumerate(reqs)}
        for ep, path in files.items():
            path.write_bytes(reqs[ep])
        servers: dict[str, tuple[subprocess.Popen, int]] = {}
        dynamo: DynamoServer | None = None
        try:
            for stack in stacks:  # every server up at once (idle but one): the stacks measured minutes apart
                servers[stack] = start_server(stack, a, tmp)
            if a.dynamo_python:
                dynamo = DynamoServer(a, tmp)
                servers["dynamo"] = dynamo.server
            check_answers(servers, reqs, dynamo)
            names = list(servers)
            modes = (("seq", 1), (f"c{a.connections}", a.connections))
            for n in range(a.rounds):
                this: dict[str, dict] = {stack: {} for stack in names}
                for i, (ep, (mode, conns)) in enumerate((ep, m) for ep in ENDPOINTS for m in modes):
                    k = (n + i) % len(names)  # interleaved: each (endpoint, mode) runs every stack back to back,
                    for stack in names[k:] + names[:k]:  # in an order that rotates
                        if served(stack, ep):
                            this[stack][f"{ep} {mode}"] = measure(servers[stack], ep, files.get(ep), conns, a.seconds)
                rounds.append(this)
                print(f"round {n + 1} done", file=sys.stderr)
        finally:
            if dynamo is not None:
                servers.pop("dynamo", None)
                dynamo.close()
            for proc, _ in servers.values():
                proc.kill()
                proc.wait()
        for _ in range(a.rounds):
            out = subprocess.run([sys.executable, str(HERE), "handlers", "--blocks", str(a.blocks), "--queries",
                                  str(a.queries)], capture_output=True, text=True, check=True).stdout
            handlers.append(json.loads(out))
    summary = summarize(rounds)
    print_table(summary)
    floor = {ep: statistics.median(h[ep] for h in handlers) for ep in ENDPOINTS}
    print("handler alone, in-process (no HTTP), median µs: " + ", ".join(f"{ep} {v:.0f}" for ep, v in floor.items()))
    doc = {"machine": common.machine(), "args": {k: str(v) for k, v in vars(a).items()}, "answers_equal": True,
           "summary": summary, "rounds": rounds, "handler_only_us": handlers,
           "packages": _versions(a.dynamo_python)}
    out = a.out or common.RESULTS / "http_stacks.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"full output: {out}")


def _versions(dynamo_python: str | None) -> dict[str, str | None]:
    from importlib import metadata
    out: dict[str, str | None] = {}
    if dynamo_python:
        out["ai-dynamo-runtime"] = subprocess.run(
            [dynamo_python, "-c", "from importlib import metadata; print(metadata.version('ai-dynamo-runtime'))"],
            capture_output=True, text=True).stdout.strip() or None
    for name in ("aiohttp", "granian", "uvicorn", "httptools", "uvloop"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["wrk"] = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split("\n")[0].strip()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", choices=["run", "serve", "handlers"], default="run")
    p.add_argument("--baseline", default="main", help="run: the git revision whose kvindex is the aiohttp baseline")
    p.add_argument("--out", type=Path, help="run: where the full JSON goes (default benchmarks/results/http_stacks.json)")
    p.add_argument("--cache", type=Path, help="serve/handlers: the workload cache directory")
    p.add_argument("--stack", choices=STACKS, help="serve: which stack")
    p.add_argument("--stacks", default=",".join(STACKS), help="run: the stacks, aiohttp first")
    p.add_argument("--port-file", type=Path)
    p.add_argument("--blocks", type=int, default=300_000, help="block-ops in the 8-replica workload")
    p.add_argument("--queries", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=3, help="per wrk run")
    p.add_argument("--connections", type=int, default=16, help="the concurrent runs' keep-alive connections")
    p.add_argument("--dynamo-python", help="run: a Python that imports ai-dynamo-runtime: Dynamo's indexer joins "
                   "the run as the peer (the whole run then inside unshare -n)")
    a = p.parse_args(argv)
    if a.what == "run" and a.dynamo_python and os.environ.get(NETNS_ENV) != "1":
        env = {**os.environ, NETNS_ENV: "1"}  # Dynamo binds 0.0.0.0: every server and client on a private loopback
        raise SystemExit(subprocess.call(["unshare", "-n", sys.executable, str(HERE), *(argv or sys.argv[1:])], env=env))
    if a.what == "serve":
        from kvindex import loops
        loops.run(serve(a.stack, a.blocks, a.queries, a.port_file, a.cache), os.environ.get(loops.ENV, "auto"))
    elif a.what == "handlers":
        from kvindex import loops
        print(json.dumps(loops.run(handler_times(a.blocks, a.queries, a.cache), os.environ.get(loops.ENV, "auto"))))
    else:
        run(a)


if __name__ == "__main__":
    main()
