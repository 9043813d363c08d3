"""A fake engine: publishes KV events like vLLM's ``ZmqEventPublisher`` (``kvindex replay``).

Invariants:
- ``FakeEngine`` has one PUB socket (bind or connect) and an optional bound ROUTER replay socket.
  Its replay buffer holds the last ``buffer_steps`` well-formed messages (3 frames, 8-byte seq)
  of *every* topic published through it, in publish order (``live_only``: sent, not kept, as a
  message the network delivers twice); a replay request
  ``[identity, b"", seq8]`` is answered with every buffered message whose seq >= start, in
  buffer order, then the end marker of the chosen ``replay_shape``. A client filters by topic.
  Garbage requests (wrong frame count, seq not 8 bytes) are ignored; the replay task never dies
  of a bad request. ``publish(..., replay_only=True)`` buffers without sending (a dropped message).
- PUB/SUB slow joiner: a PUB socket silently drops every message published before a subscriber's
  subscription has reached it (a few ms after connect on localhost, longer over a network). The
  publisher is an XPUB socket (it sends exactly as a PUB does) so that it can tell:
  ``wait_subscribers(n)`` returns once ``n`` subscribers are subscribed (every subscription and
  every departed subscriber is counted, ``XPUB_VERBOSE``/``XPUB_VERBOSER``); what is published
  after it returns reaches them. ``replay_main`` (``kvindex replay``) publishes once ``subscribers``
  subscribers are subscribed, or after ``linger_seconds`` without them (warned: a PUB drops what
  nobody receives); after the last message it keeps answering replay requests for up to
  ``linger_seconds``, ending early once every subscriber has left. With ``loop`` each round after
  the first is the capture again with every seq shifted to follow the previous round's last one
  (one continuing stream: a subscriber sees no engine restart); the replay buffer keeps them all.
- Every socket this module opens is closed with linger 0; a context is terminated by whoever
  created it. ``close()`` is idempotent and cancels and awaits the replay task it owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal

import zmq
import zmq.asyncio

from kvindex.tools.capture import Captured, load_capture

log = logging.getLogger("kvindex.tools.fake_engine")

END_SEQ = b"\xff" * 8
"""The seq frame of a replay end marker: (-1) as 8 signed big-endian bytes."""

ReplayShape = Literal["new", "old"]


def attach(sock: zmq.asyncio.Socket, endpoint: str, bind: bool) -> str:
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
        self.endpoint = attach(self._pub, self.endpoint, self._bind)
        if self.replay_address is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, self._hwm)
            self.replay_address = attach(self._router, self.replay_address, True)
            self._task = asyncio.create_task(self._serve_replay(), name="fake-engine-replay")
        log.debug("fake engine up: pub=%s replay=%s", self.endpoint, self.replay_address)

    async def wait_subscribers(self, n: int = 1, timeout: float = 10.0, *, at_least: bool = False) -> None:
        """Until exactly ``n`` subscribers are subscribed (an earlier one that left is waited out;
        ``at_least``: ``n`` or more), so that whatever is published next reaches all of them;
        ``TimeoutError`` naming the count otherwise. Only one caller at a time."""
        if self._pub is None:
            raise RuntimeError("FakeEngine.wait_subscribers() before start()")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            while await self._pub.poll(0):  # every note already there, then decide
                note = await self._pub.recv()
                self.subscribers += {b"\x01": 1, b"\x00": -1}.get(note[:1], 0)
            if self.subscribers == n or (at_least and self.subscribers > n):
                return
            left = deadline - loop.time()
            if left <= 0 or not await self._pub.poll(left * 1000):
                raise TimeoutError(f"{self.endpoint}: {self.subscribers} subscribers after {timeout:g}s, "
                                   f"waiting for {n}")

    @property
    def buffered(self) -> int:
        """How many messages the replay buffer holds now."""
        return len(self._buffer)

    async def publish(self, frames: Sequence[bytes], *, replay_only: bool = False, live_only: bool = False) -> None:
        """Send ``frames`` on PUB (unless ``replay_only``) and keep well-formed ones for replay
        (unless ``live_only``)."""
        if self._pub is None:
            raise RuntimeError("FakeEngine.publish() before start()")
        msg = tuple(bytes(f) for f in frames)
        if not replay_only:
            await self._pub.send_multipart(msg)
        if not live_only and _seq_of(msg) is not None:
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


async def _replay_rounds(
    engine: FakeEngine, captured: list[Captured], speed: float | None, loop: bool
) -> None:
    """Publish the capture once, or forever if ``loop``: round ``r`` shifts every seq by ``r`` times
    the capture's seq span, so seq keeps counting up across rounds."""
    if not captured:
        log.warning("capture is empty: nothing to publish")
        return
    seqs = [s for s in (_seq_of(c.frames) for c in captured) if s is not None]
    span = max(seqs) - min(seqs) + 1 if seqs else 0
    rounds = 0
    while True:
        sent = await engine.run_capture(shifted(captured, rounds * span) if rounds else captured, speed)
        rounds += 1
        log.info("round %d: published %d messages", rounds, sent)
        if not loop:
            return
        await asyncio.sleep(0)  # with speed=None, let replay requests and signals through


def shifted(captured: list[Captured], by: int) -> list[Captured]:
    """``captured`` with every well-formed message's seq moved up by ``by`` (others as they are)."""
    out = []
    for c in captured:
        seq = _seq_of(c.frames)
        frames = c.frames if seq is None else (c.frames[0], ((seq + by) % (1 << 64)).to_bytes(8, "big"), c.frames[2])
        out.append(Captured(c.t, tuple(frames)))
    return out


async def _await_subscribers(engine: FakeEngine, n: int, seconds: float) -> None:
    try:
        await engine.wait_subscribers(n, timeout=seconds, at_least=True)
    except TimeoutError:
        log.warning("%d of %d subscriber(s) after %g s: publishing anyway (a PUB drops what nobody receives)",
                    engine.subscribers, n, seconds)


async def _linger(engine: FakeEngine, seconds: float) -> None:
    """Answer replay requests for up to ``seconds``, ending early once every subscriber has left
    (with none ever subscribed: the whole ``seconds``, for a late one's replay request)."""
    if engine.subscribers == 0:
        await asyncio.sleep(seconds)
        return
    try:
        await engine.wait_subscribers(0, timeout=seconds)
        log.info("every subscriber left: done")
    except TimeoutError:
        pass


async def replay_main(
    path: Path,
    publish: str,
    *,
    bind: bool,
    replay_endpoint: str | None,
    speed: float | None,
    loop: bool,
    linger_seconds: float = 1.0,
    subscribers: int = 1,
) -> int:
    """Body of ``kvindex replay FILE --publish EP``: act as an engine publishing a capture.

    Publishes once ``subscribers`` are subscribed (at most ``linger_seconds`` of waiting for them),
    then keeps answering replay requests for up to ``linger_seconds``, ending early when every
    subscriber has left. Returns 0, 2 for an unreadable/malformed capture, 1 if a socket cannot be
    opened.
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
        await _await_subscribers(engine, subscribers, linger_seconds)
        await _replay_rounds(engine, captured, speed, loop)
        await _linger(engine, linger_seconds)
    except zmq.ZMQError as exc:
        log.error("cannot open %s: %s", publish, exc)
        return 1
    finally:
        await engine.close()
    return 0
