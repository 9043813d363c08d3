"""SGLang's external KV placements on kvindex's precise index: what ``ApplyExternalKvBatch`` changes,
and the answers of ``MatchExternalKv``, ``MatchExternalKvPrefix`` and ``GetExternalKvHitCounts``.

Invariants:
- An external worker is a pod of its own: its ``worker_id`` is the pod id, at dp rank 0, in one
  stream (``<worker_id>|kv_indexer.v1``) whose seq kvindex numbers itself (SGLang's ``seq`` is
  observability only: every batch applies, as in SGLang's indexer). A ``worker_id`` that names a
  ZeroMQ-fed pod (an engine lane's) is refused (FAILED_PRECONDITION): one writer per pod.
- Its blocks carry no tokens, so each reported hash is indexed as a block of its own whose
  content is the hash (``HASH_TOKENS`` tokens: its low and high u32) under the model
  ``EXTERNAL_MODEL``, from that model's root: a key that is a function of the hash alone. Tiers
  are media: HBM ``GPU``, DRAM ``CPU``, SSD ``DISK``.
- SGLang's placements are a set per (worker, tier): REPORT of a held hash and REVOKE of an unheld
  one change nothing; CLEAR_ALL_AT_TIER removes what the worker holds at the tier. The ``ledger``
  (per worker, per tier, the hashes held) makes kvindex's copy-counting index follow that rule,
  and is checked against the index (``blocks_held``) before each batch: the first batch of a
  worker in this process, or one finding the pod changed under it (a DELETE, a restored
  snapshot: gRPC applies are not in the write-ahead log), clears the pod first.
- A batch is applied in one ``store.apply`` (atomic); applies are serialised (one lock).
- Queries read every pod the index holds, ZeroMQ-fed or external, through each worker's own
  ``engine hash -> key`` entries (``hash_match`` / ``hash_tiers``): for a ZeroMQ-fed SGLang
  engine, the hashes its events carried. A prefix counts HBM and DRAM (SGLang's servable tiers:
  ``PodMatch.cpu``); a pod with no router-facing address (an external worker's
  ``worker_address``, an engine's ``url``) is left out of prefix answers, as SGLang does. An
  orphaned pod (``kvindex.pods.Orphans``: restored, no engine publishes for it) is left out of
  every answer once the HTTP API leaves it out; a worker's first batch clears its pod and takes it
  back (no orphan any more).
- Hit counts are per hash, bounded (``MAX_HIT_HASHES``, the oldest forgotten first); a hash no
  pod holds any more answers no count (its count is dropped, as SGLang drops it with its last
  placement).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvindex.events import GPU, BlockRemoved, BlockStored, KVEvent
from kvindex.index.protocol import ApplyResult
from kvindex.pods import Orphans, published_pods
from kvindex.route.grpc import INVALID_ARGUMENT, RESOURCE_EXHAUSTED
from kvindex.sequence import Position, StreamRef
from kvindex.sglang.wire import Action, ApplyBatch
from kvindex.types import PodMatch
from kvindex.views import FleetView

FAILED_PRECONDITION = 9
EXTERNAL_MODEL = "sglang-external"
TOPIC = "kv_indexer.v1"
HASH_TOKENS = 2
REPORT, REVOKE, CLEAR_ALL_AT_TIER = 1, 2, 3
HBM, DRAM, SSD = 1, 2, 3
MEDIUM = {HBM: GPU, DRAM: "CPU", SSD: "DISK"}
TIER_OF = {"gpu": HBM, "cpu": DRAM, "disk": SSD}  # kvindex's tier names -> TierType
FULL = 1  # the component bit every whole block carries
MAX_HASHES = 16_384  # per apply (all actions), per MatchExternalKv, per GetExternalKvHitCounts
MAX_ACTIONS = 256
MAX_WORKERS = 4096
MAX_WORKER_ID = 256
MAX_HIT_HASHES = 1 << 20


class Refused(Exception):
    """A request answered with a gRPC status; ``reason`` is the metric label."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


class HashStore(Protocol):
    """What this module needs of the precise store (``MemoryPreciseStore`` has it all)."""

    async def apply(self, stream: StreamRef, seq: int, epoch: int, dp_rank: int, events: Sequence[KVEvent],
                    *, force: str | None = None) -> ApplyResult: ...
    async def position(self, stream: StreamRef) -> Position | None: ...
    async def clear_pod(self, pod: str, dp_rank: int | None = None) -> None: ...
    async def blocks_held(self, pod: str) -> dict[str, int]: ...
    async def hash_match(self, hashes: Sequence[int]) -> dict[str, PodMatch]: ...
    async def hash_tiers(self, hashes: Sequence[int]) -> dict[str, dict[str, list[int]]]: ...


@dataclass
class Worker:
    address: str = ""
    ledger: dict[int, set[int]] = field(default_factory=lambda: {HBM: set(), DRAM: set(), SSD: set()})

    def size(self) -> int:
        return sum(map(len, self.ledger.values()))

    def holds(self, h: int) -> bool:
        return any(h in held for held in self.ledger.values())


def hash_block(h: int, medium: str) -> BlockStored:
    """One reported hash as the block kvindex indexes: its content is the hash (see the docstring)."""
    return BlockStored(array("Q", (h,)), None, array("I", (h & 0xFFFFFFFF, h >> 32)), HASH_TOKENS, medium)


def check_batch(batch: ApplyBatch) -> None:
    """SGLang's checks of a batch, before anything is applied."""
    wid = batch.worker_id
    if not wid:
        raise Refused(INVALID_ARGUMENT, "bad_worker_id", "worker_id must not be empty")
    if len(wid) > MAX_WORKER_ID or not wid.isprintable():
        raise Refused(INVALID_ARGUMENT, "bad_worker_id", f"worker_id must be printable, at most {MAX_WORKER_ID} characters")
    if batch.enforce_sequence:
        raise Refused(FAILED_PRECONDITION, "enforce_sequence", "enforce_sequence needs snapshot installs, which "
                      "kvindex does not serve: send batches unconditionally")
    if len(batch.actions) > MAX_ACTIONS:
        raise Refused(RESOURCE_EXHAUSTED, "too_many_actions", f"batch has {len(batch.actions)} actions; the limit is {MAX_ACTIONS}")
    total = sum(len(a.hashes) for a in batch.actions)
    if total > MAX_HASHES:
        raise Refused(RESOURCE_EXHAUSTED, "too_many_hashes", f"batch has {total} hashes; the limit is {MAX_HASHES}")
    for a in batch.actions:
        _check_action(a)


def _check_action(a: Action) -> None:
    if a.tier not in MEDIUM:
        raise Refused(INVALID_ARGUMENT, "bad_tier", f"tier {a.tier} is not HBM (1), DRAM (2) or SSD (3)")
    if a.type not in (REPORT, REVOKE, CLEAR_ALL_AT_TIER):
        raise Refused(INVALID_ARGUMENT, "bad_action", f"action type {a.type} is not REPORT, REVOKE or CLEAR_ALL_AT_TIER")
    if a.type != CLEAR_ALL_AT_TIER and not a.hashes:
        raise Refused(INVALID_ARGUMENT, "no_hashes", "REPORT and REVOKE need hashes")
    for name, side in (("component_masks", a.component_masks), ("block_sizes", a.block_sizes)):
        if side and len(side) != len(a.hashes):
            raise Refused(INVALID_ARGUMENT, "misaligned", f"{name} has {len(side)} entries for {len(a.hashes)} hashes")


def check_hashes(hashes: Sequence[int], bounded: bool = True) -> None:
    if not hashes:
        raise Refused(INVALID_ARGUMENT, "no_hashes", "hashes must not be empty")
    if bounded and len(hashes) > MAX_HASHES:
        raise Refused(RESOURCE_EXHAUSTED, "too_many_hashes", f"{len(hashes)} hashes; the limit is {MAX_HASHES}")


def events_for(w: Worker, actions: Sequence[Action], capacity: int) -> tuple[list[KVEvent], int]:
    """The index events of ``actions`` on worker ``w`` (its ledger updated), and how many reported
    hashes were refused: not whole blocks (no FULL component), or past ``capacity`` blocks held."""
    events: list[KVEvent] = []
    refused = 0
    for a in actions:
        medium, held = MEDIUM[a.tier], w.ledger[a.tier]
        if a.type == REPORT:
            for i, h in enumerate(a.hashes):
                if h in held:
                    continue
                mask = a.component_masks[i] if a.component_masks else 0
                if (mask and not mask & FULL) or w.size() >= capacity:
                    refused += 1
                    continue
                events += _report(w, h, medium)
                held.add(h)
        elif a.type == REVOKE:
            gone = [h for h in dict.fromkeys(a.hashes) if h in held]
            held.difference_update(gone)
            events += [BlockRemoved(array("Q", gone), medium)] if gone else []
        elif held:
            events.append(BlockRemoved(array("Q", sorted(held)), medium))
            held.clear()
    return events, refused


def _report(w: Worker, h: int, medium: str) -> list[KVEvent]:
    """A lower tier's copy takes the key of the worker's copy of the hash (reference.py): a hash
    the worker holds nowhere passes through the device, within the same batch."""
    if medium == GPU or w.holds(h):
        return [hash_block(h, medium)]
    return [hash_block(h, GPU), hash_block(h, medium), BlockRemoved(array("Q", (h,)), GPU)]


def engine_urls(fleet: FleetView) -> dict[str, str]:
    """Every ZeroMQ-fed pod (``kvindex.pods.published_pods``) -> its engine's URL, or ""."""
    out: dict[str, str] = {}
    for lane in fleet.lanes().values():
        for pod in {lane.engine.pod or lane.engine.endpoint, *(st.pod for st in lane.state.streams.values())}:
            out[pod] = lane.engine.url or ""
    return out


class ExternalPlacements:
    def __init__(self, store: HashStore, fleet: FleetView, orphans: Orphans, capacity: int) -> None:
        self._store, self._fleet, self._orphans, self._capacity = store, fleet, orphans, capacity
        self.workers: dict[str, Worker] = {}
        self._hits: dict[int, int] = {}
        self._lock = asyncio.Lock()

    async def apply(self, batch: ApplyBatch) -> int:
        """Apply one batch; answers how many reported hashes were refused."""
        check_batch(batch)
        pod = batch.worker_id
        if pod in published_pods(self._fleet):
            raise Refused(FAILED_PRECONDITION, "engine_pod", f"worker_id {pod!r} is a ZeroMQ-fed engine's pod")
        async with self._lock:
            w = await self._worker(pod)
            w.address = batch.worker_address
            events, refused = events_for(w, batch.actions, self._capacity)
            stream = StreamRef(f"{pod}|{TOPIC}", pod, EXTERNAL_MODEL)
            try:
                pos = await self._store.position(stream)
                seq = 0 if pos is None or pos.last_seq is None else pos.last_seq + 1
                await self._store.apply(stream, seq, pos.epoch if pos else 0, 0, events)
            except BaseException:
                self.workers.pop(pod, None)  # the ledger may be ahead of the index: the next batch starts over
                raise
            return refused

    async def _worker(self, pod: str) -> Worker:
        w = self.workers.get(pod)
        if w is not None and await self._agrees(pod, w):
            return w
        if w is None and len(self.workers) >= MAX_WORKERS:
            raise Refused(RESOURCE_EXHAUSTED, "too_many_workers", f"kvindex keeps at most {MAX_WORKERS} external workers")
        await self._store.clear_pod(pod)
        self._orphans.forget(pod)  # restored blocks, if any, are gone: the worker keeps its pod from here
        w = self.workers[pod] = Worker()
        return w

    async def _agrees(self, pod: str, w: Worker) -> bool:
        held = await self._store.blocks_held(pod)
        return not held.get("orphans") and all(held.get(t, 0) == len(w.ledger[n]) for t, n in TIER_OF.items())

    def _addresses(self, pods: Iterable[str]) -> dict[str, str]:
        urls = engine_urls(self._fleet)
        return {pod: w.address if (w := self.workers.get(pod)) is not None else urls.get(pod, "") for pod in pods}

    async def _tiers(self, hashes: Sequence[int]) -> dict[str, dict[str, list[int]]]:
        """The store's ``hash_tiers``, the pods HTTP answers leave out (orphans) left out."""
        found = await self._store.hash_tiers(hashes)
        gone = self._orphans.excluded(found) if found else ()
        return {pod: tiers for pod, tiers in found.items() if pod not in gone}

    async def prefix(self, hashes: Sequence[int], max_blocks: int) -> tuple[list[tuple[str, int, str]], int]:
        """(address, blocks, pod) of every addressed pod holding a prefix, longest first; and the
        blocks considered."""
        check_hashes(hashes, bounded=False)
        limit = min(len(hashes), max_blocks) if max_blocks else len(hashes)
        found = await self._store.hash_match(hashes[:limit])
        gone = self._orphans.excluded(found) if found else ()
        addresses = self._addresses(found)
        rows = [(addresses[pod], m.cpu, pod) for pod, m in found.items() if m.cpu and addresses[pod] and pod not in gone]
        rows.sort(key=lambda r: (-r[1], r[2]))
        return rows, limit

    async def placements(self, hashes: Sequence[int], count_as_hit: bool) -> list[tuple[str, str, dict[int, list[int]]]]:
        """(pod, address, {TierType: hashes held there}) of every pod holding any of ``hashes``."""
        check_hashes(hashes)
        found = await self._tiers(hashes)
        if count_as_hit:
            self._count({h for tiers in found.values() for held in tiers.values() for h in held})
        addresses = self._addresses(found)
        return [(pod, addresses[pod], {TIER_OF[t]: held for t, held in tiers.items()})
                for pod, tiers in sorted(found.items())]

    def _count(self, held: set[int]) -> None:
        hits = self._hits
        for h in held:
            hits[h] = hits.pop(h, 0) + 1  # re-inserted: the most recently hit last
        while len(hits) > MAX_HIT_HASHES:
            del hits[next(iter(hits))]

    async def hit_counts(self, hashes: Sequence[int]) -> list[tuple[int, int]]:
        check_hashes(hashes)
        wanted = [h for h in dict.fromkeys(hashes) if h in self._hits]
        if not wanted:
            return []
        held = {h for tiers in (await self._tiers(wanted)).values() for hs in tiers.values() for h in hs}
        for h in wanted:
            if h not in held:
                self._hits.pop(h, None)
        return [(h, self._hits[h]) for h in wanted if h in held]
