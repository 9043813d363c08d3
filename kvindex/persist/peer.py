"""``--peer``: a running kvindex's ``/v1/state`` (or a Dynamo indexer's ``/dump``), read within bounds.

Invariants:
- A peer's answer is read chunk by chunk and counted, never whole first: one that declares more
  than ``max_bytes`` (``Content-Length``, or a ``/v1/state`` snapshot header's body length) is
  refused before its body is read, one that sends more as soon as the count would pass it; memory
  holds at most ``max_bytes`` of it. A ``/v1/state`` whose first bytes are not a kvindex snapshot
  header is refused at them, one that sends past its header's length as the count passes it.
- A peer silent for ``idle`` seconds mid-answer (``min(PEER_IDLE_SECONDS, timeout / 2)``) is refused,
  and so is one whose answer (connecting, headers, body) is not whole within ``timeout`` seconds.
- The answer is decoded in a thread (``snapshot.decode``, or ``dynamo_peer.state_of_dump``, which
  lets go of the GIL as it decodes): the loop keeps answering HTTP (503 "loading") meanwhile.
- Every refusal is one log line naming the peer, why, and the setting to raise when a bound is the
  cause (``--peer-max-bytes``, ``--peer-timeout``), and is counted by reason (``on_refused``:
  ``REASONS``); kvindex then starts empty (or from its own state dir's log).
- A peer without ``/v1/state`` (404, 405: a Dynamo indexer) is asked for its ``/dump``, read
  within the same bounds (one ``timeout`` for both requests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import aiohttp

from kvindex.config import Config
from kvindex.persist import snapshot as snapshots
from kvindex.persist.dynamo_peer import state_of_dump
from kvindex.persist.snapshot import State, StateError

log = logging.getLogger("kvindex.persist.restore")
PEER_IDLE_SECONDS = 30.0  # a peer silent this long mid-answer is refused (at most half its timeout)
CONNECT_SECONDS = 10.0
REASONS = ("too_large", "timeout", "http_status", "unreachable", "malformed")
Declared = Callable[[bytearray], int | None]  # an answer's length as its first bytes declare it
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PeerBounds:
    max_bytes: int
    timeout: float  # seconds for the whole answer
    idle: float  # seconds without a byte, mid-answer

    @classmethod
    def of(cls, config: Config) -> PeerBounds:
        return cls(config.peer_max_bytes, config.peer_timeout, min(PEER_IDLE_SECONDS, config.peer_timeout / 2))


class PeerRefused(StateError):
    """A peer's answer that cannot be used; ``reason``: one of ``REASONS``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def too_large(what: str, size: str, cap: int) -> PeerRefused:
    return PeerRefused(f"its {what} {size} larger than the {cap} bytes allowed (raise --peer-max-bytes, "
                       "[state] peer_max_bytes, to load it)", "too_large")


async def read_capped(r: aiohttp.ClientResponse, bounds: PeerBounds, what: str,
                      declared: Declared | None = None) -> bytearray:
    """``r``'s body within ``bounds``; ``declared`` reads the length its first bytes state (None:
    not yet known). ``PeerRefused`` past a bound (module invariants)."""
    cap = bounds.max_bytes
    if r.content_length is not None and r.content_length > cap:
        raise too_large(what, f"declares {r.content_length} bytes (Content-Length),", cap)
    data, limit = bytearray(), None
    while chunk := await next_chunk(r, bounds.idle):
        if limit is not None and len(data) + len(chunk) > limit:
            raise PeerRefused(f"its {what} goes on past the {limit} bytes its header declares", "malformed")
        if len(data) + len(chunk) > cap:
            raise too_large(what, "is", cap)
        data += chunk
        if limit is None and declared is not None and (limit := declared(data)) is not None and limit > cap:
            raise too_large(what, f"declares {limit} bytes (its snapshot header),", cap)
    return data


async def next_chunk(r: aiohttp.ClientResponse, idle: float) -> bytes:
    """The next bytes of ``r`` (b"" at its end); ``PeerRefused`` after ``idle`` seconds without any."""
    try:
        async with asyncio.timeout(idle):
            return await r.content.readany()
    except TimeoutError:
        raise PeerRefused(f"it sent nothing for {idle:g} s mid-answer (a peer silent {PEER_IDLE_SECONDS:g} s, "
                          "or half of --peer-timeout if less, is given up on)", "timeout") from None


async def refuse_status(r: aiohttp.ClientResponse, prefix: str) -> PeerRefused:
    text = (await r.content.read(200)).decode(errors="replace")
    return PeerRefused(f"{prefix}answered HTTP {r.status}: {text}", "http_status")


async def fetch_answer(session: aiohttp.ClientSession, base: str, headers: dict[str, str],
                       bounds: PeerBounds) -> tuple[str, bytearray]:
    """The peer's ``/v1/state`` bytes, or its ``/dump``'s when it has none: (which, bytes)."""
    async with session.get(base + "/v1/state", headers=headers) as r:
        if r.status in (404, 405):
            return "/dump", await fetch_dump(session, base, headers, bounds)
        if r.status != 200:
            raise await refuse_status(r, "")
        return "/v1/state", await read_capped(r, bounds, "/v1/state", snapshots.declared_length)


async def fetch_dump(session: aiohttp.ClientSession, base: str, headers: dict[str, str],
                     bounds: PeerBounds) -> bytearray:
    async with session.get(base + "/dump", headers=headers) as r:
        if r.status != 200:
            raise await refuse_status(r, "has no /v1/state, and /dump ")
        return await read_capped(r, bounds, "/dump")


async def fetch_within(fetch: Awaitable[T], timeout: float) -> T:
    """``fetch`` awaited; ``PeerRefused`` (timeout) unless it is done within ``timeout`` seconds."""
    timer = asyncio.timeout(timeout)
    try:
        async with timer:
            return await fetch
    except TimeoutError:
        if not timer.expired():
            raise  # not ours (aiohttp's connect bound)
        raise PeerRefused(f"its answer was not whole within {timeout:g} s (raise --peer-timeout, [state] "
                          "peer_timeout, to wait longer)", "timeout") from None


async def decode(base: str, what: str, data: bytearray) -> State:
    """The answer as a ``State``, decoded off the loop; ``StateError``."""
    if what == "/v1/state":  # as a local one; decode reads any buffer (no copy of the bytearray into bytes)
        return await asyncio.to_thread(snapshots.decode, cast(bytes, data))
    state = await asyncio.to_thread(state_of_dump, data)
    log.info("peer %s: no /v1/state; loaded its Dynamo /dump: %d blocks", base, len(state.entries))
    return state


async def load_peer(url: str, token: str | None, bounds: PeerBounds,
                    on_refused: Callable[[str], None] | None = None) -> State | None:
    """The state of the peer at ``url`` within ``bounds`` (module invariants); None (logged once,
    counted) when it cannot be had. ``timeout`` bounds the answer, not its decoding after it."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = url.rstrip("/")
    try:
        connect = aiohttp.ClientTimeout(total=None, sock_connect=min(CONNECT_SECONDS, bounds.timeout))
        async with aiohttp.ClientSession(timeout=connect) as session:
            what, data = await fetch_within(fetch_answer(session, base, headers, bounds), bounds.timeout)
        return await decode(base, what, data)
    except (StateError, aiohttp.ClientError, TimeoutError, OSError) as exc:
        reason = refusal_reason(exc)
        if on_refused is not None:
            on_refused(reason)
        log.error("peer %s: cannot load its state (%s); starting empty", url,
                  exc if isinstance(exc, PeerRefused) else f"{type(exc).__name__}: {exc}")
        return None


def refusal_reason(exc: BaseException) -> str:
    if isinstance(exc, PeerRefused):
        return exc.reason
    if isinstance(exc, StateError):
        return "malformed"
    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "timeout"
    return "unreachable"
