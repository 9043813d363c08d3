"""ZeroMQ transport: one SUB socket per engine, and the replay client (DEALER).

Invariants:
- The transport yields ``Frame`` (3 frames: topic, 8-byte big-endian seq, payload) or
  ``Malformed(reason)``, in bursts (``Subscriber.bursts``: the message a wake-up awaited, then up
  to ``DRAIN_BURST`` in all of what is already queued); it never decodes payloads and never drops
  a message silently. A topic over ``MAX_TOPIC_BYTES`` is ``Malformed("topic_too_long")``; one
  that is not UTF-8 or holds a control character (NUL, C0, DEL, C1: a pod or model name no
  engine sends, that would make a pod of its own) is ``Malformed("bad_topic")``.
- Queued messages are read by a reader (``queued_bursts``: ``burst_of`` what ``queued`` reads on
  pyzmq's calls; or its native twin, ``kvindex.ingest.libzmq``): the same messages in the same
  order, counted the same (tests/test_drain.py). Framing is judged here, once (``parse_message``):
  the native reader makes only the common message's ``Frame`` itself and hands any other to it.
- The SUB socket connects (vLLM binds its PUB) or binds (llm-d-inference-sim dials us).
- A replay request is ``[b"", seq8]`` on a fresh DEALER; both reply shapes are accepted:
  ``[b"", topic, seq8, payload]`` ... end ``[b"", b"", ff*8, b""]`` (vLLM >= #45177) and
  ``[b"", seq8, payload]`` ... end ``[b"", ff*8, b""]`` (older vLLM, SGLang); a bare ``[b""]``
  also ends it. Every socket is closed with linger 0.
- Both sockets refuse messages over ``max_message_bytes`` (ZeroMQ ``MAXMSGSIZE``: libzmq drops
  the connection that sent one, so an oversized batch becomes a seq gap / a failed replay, never
  a memory spike). Not given, it is the context's default (the daemon sets it from
  ``Config.max_message_bytes``), else ``MAX_MESSAGE_BYTES``.
- libzmq reconnects a connecting SUB by itself after a network error (its monitor says
  ``CONNECT_RETRIED`` at once), but not after a protocol error (a message over ``MAXMSGSIZE`` is
  one): then nothing follows the ``DISCONNECTED``. ``Subscriber.watch_peers`` reports such a
  connection as *abandoned* (no retry within ``ABANDONED_AFTER`` seconds) and returns; the owner
  closes the socket and opens a new one (``ingest.receiver``). (Re-dialling the same socket from
  the monitor was tried and removed: under engine churn it aborted libzmq.)
- ``Subscriber.watch_peers`` counts the connected peers from the socket's monitor (connected or
  accepted: one more; disconnected: one less, never below zero).
- ``Subscriber.bursts`` sets ``burst_bytes`` to the size of the burst it yields (its parts, and
  ``MESSAGE_OVERHEAD`` per message: what the lane's inbox counts against its budget) and
  ``burst_full`` to whether it was as large as a read takes (``DRAIN_BURST``: more may be queued);
  it calls ``drained`` whenever it finds the socket empty and awaits the next message.
  It reads the next burst only when its consumer asks for it: a consumer that waits leaves the
  messages in ZeroMQ's queue, bounded by ``rcvhwm`` messages (then TCP, then the publisher's own
  high-water mark).
- A replay answer is bounded three ways: ``timeout`` seconds of waiting for the engine for the
  whole answer (the time the caller spends on the batches it was handed does not count), at most
  ``max_frames`` batches and at most ``max_bytes`` bytes (``MAX_REPLAY_BYTES``); past a bound the
  answer ends, incomplete, saying which (``ReplayAnswer.cut``: ``replay_timeout``,
  ``replay_too_many_frames``, ``replay_too_large``). A frame that would pass ``max_bytes`` is not
  kept. The reader yields to the event loop every ``YIELD_EVERY`` frames even when the socket
  always has the next one ready, so an endless answer never holds the loop.
- ``ingest_context`` makes the context every lane's sockets come from, with room for as many
  sockets as the process may open files (libzmq's default of 1,023 is 341 lanes of three sockets:
  a SUB and its monitor's two ends): it raises the soft open-file limit to the hard one first
  (``raise_nofile``) and sizes the context by the limit then in force, so libzmq never plans for
  more sockets than the process can open.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvindex.events import MAX_SEQ, Frame
from kvindex.ingest.backlog import BacklogRelease
from kvindex.ingest.libzmq import BurstReader
from kvindex.limits import MAX_TOPIC_BYTES

log = logging.getLogger("kvindex.ingest.transport")

END_SEQ = b"\xff" * 8
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # in a topic: no engine names a pod or model so
DRAIN_BURST = 256
MAX_MESSAGE_BYTES = 64 << 20
MAX_REPLAY_FRAMES = 200_000
MAX_REPLAY_BYTES = 128 << 20
YIELD_EVERY = 64  # replay frames read between two turns given to the event loop
ABANDONED_AFTER = 0.5  # seconds after a DISCONNECTED with no CONNECT_RETRIED: libzmq gave the connection up
MESSAGE_OVERHEAD = 200  # bytes a queued message costs beyond its parts (its Python objects)


def raise_nofile() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit where allowed; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def ingest_context(max_message_bytes: int) -> zmq.asyncio.Context:
    """The ZeroMQ context of a process's lanes: every socket's ``MAXMSGSIZE`` is ``max_message_bytes``
    and ``MAX_SOCKETS`` the open-file limit in force after ``raise_nofile`` (within libzmq's
    ``SOCKET_LIMIT``), not 1,023."""
    files = raise_nofile()
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    ctx.set(zmq.MAX_SOCKETS, max(ctx.get(zmq.MAX_SOCKETS), min(files, ctx.get(zmq.SOCKET_LIMIT))))
    return ctx


def _limit(ctx: zmq.Context, max_message_bytes: int | None) -> int:
    if max_message_bytes is not None:
        return max_message_bytes
    return int(ctx.sockopts.get(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES))


@dataclass(frozen=True, slots=True)
class Malformed:
    reason: str


@dataclass(frozen=True, slots=True)
class ReplayResult:
    frames: tuple[Frame, ...]
    complete: bool  # the end marker arrived
    cut: str | None = None  # the bound that ended the answer early, if one did


class ReplayError(RuntimeError):
    pass


def parse_message(parts: list[bytes]) -> Frame | Malformed:
    if len(parts) != 3:
        return Malformed("frame_count")
    topic, seq, payload = parts
    if len(seq) != 8 or seq == END_SEQ:  # all ones ends a replay answer: no batch has that seq (MAX_SEQ)
        return Malformed("bad_seq")
    if len(topic) > MAX_TOPIC_BYTES:  # the pod and model names it carries: bounded (kvindex.limits)
        return Malformed("topic_too_long")
    try:
        topic_s = topic.decode("utf-8")
    except UnicodeDecodeError:
        return Malformed("bad_topic")
    if _CONTROL.search(topic_s):
        return Malformed("bad_topic")
    return Frame(topic_s, int.from_bytes(seq, "big"), payload)


def queued_parts(sock: zmq.Socket[bytes]) -> list[bytes]:
    """The parts of the next queued message (``zmq.Again``: none yet), as ``recv_multipart`` reads
    them but 1.1–1.5 µs cheaper per 3-part message: each part's ``more`` flag read from its frame
    (ZeroMQ delivers a message's parts together: after the first part the rest are queued)."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    parts = [frame.bytes]
    while frame.more:
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        parts.append(frame.bytes)
    return parts


def queued(handle: int) -> Callable[[int], list[list[bytes]]]:
    """The reference reader of the socket at ``handle``: ``read(limit)`` is up to ``limit`` queued
    messages' parts, through pyzmq (``queued_parts``); ``kvindex.ingest.libzmq`` has its native twin."""
    sock: zmq.Socket[bytes] = zmq.Socket.shadow(handle)

    def read(limit: int) -> list[list[bytes]]:
        out: list[list[bytes]] = []
        for _ in range(limit):
            try:
                out.append(queued_parts(sock))
            except zmq.Again:
                break
        return out

    return read


def burst_of(msgs: list[list[bytes]]) -> tuple[list[Frame | Malformed], int, int]:
    """The messages parsed, the bytes the inbox counts (parts, ``MESSAGE_OVERHEAD`` each), the payloads' bytes."""
    return ([parse_message(parts) for parts in msgs], sum(len(p) for parts in msgs for p in parts)
            + MESSAGE_OVERHEAD * len(msgs), sum(len(parts[-1]) for parts in msgs))


def queued_bursts(handle: int) -> Callable[[int], tuple[list[Frame | Malformed], int, int]]:
    """The reference burst reader: ``burst_of`` up to ``limit`` queued messages (``queued``)."""
    read = queued(handle)
    return lambda limit: burst_of(read(limit))


class Subscriber:
    """One SUB socket. ``bursts()`` (and ``messages()``, one at a time) yield until the socket is
    closed or the task cancelled."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *, bind: bool, rcvhwm: int,
                 max_message_bytes: int | None = None, reader: BurstReader | None = None,
                 backlog: BacklogRelease | None = None) -> None:
        self.endpoint = endpoint
        self._backlog = backlog  # told of every burst handled (memory back to the OS after a backlog)
        self._sock = ctx.socket(zmq.SUB)
        self._queued = (reader or queued_bursts)(self._sock.underlying)  # limit -> burst_of the queued
        self.monitor: zmq.asyncio.Socket | None = None
        self.bind = bind
        self.burst_bytes = 0  # the size of the burst ``bursts`` yielded last
        self.burst_full = False  # whether it was a full read (DRAIN_BURST messages)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
            self._sock.setsockopt(zmq.MAXMSGSIZE, _limit(ctx, max_message_bytes))
            self._sock.setsockopt(zmq.SUBSCRIBE, b"")
            # monitor before connecting, or an instant ipc/loopback connection is missed. A unique
            # address: pyzmq's default names it after the socket's fd, which a closed socket's
            # lingering inproc endpoint may still hold ("Address already in use" under churn)
            monitor = self._sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED,
                addr=f"inproc://kvindex-monitor-{uuid.uuid4().hex}")
            self.monitor = monitor
            if bind:
                self._sock.bind(endpoint)
            else:
                self._sock.connect(endpoint)
        except BaseException:
            self.close()
            raise

    async def bursts(self, drained: Callable[[], None] | None = None) -> AsyncIterator[list[Frame | Malformed]]:
        """Every message, in order, in bursts of at most ``DRAIN_BURST``: what is queued, or the next
        message awaited and what came with it (a consumer's per-await costs once per burst). After
        a full burst the loop gets a turn before the next read. ``drained``: called each time the
        next message is awaited (after a full burst too: a read of exactly ``DRAIN_BURST``)."""
        burst: list[Frame | Malformed] = []
        nbytes = queued_bytes = 0  # the burst's bytes; its payloads' that waited in ZeroMQ's queue
        while True:
            if not burst:  # awaited: its first message waited in no queue (not backlog)
                if drained is not None:
                    drained()
                burst, nbytes, _ = burst_of([await self._sock.recv_multipart()])
                more, more_bytes, queued_bytes = self._queued(DRAIN_BURST - 1)
                burst += more
                nbytes += more_bytes
            self.burst_bytes = nbytes
            self.burst_full = len(burst) >= DRAIN_BURST
            yield burst
            handled, backlog, burst = len(burst), queued_bytes, []
            if handled == DRAIN_BURST:  # more may be queued: a turn for the loop, then look
                await asyncio.sleep(0)
                burst, nbytes, queued_bytes = self._queued(DRAIN_BURST)
            if self._backlog is not None:  # told once the burst was handled: behind if more wait
                self._backlog.handled(self, bool(burst), backlog)

    async def messages(self) -> AsyncIterator[Frame | Malformed]:
        """Every message, in order, one at a time (``bursts``, flattened)."""
        async for burst in self.bursts():
            for msg in burst:
                yield msg

    async def watch_peers(self, on_change: Callable[[int], None]) -> None:
        """Count the connected peers from the socket's monitor events, handing each new count to
        ``on_change`` (for /v1/pods and /readyz); until cancelled, or until a connecting socket's
        connection is abandoned by libzmq (then it returns: see the module's invariants)."""
        from zmq.utils.monitor import parse_monitor_message

        monitor = self.monitor
        assert monitor is not None  # set by __init__, or it raised
        peers = 0
        retrying = True  # until a DISCONNECTED: then libzmq must say it re-dials
        while True:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that meets a message
                async with asyncio.timeout(None if retrying else ABANDONED_AFTER):
                    raw = await monitor.recv_multipart()
            except TimeoutError:
                return  # DISCONNECTED, and no CONNECT_RETRIED: libzmq will not re-dial this socket
            kind = parse_monitor_message(raw)["event"]
            retrying = True
            if kind in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                peers += 1
            elif kind == zmq.EVENT_DISCONNECTED:
                peers = max(0, peers - 1)
                retrying = self.bind  # a bound socket's peers dial again themselves
            else:
                continue
            on_change(peers)

    def close(self) -> None:
        if self._backlog is not None:
            self._backlog.forget(self)
        if self.monitor is not None:
            try:  # stop the monitor from the monitored side first, or libzmq may never reap either socket
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
        self._sock.close(linger=0)


async def fetch_replay(
    ctx: zmq.asyncio.Context, endpoint: str, start_seq: int, *, timeout: float, max_frames: int = MAX_REPLAY_FRAMES,
    max_message_bytes: int | None = None, max_bytes: int = MAX_REPLAY_BYTES,
) -> ReplayResult:
    """Ask an engine's replay endpoint for every buffered batch with seq >= ``start_seq``, within
    the bounds (``ReplayAnswer``); the batches are collected."""
    async with open_replay(ctx, endpoint, start_seq, timeout=timeout, max_frames=max_frames,
                           max_message_bytes=max_message_bytes, max_bytes=max_bytes) as answer:
        frames = [frame async for frame in answer]
        return ReplayResult(tuple(frames), answer.complete, answer.cut)


@asynccontextmanager
async def open_replay(
    ctx: zmq.asyncio.Context, endpoint: str, start_seq: int, *, timeout: float, max_frames: int = MAX_REPLAY_FRAMES,
    max_message_bytes: int | None = None, max_bytes: int = MAX_REPLAY_BYTES,
) -> AsyncIterator[ReplayAnswer]:
    """Ask an engine's replay endpoint for every buffered batch with seq >= ``start_seq``; the
    answer is read frame by frame as the caller iterates it (``ReplayAnswer``). Past ``MAX_SEQ`` no
    batch can follow: an empty, complete answer (a stream at the last seq is asked nothing)."""
    if start_seq > MAX_SEQ:
        yield ReplayAnswer(None, timeout, max_frames, max_bytes, complete=True)
        return
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.setsockopt(zmq.MAXMSGSIZE, _limit(ctx, max_message_bytes))
        sock.connect(endpoint)
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        yield ReplayAnswer(sock, timeout, max_frames, max_bytes)
    finally:
        sock.close(linger=0)


class ReplayAnswer:
    """One replay answer, read as it is iterated: batches until the end marker (``complete``) or
    a bound (``cut`` names it). With nothing read by the deadline, a ``ReplayError``; so is a reply
    of no known shape."""

    def __init__(self, sock: zmq.asyncio.Socket | None, timeout: float, max_frames: int, max_bytes: int, *,
                 complete: bool = False) -> None:
        self._sock = sock
        self._timeout = timeout
        self._max_frames = max_frames
        self._max_bytes = max_bytes
        self.frames = 0
        self.bytes = 0
        self.complete = complete  # None socket: nothing to ask, the answer is already whole
        self.cut: str | None = None

    async def __aiter__(self) -> AsyncIterator[Frame]:
        if self._sock is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while True:
            if self.frames >= self._max_frames:
                self.cut = "replay_too_many_frames"
                return
            left = deadline - loop.time()
            if left <= 0:
                if not self.frames:
                    raise ReplayError(f"no reply within {self._timeout:g}s")
                self.cut = "replay_timeout"
                return
            try:  # asyncio.timeout: see watch_peers
                async with asyncio.timeout(left):
                    parts = await self._sock.recv_multipart()
            except TimeoutError:
                continue  # the deadline, decided above
            if not parts or parts[0] != b"":
                raise ReplayError("reply without the empty delimiter frame")
            body = parts[1:]
            if not body or _is_end(body):
                self.complete = True
                return
            frame = _replay_frame(body)
            if frame is None:
                raise ReplayError(f"unexpected reply of {len(parts)} frames")
            size = sum(map(len, parts))
            if self.bytes + size > self._max_bytes:
                self.cut = "replay_too_large"
                return
            self.bytes += size
            self.frames += 1
            if self.frames % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # the socket may always have the next one ready: never hold the loop
            handed = loop.time()
            yield frame
            deadline += loop.time() - handed  # the caller's time with the batch is not the engine's


def _is_end(body: list[bytes]) -> bool:
    if len(body) == 3:
        return body[1] == END_SEQ or (body[0] == b"" and body[2] == b"")
    if len(body) == 2:
        return body[0] == END_SEQ
    return len(body) == 1 and body[0] == b""


def _replay_frame(body: list[bytes]) -> Frame | None:
    """A replayed batch; the old 2-frame shape has no topic (``""``: the caller's stream)."""
    if len(body) == 3 and len(body[1]) == 8:
        parsed = parse_message(body)
        return parsed if isinstance(parsed, Frame) else None
    if len(body) == 2 and len(body[0]) == 8:
        return Frame("", int.from_bytes(body[0], "big"), body[1])
    return None
