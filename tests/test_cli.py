"""The command line as a user runs it: real processes, real sockets, signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvindex import native
from kvindex.config import ConfigError
from kvindex.configfile import config_from_toml, parse_engine_spec
from tests.conftest import FIXTURES

KVINDEX = [sys.executable, "-m", "kvindex"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return json.loads(r.read())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_engine_spec_forms() -> None:
    assert parse_engine_spec("tcp://10.0.0.5:5557").endpoint == "tcp://10.0.0.5:5557"
    e = parse_engine_spec("endpoint=tcp://h:1,replay=tcp://h:2,pod=ns/p,model=m,block_size=16,bind=true,dialect=llmd-sim")
    assert (e.replay, e.pod, e.model, e.block_size, e.bind, e.dialect) == ("tcp://h:2", "ns/p", "m", 16, True, "llmd-sim")
    for bad in ("nope", "endpoint=tcp://h:1,colour=red", "endpoint=tcp://h:1,block_size=x", "endpoint=tcp://h:1,dialect=trt"):
        with pytest.raises(ConfigError):
            parse_engine_spec(bad)


def test_toml_config() -> None:
    cfg = config_from_toml({
        "server": {"host": "0.0.0.0", "port": 9000},
        "engines": [{"endpoint": "tcp://*:5557", "bind": True, "dialect": "llmd-sim", "block_size": 16}],
        "models": {"m": {"tokenizer": "llmd-sim"}},
        "approx": {"topKMatches": 3, "models": {"g": {"personality": "gie-v1.5"}}},
        "drift": {"sample_size": 10, "threshold": 0.25},
    })
    assert cfg.port == 9000 and cfg.engines[0].bind and cfg.model("m").tokenizer == "llmd-sim"
    assert cfg.approx.for_model("x").top_k_matches == 3 and cfg.approx.for_model("g").personality == "gie-v1.5"
    assert cfg.drift.sample_size == 10 and cfg.drift.threshold == 0.25
    with pytest.raises(ConfigError, match="tokenize_url"):
        config_from_toml({"models": {"m": {"tokenizer": "engine"}}})


@pytest.mark.parametrize("args,needle", [
    (["serve", "--engine", "not-an-endpoint"], "not a ZeroMQ address"),
    (["serve", "--config", "/nonexistent.toml"], "cannot read config"),
    (["serve", "--token-file", "/nonexistent"], "cannot read token file"),
])
def test_bad_arguments_exit_2_with_one_line(args: list[str], needle: str) -> None:
    r = subprocess.run(KVINDEX + args, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [[], ["serve"], ["record"], ["replay"]])
def test_help(command: list[str]) -> None:
    r = subprocess.run(KVINDEX + command + ["--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "usage: kvindex" in r.stdout


def test_replay_and_serve_processes_end_to_end(tmp_path: Path) -> None:
    """The README's run command, as processes: a fake engine replaying a capture, the daemon."""
    pub, rep, http = free_port(), free_port(), free_port()
    capture = FIXTURES / "two_engines" / "events.jsonl"
    # the engine publishes once the daemon's SUB is there (it waits up to --linger 10 s for it: a loaded
    # machine may take seconds to start the daemon), then answers replays; the daemon is polled until applied
    engine = subprocess.Popen(KVINDEX + ["replay", str(capture), "--publish", f"tcp://127.0.0.1:{pub}",
                                         "--replay-endpoint", f"tcp://127.0.0.1:{rep}", "--linger", "10"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    daemon = subprocess.Popen(KVINDEX + ["serve", "--port", str(http), "--engine",
                                         f"endpoint=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{rep}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, pods = time.monotonic() + 40, []
        while time.monotonic() < deadline:
            try:
                pods = get_json(f"http://127.0.0.1:{http}/v1/pods")["pods"]
            except OSError:  # not listening yet
                pods = []
            if len(pods) == 2 and sum(p["blocks"]["gpu"] for p in pods) == 1753 - 1502 and all(p["synced"] for p in pods):
                break
            time.sleep(0.1)
        assert {p["pod"] for p in pods} == {"127.0.0.1:8000", "127.0.0.1:8001"}
        assert all(p["synced"] and p["last_seq"] is not None for p in pods)
        assert sum(p["blocks"]["gpu"] for p in pods) == 1753 - 1502, pods
    finally:
        engine.kill()
        engine.wait(timeout=15)
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=15)
    assert daemon.returncode == 0, err
    assert "kvindex stopped" in err


def test_record_writes_the_fixture_format(tmp_path: Path) -> None:
    pub = free_port()
    out = tmp_path / "rec.jsonl"
    rec = subprocess.Popen(KVINDEX + ["record", f"tcp://127.0.0.1:{pub}", "-o", str(out), "--max-messages", "18"],
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "KVINDEX_LOG_LEVEL": "INFO"})
    assert rec.stderr is not None
    head = []  # the recorder's SUB socket is open once it says so (then the replay's linger covers the join)
    while not head or "recording " not in head[-1]:
        head.append(rec.stderr.readline())
        assert head[-1], f"the recorder ended before recording: {''.join(head)}"
    engine = subprocess.run(KVINDEX + ["replay", str(FIXTURES / "small" / "events.jsonl"), "--publish",
                                       f"tcp://127.0.0.1:{pub}", "--linger", "1.5"], capture_output=True, timeout=60)
    assert engine.returncode == 0
    _, err = rec.communicate(timeout=30)
    assert rec.returncode == 0, "".join(head) + err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    original = [json.loads(x)["frames"] for x in (FIXTURES / "small" / "events.jsonl").read_text().splitlines()]
    assert [x["frames"] for x in lines] == original


def test_ranks_of_one_pod_are_separate_engines_and_endpoints_are_unique() -> None:
    from kvindex.config import Config
    from kvindex.configfile import with_overrides

    cfg = with_overrides(Config(), host=None, port=None, engines=[
        "endpoint=tcp://h:5557,pod=p,dp_rank=0", "endpoint=tcp://h:5558,pod=p,dp_rank=1"])
    assert len({e.lane_key for e in cfg.engines}) == 2
    with pytest.raises(ConfigError, match="configured twice"):
        with_overrides(cfg, host=None, port=None, engines=["tcp://h:5557"])


@pytest.mark.parametrize("flag,loop", [([], "uvloop"), (["--event-loop", "asyncio"], "asyncio")])
def test_serve_logs_its_event_loop_and_native_accelerators(flag: list[str], loop: str) -> None:
    """uvloop by default (a dependency on Linux), asyncio's on request; the log says which, and
    which native accelerators run (CI requires them all)."""
    with subprocess.Popen(KVINDEX + flag + ["serve", "--port", "0"], stderr=subprocess.PIPE, text=True) as proc:
        try:
            line = ""
            while "listening" not in line:
                line = proc.stderr.readline()
                assert line, "serve exited before listening"
            assert f"event loop {loop};" in line and native.status() in line, line
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0
