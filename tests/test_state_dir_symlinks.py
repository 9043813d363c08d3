"""The state dir's files are never opened through a symlink (issue 37, item 7): a link planted at
the snapshot's temp name, at a log segment's name or at the lock's name never lets kvindex write
the file it points to; the directory is opened once, refused when it is a link or others may write
it, and every file is reached through it (a real ``kvindex serve``)."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from kvindex.persist.lock import LOCK_NAME, StateDirLock, StateDirUnusable
from kvindex.persist.records import Decision, read_from, segment_path
from kvindex.persist.snapshot import temp_path, write_atomic
from kvindex.persist.wal import WriteAheadLog
from tests.faultkit import KVINDEX, free_port, http, serve, stop, wait_until

PRECIOUS = b"a file outside the state dir\n"


def victim(tmp_path: Path) -> Path:
    v = tmp_path / "outside" / "victim"
    v.parent.mkdir()
    v.write_bytes(PRECIOUS)
    return v


def test_a_link_at_the_snapshots_temp_name_is_replaced_not_followed(tmp_path: Path) -> None:
    state, v = tmp_path / "state", victim(tmp_path)
    state.mkdir()
    snapshot = state / "snapshot.bin"
    temp_path(snapshot).symlink_to(v)  # the temp name is predictable: .snapshot.bin.<pid>.tmp
    write_atomic(snapshot, b"new snapshot")
    assert v.read_bytes() == PRECIOUS and snapshot.read_bytes() == b"new snapshot"
    assert not temp_path(snapshot).exists() and not temp_path(snapshot).is_symlink()


def test_a_link_at_a_log_segment_is_an_error_and_never_written(tmp_path: Path) -> None:
    state, v = tmp_path / "state", victim(tmp_path)
    state.mkdir()
    segment_path(state, 1).symlink_to(v)
    errors: list[str] = []
    wal = WriteAheadLog(state, fsync="never", segment=1, on_error=errors.append)
    assert not wal.append(Decision("p", "m", (1,)))  # the link is never opened: the record is lost, counted
    wal.close()
    assert v.read_bytes() == PRECIOUS and "open" in errors


def test_a_link_at_the_lock_refuses_the_state_dir(tmp_path: Path) -> None:
    state, v = tmp_path / "state", victim(tmp_path)
    state.mkdir()
    (state / LOCK_NAME).symlink_to(v)
    with pytest.raises(StateDirUnusable, match="cannot open lock: it is a symbolic link, never followed"):
        StateDirLock(state).acquire()
    assert v.read_bytes() == PRECIOUS
    assert "cannot open lock: it is a symbolic link" in refused(state)  # kvindex serve: exit 2, one line


def test_a_link_at_a_log_segment_is_never_read(tmp_path: Path) -> None:
    """A link at a segment's name is a damaged segment: its target's records are not replayed."""
    state, outside = tmp_path / "state", tmp_path / "outside"
    state.mkdir()
    wal = WriteAheadLog(outside, fsync="never", segment=1)
    assert wal.append(Decision("planted", "m", (1, 2, 3)))
    wal.close()
    segment_path(state, 1).symlink_to(segment_path(outside, 1))
    assert list(read_from(outside, 0)) == [Decision("planted", "m", (1, 2, 3))]  # a valid segment there
    assert list(read_from(state, 0)) == []  # main's code read (and replayed) the planted record


# -- the directory itself: opened once, checked, every file reached through it ---------------------
def refused(state: Path) -> str:
    """``kvindex serve --state-dir state`` exits 2: its one line."""
    try:
        run = subprocess.run(KVINDEX + ["serve", "--port", str(free_port()), "--state-dir", str(state)],
                             check=False, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvindex serve started on {state} (still serving after 20 s)")
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("kvindex: ")]
    assert len(lines) == 1 and "Traceback" not in run.stderr and "listening" not in run.stderr, run.stderr
    return lines[0]


def test_a_state_dir_that_is_a_link_or_others_may_write_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert "is a symbolic link" in refused(link) and os.listdir(target) == []  # nothing written there
    shared = tmp_path / "shared"  # a Kubernetes emptyDir: 0777
    shared.mkdir()
    shared.chmod(0o777)
    assert "writable by every user" in refused(shared) and os.listdir(shared) == []
    if os.geteuid() == 0:  # another user's directory, another group's (only root can make them here)
        theirs, group = tmp_path / "theirs", tmp_path / "group"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        assert "owned by uid 65534" in refused(theirs) and os.listdir(theirs) == []
        group.mkdir()
        group.chmod(0o770)
        os.chown(group, -1, 65534)
        assert "writable by group 65534" in refused(group) and os.listdir(group) == []
    inside, port = shared / "kvindex", free_port()  # the way out: a directory of its own inside it
    p = serve(port, "--state-dir", str(inside), "--snapshot-seconds", "3600")
    try:
        assert stat.S_IMODE(inside.stat().st_mode) == 0o700 and inside.stat().st_uid == os.geteuid()
        assert (inside / "state.snap").is_file()
    finally:
        assert stop(p) == 0


def test_the_state_dir_swapped_for_a_link_after_start_is_never_written_through(tmp_path: Path) -> None:
    """Every file is opened relative to the directory kvindex opened at start: moving the state
    dir away and planting a link to another directory at its path sends no snapshot, log segment
    or temp file there; they go on in the directory kvindex opened."""
    state, moved, port = tmp_path / "state", tmp_path / "moved", free_port()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = serve(port, "--state-dir", str(state), "--snapshot-seconds", "0.2")
    try:
        first = (state / "state.snap").stat().st_mtime_ns
        state.rename(moved)
        state.symlink_to(elsewhere)
        for i in range(5):  # logged changes, and snapshots every 0.2 s rotate the log
            status, _ = http(f"http://127.0.0.1:{port}/v1/decisions", "POST", {
                "pod": "a", "request": {"model": "m", "prompt": f"question {i} " * 40}})
            assert status == 200
        wait_until(lambda: os.listdir(elsewhere) or (moved / "state.snap").stat().st_mtime_ns > first, 10,
                   "a snapshot after the swap")
        time.sleep(0.5)  # a few more snapshots and segments
        assert os.listdir(elsewhere) == [], os.listdir(elsewhere)  # main's code wrote state.snap, wal-*.log there
        assert (moved / "state.snap").stat().st_mtime_ns > first
    finally:
        assert stop(p) == 0
    assert os.listdir(elsewhere) == [] and (moved / "state.snap").is_file()
