"""The parent <-> worker channel of a sharded daemon: its typed messages and its client.

Each worker (``kvindex.shard.worker``) listens on a Unix stream socket; each parent-side client
(``kvindex.shard.client.ShardChannel``) is one connection to it. A message is a few frames (``kvindex.shard.frames``;
ZeroMQ's ipc:// DEALER/ROUTER cost ~110 µs a round trip here, a Unix stream ~15 µs):
- request ``[request id, msgpack Request]`` plus, for ``Match`` only, the keys as one raw frame
  of packed little-endian u64 (``pack_keys``: a prompt's keys cost one memcpy, not a msgpack int
  each);
- reply ``[request id, msgpack Ok(value) | Failed(one line)]``.

Every message is a frozen, tagged, array-like ``msgspec.Struct``: a request is ``[tag, fields...]``
and ``REQUESTS`` is the closed union the worker decodes. Each request class names the type of its
answer (``Pods(Request[list[str]])``): the client decodes a reply with ``Ok[that type] | Failed``,
so a wrong-shaped answer is an error here, never a wrong value further on.

Invariants:
- Engine lanes are dealt out evenly: a new lane goes to ``next_worker`` of the workers' lane counts
  (the fewest, the lowest index among equals), so N configured engines split N // W or N // W + 1
  per worker in configuration order, never by the luck of a hash. Writes the parent makes itself
  (``ShardedPreciseStore``) belong to ``owner_of(pod, N)`` (CRC-32 of the pod: stable).
- Every request has a deadline (``REQUEST_TIMEOUT`` by default); how a request fails, as
  ``StoreUnavailable`` naming the worker, is ``kvindex.shard.client``'s.
- Events cross as ``WireStored`` / ``WireRemoved`` / ``WireCleared`` (``token_ids`` and
  ``block_hashes`` as their packed u32 / u64 bytes) and come out as the same ``KVEvent`` values
  (``to_wire`` / ``from_wire``; hashes as an ``array("Q")``, whatever sequence went in).
"""

from __future__ import annotations

import typing
import zlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import msgspec

from kvindex.config import MAX_BLOCKS_PER_POD, MAX_LAG_SECONDS, RCVHWM, RECEIVE_BUFFER_BYTES, EngineConfig
from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvindex.index.protocol import ApplyResult, StoreUnavailable
from kvindex.sequence import Position, StreamRef
from kvindex.types import Entry, PodMatch

R = TypeVar("R", covariant=True)  # a request's answer
REQUEST_TIMEOUT = 5.0  # seconds a worker may take to answer one request


def owner_of(key: str, workers: int) -> int:
    """The worker the parent's own writes for a pod go to: CRC-32 of it."""
    return zlib.crc32(key.encode()) % workers


def next_worker(lanes: Sequence[int]) -> int:
    """The worker a new lane goes to, given each worker's lane count: the fewest (lowest index first)."""
    return min(range(len(lanes)), key=lanes.__getitem__)


def pack_keys(keys: Iterable[int]) -> bytes:
    """Keys or hashes as u64s in native byte order (an ``array("Q")``, as kvindex.keys and the
    adapters make them, as it is: one copy)."""
    return (keys if isinstance(keys, array) and keys.typecode == "Q" else array("Q", keys)).tobytes()


def unpack_keys(raw: bytes) -> array:
    return _unpacked(raw, "Q")


def _unpacked(data: bytes, typecode: str) -> array:
    out = array(typecode)
    out.frombytes(data)
    return out


class WorkerSettings(msgspec.Struct, frozen=True):
    """What a worker needs of the daemon's configuration (passed as JSON on its command line)."""

    replay_timeout: float = 2.0
    rcvhwm: int = RCVHWM
    store_buffer: int = 10_000
    max_message_bytes: int = 64 << 20
    replay_max_bytes: int = 128 << 20
    max_blocks_per_pod: int = MAX_BLOCKS_PER_POD
    silent_seconds: float = 10.0
    receive_buffer_bytes: int = RECEIVE_BUFFER_BYTES
    max_lag_seconds: float = MAX_LAG_SECONDS

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> WorkerSettings:
        return msgspec.json.decode(text, type=cls)


# -- events on the wire ----------------------------------------------------------------------------
class WireStored(msgspec.Struct, frozen=True, tag="s", array_like=True):
    block_hashes: bytes  # array("Q").tobytes(): native byte order, as token_ids
    parent_hash: int | None
    token_ids: bytes  # array("I").tobytes(): native byte order (both ends on one host, ipc://)
    block_size: int
    medium: str
    lora_name: str | None
    cache_salt: str | None
    group_idx: int


class WireRemoved(msgspec.Struct, frozen=True, tag="r", array_like=True):
    block_hashes: bytes
    medium: str
    group_idx: int


class WireCleared(msgspec.Struct, frozen=True, tag="c", array_like=True):
    pass


WireEvent = WireStored | WireRemoved | WireCleared


def to_wire(ev: KVEvent) -> WireEvent:
    if isinstance(ev, BlockStored):
        return WireStored(pack_keys(ev.block_hashes), ev.parent_hash, ev.token_ids.tobytes(), ev.block_size,
                          ev.medium, ev.lora_name, ev.cache_salt, ev.group_idx)
    if isinstance(ev, BlockRemoved):
        return WireRemoved(pack_keys(ev.block_hashes), ev.medium, ev.group_idx)
    return WireCleared()


def events_to_wire(events: Sequence[KVEvent]) -> tuple[WireEvent, ...]:
    return tuple(map(to_wire, events))


def from_wire(ev: WireEvent) -> KVEvent:
    if isinstance(ev, WireStored):
        return BlockStored(unpack_keys(ev.block_hashes), ev.parent_hash, _unpacked(ev.token_ids, "I"),
                           ev.block_size, ev.medium, ev.lora_name, ev.cache_salt, ev.group_idx)
    if isinstance(ev, WireRemoved):
        return BlockRemoved(unpack_keys(ev.block_hashes), ev.medium, ev.group_idx)
    return AllBlocksCleared()


# -- requests: one class per operation, the answer's type as its parameter -------------------------
class Request(msgspec.Struct, Generic[R], frozen=True, tag=True, array_like=True):
    """A request to a worker; ``R`` is the type of its answer."""

    reply: ClassVar[Any]  # R, as a runtime type (set for each subclass below)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is Request:
                cls.reply = typing.get_args(base)[0]


class LaneStatus(msgspec.Struct, frozen=True, array_like=True):
    """One lane as its worker sees it (``/workers``, ``/readyz``)."""

    connected: int = 0
    failure: str | None = None
    behind: tuple[str, ...] = ()
    lora: tuple[tuple[str, str, str], ...] = ()  # (pod, model, lora_name) its events named (kvindex.lora);
    # lora_name "": a stream of that pod and model applied a batch (the model is a base model)


class Ping(Request[int], frozen=True, tag="ping"):
    """The worker's pid (it is up and answering)."""


class AddLane(Request[None], frozen=True, tag="add"):
    key: str
    engine: EngineConfig


class RemoveLane(Request[bool], frozen=True, tag="remove"):
    key: str


class Lanes(Request[dict[str, LaneStatus]], frozen=True, tag="lanes"):
    pass


class Resync(Request[bool], frozen=True, tag="resync"):
    """An operator's resync of a pod's streams (awaits the engines' replay)."""

    pod: str


class Views(Request[list[dict[str, Any]]], frozen=True, tag="views"):
    """The pods' views (``GET /v1/pods``) as the worker's pod directory gives them."""


class Problems(Request[list[str]], frozen=True, tag="problems"):
    pass


class Metrics(Request[bytes], frozen=True, tag="metrics"):
    """The worker's metrics as Prometheus text."""


class Stats(Request[dict[str, int | float]], frozen=True, tag="stats"):
    """Ingest totals (benchmarks): batches, gaps, the wall clock of the last batch applied."""


class Apply(Request[ApplyResult], frozen=True, tag="apply"):
    stream: StreamRef
    seq: int
    epoch: int
    dp_rank: int
    events: tuple[WireEvent, ...]
    force: str | None = None


class Restarted(msgspec.Struct, frozen=True, array_like=True):
    position: Position
    changed: bool  # this request cleared the ranks and moved the epoch on


class Restart(Request[Restarted], frozen=True, tag="restart"):
    stream: StreamRef
    seen_epoch: int
    ranks: tuple[int, ...] | None


class GetPosition(Request[Position | None], frozen=True, tag="position"):
    stream: StreamRef


class SetPosition(Request[None], frozen=True, tag="set_position"):
    stream: StreamRef
    position: Position


class ClearPod(Request[None], frozen=True, tag="clear_pod"):
    pod: str
    dp_rank: int | None = None


class SetBlockSize(Request[int], frozen=True, tag="set_block_size"):
    model: str
    block_size: int


class BlockSize(Request[int | None], frozen=True, tag="block_size"):
    model: str


class BlockSizes(Request[dict[str, int]], frozen=True, tag="block_sizes"):
    pass


class Pods(Request[list[str]], frozen=True, tag="pods"):
    pass


class BlocksHeld(Request[dict[str, int]], frozen=True, tag="blocks_held"):
    pod: str


class EngineHashes(Request[dict[int, dict[int, int | None]]], frozen=True, tag="engine_hashes"):
    pod: str


class Match(Request[dict[str, PodMatch] | None], frozen=True, tag="match"):
    """The keys travel as the extra frame (``pack_keys``). ``block_size``: the size they were
    chunked by; a worker whose size for ``model`` is another answers None (not a match)."""

    pods: tuple[str, ...] | None
    model: str | None
    block_size: int | None = None


class ExportEntries(Request[list[Entry]], frozen=True, tag="export"):
    pass


class LoadEntries(Request[int], frozen=True, tag="load"):
    entries: tuple[Entry, ...]


REQUESTS = (Ping | AddLane | RemoveLane | Lanes | Resync | Views | Problems | Metrics | Stats | Apply | Restart
            | GetPosition | SetPosition | ClearPod | SetBlockSize | BlockSize | BlockSizes | Pods | BlocksHeld
            | EngineHashes | Match | ExportEntries | LoadEntries)
"""Every request a worker answers: the closed union it decodes."""


# -- replies ---------------------------------------------------------------------------------------
class Ok(msgspec.Struct, Generic[R], frozen=True, tag="ok", array_like=True):
    value: R


class Failed(msgspec.Struct, frozen=True, tag="error", array_like=True):
    message: str  # one line


_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
request_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(REQUESTS)
_reply_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def decode_reply(kind: type[Request[Any]], data: bytes) -> Any:
    """The value of a reply to a ``kind`` request; ``StoreUnavailable`` when it is ``Failed``."""
    dec = _reply_decoders.get(kind)
    if dec is None:
        dec = _reply_decoders[kind] = msgspec.msgpack.Decoder(Ok[kind.reply] | Failed)  # type: ignore[name-defined]
    reply = dec.decode(data)
    if isinstance(reply, Failed):
        raise StoreUnavailable(reply.message)
    return reply.value
