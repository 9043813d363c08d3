"""kvindex's HPACK decoder and its HTTP/2 + gRPC server (kvindex.route.hpack, .h2, .grpc),
against independent peers: RFC 7541's worked examples, the python-hyper ``hpack`` encoder, and a
real grpcio client over loopback. Hostile bytes never take the server down."""

from __future__ import annotations

import asyncio
import random
import socket
import struct

import grpc
import hpack as hyper_hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.route import hpack
from kvindex.route.grpc import HEALTH_CHECK, NOT_SERVING, SERVING, GrpcServer, HealthCheck
from kvindex.route.h2frames import PREFACE, frame

# RFC 7541 C.4: three requests on one connection, Huffman-coded, and the table size after each
RFC_C4 = [("828684418cf1e3c2e5f23a6ba0ab90f4ff", [(b":authority", b"www.example.com")], 57),
          ("828684be5886a8eb10649cbf", [(b"cache-control", b"no-cache")], 110),
          ("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf", [(b"custom-key", b"custom-value")], 164)]


def test_rfc7541_huffman_requests_decode_with_the_table() -> None:
    d = hpack.Decoder()
    for hexed, last, size in RFC_C4:
        headers = d.decode(bytes.fromhex(hexed))
        assert headers[-len(last):] == last
        assert d.table_bytes == size
    assert headers[:3] == [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/index.html")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from(["a", "x-id", ":path", "content-type", "grpc-timeout"]),
                                   st.binary(max_size=60)), min_size=1, max_size=6), min_size=1, max_size=8),
       st.booleans(), st.sampled_from([0, 64, 4096]))
def test_decoder_agrees_with_an_independent_encoder(blocks, huffman, table) -> None:
    enc, dec = hyper_hpack.Encoder(), hpack.Decoder()
    enc.header_table_size = table
    for block in blocks:
        assert dec.decode(enc.encode(block, huffman=huffman)) == [(n.encode(), v) for n, v in block]
    assert dec.table_bytes <= 4096


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_blocks_raise_only_hpack_errors(data) -> None:
    try:
        hpack.Decoder(max_list_bytes=1024).decode(data)
    except hpack.HpackError:
        pass


def test_huffman_is_linear_and_refuses_bad_padding() -> None:
    with pytest.raises(hpack.HpackError):
        hpack.HUFFMAN.decode(b"\x00")  # five zero bits decode '0', three zero bits are not EOS padding
    assert hpack.HUFFMAN.decode(bytes.fromhex("f1e3c2e5f23a6ba0ab90f4ff")) == b"www.example.com"


def test_literal_is_readable_by_the_decoder() -> None:
    block = hpack.STATUS_200 + hpack.literal(b"grpc-status", b"0") + hpack.literal(b"x" * 200, b"y" * 300)
    assert hpack.Decoder().decode(block) == [(b":status", b"200"), (b"grpc-status", b"0"), (b"x" * 200, b"y" * 300)]


# -- the server, driven by grpcio ------------------------------------------------------------------
class Echo:
    """Answers each message reversed; finishes when the client half-closes."""

    def __init__(self, call) -> None:
        self.call = call

    def message(self, data: bytes) -> None:
        self.call.send(data[::-1])

    def end(self) -> None:
        self.call.finish()

    def cancel(self) -> None:
        pass


class Boom(Echo):
    def message(self, data: bytes) -> None:
        raise RuntimeError("a bug")


async def serve(errors: list[str] | None = None, ready: bool = True) -> GrpcServer:
    status = lambda s: SERVING if s in ("", "liveness") or ready else NOT_SERVING  # noqa: E731
    srv = GrpcServer({b"/t.T/Echo": Echo, b"/t.T/Boom": Boom, HEALTH_CHECK: lambda c: HealthCheck(c, status)},
                     max_message_bytes=8 << 20, on_error=(errors.append if errors is not None else lambda r: None))
    await srv.start("127.0.0.1", 0)
    return srv


def raw(b: bytes) -> bytes:
    return b


async def test_streams_large_messages_health_and_unknown_methods() -> None:
    srv = await serve(ready=False)
    big = [("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}", options=big) as ch:
            echo = ch.stream_stream("/t.T/Echo", request_serializer=raw, response_deserializer=raw)
            call = echo()
            for m in [b"abc", bytes(range(256)) * 20_000, b""]:  # 5 MB: past every flow-control window
                await call.write(m)
                assert await call.read() == m[::-1]
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            health = ch.unary_unary(HEALTH_CHECK.decode(), request_serializer=raw, response_deserializer=raw)
            assert await health(b"\x0a\x08liveness") == bytes((0x08, SERVING))
            assert await health(b"\x0a\x09readiness") == bytes((0x08, NOT_SERVING))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/t.T/Nope", request_serializer=raw, response_deserializer=raw)(b"x")
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/t.T/Echo", request_serializer=raw, response_deserializer=raw)(b"x" * (9 << 20))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await srv.stop(1)


async def test_many_concurrent_streams_and_a_failing_handler() -> None:
    errors: list[str] = []
    srv = await serve(errors)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            echo = ch.unary_unary("/t.T/Echo", request_serializer=raw, response_deserializer=raw)
            answers = await asyncio.gather(*(echo(str(i).encode()) for i in range(200)))
            assert answers == [str(i).encode()[::-1] for i in range(200)]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/t.T/Boom", request_serializer=raw, response_deserializer=raw)(b"x")
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert await echo(b"still") == b"llits"  # the connection lives on
    finally:
        await srv.stop(1)
    assert "handler_failed" in errors


def frame_types(data: bytes) -> list[int]:
    """The types of the whole frames in what the server wrote."""
    types, pos = [], 0
    while len(data) - pos >= 9:
        n = int.from_bytes(data[pos:pos + 3], "big")
        types.append(data[pos + 3])
        pos += 9 + n
    return types


async def _exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 2)  # until the server closes
    except asyncio.TimeoutError:
        return b""
    finally:
        writer.close()


async def still_echoes(port: int) -> None:
    """A well-behaved client on a new connection is still answered."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        echo = ch.unary_unary("/t.T/Echo", request_serializer=raw, response_deserializer=raw)
        assert await echo(b"ok") == b"ko"


@pytest.mark.parametrize("data, reason", [
    (b"GET / HTTP/1.1\r\n\r\n", "bad_preface"),
    (PREFACE + frame(4, 0, 1, b""), "settings_on_stream"),
    (PREFACE + frame(4, 0, 0, b"\x00" * 5), "bad_settings"),
    (PREFACE + frame(1, 4, 2, b"\x82"), "bad_stream_id"),
    (PREFACE + frame(0, 0, 7, b"hello"), "data_on_idle_stream"),
    (PREFACE + frame(1, 4, 1, b"\xff\xff\xff\xff"), "bad_header_block"),
    (PREFACE + frame(1, 0, 1, b"\x82") + frame(0, 0, 1, b"x"), "continuation_expected"),
    (PREFACE + frame(6, 0, 0, b"1234"), "bad_ping"),
    (PREFACE + struct.pack(">I", 2 << 20)[1:] + b"\x00\x00\x00\x00\x00\x01", "frame_too_large"),
])

async def test_hostile_connections_get_goaway_and_the_server_lives(data: bytes, reason: str) -> None:
    errors: list[str] = []
    srv = await serve(errors)
    try:
        answer = await _exchange(srv.port, data)
        assert 7 in frame_types(answer)  # GOAWAY
        assert reason in errors
        await still_echoes(srv.port)
    finally:
        await srv.stop(1)


async def test_random_bytes_after_the_preface_never_crash() -> None:
    errors: list[str] = []
    srv = await serve(errors)
    rng = random.Random(7)
    try:
        for _ in range(40):
            await _exchange(srv.port, PREFACE + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
        await still_echoes(srv.port)
    finally:
        await srv.stop(1)


async def test_stop_lets_a_call_in_flight_finish() -> None:
    srv = await serve()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        call = ch.stream_stream("/t.T/Echo", request_serializer=raw, response_deserializer=raw)()
        await call.write(b"before")
        assert await call.read() == b"erofeb"
        stopping = asyncio.create_task(srv.stop(5))
        await asyncio.sleep(0.1)
        await call.write(b"during")  # GOAWAY keeps streams in flight going
        assert await call.read() == b"gnirud"
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        await asyncio.wait_for(stopping, 5)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()
