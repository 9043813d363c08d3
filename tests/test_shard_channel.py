"""The parent <-> worker channel on real Unix sockets: framing read back whole whatever the reads
cut, and a sharded read that writes every worker's request before it awaits any answer."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

import pytest

from kvindex.index.protocol import StoreUnavailable
from kvindex.shard import channel as ch
from kvindex.shard.client import ShardChannel
from kvindex.shard.frames import MAX_FRAMES, framed, read_message
from kvindex.shard.store import ShardedPreciseStore


async def test_read_message_gives_back_what_framed_wrote_across_any_cut() -> None:
    """Messages of 1..4 frames, empty, small and big frames (past the size read with the next
    length), written in random pieces: each read back as it was, in order."""
    rng = random.Random(7)
    messages = [[rng.randbytes(rng.choice((0, 1, 8, 300, 70_000, 200_000))) for _ in range(rng.randint(1, MAX_FRAMES))]
                for _ in range(60)]
    data = b"".join(framed(m) for m in messages)
    ours, theirs = socket.socketpair()
    reader, our_writer = await asyncio.open_unix_connection(sock=ours)
    _, writer = await asyncio.open_unix_connection(sock=theirs)

    async def write_in_pieces() -> None:
        pos = 0
        while pos < len(data):
            step = rng.choice((1, 3, 5, 4096, 65_536))
            writer.write(data[pos:pos + step])
            pos += step
            await writer.drain()
        writer.close()

    feeding = asyncio.create_task(write_in_pieces())
    try:
        for expected in messages:
            assert await asyncio.wait_for(read_message(reader), 10) == expected
        with pytest.raises(asyncio.IncompleteReadError):
            await read_message(reader)  # the peer closed it at a message boundary
    finally:
        await feeding
        our_writer.close()
        await asyncio.gather(writer.wait_closed(), our_writer.wait_closed(), return_exceptions=True)


class HeldWorker:
    """A worker's side of the channel that answers ``Pods`` (its own name) only once every worker
    has its request (``both``), or fails it at once (``fail``)."""

    def __init__(self, path: str, both: asyncio.Barrier | None, fail: bool = False) -> None:
        self.path, self.both, self.fail = path, both, fail
        self.name = Path(path).stem
        self.server: asyncio.Server | None = None
        self.handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self.handlers[me] = writer
        try:
            while True:
                rid, _ = await read_message(reader)
                if self.fail:
                    reply: ch.Ok[list[str]] | ch.Failed = ch.Failed("RuntimeError: no")
                else:
                    assert self.both is not None
                    await asyncio.wait_for(self.both.wait(), 5)  # never, if the other's request waits on this answer
                    reply = ch.Ok([self.name])
                writer.write(framed([rid, ch.encode(reply)]))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.handlers:
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        for writer in self.handlers.values():
            await asyncio.gather(writer.wait_closed(), return_exceptions=True)


async def _channels(tmp_path: Path, workers: list[HeldWorker]) -> list[ShardChannel]:
    chans = []
    for i, w in enumerate(workers):
        await w.start()
        chan = ShardChannel(i, w.path, timeout=10)
        chan.start()
        chans.append(chan)
    return chans


async def test_a_sharded_read_writes_every_request_before_awaiting_an_answer(tmp_path: Path) -> None:
    both = asyncio.Barrier(2)
    workers = [HeldWorker(str(tmp_path / f"w{i}.sock"), both) for i in range(2)]
    chans = await _channels(tmp_path, workers)
    try:
        store = ShardedPreciseStore(chans)
        for _ in range(3):
            both = asyncio.Barrier(2)
            for w in workers:
                w.both = both
            assert await asyncio.wait_for(store.pods(), 10) == ["w0", "w1"]
        assert [c.sent for c in chans] == [3, 3]
        assert all(c.in_flight() == [] for c in chans)
    finally:
        for c in chans:
            await c.close()
        for w in workers:
            await w.close()


async def test_a_failed_worker_fails_the_read_and_the_others_request_is_forgotten(tmp_path: Path) -> None:
    workers = [HeldWorker(str(tmp_path / "w0.sock"), None, fail=True),
               HeldWorker(str(tmp_path / "w1.sock"), asyncio.Barrier(2))]  # never answers on its own
    chans = await _channels(tmp_path, workers)
    try:
        with pytest.raises(StoreUnavailable, match=r"^worker 0: RuntimeError: no$"):
            await asyncio.wait_for(ShardedPreciseStore(chans).pods(), 10)
        await asyncio.sleep(0)  # the forgotten request's bookkeeping runs as its future's callback
        assert [c.in_flight() for c in chans] == [[], []]
    finally:
        for c in chans:
            await c.close()
        for w in workers:
            await w.close()
