"""A daemon that fails to start cleans up after itself: no task, socket or fd is left behind
(counted in this very process: asyncio tasks and /proc/self/fd)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from kvindex.config import Config, EngineConfig
from kvindex.daemon import Daemon
from tests.conftest import ipc_endpoint


def _fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the listing's own fd, closed meanwhile
    return out


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.02)


async def test_failed_start_leaves_nothing_running(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        await _settle()
        tasks, fds = set(asyncio.all_tasks()), _fds()
        config = Config(host="127.0.0.1", port=port, state_dir=tmp_path / "state", snapshot_seconds=3600,
                        engines=(EngineConfig(endpoint=ipc_endpoint(tmp_path, "pub"), replay=ipc_endpoint(tmp_path, "rep")),
                                 EngineConfig(endpoint=ipc_endpoint(tmp_path, "bound"), bind=True)))
        daemon = Daemon(config)
        with pytest.raises(OSError):
            await daemon.run_forever(asyncio.Event())
        await _settle()
        assert set(asyncio.all_tasks()) == tasks, set(asyncio.all_tasks()) - tasks
        assert _fds() == fds, {k: v for k, v in _fds().items() if fds.get(k) != v}
        assert daemon.fleet.lanes() == {} and daemon.recovery.wal is None
        await daemon.stop()  # idempotent
    finally:
        taken.close()


async def test_stop_without_start_is_safe(tmp_path: Path) -> None:
    await _settle()
    fds = _fds()
    daemon = Daemon(Config(port=0, state_dir=tmp_path / "state"))
    await daemon.stop()
    await daemon.stop()
    await _settle()
    assert _fds() == fds
