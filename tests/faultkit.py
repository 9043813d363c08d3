"""Helpers for the fault and state tests: synthetic engine streams (the simulated vLLM block cache,
so the engine's own truth is known), capture files for ``kvindex replay``, and process probes."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvindex.tools.capture import encode_line
from kvindex.tools.engine_sim import SimulatedCache, encode_batch

KVINDEX = [sys.executable, "-m", "kvindex"]
BLOCK = 4


def stream(n: int, *, pod: str = "sim-0", model: str = "m", seed: int = 0, num_blocks: int = 48,
           start_seq: int = 0) -> tuple[list[tuple[bytes, bytes, bytes]], SimulatedCache]:
    """``n`` engine messages (topic, seq8, payload) of a simulated vLLM engine, and the engine."""
    rng = random.Random(seed)
    cache = SimulatedCache(num_blocks, BLOCK, hash_seed=seed)
    prefixes = [[rng.randrange(1, 5000) for _ in range(BLOCK * rng.randrange(1, 4))] for _ in range(6)]
    topic = f"kv@{pod}@{model}".encode()
    out = []
    seq = start_seq
    while len(out) < n:
        prompt = rng.choice(prefixes) + [rng.randrange(1, 5000) for _ in range(rng.randrange(1, 4 * BLOCK))]
        events = cache.admit(prompt).events
        if not events:
            continue
        out.append((topic, seq.to_bytes(8, "big"), encode_batch(events, time.time())))
        seq += 1
    return out, cache


def write_capture(path: Path, frames: list[tuple[bytes, bytes, bytes]], dt: float) -> Path:
    path.write_text("".join(encode_line(i * dt, f) + "\n" for i, f in enumerate(frames)))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, method: str = "GET", body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, ctype = r.read(), r.status, r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        raw, status, ctype = e.read(), e.code, e.headers.get("Content-Type", "")
    return status, json.loads(raw) if "json" in ctype else raw


def wait_http(url: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            http(url, timeout=1)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait_until(cond: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def serve(port: int, *args: str, log: Path | None = None) -> subprocess.Popen:
    err = open(log, "ab") if log else subprocess.DEVNULL
    try:
        p = subprocess.Popen(KVINDEX + ["serve", "--port", str(port), *args], stdout=subprocess.DEVNULL, stderr=err)
    finally:
        if log:
            err.close()
    wait_http(f"http://127.0.0.1:{port}/healthz")
    wait_until(lambda: not loading(port), 60, "the saved state to load")
    return p


def loading(port: int) -> bool:
    """True while the daemon restores its saved state (HTTP is up, answering 503 "loading")."""
    status, body = http(f"http://127.0.0.1:{port}/readyz")
    return status == 503 and any(str(r).startswith("loading") for r in body.get("reasons", []))


def replay(capture: Path, pub: int, rep: int | None, *extra: str) -> subprocess.Popen:
    args = KVINDEX + ["replay", str(capture), "--publish", f"tcp://127.0.0.1:{pub}"]
    if rep is not None:
        args += ["--replay-endpoint", f"tcp://127.0.0.1:{rep}"]
    return subprocess.Popen(args + list(extra), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pods(port: int) -> dict[str, dict[str, Any]]:
    return {p["pod"]: p for p in http(f"http://127.0.0.1:{port}/v1/pods")[1]["pods"]}


def dump(port: int) -> dict[str, set[tuple[str, int, int, int]]]:
    """``/dump`` as sets of (pod, rank, engine hash, key) per model (event ids are positional)."""
    out: dict[str, set[tuple[str, int, int, int]]] = {}
    for name, entry in http(f"http://127.0.0.1:{port}/dump")[1].items():
        out[name] = {(e["pod"], e["event"]["dp_rank"], b["block_hash"], b["kvindex_key"])
                     for e in entry["events"] for b in e["event"]["data"]["stored"]["blocks"]}
        out[name] |= {tuple(u) for u in entry.get("kvindex_unplaced", ())}
    return out


def held(port: int, pod: str) -> set[int]:
    return {h for (p, _, h, _) in set().union(*dump(port).values()) if p == pod} if dump(port) else set()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stop(p: subprocess.Popen, sig: int | None = None) -> int:
    if p.poll() is None:
        if sig is None:
            p.terminate()
        else:
            p.send_signal(sig)
    try:
        return p.wait(timeout=15)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()
