"""Mooncake's dialect of the KV-indexer RFC (#1403): its request fields and its answers' shapes.

Mooncake's conductor and its cache-aware proxy speak the same routes as Dynamo's indexer
(``/register``, ``/unregister``, ``/query``, ``/query_by_hash``) with other field names and
shapes; ``kvindex.http.dynamo`` serves both on the same routes and asks ``speaks_mooncake`` which
one a request is in. The Structs here are declared with ``kvindex.http.fields``' types and checked by
``kvindex.http.bodies.parse`` (the one place of the body rules and the ``kvindex.limits``
lengths), called by the handlers; this module maps them onto kvindex's registry and query
arguments and shapes the answers.

Verified against kvcache-ai/Mooncake: the proxy ``mooncake-conductor/example/
cache_aware_disagg_proxy.py`` (msgpack bodies, ``token_ids`` as a bin of little-endian int32, the
``hash_profile`` it registers, the ``instances`` it reads), the conductor's HTTP handlers
``mooncake-conductor/src/kvevent/event_manager.cpp`` (fields, defaults, ``instances`` with
lower-case tiers, ``/unregister`` by ``(instance_id, tenant_id, dp_rank)``, 404 when unknown) and
``docs/source/design/conductor/indexer-api-design.md`` (results keyed by tenant, upper-case tiers,
``/query_by_hash`` with rolling ``seq_hashes``).

Invariants:
- The dialect rule, written once: a body is Mooncake's when it has no ``model_name`` (Dynamo's
  model field, which every Dynamo body carries) and either a field only Mooncake sends
  (``MOONCAKE_FIELDS``) or its ``token_ids`` as a byte string (the int32 blob). The content type
  decides only the answer's encoding (msgpack for msgpack, else JSON), as for Dynamo's dialect.
- ``tenant_id`` is Mooncake's registration scope (a query sees the instances registered under its
  tenant, default ``"default"``): it maps onto kvindex's routing group, never onto ``cache_salt``
  (Mooncake's ``cache_salt`` is the separate hash namespace, and maps onto kvindex's).
- An empty string Mooncake sends for an optional name (``lora_name``, ``cache_salt``,
  ``replay_endpoint``, ``tenant_id``) means "not set", as in Mooncake.
- Counts are tokens of complete blocks, the same numbers as Dynamo's dialect for the same prompt
  (one query path); ``longest_matched`` is the deepest tier's prefix (tiers are cumulative through
  the device tier). A query whose ``block_size`` is not the model's matches no instance (Mooncake
  keys its contexts by block size too).
- Only ``type: "vLLM"`` publishers and the ``vllm_v1`` hash profile are served: kvindex keys vLLM's
  blocks by the token ids their events carry, so any vLLM hash algorithm and seed work. Rolling
  ``seq_hashes`` are refused (400 ``unsupported``): kvindex does not index Mooncake's hash chain.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import msgspec

from kvindex.query.answers import PreciseAnswer
from kvindex.events import MAX_BLOCK_SIZE
from kvindex.http.errors import ApiError
from kvindex.http.fields import (
    RANK_ERROR,
    BlankEndpoint,
    BlankId,
    BlankSalt,
    BlockSize,
    Body,
    Count,
    DpRank,
    Endpoint,
    Id,
    Model,
)
from kvindex.registrations import DEFAULT_GROUP, Registration

# fields only Mooncake's bodies carry (Dynamo's carry ``model_name``)
MOONCAKE_FIELDS = frozenset({"modelname", "model", "type", "tenant_id", "hash_profile", "seq_hashes", "block_hash",
                             "additionalsalt", "cache_group"})
PUBLISHER_TYPES = ("vLLM",)
HASH_STRATEGY, HASH_PROJECTION = "vllm_v1", "low64_be"  # vLLM's block hashes, as vLLM publishes them
_INSTANCE = "instance_id must be a non-empty string"
_LOW7 = bytes(range(128))  # the high bytes of non-negative int32s
_BLOCK = f"block_size must be an integer from 1 to {MAX_BLOCK_SIZE}"


def speaks_mooncake(body: dict[str, Any]) -> bool:
    """The dialect rule (see the module docstring)."""
    return "model_name" not in body and (not MOONCAKE_FIELDS.isdisjoint(body) or type(body.get("token_ids")) is bytes)


# -- the bodies (checked by kvindex.http.bodies.parse) ------------------------------------------
class HashProfile(msgspec.Struct, frozen=True):
    strategy: str = ""
    algorithm: str = ""
    python_hash_seed: str = ""
    index_projection: str = HASH_PROJECTION


class MooncakeRegister(Body, frozen=True):
    """``POST /register`` as Mooncake's proxy sends it."""

    bad: ClassVar[dict[str, str]] = {
        "instance_id": _INSTANCE, "block_size": _BLOCK, "dp_rank": RANK_ERROR, "type": "type must be a string",
        "hash_profile": "hash_profile must be an object of strings (strategy, algorithm, python_hash_seed, "
                        "index_projection)", "cache_group": "cache_group must be 0 or null",
        "additionalsalt": "additionalsalt must be a string"}
    missing: ClassVar[dict[str, str]] = {"instance_id": _INSTANCE}
    endpoint: Endpoint
    type: str
    modelname: Model
    instance_id: Id | Count
    block_size: BlockSize
    dp_rank: DpRank
    replay_endpoint: BlankEndpoint | None = None
    lora_name: BlankId | None = None
    tenant_id: BlankId | None = None
    hash_profile: HashProfile | None = None
    cache_group: int | None = None
    additionalsalt: str | None = None


class MooncakeUnregister(Body, frozen=True):
    """``POST /unregister``: ``(instance_id, tenant_id, dp_rank)``; older drafts add the model."""

    bad: ClassVar[dict[str, str]] = {"instance_id": _INSTANCE, "dp_rank": RANK_ERROR}
    missing: ClassVar[dict[str, str]] = {"instance_id": _INSTANCE}
    instance_id: Id | Count
    dp_rank: DpRank
    tenant_id: BlankId | None = None
    modelname: Model | None = None


class MooncakeQuery(Body, frozen=True):
    """``POST /query``; ``token_ids`` (a little-endian int32 blob or an array) is read apart."""

    bad: ClassVar[dict[str, str]] = {"block_size": _BLOCK}
    model: Model
    block_size: BlockSize
    tenant_id: BlankId | None = None
    lora_name: BlankId | None = None
    cache_salt: BlankSalt | None = None
    instance_id: BlankId | None = None


class QueryArgs(NamedTuple):
    """A Mooncake ``/query`` as the arguments of the one query path."""

    model: str
    group: str
    lora_name: str | None
    cache_salt: str | None
    token_ids: Any


def tenant(value: str | None) -> str:
    """Mooncake's tenant as kvindex's routing group (``""`` or absent: ``"default"``)."""
    return value or DEFAULT_GROUP


def register_args(args: MooncakeRegister) -> tuple[str, str | None]:
    """The registration's group (its tenant) and replay endpoint, once what kvindex cannot serve is refused."""
    if args.type not in PUBLISHER_TYPES:
        raise ApiError(f"type must be \"vLLM\": kvindex subscribes to vLLM's KV event streams (got {args.type[:64]!r})",
                       field="type", reason="unsupported")
    profile = args.hash_profile
    if profile is not None and profile.strategy != HASH_STRATEGY:
        raise ApiError(f"hash_profile.strategy must be \"{HASH_STRATEGY}\": kvindex keys vLLM's blocks by the token "
                       "ids their events carry", field="hash_profile.strategy", reason="unsupported")
    if profile is not None and profile.index_projection != HASH_PROJECTION:
        raise ApiError(f"hash_profile.index_projection must be \"{HASH_PROJECTION}\" (the block hashes vLLM "
                       "publishes)", field="hash_profile.index_projection", reason="unsupported")
    if args.cache_group not in (None, 0):
        raise ApiError("cache_group must be 0 or null: one KV cache group per engine", field="cache_group",
                       reason="unsupported")
    if args.additionalsalt:
        raise ApiError("additionalsalt is not supported: kvindex namespaces blocks by model, LoRA and the request's "
                       "cache_salt", field="additionalsalt", reason="unsupported")
    return tenant(args.tenant_id), args.replay_endpoint or None


def same_registration(reg: Registration | None, args: MooncakeRegister, group: str, replay: str | None) -> bool:
    """Mooncake answers a repeated identical registration as a success (its proxy registers at each start)."""
    return reg is not None and (reg.model, reg.group, reg.block_size, reg.engine.endpoint, reg.engine.replay) == (
        args.modelname, group, args.block_size, args.endpoint, replay)


def registered(iid: str) -> dict[str, Any]:
    return {"status": "registered successfully", "instance_id": iid}


def unregistered(found: Sequence[Registration], tenant_id: str) -> dict[str, Any]:
    """Mooncake's answer: the removed ``instance|tenant|rank`` keys."""
    return {"status": "unregistered successfully",
            "removed_instances": [f"{r.instance_id}|{tenant_id}|{r.dp_rank}" for r in found]}


def token_ids(value: Any) -> Any:
    """The int32 blob as an ``array("I")`` (negative ids refused); anything else is left to the
    query service's token check (an array of ids, Mooncake's JSON form)."""
    if type(value) is not bytes:
        return value
    if len(value) % 4:
        raise ApiError(f"token_ids must be little-endian int32s: {len(value)} bytes is not a multiple of 4",
                       field="token_ids", reason="bad_field")
    if value[3::4].translate(None, _LOW7):  # a high byte >= 0x80: a negative int32 (C-level, no loop)
        raise ApiError("token_ids must be non-negative token ids", field="token_ids", reason="bad_field")
    ids = array("I", value)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids


def query_args(args: MooncakeQuery, body: dict[str, Any]) -> QueryArgs:
    return QueryArgs(args.model, tenant(args.tenant_id), args.lora_name or None, args.cache_salt or None,
                     token_ids(body.get("token_ids")))


def only_instance(pods: list[str] | None, args: MooncakeQuery) -> list[str] | None:
    """The candidate pods, narrowed to ``instance_id`` when the query names one."""
    if not args.instance_id:
        return pods
    return [args.instance_id] if pods is None or args.instance_id in pods else []


def query_answer(answer: PreciseAnswer, args: MooncakeQuery) -> dict[str, Any]:
    """``{"instances": {...}, "<tenant>": {...}}``: the conductor's ``instances`` (its proxy reads
    them) and the documented tenant-keyed view, one map; each instance with both spellings of the
    tiers (upper case as documented, lower case as the conductor answers)."""
    bs = answer.block_size
    instances: dict[str, dict[str, Any]] = {}
    if bs == args.block_size:
        for pod, m in answer.matches.items():
            dp = {str(r): n * bs for r, n in m.dp.items()}
            gpu, cpu, disk = m.gpu * bs, m.cpu * bs, m.disk * bs
            instances[pod] = {"longest_matched": max(gpu, cpu, disk), "GPU": gpu, "CPU": cpu, "DISK": disk, "DP": dp,
                              "gpu": gpu, "cpu": cpu, "disk": disk, "dp": dp}
    return {"instances": instances, tenant(args.tenant_id): instances}


def refuse_by_hash(body: dict[str, Any]) -> ApiError:
    """Mooncake's ``/query_by_hash`` carries rolling sequence hashes kvindex does not index."""
    name = "block_hash" if "block_hash" in body and "seq_hashes" not in body else "seq_hashes"
    return ApiError(f"{name}: Mooncake's rolling sequence hashes are not indexed by kvindex (it chains its own "
                    "per-block keys): send the token ids to /query", field=name, reason="unsupported")
