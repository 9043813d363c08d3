"""The state dir's files are never opened through a symlink (issue 37, item 7): a link planted at
the snapshot's temp name, at a log segment's name or at the lock's name never lets kvindex write
the file it points to."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvindex.persist.lock import LOCK_NAME, StateDirLock
from kvindex.persist.records import Decision, segment_path
from kvindex.persist.snapshot import temp_path, write_atomic
from kvindex.persist.wal import WriteAheadLog

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
    with pytest.raises(OSError):
        StateDirLock(state).acquire()
    assert v.read_bytes() == PRECIOUS
