"""The state directory, opened once: every file in it is reached through that descriptor.

Invariants:
- ``StateDir.open(path)`` creates a missing directory ``0700`` (its missing parents with the
  default mode), then opens it with ``O_DIRECTORY | O_NOFOLLOW``. It refuses (``StateDirRefused``; at start the
  CLI exits 2 with its one line) a path that is itself a symbolic link (give the
  directory it points to), a directory another user owns (a root-owned one is refused too unless
  kvindex runs as root), one every user may write (``o+w``, sticky bit or not), and one its group
  may write when that group is not kvindex's own. A Kubernetes ``emptyDir`` is ``0777``: point
  ``--state-dir`` at a directory inside it, which kvindex then creates ``0700``.
- Every open, rename, unlink and listing of the directory's entries goes through the descriptor
  (``dir_fd``, ``os.listdir(fd)``) with ``O_NOFOLLOW`` on every file: renaming or replacing the
  directory's path (or a symlink planted in it) after start cannot send a write elsewhere.
- A ``StateDir`` is closed by whoever opened it (``close()``, idempotent).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from types import TracebackType

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StateDirRefused(ValueError):
    """A state directory kvindex will not use; the message says why in one line (the daemon
    raises it as ``kvindex.persist.lock.StateDirUnusable``, a ``ConfigError``: exit 2)."""


class StateDir:
    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def open(cls, path: Path, *, create: bool = True) -> StateDir:
        """The directory at ``path`` (made ``0700`` when missing and ``create``), checked."""
        if create and not os.path.lexists(path):
            _make(path)
        try:
            fd = os.open(path, DIR_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
                raise StateDirRefused(f"state dir {path} is a symbolic link (to {os.path.realpath(path)}): give "
                                      "the directory itself") from None
            raise StateDirRefused(f"state dir {path}: {exc.strerror}") from None
        try:
            _check(path, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"state dir {self.path} is closed")
        return self._fd

    def file(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of the entry ``name``, never through a symlink."""
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def read(self, name: str) -> bytes | None:
        """The bytes of the file ``name``; None when there is none."""
        try:
            fd = self.file(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def unlink(self, name: str) -> None:
        os.unlink(name, dir_fd=self.fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def sync(self) -> None:
        """fsync the directory (its entries: a rename, a new file)."""
        os.fsync(self.fd)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> StateDir:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _make(path: Path) -> None:
    """Create the directory ``0700`` (its missing parents with the default mode)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # made meanwhile: opened and checked like any other
    except OSError as exc:
        raise StateDirRefused(f"state dir {path}: cannot create it: {exc.strerror}") from None


def _check(path: Path, st: os.stat_result) -> None:
    """Refuse a directory others own or may write (the module docstring)."""
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    hint = "; point --state-dir at a directory of its own inside it (kvindex creates it 0700)"
    if st.st_uid != me:
        raise StateDirRefused(f"state dir {path} is owned by uid {st.st_uid}, not by kvindex's uid {me}{hint}")
    if mode & stat.S_IWOTH:
        raise StateDirRefused(f"state dir {path} is writable by every user (mode {mode:04o}){hint}")
    if mode & stat.S_IWGRP and st.st_gid != os.getegid():
        raise StateDirRefused(f"state dir {path} is writable by group {st.st_gid}, not kvindex's own "
                              f"(mode {mode:04o}){hint}")


def as_state_dir(directory: Path | StateDir) -> tuple[StateDir, bool]:
    """``directory`` as a ``StateDir`` and whether the caller opened it (and must close it)."""
    if isinstance(directory, StateDir):
        return directory, False
    return StateDir.open(directory), True
