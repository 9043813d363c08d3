"""The token and the bind address through the real CLI: an empty ``KVINDEX_TOKEN`` is refused, a
trailing newline is stripped as the token file's is, ``--auth all`` needs a token, and serving a
non-loopback address without a token says so at start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.test_cli import KVINDEX, free_port

WARNING = "without a token"


def env(**kw: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "KVINDEX_TOKEN"}
    out.update(kw)
    return out


def start(args: list[str], environ: dict[str, str]) -> tuple[subprocess.Popen, list[str]]:
    """A ``kvindex serve`` and its log lines up to the one saying it listens."""
    p = subprocess.Popen(KVINDEX + ["serve", *args], stderr=subprocess.PIPE, text=True, env=environ)
    assert p.stderr is not None
    lines: list[str] = []
    while not lines or "listening" not in lines[-1]:
        lines.append(p.stderr.readline())
        if not lines[-1]:
            p.wait(timeout=30)
            raise AssertionError("serve exited before listening: " + "".join(lines))
    return p, lines


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    assert p.returncode == 0


def status(url: str, method: str = "GET", token: str | None = None, body: Any = None) -> int:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("value", ["", " ", "\n", " \t\n"])
def test_an_empty_kvindex_token_is_refused(value: str) -> None:
    r = subprocess.run(KVINDEX + ["serve", "--port", str(free_port())], capture_output=True, text=True, timeout=30,
                       env=env(KVINDEX_TOKEN=value), check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "KVINDEX_TOKEN" in lines[0] and "empty" in lines[0], r.stderr


def test_auth_all_without_a_token_is_refused() -> None:
    r = subprocess.run(KVINDEX + ["serve", "--port", str(free_port()), "--auth", "all"], capture_output=True,
                       text=True, timeout=30, env=env(), check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--auth all" in r.stderr, r.stderr


def test_kvindex_token_is_stripped_and_auth_all_guards_reads() -> None:
    port = free_port()
    p, lines = start(["--port", str(port), "--auth", "all"], env(KVINDEX_TOKEN="s3cret\n"))
    base = f"http://127.0.0.1:{port}"
    try:
        assert not any(WARNING in line for line in lines), lines
        assert status(base + "/register", "POST", None, {}) == 401
        assert status(base + "/register", "POST", "s3cret", {}) == 400  # past the token: a bad body
        assert status(base + "/v1/pods") == 401 and status(base + "/v1/pods", token="s3cret") == 200
        assert status(base + "/healthz") == 200 and status(base + "/readyz") in (200, 503)
    finally:
        stop(p)


@pytest.mark.parametrize("host,token,warned", [("0.0.0.0", None, True), ("0.0.0.0", "s3cret", False),
                                               ("127.0.0.1", None, False), ("localhost", None, False)])
def test_a_reachable_bind_without_a_token_is_warned_about(host: str, token: str | None, warned: bool) -> None:
    environ = env() if token is None else env(KVINDEX_TOKEN=token)
    p, lines = start(["--host", host, "--port", str(free_port())], environ)
    try:
        hits = [line for line in lines if WARNING in line]
        assert bool(hits) == warned, lines
        if warned:
            assert "WARNING" in hits[0] and host in hits[0]
    finally:
        stop(p)
