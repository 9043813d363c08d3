"""The state dir at start: one daemon per directory (issue 13, class 8) and a disk that cannot be
written (class 12). Real ``kvindex serve`` processes, real files, real OSErrors.

How "disk full" is made: ``RLIMIT_FSIZE`` set in the child before exec (and ``SIGXFSZ`` ignored):
every write past the limit fails with EFBIG, an ``OSError`` on the same code paths as ENOSPC, for
any user and without mounting anything (a tiny tmpfs would need root and ``mount``, not
available everywhere). ``resource.prlimit`` on the running daemon then "frees the disk"."""

from __future__ import annotations

import resource
import signal
import socket
import subprocess
from pathlib import Path

from kvindex.persist import snapshot as snapshots
from kvindex.persist.wal import segments
from tests.faultkit import (
    KVINDEX,
    free_port,
    http,
    pods,
    serve,
    stop,
    wait_http,
    wait_until,
)

MSGS = [{"role": "system", "content": "you are a state dir tester " * 4}]


def decide(port: int, i: int, pod: str = "a", words: int = 40) -> None:
    status, body = http(f"http://127.0.0.1:{port}/v1/decisions", "POST", {
        "pod": pod, "request": {"model": "m", "messages": MSGS + [{"role": "user", "content": f"question {i} " * words}]}})
    assert status == 200, body


def approx_entries(port: int) -> dict[str, int]:
    return {p: v["approx_entries"] for p, v in pods(port).items()}


def metric(port: int, name: str) -> float:
    text = http(f"http://127.0.0.1:{port}/metrics")[1].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# -- class 8: two daemons, one state dir ---------------------------------------------------------
def test_a_second_daemon_on_the_same_state_dir_exits_2_naming_the_holder(tmp_path: Path) -> None:
    state_dir, port = tmp_path / "state", free_port()
    first = serve(port, "--state-dir", str(state_dir), "--snapshot-seconds", "3600")
    try:
        for i in range(3):
            decide(port, i)
        before = {n: (state_dir / f"wal-{n:08d}.log").stat().st_size for n in segments(state_dir)}
        second = subprocess.run(KVINDEX + ["serve", "--port", str(free_port()), "--state-dir", str(state_dir)],
                                check=False, capture_output=True, text=True, timeout=30)
        assert second.returncode == 2, second.stderr
        lines = [line for line in second.stderr.splitlines() if line.startswith("kvindex: ")]  # the rest: log
        assert len(lines) == 1 and f"pid {first.pid}" in lines[0] and socket.gethostname() in lines[0], lines
        assert "Traceback" not in second.stderr and "listening" not in second.stderr
        assert "state dir" in lines[0] and str(state_dir) in lines[0]
        after = {n: (state_dir / f"wal-{n:08d}.log").stat().st_size for n in segments(state_dir)}
        assert after == before, "the second daemon touched the first one's log"
        decide(port, 3)  # the first one is unharmed
        expected = approx_entries(port)
    finally:
        stop(first, signal.SIGKILL)  # the kernel releases the lock of a killed holder
    port2 = free_port()
    again = serve(port2, "--state-dir", str(state_dir))
    try:
        assert approx_entries(port2) == expected
    finally:
        assert stop(again) == 0


# -- class 12: a disk that cannot be written at start --------------------------------------------
def test_disk_full_at_start_serves_exactly_and_retries_the_snapshot(tmp_path: Path) -> None:
    state_dir, port = tmp_path / "state", free_port()
    p = serve(port, "--state-dir", str(state_dir), "--snapshot-seconds", "3600")
    for i in range(80):
        decide(port, i, pod=f"p{i % 4}", words=120)
    expected = approx_entries(port)
    assert stop(p, signal.SIGTERM) == 0  # final snapshot
    snap = state_dir / snapshots.SNAPSHOT_NAME
    limit = snap.stat().st_size // 2  # no new snapshot fits; a few log records do
    assert limit > 6 << 10, "make the state bigger"

    def full_disk() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))  # soft: prlimit lifts it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    port = free_port()
    with open(tmp_path / "daemon.log", "wb") as err:
        daemon = subprocess.Popen(KVINDEX + ["serve", "--port", str(port), "--state-dir", str(state_dir),
                                             "--snapshot-seconds", "0.5"],
                                  stdout=subprocess.DEVNULL, stderr=err, preexec_fn=full_disk)  # noqa: PLW1509 (no threads yet)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)  # it did not exit 1 at the snapshot
        wait_until(lambda: http(f"http://127.0.0.1:{port}/readyz")[0] == 200, 30, "ready")
        assert daemon.poll() is None
        assert approx_entries(port) == expected  # answers are exact
        wait_until(lambda: metric(port, "kvindex_snapshot_errors_total") >= 2, 20, "failed snapshots counted, retried")
        assert not list(state_dir.glob(".state.snap.*.tmp")), "a failed write left its temp file"
        log = (tmp_path / "daemon.log").read_text()
        assert "startup snapshot failed" in log and "periodic snapshot failed" in log
        decide(port, 100, pod="after")  # logged: the old segments are kept, a new one takes it
        expected = approx_entries(port)
        saved = snapshots.read_file(snap)
        assert saved is not None
        resource.prlimit(daemon.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        wait_until(lambda: (s := snapshots.read_file(snap)) is not None and s.created > saved.created, 20,
                   "a snapshot once the disk is free")
        assert metric(port, "kvindex_wal_degraded ") == 0.0
    finally:
        stop(daemon, signal.SIGKILL)
    port = free_port()
    again = serve(port, "--state-dir", str(state_dir))
    try:
        assert approx_entries(port) == expected
    finally:
        assert stop(again) == 0


def test_the_lock_file_names_its_holder(tmp_path: Path) -> None:
    """The lock file is the only file the lock adds; it names its holder."""
    state_dir, port = tmp_path / "state", free_port()
    p = serve(port, "--state-dir", str(state_dir))
    try:
        assert (state_dir / "lock").read_text().split()[:2] == ["pid", str(p.pid)]
    finally:
        assert stop(p) == 0
