"""kvindex SIGKILLed again and again, at random moments: right after a restart, in the middle of a
snapshot write, mid-stream; each time restarted on the same state dir while a simulated vLLM
engine (with a replay endpoint) keeps publishing. At the end its blocks equal the engine's own
truth and an uninterrupted control run's, and no snapshot temp file survived (issue 13, class 1)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from kvindex.persist import snapshot as snapshots
from tests.faultkit import (
    dump,
    free_port,
    http,
    pods,
    replay,
    serve,
    stop,
    stream,
    wait_until,
    write_capture,
)


def engine_arg(pub: int, rep: int) -> str:
    return f"endpoint=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{rep}"


def temp_files(state_dir: Path) -> list[str]:
    return sorted(p.name for p in state_dir.glob(".state.snap.*.tmp"))


def kill_while_writing(p, state_dir: Path, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    """SIGKILL ``p`` as soon as a snapshot temp file exists (mid-write); True if one was caught."""
    deadline = time.monotonic() + timeout
    caught = False
    while time.monotonic() < deadline and not caught:
        caught = bool(temp_files(state_dir))
        if not caught:
            time.sleep(0.0005)
    p.kill()
    p.wait()
    return caught


def test_sigkill_at_random_moments_including_right_after_a_restart(tmp_path: Path) -> None:
    rng = random.Random(13)
    frames, truth = stream(900, seed=13)
    capture = write_capture(tmp_path / "cap.jsonl", frames, dt=0.012)
    pub, rep, ref_port, port = free_port(), free_port(), free_port(), free_port()
    spec = engine_arg(pub, rep)
    state_dir, log = tmp_path / "state", tmp_path / "victim.log"
    ref = serve(ref_port, "--engine", spec)
    victim = serve(port, "--engine", spec, "--state-dir", str(state_dir), "--snapshot-seconds", "0.3", log=log)
    engine = replay(capture, pub, rep, "--speed", "1", "--linger", "3", "--subscribers", "2")
    moments: list[str] = []
    try:
        wait_until(lambda: (pods(port).get("sim-0") or {}).get("last_seq", 0) > 30, 15, "the stream to start")
        for cycle in range(12):
            kind = ("after-restart", "mid-write", "random")[cycle % 3]
            if kind == "after-restart":
                # the window of the old bug: the startup snapshot written, no periodic one yet
                time.sleep(rng.uniform(0.0, 0.15))
                victim.kill()
                victim.wait()
            elif kind == "mid-write":
                kind += "(caught)" if kill_while_writing(victim, state_dir, 2.0) else "(missed)"
            else:
                time.sleep(rng.uniform(0.05, 0.6))
                victim.kill()
                victim.wait()
            moments.append(kind)
            # after-restart kills need a long snapshot period (no periodic snapshot to save them)
            period = "3600" if (cycle + 1) % 3 == 0 else "0.3"
            victim = serve(port, "--engine", spec, "--state-dir", str(state_dir), "--snapshot-seconds", period,
                           log=log)
            stale = [n for n in temp_files(state_dir) if f".{victim.pid}." not in n]
            assert not stale, f"temp files of killed processes survived a restart: {stale} ({moments})"
        assert engine.wait(timeout=60) == 0
        last = len(frames) - 1

        def settled() -> bool:
            mine = pods(port).get("sim-0") or {}
            return mine.get("last_seq") == last == pods(ref_port)["sim-0"]["last_seq"] and bool(mine.get("synced"))

        wait_until(settled, 30, f"both daemons at seq {last}, synced")
        mine, theirs = pods(port)["sim-0"], pods(ref_port)["sim-0"]
        assert mine["blocks"] == theirs["blocks"], (moments, mine, theirs)
        assert dump(port) == dump(ref_port), moments
        status, raw = http(f"http://127.0.0.1:{port}/v1/state")
        assert status == 200
        held = {e.hash for e in snapshots.decode(raw).all_entries()}
        assert held == set(truth.held()), (moments, len(held - set(truth.held())), "phantom blocks")
        print("SIGKILL moments:", moments)  # with -s: how many kills landed mid-write
    finally:
        for p in (engine, ref, victim):
            stop(p)
    assert not temp_files(state_dir), "a temp file survived a clean stop"
    assert not any(f.endswith(".tmp") for f in os.listdir(state_dir))
