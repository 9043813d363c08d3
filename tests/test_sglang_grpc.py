"""SGLang's KV indexer API (``kv_indexer.v1.KVIndexer``, ``--grpc-port``) end to end: a real gRPC
client (grpcio, stubs generated at test time from kvindex's own ``kv_indexer.proto`` with
grpcio-tools) against a running daemon, its answers held equal to what the HTTP API says of the
same state.

- SGLang-dialect events over real ZeroMQ (negative i64 hashes, a DRAM tier): MatchExternalKvPrefix
  answers, per pod, /v1/score's device + host blocks for the same prompt; MatchExternalKv's hashes
  per tier are what the frames stored and removed.
- Batches applied over gRPC: /v1/pods/{pod} counts what SGLang's set rules say is held (REPORT
  twice, REVOKE, CLEAR_ALL_AT_TIER), /v1/score finds the first block under ``sglang-external``;
  the hit counts follow count_as_hit and drop with the last placement.
- Malformed protobuf, an unknown method, an over-size message, SGLang's limits and checks: each a
  gRPC status, counted by reason in /metrics; the server answers the next call.
- An orphaned pod (restored, no engine publishes for it) is in no gRPC answer, as in no HTTP one,
  until its worker's next batch makes it the worker's again.
- A token guards ApplyExternalKvBatch; --grpc-port is refused without the memory store.
- Stop: a call in flight (sent, not yet half-closed) is answered after GOAWAY and the stop ends
  with it; one that outlives the grace period is cut off (UNAVAILABLE), nothing left open.
- The index's hash_match / hash_tiers: the fast index equals the reference on random workloads;
  the codec raises only WireError on any bytes.

Random workloads, gRPC against HTTP: test_sglang_differential.py.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from array import array
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.config import Config, ConfigError
from kvindex.events import BlockRemoved, BlockStored
from kvindex.index.precise import CORE, PreciseIndex
from kvindex.index.reference import ReferenceIndex
from kvindex.sglang import wire
from tests.conftest import engine_config, ipc_endpoint, need_native, wait_for
from tests.sglang_client import (
    SERVICE, URL_A, Client, action, generate_stubs, http_prefix, http_tiers, metric, sgl_frame, signed,
)

BS = 4


@pytest.fixture(scope="module")
def pb(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return generate_stubs(tmp_path_factory.mktemp("stubs"))


async def test_zeromq_engines_answer_as_the_http_api(make_harness: Any, make_engine: Any, tmp_path: Path, pb: Any) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"))
    cfg = Config(engines=(engine_config(engine, dialect="sglang", url=URL_A),), grpc_port=0)
    h = await make_harness(cfg)
    await h.wait_connected()
    tokens = list(range(1000, 1000 + 8 * BS))
    hashes = [signed(0xF000_0000_0000_0000 + i) for i in range(8)]  # negative on the wire, as SGLang's are
    await engine.publish(sgl_frame("a", 0, ["BlockStored", hashes[:6], None, tokens[:6 * BS], BS, None, "GPU"]))
    await engine.publish(sgl_frame("b", 0, ["BlockStored", hashes[:3], None, tokens[:3 * BS], BS, None, "GPU"]))
    await engine.publish(sgl_frame("b", 1, ["BlockStored", hashes[:5], None, [], 0, None, "CPU"],
                                   ["BlockRemoved", hashes[1:2], "GPU"]))
    await h.wait_seq("a", 0)
    await h.wait_seq("b", 1)
    client = Client(h.daemon.indexer.port, pb)
    for n in range(1, 9):
        status, score = await h.post("/v1/score", {"model": "m", "token_ids": tokens[:n * BS] + [7]})
        assert status == 200, score
        http = {pod: p["precise"]["tier_blocks"]["device"] + p["precise"]["tier_blocks"]["host"]
                for pod, p in score["pods"].items() if p["precise"]["total_blocks"]}
        assert await client.prefix(hashes[:n]) == http, n
    assert await client.prefix(hashes, max_blocks=2) == {"a": 2, "b": 2}
    r = await client("MatchExternalKvPrefix", pb.MatchExternalKvPrefixRequest(hashes=hashes))
    assert [(m.worker_address, m.matched_prefix_blocks) for m in r.matches] == [(URL_A, 6), (URL_A, 3)]
    assert (r.best_prefix_blocks, r.blocks_read) == (6, 8)
    held = await client.tiers(list(reversed(hashes)))
    assert held == {"a": {1: list(reversed(hashes[:6]))},
                    "b": {1: [hashes[2], hashes[0]], 2: list(reversed(hashes[:3]))}}  # CPU 3, 4: keyless, never held
    code = await client.code("ApplyExternalKvBatch", pb.ApplyExternalKvBatchRequest(
        worker_id="a", actions=[action(pb, 1, 1, [1])]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # a ZeroMQ-fed pod has one writer
    status, pod = await h.get("/v1/pods/a")
    assert pod["blocks"]["gpu"] == 6, pod
    await client.channel.close()


async def test_applied_batches_answer_as_the_http_api(make_harness: Any, pb: Any) -> None:
    h = await make_harness(Config(grpc_port=0))
    client = Client(h.daemon.indexer.port, pb)
    hs = [signed((0x9E37_79B9_7F4A_7C15 * (i + 1)) & ((1 << 64) - 1)) for i in range(8)]
    REPORT, REVOKE, CLEAR, HBM, DRAM, SSD = 1, 2, 3, 1, 2, 3
    r = await client.apply("w1", action(pb, REPORT, HBM, hs[:5]), action(pb, REPORT, DRAM, hs[3:7]),
                           action(pb, REVOKE, HBM, [hs[4], hs[7]]), seq=41)
    assert r.applied_seq == 41
    await client.apply("w2", action(pb, REPORT, HBM, hs[:2]), action(pb, REPORT, SSD, hs[2:4]), address="")

    async def blocks(pod: str) -> dict[str, int]:
        status, view = await h.get(f"/v1/pods/{pod}")
        assert status == 200, view
        return {t: view["blocks"][t] for t in ("gpu", "cpu", "disk")}

    assert await blocks("w1") == {"gpu": 4, "cpu": 4, "disk": 0}
    assert await blocks("w2") == {"gpu": 2, "cpu": 0, "disk": 2}
    assert await client.prefix(hs) == {"w1": 7}  # HBM+DRAM: hs[0..6]; w2 has no address: left out
    await client.apply("w1", action(pb, REPORT, HBM, hs[:5]), action(pb, REPORT, DRAM, hs[3:7]), seq=42)
    assert await blocks("w1") == {"gpu": 5, "cpu": 4, "disk": 0}  # a set: a second REPORT adds no copy
    await client.apply("w1", action(pb, CLEAR, DRAM), action(pb, REVOKE, HBM, [hs[2]]), seq=43)
    assert await blocks("w1") == {"gpu": 4, "cpu": 0, "disk": 0}
    assert await client.prefix(hs) == {"w1": 2}
    assert await client.tiers(hs) == {"w1": {HBM: [hs[0], hs[1], hs[3], hs[4]]}, "w2": {HBM: hs[:2], SSD: hs[2:4]}}
    first = hs[0] & ((1 << 64) - 1)  # the block a hash is indexed as: its two u32 halves
    status, score = await h.post("/v1/score", {"model": "sglang-external",
                                               "token_ids": [first & 0xFFFFFFFF, first >> 32, 0]})
    assert {p: s["precise"]["blocks"] for p, s in score["pods"].items()} == {"w1": 1, "w2": 1}, score

    await client.tiers([hs[0], hs[1], 12345], hit=True)
    await client.tiers([hs[0], 12345], hit=True)
    counts = await client("GetExternalKvHitCounts", pb.GetExternalKvHitCountsRequest(hashes=[hs[0], hs[1], 12345]))
    assert [(e.hash, e.hit_count_total) for e in counts.entries] == [(hs[0], 2), (hs[1], 1)]
    await client.apply("w1", action(pb, REVOKE, HBM, [hs[1]]))
    await client.apply("w2", action(pb, REVOKE, HBM, [hs[1]]))
    counts = await client("GetExternalKvHitCounts", pb.GetExternalKvHitCountsRequest(hashes=[hs[1], hs[0]]))
    assert [(e.hash, e.hit_count_total) for e in counts.entries] == [(hs[0], 2)]  # gone with its last placement

    async with h.session.delete(h.url + "/v1/pods/w1") as deleted:
        assert deleted.status == 200
    await client.apply("w1", action(pb, REPORT, DRAM, hs[6:8]))
    assert await blocks("w1") == {"gpu": 0, "cpu": 2, "disk": 0}  # the ledger followed the DELETE
    assert await metric(h, 'kvindex_sglang_grpc_requests_total{code="0",method="ApplyExternalKvBatch"}') == 7
    await client.channel.close()


async def test_orphaned_pods_are_left_out_as_the_http_api_leaves_them(make_harness: Any, make_engine: Any,
                                                                       tmp_path: Path, pb: Any) -> None:
    engine, state = await make_engine(ipc_endpoint(tmp_path, "pub")), tmp_path / "state"
    h = await make_harness(Config(engines=(engine_config(engine, dialect="sglang", url=URL_A),), grpc_port=0,
                                  state_dir=state))
    await h.wait_connected()
    tokens, hashes = list(range(100, 100 + 3 * BS)), [11, 12, 13]
    await engine.publish(sgl_frame("a", 0, ["BlockStored", hashes, None, tokens, BS, None, "GPU"]))
    await h.wait_seq("a", 0)
    client = Client(h.daemon.indexer.port, pb)
    await client.apply("w", action(pb, 1, 1, [5, 6]))
    assert await client.tiers([*hashes, 5, 6]) == {"a": {1: hashes}, "w": {1: [5, 6]}}
    await client.channel.close()
    await h.daemon.stop()  # the final snapshot holds both pods
    h2 = await make_harness(Config(grpc_port=0, state_dir=state, orphan_grace_seconds=0))  # the engine is gone
    client = Client(h2.daemon.indexer.port, pb)
    assert await http_prefix(h2, "m", tokens + [7], {"a"}) == {}  # HTTP answers no orphan
    assert await client.tiers([*hashes, 5, 6]) == {}  # nor does gRPC (the blocks are still held)
    assert (await h2.get("/v1/pods/w"))[1]["blocks"]["gpu"] == 2
    await client.apply("w", action(pb, 1, 1, [7]))  # the worker's next batch: its pod, from what it reports
    assert await client.tiers([5, 6, 7]) == {"w": {1: [7]}} == await http_tiers(h2, [5, 6, 7])
    await client.channel.close()


async def test_bad_requests_are_statuses_counted_by_reason(make_harness: Any, pb: Any) -> None:
    h = await make_harness(Config(grpc_port=0))
    client = Client(h.daemon.indexer.port, pb)
    C = grpc.StatusCode
    for data, reason in ((b"\x0a\x05ab", "truncated"), (b"\x0b", "bad_wire_type"), (b"\x08" + b"\xff" * 11, "bad_varint"),
                         (b"\x0a\x02\xff\xfe", "bad_utf8"), (b"\x09" + b"\x00" * 8, "wrong_wire_type"),
                         (b"\x1a\x03\x1a\x01\x00", "bad_packed")):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await client.raw(SERVICE + "ApplyExternalKvBatch", data)
        assert exc.value.code() == C.INVALID_ARGUMENT, (data, exc.value)
        assert await metric(h, f'kvindex_sglang_grpc_errors_total{{reason="{reason}"}}') == 1, reason
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await client.raw(SERVICE + "ReplaceExternalKvSnapshot", b"")
    assert exc.value.code() == C.UNIMPLEMENTED
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await client.raw(SERVICE + "MatchExternalKvPrefix", b"\x0a" + wire.varint(8 << 20) + bytes(8 << 20))
    assert exc.value.code() == C.RESOURCE_EXHAUSTED
    assert await metric(h, 'kvindex_sglang_grpc_errors_total{reason="message_too_large"}') == 1
    A = pb.ApplyExternalKvBatchRequest
    for request, code in (
            (pb.MatchExternalKvRequest(hashes=list(range(16_385))), C.RESOURCE_EXHAUSTED),
            (pb.MatchExternalKvRequest(), C.INVALID_ARGUMENT),
            (A(worker_id="w", actions=[action(pb, 1, 1, [1])] * 257), C.RESOURCE_EXHAUSTED),
            (A(worker_id="w", actions=[action(pb, 1, 0, [1])]), C.INVALID_ARGUMENT),
            (A(worker_id="w", actions=[action(pb, 0, 1, [1])]), C.INVALID_ARGUMENT),
            (A(worker_id="w", actions=[action(pb, 2, 1)]), C.INVALID_ARGUMENT),
            (A(worker_id="w", actions=[pb.ExternalKvAction(type=1, tier=1, hashes=[1, 2], block_sizes=[4])]),
             C.INVALID_ARGUMENT),
            (A(worker_id=""), C.INVALID_ARGUMENT), (A(worker_id="a\nb"), C.INVALID_ARGUMENT),
            (A(worker_id="w", enforce_sequence=True), C.FAILED_PRECONDITION)):
        name = "MatchExternalKv" if isinstance(request, pb.MatchExternalKvRequest) else "ApplyExternalKvBatch"
        assert await client.code(name, request) == code, request
    assert await client.prefix(list(range(50_000))) == {}  # a prefix query has no hash cap (SGLang's rule)
    assert await client.apply("w", action(pb, 1, 1, [5])) is not None  # still serving
    status, pods = await h.get("/v1/pods")
    assert [p["pod"] for p in pods["pods"]] == ["w"], pods
    await client.channel.close()


async def test_a_token_guards_applies(make_harness: Any, pb: Any) -> None:
    h = await make_harness(Config(grpc_port=0), token="s3cret")
    anonymous, holder = Client(h.daemon.indexer.port, pb), Client(h.daemon.indexer.port, pb, token="s3cret")
    request = pb.ApplyExternalKvBatchRequest(worker_id="w", actions=[action(pb, 1, 1, [5])])
    assert await anonymous.code("ApplyExternalKvBatch", request) == grpc.StatusCode.UNAUTHENTICATED
    assert await anonymous.prefix([5]) == {}  # reads are open with auth = "writes"
    await holder("ApplyExternalKvBatch", request)
    assert await anonymous.tiers([5]) == {"w": {1: [5]}}
    for c in (anonymous, holder):
        await c.channel.close()


def test_grpc_port_needs_the_memory_store() -> None:
    with pytest.raises(ConfigError, match="--grpc-port .* needs the memory store in one process .*, not --workers 2"):
        Config(grpc_port=0, workers=2)
    r = subprocess.run([sys.executable, "-m", "kvindex", "serve", "--grpc-port", "0", "--port", "0",
                        "--store", "redis://:pw@127.0.0.1:1/0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("kvindex: --grpc-port (SGLang's KV indexer API) needs the memory store in one process (it "
                        "reads each engine's own block hashes there), not --store redis://:***@127.0.0.1:1/0\n")
    with pytest.raises(ConfigError, match="grpc_port must be"):
        Config(grpc_port=70000)


def test_hash_match_and_tiers_equal_the_reference() -> None:
    need_native(CORE, "kvindex.index._core")
    rng = random.Random(39)
    for _ in range(30):
        fast, ref = PreciseIndex(), ReferenceIndex()
        hashes = [rng.getrandbits(64) for _ in range(12)]
        for ix in (fast, ref):
            ix.set_block_size("m", 2)
        for step in range(40):
            pod, rank = rng.choice("abc"), rng.randrange(2)
            start, n = rng.randrange(4), rng.randrange(1, 6)
            hs = hashes[start:start + n]
            medium = rng.choice(["GPU", "GPU", "CPU", "DISK"])
            ev: Any = (BlockRemoved(array("Q", hs), medium) if rng.random() < 0.3 else
                       BlockStored(array("Q", hs), None if start == 0 else hashes[start - 1],
                                   array("I", range(2 * start, 2 * (start + n))) if medium == "GPU" else array("I"),
                                   2, medium))
            for ix in (fast, ref):
                ix.apply_batch(pod, "m", rank, [ev])
            probe = hashes[:rng.randrange(1, 12)]
            assert fast.hash_match(probe) == ref.hash_match(probe), step
            assert fast.hash_tiers(probe) == ref.hash_tiers(probe), step


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_the_codec_refuses_any_bytes_only_with_wire_errors(data: bytes) -> None:
    for decode in (wire.decode_apply, wire.decode_query, wire.decode_action):
        try:
            decode(data)
        except wire.WireError:
            pass


def test_the_codec_reads_what_grpcio_writes(pb: Any) -> None:
    request = pb.ApplyExternalKvBatchRequest(worker_id="w-é", seq=2**64 - 1, worker_address="http://x",
                                             actions=[pb.ExternalKvAction(type=3, tier=2),
                                                      pb.ExternalKvAction(type=1, tier=1, hashes=[-1, 0, 2**63 - 1],
                                                                          component_masks=[1, 3, 0])])
    got = wire.decode_apply(request.SerializeToString())
    assert (got.worker_id, got.seq, got.worker_address) == ("w-é", 2**64 - 1, "http://x")
    assert [(a.type, a.tier, list(a.hashes), a.component_masks) for a in got.actions] == \
        [(3, 2, [], ()), (1, 1, [2**64 - 1, 0, 2**63 - 1], (1, 3, 0))]
    answer = pb.MatchExternalKvPrefixResponse.FromString(wire.prefix_response([wire.prefix_match("u", 3, "w")], 3, 9))
    assert [(m.worker_address, m.matched_prefix_blocks, m.worker_id) for m in answer.matches] == [("u", 3, "w")]
    entry = pb.HitCountEntry.FromString(wire.hit_entry(2**64 - 1, 5))
    assert (entry.hash, entry.hit_count_total) == (-1, 5)


async def open_call(client: Client, pb: Any, hashes: list[int], release: asyncio.Event) -> asyncio.Future[Any]:
    """A MatchExternalKvPrefix call whose request is sent but not half-closed until ``release``:
    a call in flight for as long as the test wants."""
    async def requests() -> Any:
        yield pb.MatchExternalKvPrefixRequest(hashes=hashes)
        await release.wait()
    call = client.channel.stream_unary(SERVICE + "MatchExternalKvPrefix", request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=pb.MatchExternalKvPrefixResponse.FromString)
    return asyncio.ensure_future(call(requests(), timeout=30))


async def listener_closed(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


async def test_stop_lets_a_call_in_flight_finish(make_harness: Any, pb: Any) -> None:
    h = await make_harness(Config(grpc_port=0))
    indexer = h.daemon.indexer
    client = Client(indexer.port, pb)
    await client.apply("w", action(pb, 1, 1, range(1, 200)))
    release = asyncio.Event()
    pending = await open_call(client, pb, [1, 2, 3], release)
    await wait_for(lambda: indexer.in_flight() == 1, what="the call open on the server")
    t0 = time.monotonic()
    stopping = asyncio.ensure_future(h.daemon.stop())
    while not await listener_closed(indexer.port):  # the listener closes, GOAWAY goes out at once
        await asyncio.sleep(0.01)
    assert not stopping.done()  # waiting for the call in flight
    release.set()
    answer = await pending
    assert [(m.worker_id, m.matched_prefix_blocks) for m in answer.matches] == [("w", 3)]
    await stopping
    assert time.monotonic() - t0 < 4  # ended with its last call, not at the grace period (5 s)
    assert indexer.in_flight() == 0
    await client.channel.close()


async def test_stop_ends_a_call_that_outlives_the_grace(make_harness: Any, pb: Any) -> None:
    h = await make_harness(Config(grpc_port=0))
    indexer = h.daemon.indexer
    client = Client(indexer.port, pb)
    release = asyncio.Event()
    pending = await open_call(client, pb, [1], release)
    await wait_for(lambda: indexer.in_flight() == 1, what="the call open on the server")
    t0 = time.monotonic()
    await indexer.stop(grace=0.5)
    assert 0.4 < time.monotonic() - t0 < 3
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await pending
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value
    assert indexer.in_flight() == 0
    with pytest.raises(grpc.aio.AioRpcError) as exc:  # and nothing is served any more
        await asyncio.wait_for(client.prefix([1]), 10)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    release.set()
    await client.channel.close()
