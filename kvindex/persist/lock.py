"""One daemon per state directory: an exclusive ``flock`` on ``<state-dir>/lock``, held for the
life of the process.

Invariants:
- The lock file is opened through the state dir's descriptor (``kvindex.persist.statedir``), never
  through a symlink: a link at its name (or any failure to open it) is ``StateDirUnusable`` (a
  ``ConfigError``: exit 2, one line), as is a directory ``StateDir.open`` refuses.
- ``StateDirLock.acquire`` takes the lock without waiting or raises ``StateDirBusy`` (a
  ``ConfigError``: the CLI exits 2) with one line naming the holder (pid and host, as the holder
  wrote them into the file). Nothing in the directory is read or written before the lock is held.
- The kernel releases the lock when the holder dies (SIGKILL included): a stale lock file never
  blocks a restart. The holder's pid and host are written after the lock is taken; if even that
  fails (disk full) the lock still holds and a second daemon says the holder is unknown.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from kvindex.config import ConfigError
from kvindex.persist.statedir import StateDir, StateDirRefused

LOCK_NAME = "lock"


class StateDirBusy(ConfigError):
    """Another process holds the state directory."""


class StateDirUnusable(ConfigError):
    """A state directory kvindex refuses (``kvindex.persist.statedir.StateDirRefused``), or whose
    lock cannot be opened."""


def open_state_dir(path: Path) -> StateDir:
    """``StateDir.open(path)``; a refusal is ``StateDirUnusable`` (exit 2, its one line)."""
    try:
        return StateDir.open(path)
    except StateDirRefused as exc:
        raise StateDirUnusable(str(exc)) from None


class StateDirLock:
    """The lock of ``directory`` (a path: opened, checked and closed here; a ``StateDir``: its owner's)."""

    def __init__(self, directory: Path | StateDir) -> None:
        self._dir = directory
        self.path = directory.path / LOCK_NAME if isinstance(directory, StateDir) else directory / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:  # held already
            return
        state, opened = (self._dir, False) if isinstance(self._dir, StateDir) else (open_state_dir(self._dir), True)
        try:
            fd = state.file(LOCK_NAME, os.O_RDWR | os.O_CREAT)  # never through a symlink
        except OSError as exc:  # a link at its name (ELOOP), EACCES: nothing was touched
            why = "it is a symbolic link, never followed" if exc.errno == errno.ELOOP else exc.strerror
            raise StateDirUnusable(f"state dir {self.path.parent}: cannot open {LOCK_NAME}: {why}") from None
        finally:
            if opened:
                state.close()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise StateDirBusy(f"state dir {self.path.parent} is in use by another kvindex ({holder}); "
                               "one daemon per --state-dir") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        try:  # who holds it, for the next one to say (best effort: the lock is what counts)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text.splitlines()[0] if text else "holder unknown"
