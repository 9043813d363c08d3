"""Reading a socket's queued messages: the native reader (``kvindex.ingest._drain`` on the libzmq
pyzmq loaded) against the reference (``transport.queued``, pyzmq's calls), on real sockets.

Both readers get the very same messages, queued on twin inproc pairs, and must hand back the
same parts in the same order, burst by burst; a real Subscriber on ipc then yields every published
message, bad ones included, in order, through whichever reader the daemon would use."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvindex import native
from kvindex.events import Frame
from kvindex.ingest import libzmq
from kvindex.ingest.transport import (DRAIN_BURST, MESSAGE_OVERHEAD, Malformed, Subscriber, burst_of, parse_message,
                                      queued, queued_bursts)
from kvindex.limits import MAX_TOPIC_BYTES
from tests.conftest import ipc_endpoint, need_native

Read = Callable[[int], list[list[bytes]]]


def native_reader() -> libzmq.Reader:
    reader = libzmq.native_queued()
    need_native(reader, "the native reader")
    assert reader is not None
    return reader


def messages(seed: int) -> list[list[bytes]]:
    """Messages as garbage and engines send them: 1 to 5 parts, empty parts, a part of 2 MB."""
    rnd = random.Random(seed)
    out: list[list[bytes]] = [[b"kv@p@m", (7).to_bytes(8, "big"), os.urandom(2 << 20)], [b""], [b"", b"", b""]]
    for i in range(500):
        parts = rnd.choice((1, 2, 3, 3, 3, 4, 5))
        out.append([rnd.randbytes(rnd.choice((0, 1, 8, 60, 4800))) for _ in range(parts)])
    return out


def native_bursts() -> libzmq.BurstReader:
    reader = libzmq.native_bursts(parse_message, MESSAGE_OVERHEAD)
    need_native(reader, "the native burst reader")
    assert reader is not None
    return reader


def framed(seed: int) -> list[list[bytes]]:
    """Engine messages beside every way framing can fail or nearly fail: topics at and past the
    bound, control and non-ASCII bytes (valid UTF-8 or not), seqs of 7, 8 (all ones, zero, the
    largest batch) and 9 bytes, 2 and 4 parts, empty parts; ``messages``'s garbage too."""
    rnd = random.Random(seed)
    seq8 = (5).to_bytes(8, "big")
    topics = [b"kv@pod-1@m", b"kv@pod-2@m", b"", b"a" * MAX_TOPIC_BYTES, b"a" * (MAX_TOPIC_BYTES + 1), b"kv\x00p",
              b"kv\x1fp", b"kv\x7fp", "kv@p\u00e9@m".encode(), "kv\u0085".encode(), b"kv\xff", b"~ !", b"kv@\x80"]
    seqs = [seq8, b"\xff" * 8, bytes(8), (2**64 - 2).to_bytes(8, "big"), b"\x01" * 7, b"\x01" * 9, b""]
    out = [[t, s, rnd.randbytes(rnd.choice((0, 3, 900)))] for t in topics for s in seqs]
    out += [[b"kv@pod-1@m", seq8], [b"kv@pod-1@m", seq8, b"p", b"x"], [b"kv@pod-1@m"]]
    out += messages(seed)[3:]
    rnd.shuffle(out)
    return out


class Pair:
    """An inproc PAIR whose receiving end is read by ``reader``."""

    def __init__(self, ctx: zmq.Context[Any], name: str, reader: libzmq.Reader) -> None:
        self.tx, self.rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        self.tx.sndhwm = self.rx.rcvhwm = 0  # queue everything: the test sends before it reads
        self.rx.bind(f"inproc://{name}")
        self.tx.connect(f"inproc://{name}")
        self.read: Read = reader(self.rx.underlying)

    def close(self) -> None:
        self.tx.close(linger=0)
        self.rx.close(linger=0)

    def send(self, msgs: list[list[bytes]]) -> None:
        for m in msgs:
            self.tx.send_multipart(m)

    def read_all(self, limit: int) -> list[list[list[bytes]]]:
        """Bursts of at most ``limit`` until nothing is queued (libzmq hands inproc messages over
        at once, so what was sent is queued)."""
        bursts = []
        while burst := self.read(limit):
            assert len(burst) <= limit
            bursts.append(burst)
        return bursts


@pytest.fixture
def ctx() -> Any:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.mark.parametrize("limit", [1, 3, DRAIN_BURST - 1])
def test_native_reader_reads_what_pyzmq_reads(ctx: zmq.Context[Any], limit: int) -> None:
    msgs = messages(limit)
    reader = native_reader()
    ref, fast = Pair(ctx, f"ref-{limit}", queued), Pair(ctx, f"fast-{limit}", reader)
    try:
        for pair in (ref, fast):
            assert pair.read(limit) == []  # nothing queued: an empty burst, at once
            pair.send(msgs)
        bursts = fast.read_all(limit)
        assert bursts == ref.read_all(limit)
        assert [m for b in bursts for m in b] == msgs
        assert fast.read(0) == [] and fast.read(limit) == []
        fast.send(msgs[:5])  # and it goes on reading what comes after
        assert fast.read(limit) == msgs[:min(5, limit)]
    finally:
        ref.close()
        fast.close()


@pytest.mark.parametrize("limit", [1, 7, DRAIN_BURST])
def test_native_bursts_frame_what_the_reference_frames(ctx: zmq.Context[Any], limit: int) -> None:
    """Burst by burst, the native reader's messages and counts are ``burst_of`` the parts pyzmq reads."""
    msgs = framed(limit)
    reader = native_bursts()
    ref, fast = Pair(ctx, f"bref-{limit}", queued), Pair(ctx, f"bfast-{limit}", reader)  # type: ignore[arg-type]
    try:
        assert fast.read(limit) == ([], 0, 0)
        for pair in (ref, fast):
            pair.send(msgs)
        bursts = [burst_of(b) for b in ref.read_all(limit)]
        got = []
        while (burst := fast.read(limit))[0]:
            got.append(burst)
        assert got == bursts
        messages_got = [m for b, _, _ in got for m in b]
        assert messages_got == [parse_message(m) for m in msgs]
        assert {type(m) for m in messages_got} == {Frame, Malformed}  # both paths taken
        assert [type(m.topic) for m in messages_got if isinstance(m, Frame)] == [str] * sum(
            isinstance(m, Frame) for m in messages_got)
    finally:
        ref.close()
        fast.close()


def test_the_reference_burst_reader_is_burst_of_queued(ctx: zmq.Context[Any]) -> None:
    msgs = framed(3)
    ref = Pair(ctx, "qb", queued_bursts)  # type: ignore[arg-type]
    try:
        ref.send(msgs[:10])
        assert ref.read(DRAIN_BURST) == burst_of(msgs[:10])  # type: ignore[comparison-overlap]
        assert burst_of(msgs[:2])[1] == sum(map(len, msgs[0] + msgs[1])) + 2 * MESSAGE_OVERHEAD
    finally:
        ref.close()


def test_native_reader_refuses_a_null_handle() -> None:
    native_reader()
    drain = native.load("kvindex.ingest._drain")
    assert drain is not None
    library = drain.Library((1,) * 6)  # addresses never called: the handle is refused first
    with pytest.raises(ValueError, match="handle is 0"):
        library.drain(0, 1)
    with pytest.raises(ValueError, match="handle is 0"):
        library.drain_frames(0, 1, Frame, parse_message, MAX_TOPIC_BYTES, MESSAGE_OVERHEAD)
    with pytest.raises(ValueError, match="six addresses"):
        drain.Library((1, 2))
    with pytest.raises(ValueError, match="address is 0"):
        drain.Library((0,) * 6)


def test_the_library_is_pyzmqs_own() -> None:
    native_reader()
    lib, where = libzmq._open()
    assert lib is not None and Path(where).name.startswith("libzmq")
    assert libzmq._proven(lib) is None


def test_libzmq_found_in_a_maps_text() -> None:
    maps = """\
7f0 r-xp 00000000 08:01 1 /venv/lib/python3.11/site-packages/pyzmq.libs/libzmq-2f02442c.so.5.2.5
7f1 r--p 00001000 08:01 1 /venv/lib/python3.11/site-packages/pyzmq.libs/libzmq-2f02442c.so.5.2.5
7f2 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libzmq.so.5.2.4
7f3 rw-p 00000000 00:00 0
7f4 r-xp 00000000 08:01 3 /venv/lib/python3.11/site-packages/zmq/backend/cython/_zmq.cpython-311.so
7f5 r-xp 00000000 08:01 4 /tmp/dir with spaces/libzmq.so.5
"""
    assert libzmq.mapped_libzmq(maps) == ["/tmp/dir with spaces/libzmq.so.5",
                                          "/usr/lib/x86_64-linux-gnu/libzmq.so.5.2.4",
                                          "/venv/lib/python3.11/site-packages/pyzmq.libs/libzmq-2f02442c.so.5.2.5"]
    assert libzmq.mapped_libzmq("7f3 rw-p 00000000 00:00 0\n") == []


def test_without_the_accelerator_pyzmq_reads(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVINDEX_PURE_PYTHON", "1")
    with caplog.at_level(logging.INFO, "kvindex.ingest.transport"):
        assert libzmq.native_queued() is None
        assert libzmq.native_bursts(parse_message, MESSAGE_OVERHEAD) is None
    assert caplog.messages == ["queued engine messages are read through pyzmq's calls (slower): "
                               "kvindex.ingest._drain is not in use (KVINDEX_PURE_PYTHON is set)"] * 2


@pytest.mark.parametrize("which", ["reference", "native"])
async def test_a_subscriber_yields_every_message_in_order(tmp_path: Path, which: str) -> None:
    reader = queued_bursts if which == "reference" else native_bursts()
    ctx = zmq.asyncio.Context()
    endpoint = ipc_endpoint(tmp_path, "pub")
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.bind(endpoint)
    sub = Subscriber(ctx, endpoint, bind=False, rcvhwm=0, reader=reader)
    try:
        probe = [b"kv@p@m", (0).to_bytes(8, "big"), b"probe"]
        first: list[Frame | Malformed] = []

        async def until_subscribed() -> None:
            async for burst in sub.bursts():
                first.extend(burst)
                return

        waiting = asyncio.create_task(until_subscribed())
        while not waiting.done():  # the slow joiner: publish until one arrives
            await pub.send_multipart(probe)
            await asyncio.sleep(0.01)
        sent = [[b"kv@p@m", (i + 1).to_bytes(8, "big"), os.urandom(64)] if i % 7 else [b"bad", b"frame"]
                for i in range(3 * DRAIN_BURST)]
        for m in sent:
            await pub.send_multipart(m)
        got: list[Frame | Malformed] = []
        sizes: list[int] = []

        async def read() -> None:
            async for burst in sub.bursts():
                sizes.append(len(burst))
                got.extend(m for m in burst if m != parse_message(probe))
                if len(got) == len(sent):
                    return

        await asyncio.wait_for(read(), 10)
        assert got == [parse_message(m) for m in sent]
        assert max(sizes) <= DRAIN_BURST
        assert got[0] == Malformed("frame_count") and got[1] == Frame("kv@p@m", 2, sent[1][2])
    finally:
        sub.close()
        pub.close(linger=0)
        ctx.destroy(linger=0)
