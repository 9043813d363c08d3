"""A gRPC client of kvindex's SGLang KV indexer API (``--grpc-port``), for the tests: grpcio, with
the message classes generated at test time from kvindex's own ``kv_indexer.proto`` (grpcio-tools),
and the HTTP API's view of the same state (``/v1/score``, ``/v1/state``) to hold its answers to.

Hashes are signed here, as SGLang sends them (``sfixed64``); kvindex holds the same bits as u64.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest

from kvindex.index.protocol import tier_of
from kvindex.persist import snapshot as snapshots

PROTO = Path(__file__).resolve().parent.parent / "kvindex" / "sglang" / "kv_indexer.proto"
SERVICE = "/kv_indexer.v1.KVIndexer/"
URL_A, URL_B = "http://10.0.0.1:30000", "http://10.0.0.2:30000"
REPORT, REVOKE, CLEAR = 1, 2, 3
HBM, DRAM, SSD = 1, 2, 3
TIER_TYPE = {"gpu": HBM, "cpu": DRAM, "disk": SSD}


def generate_stubs(out: Path) -> Any:
    """kv_indexer_pb2, generated from kvindex's .proto into ``out``."""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO.parent}", f"--python_out={out}",
                    str(PROTO)], check=True)
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("kv_indexer_pb2")
    finally:
        sys.path.remove(str(out))


def signed(h: int) -> int:
    return h - (1 << 64) if h >> 63 else h


def unsigned(h: int) -> int:
    return h & ((1 << 64) - 1)


def action(pb: Any, kind: int, tier: int, hashes: Iterable[int] = ()) -> Any:
    return pb.ExternalKvAction(type=kind, tier=tier, hashes=list(hashes))


def sgl_frame(pod: str, seq: int, *events: list[Any], model: str = "m") -> list[bytes]:
    """One SGLang message: array-shaped events (``["BlockStored", hashes, parent, tokens, bs, lora, medium]``)."""
    return [f"kv@{pod}@{model}".encode(), seq.to_bytes(8, "big"), msgpack.packb([1.0, list(events), 0])]


class Client:
    """grpcio's asyncio channel to the daemon's --grpc-port, one unary method per RPC."""

    def __init__(self, port: int, pb: Any, token: str | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.pb = pb
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        responses = {"ApplyExternalKvBatch": pb.ApplyExternalKvBatchResponse, "MatchExternalKv": pb.MatchExternalKvResponse,
                     "MatchExternalKvPrefix": pb.MatchExternalKvPrefixResponse,
                     "GetExternalKvHitCounts": pb.GetExternalKvHitCountsResponse}
        self.calls = {name: self.channel.unary_unary(SERVICE + name, request_serializer=lambda m: m.SerializeToString(),
                                                     response_deserializer=r.FromString)
                      for name, r in responses.items()}

    async def __call__(self, name: str, request: Any) -> Any:
        return await self.calls[name](request, timeout=10, metadata=self.metadata)

    async def raw(self, path: str, data: bytes) -> bytes:
        call = self.channel.unary_unary(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return await call(data, timeout=10)

    async def code(self, name: str, request: Any) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await self(name, request)
        return exc.value.code()

    async def apply(self, worker: str, *actions: Any, seq: int = 0, address: str = URL_A) -> Any:
        return await self("ApplyExternalKvBatch", self.pb.ApplyExternalKvBatchRequest(
            worker_id=worker, seq=seq, worker_address=address, actions=list(actions)))

    async def prefix(self, hashes: Sequence[int], max_blocks: int = 0) -> dict[str, int]:
        r = await self("MatchExternalKvPrefix", self.pb.MatchExternalKvPrefixRequest(hashes=hashes, max_blocks=max_blocks))
        return {m.worker_id: m.matched_prefix_blocks for m in r.matches}

    async def tiers(self, hashes: Sequence[int], hit: bool = False) -> dict[str, dict[int, list[int]]]:
        r = await self("MatchExternalKv", self.pb.MatchExternalKvRequest(hashes=hashes, count_as_hit=hit))
        return {m.worker_id: {t.tier: list(t.hashes) for t in m.hashes_by_tier} for m in r.matches}


async def metric(h: Any, line: str) -> float:
    status, text = await h.get("/metrics")
    for row in text.decode().splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


async def http_prefix(h: Any, model: str, token_ids: list[int], addressed: set[str]) -> dict[str, int]:
    """MatchExternalKvPrefix's answer as ``/v1/score`` states it: per addressed pod holding a prefix,
    its device + host blocks (the prefix held on HBM or DRAM)."""
    status, score = await h.post("/v1/score", {"model": model, "token_ids": token_ids})
    assert status == 200, score
    out = {}
    for pod, p in score["pods"].items():
        tiers = p["precise"]["tier_blocks"]
        if pod in addressed and tiers["device"] + tiers["host"]:
            out[pod] = tiers["device"] + tiers["host"]
    return out


async def http_tiers(h: Any, hashes: Sequence[int]) -> dict[str, dict[int, list[int]]]:
    """MatchExternalKv's answer as ``GET /v1/state`` states it: per pod, per tier, which of
    ``hashes`` it holds keyed (request order, each once)."""
    status, raw = await h.get("/v1/state")
    assert status == 200
    held: dict[str, dict[int, set[int]]] = {}
    for pod, _rank, medium, h_, key, copies in snapshots.decode(raw).all_entries():
        if key is not None and copies > 0:
            held.setdefault(pod, {}).setdefault(TIER_TYPE[tier_of(medium)], set()).add(signed(h_))
    out = {}
    for pod, tiers in held.items():
        row = {t: [x for x in dict.fromkeys(hashes) if x in s] for t, s in tiers.items()}
        if row := {t: hs for t, hs in row.items() if hs}:
            out[pod] = row
    return out
