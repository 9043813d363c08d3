"""What the daemon writes to its write-ahead log as it runs, and a write that outlives a cancel.

Invariants:
- ``journal_on`` hooks every change outside the lanes into the log (decisions recorded into the
  approximate index, pod removals, registrations); a lane's ``LaneJournal`` logs its applied
  batches and operator resyncs. Each append is handled by the log (never raises).
- ``finished`` awaits a file write running in a thread; cancelled meanwhile (SIGTERM), it still
  waits for the thread before the cancellation goes on, so two snapshot writes never overlap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

from kvindex.index.approx import ApproxIndex
from kvindex.persist.wal import (
    Batch,
    Decision,
    PodRemoved,
    RegistrationChange,
    Resync,
    WriteAheadLog,
)
from kvindex.registrations import Registration, Registrations
from kvindex.views import PodsView


def journal_on(wal: WriteAheadLog, approx: ApproxIndex, pods: PodsView, registrations: Registrations) -> None:
    def decided(pod: str, model: str, hashes: Sequence[int]) -> None:
        wal.append(Decision(pod, model, tuple(hashes)))

    def removed(pod: str) -> None:
        wal.append(PodRemoved(pod))

    def registered(kind: str, reg: Registration) -> None:
        wal.append(RegistrationChange("add" if kind == "add" else "remove", reg.to_json()))

    approx.on_record = decided
    pods.on_remove = removed
    registrations.on_change = registered


async def finished(write: Coroutine[Any, Any, None]) -> None:
    """Await a file write in a thread; cancelled meanwhile (SIGTERM), still wait for the thread to
    finish before the cancellation goes on: the next snapshot (the final one) must not write while
    this one is still writing, or an older snapshot could land over a newer one."""
    task = asyncio.ensure_future(write)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


class LaneJournal:
    """What a lane logs: applied batches and operator resyncs."""

    __slots__ = ("_wal",)

    def __init__(self, wal: WriteAheadLog) -> None:
        self._wal = wal

    def batch(self, key: str, topic: str, seq: int, payload: bytes) -> None:
        self._wal.append(Batch(key, topic, seq, payload))

    def resync(self, key: str, pod: str) -> None:
        self._wal.append(Resync(key, pod))
