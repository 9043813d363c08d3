"""Hostile input and resource floods at the HTTP edge of a live daemon (issue 13, classes 11, 16, 19, 21).

Real ``kvindex serve`` processes (their stderr log captured), real sockets, real ZeroMQ engines
(``FakeEngine`` in this process; its replay buffer is the engine's truth for a gap). Expected values
come from the test's own construction: the bodies it sent, the frames it published, the limits it
configured, the open-file limit it gave the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvindex.config import Config
from kvindex.daemon import Daemon
from kvindex.query.decisions import MAX_DECISION_PODS
from kvindex.http.bodies import MAX_DEPTH
from kvindex.limits import MAX_ID_CHARS, MAX_MODEL_CHARS, MAX_SALT_CHARS
from kvindex.logs import BurstLog, OneLine, shown
from kvindex.tools.fake_engine import FakeEngine
from tests.faultkit import (
    KVINDEX,
    free_port,
    open_fds,
    serve,
    stop,
    stream,
    wait_http,
    wait_until,
    write_capture,
)

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: ")


# -- helpers -------------------------------------------------------------------------------------
class Client:
    """One keep-alive HTTP/1.1 connection (reopened when the server closed it)."""

    def __init__(self, port: int, timeout: float = 30) -> None:
        self.port, self.timeout = port, timeout
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def request(self, method: str, path: str, body: bytes | None = None,
                ctype: str = "application/json") -> tuple[int, bytes]:
        headers = {"Content-Type": ctype} if body is not None else {}
        self.conn.request(method, path, body=body, headers=headers)
        r = self.conn.getresponse()
        return r.status, r.read()

    def json(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, raw = self.request(method, path, None if body is None else json.dumps(body).encode())
        return status, json.loads(raw) if raw else None

    def close(self) -> None:
        self.conn.close()


def counters(client: Client, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    status, raw = client.request("GET", "/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(raw.decode()):
        if fam.name == family:
            for s in fam.samples:
                if s.name == family + "_total":
                    out[tuple(sorted(s.labels.items()))] = s.value
    return out


def log_lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines()


def assert_one_line_records(log: Path) -> None:
    """Every line of the log is a record's own line (a timestamped header), no traceback."""
    lines = log_lines(log)
    assert not [ln for ln in lines if "Traceback" in ln], "\n".join(lines[-40:])
    stray = [ln for ln in lines if not LOG_LINE.match(ln)]
    assert not stray, stray[:5]


async def post_routes() -> list[str]:
    """Every POST route of the daemon's application, from its router (path parameters filled in)."""
    d = Daemon(Config())
    try:
        paths = sorted({r.resource.canonical for r in d.app.router.routes() if r.method == "POST" and r.resource})
    finally:
        await d.stop()
    assert len(paths) >= 7
    return [re.sub(r"\{[^}]+\}", "x", p) for p in paths]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Client, Path]]:
    port, log = free_port(), tmp_path / "kvindex.log"
    proc = serve(port, log=log)
    client = Client(port)
    try:
        yield client, log
    finally:
        client.close()
        assert stop(proc) == 0


def deep_json(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "array" else '{"a":' * depth + "1" + "}" * depth


# -- class 11: every body error is a 4xx, counted, one line ------------------------------------------
def test_deeply_nested_and_hostile_bodies_are_4xx_on_every_post_route(daemon: tuple[Client, Path]) -> None:
    client, log = daemon
    routes = asyncio.run(post_routes())
    base = {"model": "m", "model_name": "m", "token_ids": [1, 2, 3], "instance_id": 1, "endpoint": "tcp://h:1",
            "block_size": 16, "pod": "p", "request": {"model": "m", "prompt": "hi"}}
    bodies: list[tuple[bytes, str]] = []
    for depth in (MAX_DEPTH + 1, 990, 5000, 100_000):
        for kind in ("array", "object"):
            bodies.append((deep_json(depth, kind).encode(), "application/json"))  # the whole body
            for field in ("prompt", "messages", "token_ids", "block_hashes", "request", "pods", "x"):
                bodies.append(((json.dumps(base)[:-1] + f', "{field}": {deep_json(depth, kind)}}}').encode(),
                               "application/json"))
    for depth in (MAX_DEPTH + 1, 500, 5000):  # msgpack: under and past msgpack's own stack limit
        bodies.append((b"\x91" * depth + b"\xc0", "application/msgpack"))
        bodies.append((b"\x82\xaamodel_name\xa1m\xa9token_ids" + b"\x91" * depth + b"\x01", "application/msgpack"))
    before = counters(client, "kvindex_http_rejections")
    deep = 0
    for path in routes:
        for body, ctype in bodies:
            status, raw = client.request("POST", path, body, ctype)
            assert 400 <= status < 500, (path, body[:80], status, raw[:200])
            err = json.loads(raw)
            assert isinstance(err["error"], str) and "\n" not in err["error"] and "field" in err, raw[:200]
            deep += err["error"].startswith("body nests")
    after = counters(client, "kvindex_http_rejections")
    too_deep = {k: v - before.get(k, 0) for k, v in after.items() if dict(k)["reason"] == "too_deep"}
    assert sum(too_deep.values()) == deep > 0
    # every route that reads a body said so in its own words, and counted it under its endpoint
    assert {dict(k)["endpoint"] for k in too_deep} == {p for p in routes if not p.endswith("/resync")}
    # a body within the depth limit is still answered as before
    status, _ = client.json("POST", "/query", {"model_name": "m", "token_ids": [1, 2], "x": [[[[1]]]]})
    assert status == 200
    # logged without a traceback, one line per (endpoint, reason) per interval: not one per request
    assert_one_line_records(log)
    refused = [ln for ln in log_lines(log) if "POST /query refused 400 (too_deep)" in ln]
    assert len(refused) == 1, refused


# -- class 21: -0 as a token id, one rule --------------------------------------------------------------
def test_negative_zero_token_id_is_refused_by_every_endpoint_that_takes_token_ids(daemon: tuple[Client, Path]) -> None:
    client, _ = daemon
    for path, body in (("/query", '{"model_name": "m", "token_ids": [1, -0, 2]}'),
                       ("/v1/score", '{"model": "m", "token_ids": [1, -0, 2]}'),
                       ("/v1/decisions", '{"pod": "p", "request": {"model": "m"}, "token_ids": [-0]}'),
                       ("/v1/decisions", '{"decisions": [{"pod": "p", "request": {"model": "m"}, "token_ids": [-0]}]}')):
        status, raw = client.request("POST", path, body.encode())
        assert status == 400 and json.loads(raw)["field"] == "token_ids", (path, raw)
    for path, body in (("/query", '{"model_name": "m", "token_ids": [1, 0, 2]}'),  # 0 itself is a token id
                       ("/v1/score", '{"model": "m", "token_ids": [1, 0, 2]}'),
                       ("/query", '{"model_name": "m-0", "token_ids": [1, 0], "x": "-0"}')):  # -0 elsewhere
        status, raw = client.request("POST", path, body.encode())
        assert status == 200, (path, raw)


# -- class 16: names are bounded at entry, and logged on one line --------------------------------------
def test_names_over_their_limit_are_refused_naming_the_field_and_the_limit(daemon: tuple[Client, Path]) -> None:
    client, _ = daemon
    reg = {"instance_id": "i", "model_name": "m", "endpoint": "tcp://127.0.0.1:1", "block_size": 16}
    long_id, long_model, long_salt = "i" * (MAX_ID_CHARS + 1), "m" * (MAX_MODEL_CHARS + 1), "s" * (MAX_SALT_CHARS + 1)
    cases = [
        ("/register", {**reg, "instance_id": long_id}, "instance_id", MAX_ID_CHARS),
        ("/register", {**reg, "instance_id": "i" * (1 << 20)}, "instance_id", MAX_ID_CHARS),  # the 1 MB id
        ("/register", {**reg, "model_name": long_model}, "model_name", MAX_MODEL_CHARS),
        ("/register", {**reg, "routing_group": long_id}, "routing_group", MAX_ID_CHARS),
        ("/unregister", {"instance_id": long_id, "model_name": "m"}, "instance_id", MAX_ID_CHARS),
        ("/query", {"model_name": long_model, "token_ids": [1]}, "model_name", MAX_MODEL_CHARS),
        ("/query", {"model_name": "m", "token_ids": [1], "lora_name": long_id}, "lora_name", MAX_ID_CHARS),
        ("/query", {"model_name": "m", "token_ids": [1], "cache_salt": long_salt}, "cache_salt", MAX_SALT_CHARS),
        ("/query_by_hash", {"model_name": long_model, "block_hashes": [1]}, "model_name", MAX_MODEL_CHARS),
        ("/v1/score", {"model": long_model, "token_ids": [1]}, "model", MAX_MODEL_CHARS),
        ("/v1/score", {"model": "m", "token_ids": [1], "pods": ["p", long_id]}, "pods", MAX_ID_CHARS),
        ("/v1/score", {"model": "m", "token_ids": [1], "lora_name": long_id}, "lora_name", MAX_ID_CHARS),
        ("/v1/score", {"model": "m", "token_ids": [1], "cache_salt": long_salt}, "cache_salt", MAX_SALT_CHARS),
        ("/v1/decisions", {"pod": long_id, "request": {"model": "m", "prompt": "x"}}, "pod", MAX_ID_CHARS),
        ("/v1/decisions", {"pod": "p", "request": {"model": long_model, "prompt": "x"}}, "request.model",
         MAX_MODEL_CHARS),
        ("/v1/approx/explain", {"request": {"model": long_model, "prompt": "x"}}, "model", MAX_MODEL_CHARS),
    ]
    for path, body, field, limit in cases:
        status, err = client.json("POST", path, body)
        assert status == 400 and err["field"] == field and str(limit) in err["error"], (path, field, err)
    status, err = client.json("GET", "/v1/pods/" + long_id)
    assert status == 400 and err["field"] == "pod"
    status, got = client.json("POST", "/register", {**reg, "instance_id": "i" * MAX_ID_CHARS})  # at the limit: fine
    assert status == 201, got


FORGED = "2026-12-02 00:00:00,000 ERROR kvindex.daemon: FORGED"


def test_an_exceptions_text_is_escaped_like_any_name() -> None:
    """A peer's error text reaches the log inside an exception (``%s`` of a StateError, a
    ZMQError): the filter escapes it as it does a string argument."""
    record = logging.LogRecord("kvindex", logging.WARNING, __file__, 1, "peer failed: %s (%r)",
                               (ValueError("bad\n" + FORGED), "x"), None)
    OneLine().filter(record)
    assert "\n" not in record.getMessage() and FORGED in record.getMessage()


def test_names_with_newlines_cannot_forge_log_lines(tmp_path: Path) -> None:
    """An instance id and a path carrying a newline and a fake log header, an engine's topic
    carrying one (refused: bad_topic), and an over-long topic: the daemon's log stays one record
    per line, the names escaped."""
    port, pub, log = free_port(), free_port(), tmp_path / "kvindex.log"
    evil_pod = "evil\n" + FORGED
    frames = stream(3, pod=evil_pod)[0] + [(b"kv@" + b"p" * 5000 + b"@m", (9).to_bytes(8, "big"), b"\x90")]
    capture = write_capture(tmp_path / "evil.jsonl", frames, 0.01)
    proc = serve(port, "--engine", f"endpoint=tcp://127.0.0.1:{pub}", log=log)
    client = Client(port)
    try:
        status, got = client.json("POST", "/register", {"instance_id": "id\n" + FORGED, "model_name": "m\r\nx",
                                                        "endpoint": "tcp://127.0.0.1:1", "block_size": 16})
        assert status == 201, got
        status, _ = client.request("GET", "/v1/pods/a%0A" + FORGED.replace(" ", "%20"))
        assert status == 404
        engine = subprocess.Popen(KVINDEX + ["replay", str(capture), "--publish", f"tcp://127.0.0.1:{pub}",
                                             "--linger", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert engine.wait(timeout=30) == 0
        # a topic with a control character is refused and counted, never a pod (issue 37, item 12)
        errors = wait_until(lambda: (e := counters(client, "kvindex_decode_errors")) and any(
            dict(k)["reason"] == "bad_topic" and v >= 3 for k, v in e.items()) and e, 10, "the evil topic's batches")
        assert any(dict(k)["reason"] == "topic_too_long" and v >= 1 for k, v in errors.items()), errors
        assert evil_pod not in {p["pod"] for p in client.json("GET", "/v1/pods")[1]["pods"]}
        assert not any(len(p["pod"]) > MAX_ID_CHARS + MAX_MODEL_CHARS for p in client.json("GET", "/v1/pods")[1]["pods"])
    finally:
        client.close()
        assert stop(proc) == 0
    assert_one_line_records(log)
    text = log.read_text()
    assert not [ln for ln in text.splitlines() if ln.startswith(FORGED[:23])]
    assert "id\\n" + FORGED in text  # escaped, and there


# -- class 19: connections capped, slow headers and bodies cut off -----------------------------------
def config_file(tmp_path: Path, **server: Any) -> Path:
    path = tmp_path / "kvindex.toml"
    path.write_text("[server]\n" + "".join(f"{k} = {v!r}\n" for k, v in server.items()))
    return path


def refused_or_open(socks: list[socket.socket], wait: float) -> tuple[int, int]:
    """How many of ``socks`` were answered 503 and closed, and how many are still open and silent."""
    refused = silent = 0
    deadline = time.monotonic() + wait
    for s in socks:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = s.recv(4096)
        except TimeoutError:
            silent += 1
            continue
        refused += data.startswith(b"HTTP/1.1 503") and b"too many connections" in data
    return refused, silent


def test_connections_past_the_cap_are_refused_and_those_within_keep_being_served(tmp_path: Path) -> None:
    port, cap = free_port(), 20
    proc = serve(port, "--max-connections", str(cap), log=tmp_path / "kvindex.log")
    client = Client(port)
    socks: list[socket.socket] = []
    try:
        assert client.json("GET", "/healthz")[0] == 200  # one connection within the cap, kept alive
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]  # idle, half-open-like
        refused, silent = refused_or_open(socks, 5.0)
        assert silent == cap - 1 and refused == 300 - silent, (refused, silent)
        for _ in range(5):  # the connection within the cap is served throughout
            assert client.json("GET", "/healthz")[0] == 200
        assert open_fds(proc.pid) < 100  # refused connections hold no descriptor
        assert counters(client, "kvindex_http_connections_refused")[()] == refused
        for s in socks:
            s.close()
        wait_until(lambda: http_ok(port), 10, "new connections served once the flood ends")
    finally:
        for s in socks:
            s.close()
        client.close()
        assert stop(proc) == 0


def http_ok(port: int) -> bool:
    c = Client(port, timeout=5)
    try:
        return c.request("GET", "/healthz")[0] == 200
    except OSError:
        return False
    finally:
        c.close()


def closed_within(s: socket.socket, seconds: float, trickle: bytes = b"") -> tuple[float, bytes]:
    """Send ``trickle`` a byte every 0.2 s until the server closes ``s``; (seconds taken, what it answered)."""
    t0, got = time.monotonic(), b""
    s.settimeout(0.2)
    while time.monotonic() - t0 < seconds:
        if trickle:
            try:
                s.sendall(trickle[:1])
            except OSError:
                break
        try:
            data = s.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
        if not data:
            break
        got += data
    return time.monotonic() - t0, got


def test_slow_headers_and_trickled_bodies_are_cut_off(tmp_path: Path) -> None:
    port = free_port()
    proc = serve(port, "--config", str(config_file(tmp_path, idle_timeout=1.5, body_timeout=1.5)),
                 log=tmp_path / "kvindex.log")
    socks: list[socket.socket] = []

    def connect() -> socket.socket:
        socks.append(socket.create_connection(("127.0.0.1", port)))
        return socks[-1]
    try:
        taken, got = closed_within(connect(), 15)  # connects and says nothing
        assert got == b"" and 1.0 < taken < 6, taken
        slow = connect()
        slow.sendall(b"GET /healthz HTTP/1.1\r\n")  # then a header trickled at 5 B/s
        taken, got = closed_within(slow, 15, trickle=b"X" * 1000)
        assert got == b"" and taken < 6, (taken, got)
        body = connect()
        body.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        taken, got = closed_within(body, 15, trickle=b" " * 1000)  # a body trickled at 5 B/s
        assert got.startswith(b"HTTP/1.1 408") and b'"field": "body"' in got and taken < 8, (taken, got)
        assert http_ok(port)
    finally:
        for s in socks:
            s.close()
        assert stop(proc) == 0


# -- class 19: descriptors kept for the engines; a replay out of them recovers -----------------------
NOFILE = 128  # the daemon's open-file limit (soft and hard) in these tests


def kvindex_with_nofile(soft: int, hard: int, *args: str) -> list[str]:
    """``python -m kvindex ARGS`` run with the open-file limit (soft, hard): set, then exec'd (no
    preexec_fn: this process runs threads)."""
    code = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
            "os.execv(sys.executable, [sys.executable, '-m', 'kvindex', *sys.argv[1:]])")
    return [KVINDEX[0], "-c", code, *args]


def start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as err:
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)


def pod_view(client: Client, pod: str) -> dict[str, Any] | None:
    return {p["pod"]: p for p in client.json("GET", "/v1/pods")[1]["pods"]}.get(pod)


async def run_flood(tmp_path: Path, *serve_args: str, expect_wait: bool) -> None:
    """A daemon with ``NOFILE`` descriptors and one engine (replay on); a connection flood; during it
    a seq gap only the engine's replay can fill; then the flood ends. ``expect_wait``: the flood
    exhausts the daemon's descriptors (no cap given), so the replay must wait for them."""
    engine = FakeEngine("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    await engine.start()
    port, log = free_port(), tmp_path / "kvindex.log"
    proc = await asyncio.to_thread(start, kvindex_with_nofile(
        NOFILE, NOFILE, "serve", "--port", str(port), "--engine",
        f"endpoint={engine.endpoint},replay={engine.replay_address}", *serve_args), log)
    flood: list[socket.socket] = []
    client = Client(port)
    try:
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/healthz")
        await engine.wait_subscribers(1)
        frames, truth = stream(20, seed=5)
        for f in frames[:10]:
            await engine.publish(f)
        await asyncio.to_thread(wait_until, lambda: (pod_view(client, "sim-0") or {}).get("last_seq") == 9, 10, "seq 9")
        for _ in range(3 * NOFILE):  # far more connections than the daemon has descriptors
            flood.append(socket.create_connection(("127.0.0.1", port)))
        if expect_wait:
            await asyncio.to_thread(wait_until, lambda: open_fds(proc.pid) >= NOFILE - 1, 10, "descriptors exhausted")
        else:  # the cap holds: descriptors are left for the engines
            await asyncio.sleep(1.0)
            assert open_fds(proc.pid) < NOFILE - 8
        await engine.publish(frames[10], replay_only=True)  # the gap: only the replay has seq 10
        for f in frames[11:]:
            await engine.publish(f)
        if expect_wait:  # meanwhile: unsynced, with the reason
            view = await asyncio.to_thread(wait_until, lambda: (v := pod_view(client, "sim-0")) and not v["synced"] and v,
                                           10, "the pod shown unsynced while its replay waits")
            assert view["unsynced_reason"] == "replay_waiting_for_file_descriptors", view
            await asyncio.sleep(1.0)
            for s in flood:
                s.close()
        view = await asyncio.to_thread(
            wait_until, lambda: (v := pod_view(client, "sim-0")) and v["synced"] and v["last_seq"] == 19 and v, 30,
            "the pod synced again at seq 19")
        dumped = client.json("GET", "/dump")[1].values()  # placed in Dynamo's tree (--dynamo-dump) or not
        held = {b["block_hash"] for group in dumped for e in group["events"]
                if e["pod"] == "sim-0" for b in e["event"]["data"]["stored"]["blocks"]}
        held |= {u[2] for group in dumped for u in group.get("kvindex_unplaced", ()) if u[0] == "sim-0"}
        assert held == set(truth.held())  # exactly the engine's blocks: the gap was filled, nothing lost
        assert view["replays"] >= 1 and view["gaps"] >= 1
    finally:
        for s in flood:
            s.close()
        client.close()
        assert stop(proc) == 0
        await engine.close()


async def test_default_connection_cap_keeps_descriptors_for_the_engines(tmp_path: Path) -> None:
    await run_flood(tmp_path, expect_wait=False)


async def test_replay_out_of_descriptors_waits_unsynced_and_recovers_after_the_flood(tmp_path: Path) -> None:
    await run_flood(tmp_path, "--max-connections", "100000", expect_wait=True)


def test_soft_open_file_limit_raised_to_the_hard_one_and_the_cap_derived_from_it(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "kvindex.log"
    proc = start(kvindex_with_nofile(64, 2048, "serve", "--port", str(port)), log)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        assert re.search(r"Max open files\s+2048\s+2048", limits), limits
    finally:
        assert stop(proc) == 0
    assert "at most 1792 connections" in log.read_text()  # 2048 less the 256 kept for everything but HTTP


# -- class 21: decisions cannot flood the pod directory -----------------------------------------------
def test_decisions_for_unknown_pods_are_bounded(daemon: tuple[Client, Path]) -> None:
    client, log = daemon

    def decide(pod: str) -> tuple[int, Any]:
        return client.json("POST", "/v1/decisions", {"pod": pod, "request": {"model": "m", "prompt": f"hello {pod} " * 8}})

    for i in range(MAX_DECISION_PODS):
        status, got = decide(f"router-pod-{i}")
        assert status == 200, got
    for i in range(MAX_DECISION_PODS, MAX_DECISION_PODS + 50):
        status, err = decide(f"router-pod-{i}")
        assert status == 409 and err["field"] == "pod" and f"router-pod-{i}" in err["error"], err
    status, got = decide("router-pod-7")  # a pod already known keeps being decided for
    assert status == 200, got
    status, got = client.json("POST", "/v1/decisions", {"decisions": [  # a batch is refused whole
        {"pod": "router-pod-1", "request": {"model": "m", "prompt": "a " * 8}},
        {"pod": "yet-another", "request": {"model": "m", "prompt": "b " * 8}}]})
    assert status == 409
    pods = client.json("GET", "/v1/pods")[1]["pods"]
    assert len(pods) == MAX_DECISION_PODS and "yet-another" not in {p["pod"] for p in pods}
    rejected = counters(client, "kvindex_http_rejections")
    assert rejected[(("endpoint", "/v1/decisions"), ("reason", "unknown_pod"))] == 51
    assert len([ln for ln in log_lines(log) if "(unknown_pod)" in ln]) == 1  # rate-limited: one line


def test_refusal_log_is_one_line_per_reason_per_interval_with_the_suppressed_count(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    burst = BurstLog(logging.getLogger("kvindex.test"), interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvindex.test"):
        for i in range(100):
            now[0] = i * 0.05  # 100 refusals in 5 s
            burst.log(logging.INFO, ("/query", "too_deep"), "refused %s", shown("a\nb" * 200))
            burst.log(logging.INFO, ("/query", "malformed"), "refused")
        now[0] = 11.0
        burst.log(logging.INFO, ("/query", "too_deep"), "refused %s", "x")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "\n" not in lines[0] and lines[0].endswith("more chars]")
    assert lines[2] == "refused x (99 more like this suppressed)"


def test_malformed_http_is_logged_once_per_interval_without_tracebacks(daemon: tuple[Client, Path]) -> None:
    client, log = daemon
    port = client.port
    bad = [b"POST /query HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\nzz\r\n",
           b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
           b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\":"]  # then cut short
    for _ in range(20):
        for req in bad:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(req)
                s.shutdown(socket.SHUT_WR)
                s.settimeout(5)
                with contextlib.suppress(OSError):
                    s.recv(4096)
    assert client.json("GET", "/healthz")[0] == 200
    wait_until(lambda: counters(client, "kvindex_http_rejections").get(
        (("endpoint", "/query"), ("reason", "body_incomplete")), 0) == 20, 10, "the cut bodies counted")
    assert_one_line_records(log)
    lines = log_lines(log)
    server = [ln for ln in lines if "kvindex.http.server" in ln]
    assert 1 <= len(server) <= 2 and all("BadHttpMessage" in ln or "LineTooLong" in ln for ln in server), server
    assert len([ln for ln in lines if "(body_incomplete)" in ln]) == 1
