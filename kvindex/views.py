"""What the layers above ingest may see of the engine lanes and of the pod directory: Protocols.

Vocabulary: no code; it names ``config.EngineConfig`` and ``sequence.StreamRef`` in annotations only. The in-process
implementations (``ingest.fleet.Fleet`` with its ``ingest.lane.EngineLane``s, ``pods.PodDirectory``)
and the sharded ones (``shard.supervisor.ShardedFleet``, ``ShardedPods``) satisfy them by shape;
the HTTP handlers, the pod directory and recovery are written against these, so which one runs is
the composition root's (``daemon.py``) choice alone.

Invariants: everything here is read-only except what a caller is documented to set
(``RestorableLane.key``/``journal``, ``PodsView.on_remove``); a lane's streams are read on the
event loop and never changed through these views.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: this module imports nothing of kvindex at run time
    from kvindex.config import EngineConfig
    from kvindex.sequence import StreamRef


class StreamView(Protocol):
    """One engine stream as this replica sees it (``ingest.streams.Stream``)."""

    @property
    def topic(self) -> str: ...
    @property
    def pod(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def ref(self) -> StreamRef: ...
    @property
    def last_seq(self) -> int | None: ...
    @property
    def batches(self) -> int: ...
    @property
    def gaps(self) -> int: ...
    @property
    def replays(self) -> int: ...
    @property
    def restarts(self) -> int: ...
    @property
    def synced(self) -> bool: ...
    @property
    def unsynced_reason(self) -> str | None: ...
    @property
    def needs_resync(self) -> str | None: ...  # why this replica owes the stream a resync
    @property
    def last_applied(self) -> float | None: ...
    @property
    def last_event(self) -> float | None: ...  # time.monotonic() of the last batch received; None: never


class LaneStateView(Protocol):
    @property
    def connected_peers(self) -> int: ...
    @property
    def streams(self) -> Mapping[str, StreamView]: ...  # by topic
    def receiving_problem(self) -> str | None:
        """Why every stream of the lane is unsynced now whatever the store says: lagging, or batches
        dropped or lost with the connection (None: nothing)."""
        ...


class LaneView(Protocol):
    """One engine publisher's lane."""

    @property
    def engine(self) -> EngineConfig: ...
    @property
    def state(self) -> LaneStateView: ...
    def behind(self, model: str) -> bool:
        """Whether a stream of ``model`` waits for the store (its answers may lack batches)."""
        ...


class FleetView(Protocol):
    """The set of engine lanes, by key: the only owner of their tasks."""

    def add(self, key: str, engine: EngineConfig) -> LaneView:
        """Start a lane (``KeyError`` if ``key`` runs already)."""
        ...

    async def remove(self, key: str) -> LaneView | None: ...
    def lanes(self) -> Mapping[str, LaneView]: ...
    def lane_task_failed(self, key: str) -> str | None:
        """Why the lane's task ended (None: it runs, or no such lane)."""
        ...

    def behind(self, model: str) -> bool:
        """Whether any lane's stream of ``model`` waits for the store."""
        ...

    def store_lost(self) -> None:
        """The store lost its state: every stream resynchronises once it answers."""
        ...

    def flush_metrics(self) -> None:
        """Pending counts into the metric children (before a scrape)."""
        ...

    async def resync(self, pod: str) -> bool:
        """Operator's resync of ``pod``; False when no lane knows it."""
        ...

    async def close(self) -> None: ...


class PodsView(Protocol):
    """The pod directory: one view per pod, readiness, removal."""

    on_remove: Callable[[str], object] | None  # told each pod removed (the write-ahead log)

    async def views(self) -> list[dict[str, Any]]: ...
    async def readiness_problems(self) -> list[str]: ...
    async def remove(self, pod: str) -> bool:
        """Forget ``pod`` in both stores and the drift sample; True if either store knew it."""
        ...


class Journal(Protocol):
    """Where a lane logs what it changed (the write-ahead log)."""

    def batch(self, key: str, topic: str, seq: int, payload: bytes) -> None: ...
    def resync(self, key: str, pod: str) -> None: ...


class RestorableLane(LaneView, Protocol):
    """A lane recovery can seed before it runs, and re-apply logged changes through."""

    key: str  # the lane's key in the fleet (the journal's records name it)
    journal: Journal | None

    def restore_streams(self, saved: list[dict[str, Any]]) -> None: ...
    async def install_restored(self) -> None: ...
    async def apply_logged(self, topic: str, seq: int, payload: bytes) -> None: ...
    async def resync_logged(self, pod: str) -> None: ...
