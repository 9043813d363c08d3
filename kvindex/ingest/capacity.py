"""The bound on blocks per pod (``--max-blocks-per-pod``): one engine that only stores, or a
publisher gone wrong, cannot grow kvindex's memory without limit.

Invariants:
- A pod's count is the store's own (``blocks_held``: copies in every tier), read when this
  process first sees the pod, after a batch that cleared a rank, and whenever the stores this
  writer applied since the last read (``CHECK_FRACTION`` of the cap, at least ``CHECK_MIN``) or the
  running estimate (the read count plus this writer's stores minus its removals) pass the cap: a
  pod goes over the cap by at most about ``cap / CHECK_FRACTION`` blocks (per replica sharing a
  store), and a read costs one store call per that many blocks stored.
- Over the cap, a pod's BlockStored events are refused (their copies counted in
  ``kvindex_blocks_refused_total{pod}``) while everything else it publishes still applies (its
  removals and clears shrink it), the blocks it holds are kept, and its streams are marked
  unsynced with reason ``over_capacity`` (the index lacks blocks the engine holds: its answers for
  the pod are lower bounds). ``kvindex_pod_over_capacity{pod}`` is 1; one warning per crossing.
- Back under ``RESUME`` of the cap (removals, a clear, an engine restart) its stores apply again;
  it stays unsynced until the usual recovery (AllBlocksCleared, an engine restart, a resync)
  makes it whole. A pod emptied by something that is not one of its batches (an engine restart,
  a resync, a restart kvindex did not see: ``forget``; ``DELETE /v1/pods/{pod}``, a registration
  removed, another replica's restart: none of this writer's calls) is seen too: while over, the
  count is re-read every ``OVER_CHECK_EVERY`` batches whose stores were refused, so an emptied pod
  never refuses blocks for longer than that.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvindex.events import BlockStored, KVEvent
from kvindex.index.protocol import PreciseStore
from kvindex.metrics import Metrics
from kvindex.types import Applied

log = logging.getLogger("kvindex.ingest.lane")
CHECK_FRACTION = 64
CHECK_MIN = 1024
RESUME = 0.9
OVER_CHECK_EVERY = 16  # batches refused stores between two reads of an over pod's count
OVER_CAPACITY = "over_capacity"  # the unsynced reason


@dataclass(slots=True)
class _Pod:
    held: int = 0  # the store's count when last read, plus this writer's changes since
    unchecked: int = -1  # copies stored since the last read (-1: never read)
    over: bool = False
    refused: int = 0  # batches whose stores were refused since the last read


class PodCapacity:
    def __init__(self, cap: int, store: PreciseStore, metrics: Metrics) -> None:
        self.cap = cap
        self._every = max(CHECK_MIN, cap // CHECK_FRACTION)
        self._store = store
        self._metrics = metrics
        self._pods: dict[str, _Pod] = {}

    def admit(self, pod: str, events: Sequence[KVEvent]) -> Sequence[KVEvent]:
        """The events to apply: without BlockStored (counted) while ``pod`` is over the cap."""
        p = self._pods.get(pod)
        if p is None or not p.over:
            return events
        kept = [ev for ev in events if type(ev) is not BlockStored]
        if len(kept) < len(events):
            refused = sum(len(ev.block_hashes) for ev in events if type(ev) is BlockStored)  # type: ignore[union-attr]
            self._metrics.blocks_refused.labels(pod).inc(refused)
            p.refused += 1
        return tuple(kept)

    def forget(self, pod: str) -> None:
        """The pod's streams were cleared or restarted: its count is read again at its next batch
        (and until then its stores apply)."""
        p = self._pods.pop(pod, None)
        if p is not None and p.over:
            self._metrics.pod_over_capacity.labels(pod).set(0)

    def counted(self, pod: str, done: Applied | None) -> bool:
        """After an applied batch: its stores and removals counted; True when the store's count is
        due to be read (``recount``) before ``over`` judges the pod (a plain call: the common batch
        awaits nothing here)."""
        p = self._pods.get(pod)
        if p is None:
            p = self._pods[pod] = _Pod()
        if done is not None:
            p.held += done.stored - done.removed
            p.unchecked += done.stored if p.unchecked >= 0 else 0
        due = p.unchecked < 0 or p.unchecked >= self._every or (done is not None and done.cleared > 0) \
            or p.refused >= OVER_CHECK_EVERY
        return due or (p.held > self.cap) != p.over or (p.over and p.held <= self.cap * RESUME)

    async def recount(self, pod: str) -> None:
        """The pod's count read from the store (every tier's copies)."""
        held = await self._store.blocks_held(pod)
        p = self._pods[pod]
        p.held, p.unchecked, p.refused = held["gpu"] + held["cpu"] + held["disk"], 0, 0

    def over(self, pod: str) -> bool:
        """Whether the pod counted (``counted``) is over the cap now; a crossing either way is logged and set
        in ``kvindex_pod_over_capacity``."""
        p = self._pods[pod]
        if not p.over and p.held > self.cap:
            p.over = True
            self._metrics.pod_over_capacity.labels(pod).set(1)
            log.warning("pod %s: holds %d blocks, over --max-blocks-per-pod %d: its new blocks are refused (counted in "
                        "kvindex_blocks_refused_total) and it is unsynced (%s) until it is back under", pod, p.held,
                        self.cap, OVER_CAPACITY)
        elif p.over and p.held <= self.cap * RESUME:
            p.over = False
            self._metrics.pod_over_capacity.labels(pod).set(0)
            log.info("pod %s: back under --max-blocks-per-pod (%d blocks): its stores apply again; it stays unsynced "
                     "until an AllBlocksCleared, an engine restart or a resync", pod, p.held)
        return p.over
