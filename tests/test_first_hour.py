"""A new user's first hour (issue 15, part 4), as real processes: the build that says which
accelerator it skipped and why, tests that skip saying what to install, an engine address that is
not ZeroMQ, a log that says "connected" only when it is and warns when an engine stays silent,
/v1/pods listing configured engines that never published with the age of the last event, a
block-size warning naming both sizes, a score that says why it has no precise answer, --log-level
after the subcommand, and ``kvindex replay``'s --linger and --loop as their help says."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from kvindex import native
from kvindex.config import Config
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, ROOT, engine_config, ipc_endpoint, wait_for
from tests.faultkit import stream

KVINDEX = [sys.executable, "-m", "kvindex"]
SMALL = FIXTURES / "small" / "events.jsonl"  # model "tiny", pod 127.0.0.1:8000, 18 batches, block size 32
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def wait_until(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except OSError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Serve:
    """``kvindex serve`` as a subprocess; its log in a file."""

    def __init__(self, tmp: Path, *args: str, toml: str = "") -> None:
        self.port = free_port()
        self.log_path = tmp / f"serve-{self.port}.log"
        config = tmp / f"kvindex-{self.port}.toml"
        config.write_text(textwrap.dedent(toml))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(KVINDEX + ["serve", "--port", str(self.port), "--config", str(config),
                                                    *args], stdout=subprocess.DEVNULL, stderr=log, env=ENV)
        wait_until(lambda: self.get("/healthz"), 30, "kvindex serve up")

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def get(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return http(f"http://127.0.0.1:{self.port}{path}", body)

    def pod(self, name: str) -> dict[str, Any] | None:
        return next((p for p in self.get("/v1/pods")["pods"] if p["pod"] == name), None)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Serve]]:
    made: list[Serve] = []

    def make(*args: str, toml: str = "") -> Serve:
        made.append(Serve(tmp_path, *args, toml=toml))
        return made[-1]
    yield make
    for s in made:
        s.stop()


def replay(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(KVINDEX + ["replay", str(SMALL), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV)


# -- the test suite: missing programs skip saying why, and fail in CI --------------------------
@pytest.mark.parametrize("ci,outcome", [(None, "skipped"), ("true", "failed")])
def test_a_missing_program_skips_naming_it_and_fails_in_ci(tmp_path: Path, ci: str | None, outcome: str) -> None:
    (tmp_path / "test_needs.py").write_text("from tests.programs import need\n\n"
                                           "def test_it():\n    need('no-such-program', None, 'no-such-package')\n")
    env = {k: v for k, v in ENV.items() if k != "CI"} | ({"CI": ci} if ci else {})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=False)
    assert f"1 {outcome}" in r.stdout, r.stdout
    assert "no-such-program is not installed" in r.stdout and "apt-get install -y no-such-package" in r.stdout
    assert "gcc libc6-dev redis-server chromium" in r.stdout, r.stdout  # everything the suite needs


# -- the build and the start line name what is really missing ----------------------------------
def test_the_build_says_loudly_which_accelerator_it_skipped_and_how_to_fix_it(tmp_path: Path) -> None:
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    for pkg in ("kvindex", "adapters"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        for c in [*(ROOT / pkg).glob("_*.c"), *(ROOT / pkg).glob("*.h")]:
            shutil.copy(c, tmp_path / pkg / c.name)
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path, timeout=120,
                       capture_output=True, text=True, env={**ENV, "CC": "no-such-cc"}, check=False)
    assert r.returncode == 0, r.stderr  # optional: kvindex still installs
    assert "native accelerators NOT built" in r.stderr, r.stderr
    for name in native.ACCELERATORS:
        assert f"  - {name}: no C compiler (no-such-cc is not on PATH)" in r.stderr, r.stderr
    assert "apt-get install -y gcc libc6-dev\n" in r.stderr  # a compiler is all the build needs
    assert "NOT built" in (tmp_path / "build" / "kvindex-native-warnings.txt").read_text()


def test_the_start_line_never_asks_for_an_installed_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("needs a C compiler on PATH (apt-get install -y gcc)")
    text = native.fix(["kvindex._keys"])
    assert "is installed" in text and "read its warnings" in text, text
    assert "apt-get install" not in text and "xxhash" not in text, text
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert native.fix(["kvindex.index._core"]).startswith("no C compiler found: apt-get install gcc")


# -- an engine address that is not ZeroMQ -------------------------------------------------------
@pytest.mark.parametrize("spec", ["http://127.0.0.1:8000", "endpoint=https://vllm:8000,pod=p"])
def test_an_http_engine_exits_2_with_one_line_naming_the_flag_and_the_fix(spec: str) -> None:
    r = subprocess.run(KVINDEX + ["serve", "--port", "0", "--engine", spec], capture_output=True, text=True,
                       timeout=30, env=ENV, check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is not a ZeroMQ transport" in r.stderr and "tcp://host:port" in r.stderr and "Traceback" not in r.stderr


# -- connected only when it is; a silent engine is warned about; /v1/pods lists it -------------
def test_an_engine_is_subscribed_then_connected_and_its_pod_row_tells_its_age(serve: Callable[..., Serve]) -> None:
    pub = free_port()
    s = serve("--engine", f"endpoint=tcp://127.0.0.1:{pub},pod=p0,model=tiny",
              toml="[server]\nengine_silent_seconds = 0.5\n")
    wait_until(lambda: "not connected to" in s.log, 20, "the silence warning")
    assert f"engine p0: subscribing to tcp://127.0.0.1:{pub}" in s.log, s.log
    assert "connected to tcp" not in s.log.replace("not connected to", ""), s.log
    assert f"WARNING kvindex.ingest.lane: engine p0: not connected to tcp://127.0.0.1:{pub} after 0.5 s" in s.log
    row = s.pod("p0")  # configured, never published: listed, its age null (never)
    assert row is not None and row["connected"] is False and row["last_event_age_seconds"] is None, row
    assert row["endpoint"] == f"tcp://127.0.0.1:{pub}" and row["batches"] == 0, row
    engine = replay("--publish", f"tcp://127.0.0.1:{pub}", "--linger", "30")
    try:
        wait_until(lambda: f"engine p0: connected to tcp://127.0.0.1:{pub}" in s.log, 20, "connected")
        row = wait_until(lambda: (r := s.pod("p0")) and r["last_seq"] == 17 and r, 20, "the capture applied")
        assert row["connected"] is True and 0 <= row["last_event_age_seconds"] < 10, row
        time.sleep(0.3)
        later = s.pod("p0")["last_event_age_seconds"]
        assert later >= row["last_event_age_seconds"] + 0.25, (row, later)  # seconds since, not a constant
    finally:
        engine.kill()
        engine.wait()


def test_a_connected_engine_that_publishes_nothing_is_warned_about(serve: Callable[..., Serve], tmp_path: Path) -> None:
    pub = free_port()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    engine = subprocess.Popen(KVINDEX + ["replay", str(empty), "--publish", f"tcp://127.0.0.1:{pub}", "--linger", "60"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        s = serve("--engine", f"endpoint=tcp://127.0.0.1:{pub},pod=quiet", toml="[server]\nengine_silent_seconds = 1\n")
        wait_until(lambda: "nothing published in 1 s" in s.log, 20, "the silence warning")
        assert "engine quiet: connected to" in s.log and "are KV events enabled" in s.log, s.log
    finally:
        engine.kill()
        engine.wait()


# -- a block-size mismatch names both sizes ----------------------------------------------------
def test_a_block_size_mismatch_warning_names_both_sizes(serve: Callable[..., Serve], tmp_path: Path) -> None:
    """Pod A's engine stores blocks of model tiny at 32 tokens (the capture); pod B's says 16."""
    first = load_capture(SMALL)[0]
    ts, events = msgpack.unpackb(first.frames[2])[:2]
    other = tmp_path / "other.jsonl"
    payload = msgpack.packb([ts, [{**events[0], "block_size": 16}]])
    other.write_text(json.dumps({"t": 0.0, "frames": [base64.b64encode(f).decode() for f in
                                                      (b"kv@pod-b@tiny", (0).to_bytes(8, "big"), payload)]}) + "\n")
    a, b = free_port(), free_port()
    s = serve("--engine", f"tcp://127.0.0.1:{a}", "--engine", f"tcp://127.0.0.1:{b}")
    engines = [replay("--publish", f"tcp://127.0.0.1:{a}", "--linger", "30")]
    try:
        wait_until(lambda: (r := s.pod("127.0.0.1:8000")) and r["last_seq"] == 17, 20, "pod A applied")
        engines.append(subprocess.Popen(KVINDEX + ["replay", str(other), "--publish", f"tcp://127.0.0.1:{b}",
                                                   "--linger", "30"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, env=ENV))
        line = wait_until(lambda: next((ln for ln in s.log.splitlines() if "block_size_mismatch" in ln), None), 20,
                          "the mismatch warning")
        assert "pod pod-b: 1 BlockStored event(s) with block size 16, but model tiny's block size is 32" in line, line
    finally:
        for engine in engines:
            engine.kill()
            engine.wait()


# -- a score without a tokenizer says why --------------------------------------------------------
def test_a_chat_score_without_a_tokenizer_says_why_precise_is_null(serve: Callable[..., Serve]) -> None:
    s = serve()
    got = s.get("/v1/score", {"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "hi"}]})
    assert got["precise_reason"] == ('no tokenizer configured for model Qwen/Qwen3-8B: give token_ids, or set '
                                     '[models."Qwen/Qwen3-8B"] tokenizer ("hf" with tokenizer_path, "engine" or "render" '
                                     'with tokenize_url, or "llmd-sim")'), got
    assert s.get("/v1/score", {"model": "m", "token_ids": [1, 2, 3]})["precise_reason"] is None


# -- --log-level after the subcommand ------------------------------------------------------------
def test_log_level_works_after_the_subcommand_and_is_listed(tmp_path: Path) -> None:
    for command in ("serve", "record", "replay", "demo"):
        r = subprocess.run(KVINDEX + [command, "--help"], capture_output=True, text=True, timeout=30, env=ENV, check=False)
        assert "--log-level LEVEL" in r.stdout, (command, r.stdout)
    missing = str(tmp_path / "missing.jsonl")
    loud = subprocess.run(KVINDEX + ["replay", missing, "--publish", "tcp://127.0.0.1:1"], capture_output=True,
                          text=True, timeout=30, env=ENV, check=False)
    assert loud.returncode == 2 and "ERROR kvindex.tools.fake_engine: cannot load capture" in loud.stderr
    for args in (["replay", missing, "--publish", "tcp://127.0.0.1:1", "--log-level", "critical"],
                 ["--log-level", "critical", "replay", missing, "--publish", "tcp://127.0.0.1:1"]):
        quiet = subprocess.run(KVINDEX + args, capture_output=True, text=True, timeout=30, env=ENV, check=False)
        assert quiet.returncode == 2 and quiet.stderr == "", (args, quiet.stderr)


# -- replay: --linger is a bound, not a sleep; --loop keeps seq counting -------------------------
def subscriber(port: int) -> tuple[zmq.Context, zmq.Socket]:
    """A SUB socket on every topic of tcp://127.0.0.1:``port``, waiting at most 20 s per message."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 20_000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return ctx, sub


def test_replay_publishes_once_subscribed_and_ends_when_the_subscriber_leaves() -> None:
    port = free_port()
    ctx, sub = subscriber(port)
    t0 = time.monotonic()
    engine = replay("--publish", f"tcp://127.0.0.1:{port}", "--linger", "600")
    try:
        seqs = [int.from_bytes(sub.recv_multipart()[1], "big") for _ in range(18)]
        assert seqs == list(range(18)) and time.monotonic() - t0 < 20  # not 600 s of waiting first
        sub.close(linger=0)
        assert engine.wait(timeout=30) == 0  # every subscriber left: done, not 600 s later
        assert time.monotonic() - t0 < 40
    finally:
        engine.kill()
        ctx.term()


def test_replay_loop_keeps_seq_counting_across_rounds() -> None:
    port = free_port()
    ctx, sub = subscriber(port)
    engine = replay("--publish", f"tcp://127.0.0.1:{port}", "--loop", "--speed", "50")
    try:
        frames = [sub.recv_multipart() for _ in range(40)]
        assert [int.from_bytes(f[1], "big") for f in frames] == list(range(40))  # 18 a round, no restart at 0
        assert frames[18][2] == frames[0][2] and frames[18][0] == frames[0][0]  # the events repeat as recorded
    finally:
        engine.kill()
        engine.wait()
        sub.close(linger=0)
        ctx.term()


# -- a failed catch-up: the log, /v1/pods, /readyz and kvindex_pod_synced agree ----------------
async def test_a_catch_up_from_a_dead_replay_endpoint_is_unsynced_everywhere(make_harness: Any, make_engine: Any,
                                                                             tmp_path: Path, caplog: Any) -> None:
    """kvindex stops at seq 19 (state saved); when it comes back the engine's replay endpoint
    answers nothing. The log says UNSYNCED, and so do /v1/pods, /readyz and the metric (issue 15:
    before issue 13's fix they said synced)."""
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "rep"))
    config = Config(engines=(engine_config(engine),), state_dir=tmp_path / "state", replay_timeout=0.3)
    h = await make_harness(config)
    await h.wait_connected()
    frames, _ = stream(20, seed=7)
    for f in frames:
        await engine.publish(f)
    await h.wait_seq("sim-0", 19)
    await h.daemon.stop()
    await engine.close()  # the replay endpoint is gone
    caplog.set_level(logging.WARNING, logger="kvindex.ingest.lane")
    h2 = await make_harness(config)
    await wait_for(lambda: (s := h2.stream("sim-0")) is not None and not s.synced, 10, "the catch-up's verdict")
    reason = h2.stream("sim-0").unsynced_reason
    assert any("pod sim-0: UNSYNCED" in r.getMessage() for r in caplog.records), caplog.text
    _, pods = await h2.get("/v1/pods")
    (view,) = [p for p in pods["pods"] if p["pod"] == "sim-0"]
    assert view["synced"] is False and view["unsynced_reason"] == reason, view
    status, ready = await h2.get("/readyz")
    assert status == 503 and f"pod sim-0: unsynced ({reason})" in ready["reasons"], ready
    _, body = await h2.get("/metrics")
    assert re.search(r'kvindex_pod_synced\{pod="sim-0"\} 0\.0', body.decode()), body.decode()[:2000]
