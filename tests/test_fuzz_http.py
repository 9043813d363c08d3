"""Arbitrary JSON, msgpack and bytes at every HTTP endpoint of one live daemon (a real process,
holding real blocks from a recorded vLLM capture and a few decisions): no 5xx ever, every
rejection a 4xx ``{"error", "field"}``, and a rejected body changes nothing."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import FIXTURES
from tests.faultkit import free_port, replay, serve, stop, wait_until

EXAMPLES = 200
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-1, 2**64 + 1)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=10), c, max_size=5),
                      max_leaves=20)
FIELDS = ["model", "model_name", "prompt", "messages", "input", "instructions", "token_ids", "pods", "pod", "request",
          "cached_tokens", "prompt_tokens", "decisions", "instance_id", "endpoint", "replay_endpoint", "block_size",
          "dp_rank", "routing_group", "block_hashes", "lora_name", "cache_salt"]
near_valid = st.fixed_dictionaries({}, optional={f: values for f in FIELDS}) | st.fixed_dictionaries(
    {"model": st.just("tiny"), "model_name": st.just("tiny")},
    optional={"token_ids": st.lists(st.integers(-5, 2**33), max_size=40) | values, "pods": values,
              "prompt": values, "messages": values, "block_hashes": values, "cache_salt": values})
bodies = values | near_valid
packable = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
                        | st.binary(max_size=20),
                        lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=10) | st.integers(0, 9), c,
                                                                            max_size=5), max_leaves=20)

POSTS = ["/v1/score", "/v1/decisions", "/v1/approx/explain", "/register", "/unregister", "/query", "/query_by_hash",
         "/v1/pods/127.0.0.1:8000/resync"]
MUTATING = {"/v1/decisions", "/register", "/unregister", "/v1/pods/127.0.0.1:8000/resync"}
GETS = ["/", "/healthz", "/metrics", "/v1/pods", "/v1/drift", "/v1/drift/history", "/v1/state", "/workers", "/dump",
        "/health", "/readyz"]


class Client:
    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def request(self, method: str, path: str, body: bytes | None = None, ctype: str = "application/json") -> tuple[int, bytes, str]:
        for attempt in (0, 1):
            try:
                self.conn.request(method, path, body=body, headers={"Content-Type": ctype} if body is not None else {})
                r = self.conn.getresponse()
                return r.status, r.read(), r.getheader("Content-Type", "")
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def state(self) -> tuple[Any, Any]:
        pods = json.loads(self.request("GET", "/v1/pods")[1])
        for p in pods["pods"]:
            p.pop("last_event_age_seconds", None)
            p.pop("connected", None)
        return pods, json.loads(self.request("GET", "/dump")[1])


@pytest.fixture(scope="module")
def daemon() -> Iterator[Client]:
    pub, port = free_port(), free_port()
    proc = serve(port, "--engine", f"endpoint=tcp://127.0.0.1:{pub}")
    engine = replay(FIXTURES / "small" / "events.jsonl", pub, None, "--linger", "1")
    client = Client(port)
    try:
        assert engine.wait(timeout=30) == 0
        wait_until(lambda: any(p["last_seq"] == 17 for p in json.loads(client.request("GET", "/v1/pods")[1])["pods"]),
                   10, "capture applied")
        for i in range(3):
            status, body, _ = client.request("POST", "/v1/decisions", json.dumps(
                {"pod": f"p{i}", "request": {"model": "tiny", "prompt": f"hello {i} " * 40}}).encode())
            assert status == 200, body
        yield client
    finally:
        client.conn.close()
        engine.kill() if engine.poll() is None else None
        assert stop(proc) == 0


def check_answer(status: int, raw: bytes, ctype: str, where: str) -> None:
    assert status < 500, f"{where}: {status} {raw[:300]!r}"
    if status >= 400:
        err = json.loads(raw)
        assert isinstance(err, dict) and isinstance(err.get("error"), str) and "field" in err, (where, raw[:300])
        assert "\n" not in err["error"]


def _post(client: Client, path: str, data: bytes, ctype: str, baseline: dict[str, Any]) -> None:
    status, raw, rctype = client.request("POST", path, data, ctype)
    check_answer(status, raw, rctype, f"POST {path} {data[:200]!r}")
    if path in MUTATING:
        now = client.state()
        if status >= 400:
            assert now == baseline["state"], f"rejected POST {path} {data[:200]!r} changed state"
        baseline["state"] = now


@pytest.mark.parametrize("path", POSTS)
def test_arbitrary_json(daemon: Client, path: str) -> None:
    baseline = {"state": daemon.state()}
    start = baseline["state"]

    @FUZZ
    @given(body=bodies)
    def run(body: Any) -> None:
        _post(daemon, path, json.dumps(body).encode(), "application/json", baseline)

    run()
    if path not in MUTATING:
        assert daemon.state() == start


@pytest.mark.parametrize("path", POSTS)
def test_arbitrary_bytes(daemon: Client, path: str) -> None:
    baseline = {"state": daemon.state()}

    @settings(FUZZ, max_examples=EXAMPLES // 2)
    @given(data=st.binary(max_size=300) | packable.map(lambda v: msgpack.packb(v, use_bin_type=True)),
           ctype=st.sampled_from(["application/json", "application/msgpack", "text/plain", "application/octet-stream"]))
    def run(data: bytes, ctype: str) -> None:
        _post(daemon, path, data, ctype, baseline)

    run()


def test_paths_and_query_strings(daemon: Client) -> None:
    baseline = daemon.state()

    @settings(FUZZ, max_examples=EXAMPLES)
    @given(text=st.text(max_size=40), method=st.sampled_from(["GET", "DELETE", "POST"]),
           route=st.sampled_from(["/v1/pods/{}", "/v1/pods/{}/resync", "/v1/drift?window={}", "/workers?model_name={}",
                                  "/v1/drift?recheck={}"]))
    def run(text: str, method: str, route: str) -> None:
        path = route.format(quote(text, safe=""))
        if text in ("127.0.0.1:8000", "p0", "p1", "p2") and method in ("DELETE", "POST"):
            return  # would legitimately remove or resync a real pod
        status, raw, ctype = daemon.request(method, path, b"{}" if method == "POST" else None)
        check_answer(status, raw, ctype, f"{method} {path}")

    run()
    assert daemon.state() == baseline


def test_every_get_endpoint_answers(daemon: Client) -> None:
    for path in GETS:
        status, raw, ctype = daemon.request("GET", path)
        if path == "/readyz":
            assert status in (200, 503)  # the capture's engine has gone: not ready, rightly
            continue
        check_answer(status, raw, ctype, path)
        assert status == 200, path


def test_oversized_body_is_413(daemon: Client) -> None:
    status, raw, ctype = daemon.request("POST", "/v1/score", b"[" + b"1," * (5 << 20) + b"1]")
    assert status == 413 and json.loads(raw)["field"] == "body"
