"""Shared pieces of the benchmark: workloads (generated once, cached), queries, machine facts.

Invariants:
- A workload is identified by its generator arguments; the cached file under
  ``benchmarks/results/workloads/`` is reused only when its sidecar records the same arguments.
- Queries are 8k-token prompts (``QUERY_TOKENS`` + 1 tokens, so both kvindex, which never counts
  the block holding the last prompt token, and Dynamo, which hashes every full block, look at
  exactly 512 blocks of 16): the workload's own next prompts with the deepest matches, padded.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from random import Random
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODEL = "bench-model"
BLOCK_SIZE = 16
QUERY_BLOCKS = 512
QUERY_TOKENS = QUERY_BLOCKS * BLOCK_SIZE
# kvindex's and Dynamo's RSS are both read this long after their last batch was applied: kvindex
# gives a backlog's memory back once its queues were quiet for 50 ms (kvindex.ingest.backlog)
RSS_SETTLE_SECONDS = 0.3

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvindex import loops, native  # noqa: E402
from kvindex.tools.workload import read_messages

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Workload:
    """A generated message file, loaded into memory, and its sidecar."""

    path: Path
    replicas: int
    messages: list[tuple[str, int, bytes]]
    sidecar: dict

    @property
    def block_ops(self) -> int:
        """Stored + removed block hashes in the whole file."""
        return int(self.sidecar["stats"]["block_ops"])

    @property
    def topics(self) -> list[str]:
        """One topic per replica, in replica order."""
        return list(self.sidecar["topics"])

    def last_seqs(self) -> dict[str, int]:
        """Per topic: the seq of its last message."""
        return {t: n - 1 for t, n in zip(self.topics, self.sidecar["stats"]["batches_per_replica"]) if n}


def gen_args(replicas: int, blocks: int, queries: int) -> list[str]:
    """gen_workload arguments: design-load shape, round-robin routing (deep prefixes on many pods)."""
    return ["--replicas", str(replicas), "--blocks", str(blocks), "--routing", "rr",
            "--dialect", "map", "--capacity", "26000", "--block-size", str(BLOCK_SIZE),
            "--queries", str(queries), "--model", MODEL, "--quiet"]


def workload(replicas: int, blocks: int, queries: int = 128, cache: Path | None = None) -> Workload:
    """Generate (or reuse from ``cache``) the workload for ``replicas`` and load it."""
    cache = cache or RESULTS / "workloads"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"r{replicas}_b{blocks}_q{queries}_map_int.bin"
    side = path.with_name(path.name + ".json")
    args = gen_args(replicas, blocks, queries)
    if not (path.exists() and side.exists() and _same_params(side, replicas, blocks, queries)):
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gen_workload.py"), str(path), *args]
        subprocess.run(cmd, check=True)
    return Workload(path, replicas, list(read_messages(path)), json.loads(side.read_text()))


TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def trace_workload(replicas: int, capacity: int, requests: int | None, queries: int,
                   cache: Path | None = None) -> Workload:
    """The Mooncake trace replayed by benchmarks/trace_workload.py (generated once, cached), loaded."""
    cache = cache or RESULTS / "workloads"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"mooncake_r{replicas}_c{capacity}_n{requests or 'all'}_q{queries}.bin"
    side = path.with_name(path.name + ".json")
    want = {"replicas": replicas, "capacity": capacity, "requests": requests, "queries": queries, "model": MODEL}
    try:
        fresh = {k: json.loads(side.read_text())["params"].get(k) for k in want} == want and path.exists()
    except (OSError, ValueError, KeyError):
        fresh = False
    if not fresh:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "trace_workload.py"), str(path), "--trace", str(TRACE),
               "--replicas", str(replicas), "--capacity", str(capacity), "--queries", str(queries),
               "--model", MODEL, "--quiet", *(["--requests", str(requests)] if requests else [])]
        subprocess.run(cmd, check=True)
    return Workload(path, replicas, list(read_messages(path)), json.loads(side.read_text()))


def _same_params(side: Path, replicas: int, blocks: int, queries: int) -> bool:
    """Whether a cached sidecar was generated with these arguments."""
    try:
        p = json.loads(side.read_text())["params"]
    except (OSError, ValueError, KeyError):
        return False
    return (p.get("replicas"), p.get("blocks"), p.get("queries"), p.get("routing"), p.get("model")) == (
        replicas, blocks, queries, "rr", MODEL)


def pick_queries(wl: Workload, count: int) -> list[dict]:
    """The ``count`` sidecar queries with the most matched blocks summed over pods, padded to 8k.

    Each result: ``token_ids`` (QUERY_TOKENS + 1 tokens) and ``expected`` blocks per replica
    index (the generator's ``prefix_blocks``, capped at QUERY_BLOCKS).
    """
    ranked = sorted(wl.sidecar["queries"], key=lambda q: -sum(q["prefix_blocks"]))[:count]
    out = []
    for n, q in enumerate(ranked):
        rng = Random(1_000_003 + n)
        tokens = list(q["token_ids"][:QUERY_TOKENS])
        tokens += [rng.randrange(32000, 64000) for _ in range(QUERY_TOKENS + 1 - len(tokens))]
        expected = [min(b, QUERY_BLOCKS, len(q["token_ids"]) // BLOCK_SIZE) for b in q["prefix_blocks"]]
        out.append({"token_ids": tokens, "expected": expected})
    return out


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank on sorted values."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, round(q / 100 * (len(s) - 1))))
    return s[k]


def latency_summary(seconds: list[float]) -> dict[str, float]:
    """p50/p99/mean in microseconds."""
    us = [x * 1e6 for x in seconds]
    return {"p50_us": pct(us, 50), "p99_us": pct(us, 99), "mean_us": statistics.fmean(us) if us else 0.0,
            "n": len(us)}


def free_port() -> int:
    """A TCP port on loopback nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes() -> int:
    """This process's resident set size (VmRSS) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def machine() -> dict:
    """CPU model, core count, Python and package versions."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    pkgs = {}
    for name in ("kvindex", "pyzmq", "msgpack", "msgspec", "aiohttp", "uvloop", "xxhash", "ai-dynamo-runtime"):
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "packages": pkgs, "git": git_state(),
            "event_loop": loops.factory(os.environ.get(loops.ENV, "auto"))[0], "native": native.status()}


def run_daemon(main: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine that drives an in-process Daemon on the loop ``kvindex serve`` would use."""
    return loops.run(main, os.environ.get(loops.ENV, "auto"))


def git_state() -> dict:
    """The measured tree: HEAD commit and the kvindex/adapters files changed since (read-only git)."""
    def git(*args: str) -> str:
        """stdout of a read-only git command, or "" when git is missing."""
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.rstrip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "kvindex", "adapters").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or None, "modified": dirty}
