"""Engines registered at runtime (``POST /register``): the registry, its rules and its answers.

``Registrations`` is the data (what the snapshot and the write-ahead log save and restore);
``EngineRegistry`` is the service the compatibility API (``kvindex.http.dynamo``) calls: it checks a
registration against the ones before it and the precise store, and owns the lanes it adds.

Invariants:
- An engine registered here is known by ``str(instance_id)`` everywhere (pod id); its
  ``(instance_id, dp_rank)`` is unique; the first registration of a (model, routing_group) fixes
  its block size and a different one later is refused (keys are chunked by it).
- Each registration owns exactly one lane in the fleet, keyed ``register:<instance>:<rank>``;
  unregistering removes the lane, then the rank's blocks, then the pod once no rank is left.
- A refused registration changes nothing (``QueryError`` with the field at fault, before any write).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvindex import dynamo_dump
from kvindex import keys as K
from kvindex.query.answers import QueryError
from kvindex.config import ConfigError, EngineConfig
from kvindex.index.protocol import PreciseStore
from kvindex.views import FleetView, PodsView

DEFAULT_GROUP = "default"


@dataclass(frozen=True, slots=True)
class Registration:
    instance_id: str
    model: str
    group: str
    block_size: int
    dp_rank: int
    engine: EngineConfig

    @property
    def lane_key(self) -> str:
        return f"register:{self.instance_id}:{self.dp_rank}"

    def to_json(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "model": self.model, "group": self.group,
                "block_size": self.block_size, "dp_rank": self.dp_rank, "endpoint": self.engine.endpoint,
                "replay": self.engine.replay, "url": self.engine.url}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Registration:
        """A saved registration (snapshot, write-ahead log); ``ValueError`` if malformed."""
        try:
            iid, model, group = str(d["instance_id"]), str(d["model"]), str(d["group"])
            block_size, dp_rank = int(d["block_size"]), int(d["dp_rank"])
            engine = EngineConfig(endpoint=str(d["endpoint"]), pod=iid, model=model, block_size=block_size,
                                  dp_rank=dp_rank, replay=d.get("replay") if isinstance(d.get("replay"), str) else None,
                                  url=d.get("url") if isinstance(d.get("url"), str) else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"saved registration {d!r} is malformed: {exc}") from None
        return cls(iid, model, group, block_size, dp_rank, engine)


class Registrations:
    """Engines added at runtime; each owns one lane in the fleet."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, int], Registration] = {}
        self.block_sizes: dict[tuple[str, str], int] = {}
        self.on_change: Callable[[str, Registration], object] | None = None  # ("add" | "remove", reg)

    def add(self, reg: Registration) -> None:
        self.by_key[(reg.instance_id, reg.dp_rank)] = reg
        self.block_sizes.setdefault((reg.model, reg.group), reg.block_size)
        if self.on_change is not None:
            self.on_change("add", reg)

    def remove(self, reg: Registration) -> None:
        del self.by_key[(reg.instance_id, reg.dp_rank)]
        if not self.matching(model=reg.model, group=reg.group):
            self.block_sizes.pop((reg.model, reg.group), None)  # the next registration sets it again
        if self.on_change is not None:
            self.on_change("remove", reg)

    def matching(self, instance_id: str | None = None, model: str | None = None,
                 group: str | None = None, dp_rank: int | None = None) -> list[Registration]:
        return [r for r in self.by_key.values()
                if (instance_id is None or r.instance_id == instance_id) and (model is None or r.model == model)
                and (group is None or r.group == group) and (dp_rank is None or r.dp_rank == dp_rank)]


class EngineRegistry:
    """Registering and unregistering engines: the rules between a request and the fleet."""

    def __init__(self, registrations: Registrations, store: PreciseStore, fleet: FleetView, pods: PodsView) -> None:
        self.registrations = registrations
        self._store, self._fleet, self._pods = store, fleet, pods

    async def register(self, iid: str, model: str, group: str, block_size: int, dp_rank: int,
                       endpoint: str, replay: str | None, url: str | None = None) -> Registration:
        regs = self.registrations
        if (iid, dp_rank) in regs.by_key:
            raise QueryError(f"instance {iid} dp_rank {dp_rank} is already registered", field="instance_id",
                             status=409, reason="duplicate")
        live = regs.block_sizes.get((model, group))
        if live is not None and live != block_size:  # one block size per model: keys are chunked by it
            raise QueryError(f"block_size {block_size} contradicts {live}, the block size of the engines registered "
                             f"for {model}:{group}", field="block_size", status=409, reason="block_size_mismatch")
        try:
            engine = EngineConfig(endpoint=endpoint, pod=iid, model=model, block_size=block_size, dp_rank=dp_rank,
                                  replay=replay, url=url)
        except ConfigError as exc:
            raise QueryError(str(exc), field="url" if "url" in str(exc) else "endpoint", reason="bad_field") from None
        reg = Registration(iid, model, group, block_size, dp_rank, engine)
        held = await self._store.set_block_size(model, block_size)  # set unless engines hold blocks of another
        if held != block_size:
            raise QueryError(f"block_size {block_size} contradicts {held}, the block size of the blocks live engine "
                             f"streams of {model} hold", field="block_size", status=409, reason="block_size_mismatch")
        regs.add(reg)
        self._fleet.add(reg.lane_key, engine)
        return reg

    def registered(self, iid: str, dp_rank: int) -> Registration | None:
        """The registration of ``(iid, dp_rank)``, if any."""
        return self.registrations.by_key.get((iid, dp_rank))

    async def unregister(self, iid: str, model: str | None, group: str | None, dp_rank: int | None) -> list[Registration]:
        """Every matching registration removed (lane, then blocks; the pod once no rank is left).
        ``None``: any model, group or rank."""
        regs = self.registrations
        found = regs.matching(iid, model, group, dp_rank)
        if not found:
            where = " ".join(f"{k} {v}" for k, v in (("model", model), ("group", group), ("dp_rank", dp_rank))
                             if v is not None)
            raise QueryError(f"instance {iid} is not registered" + (f" ({where})" if where else ""),
                             field="instance_id", status=404, reason="unknown_instance")
        for reg in found:
            await self._fleet.remove(reg.lane_key)
            regs.remove(reg)
            await self._store.clear_pod(iid, reg.dp_rank)
        if not regs.matching(iid):
            await self._pods.remove(iid)
        return found

    def workers(self, model: str | None, group: str | None) -> list[dict[str, Any]]:
        """The ``/workers`` answer: one entry per (instance, model, group), a listener per rank."""
        fleet = self._fleet
        lanes = fleet.lanes()
        out: dict[tuple[str, str, str], dict[str, Any]] = {}
        for reg in sorted(self.registrations.matching(model=model, group=group), key=lambda r: (r.instance_id, r.dp_rank)):
            w = out.setdefault((reg.instance_id, reg.model, reg.group), {
                "instance_id": reg.instance_id, "source": "zmq", "status": "active", "model_name": reg.model,
                "routing_group": reg.group, "block_size": reg.block_size, "endpoints": {}, "listeners": {}})
            failure = fleet.lane_task_failed(reg.lane_key)
            lane = lanes.get(reg.lane_key)
            status = "failed" if failure else "active" if lane and lane.state.connected_peers else "pending"
            w["endpoints"][str(reg.dp_rank)] = reg.engine.endpoint
            w["listeners"][str(reg.dp_rank)] = {"endpoint": reg.engine.endpoint, "status": status,
                                                **({"last_error": failure} if failure else {})}
        for w in out.values():
            states = {lst["status"] for lst in w["listeners"].values()}
            w["status"] = next((s for s in ("failed", "pending", "active") if s in states), "paused")
        return list(out.values())

    async def candidates(self, model: str, group: str | None) -> list[str] | None:
        """The pods a query may answer with: its routing group's (one index per (model, group), as
        Dynamo keeps). The default group also holds every engine not registered through /register.
        None: every pod."""
        regs = self.registrations
        group = group or DEFAULT_GROUP
        if group != DEFAULT_GROUP:
            return sorted({r.instance_id for r in regs.matching(model=model, group=group)})
        elsewhere = {r.instance_id for r in regs.by_key.values() if r.group != DEFAULT_GROUP}
        if not elsewhere:
            return None
        inside = {r.instance_id for r in regs.by_key.values() if r.group == DEFAULT_GROUP}
        return sorted((set(await self._store.pods()) - elsewhere) | inside)

    async def dump(self) -> dict[str, Any]:
        """Every held keyed block as Dynamo ``RouterEvent``s (``kvindex.dynamo_dump``)."""
        out: dict[str, Any] = {}
        store = self._store
        lineage = getattr(store, "lineage", None)  # the in-memory store records it; others place nothing
        rec = lineage() if lineage is not None else None
        of = rec.lookup() if rec is not None else (lambda key: None)
        models = {v["pod"]: v.get("model") for v in await self._pods.views()}
        known = list(await store.block_sizes()) or ["unknown"]
        for pod in sorted(set(models) | set(await store.pods())):
            # a pod restored from a peer has no model yet: its blocks go where their roots say
            candidates: list[str] = [str(models[pod])] if models.get(pod) else known
            for rank, blocks in (await store.engine_hashes(pod)).items():
                for i, model in enumerate(candidates):
                    group = f"{model}:{DEFAULT_GROUP}"
                    if group not in out:
                        out.update(dynamo_dump.dump_groups([(group, await store.block_size(model) or 0)]))
                    entry = out[group]
                    events, blocks = dynamo_dump.worker_events(pod, rank, blocks, K.root_key(model), of,
                                                               len(entry["events"]))
                    entry["events"] += events
                    if i == len(candidates) - 1:
                        entry["kvindex_unplaced"] += [[pod, rank, h, k] for h, k in blocks.items()]
        return out
