"""``--peer`` reads within bounds: a hostile or broken peer costs a real ``kvindex serve`` at most
``--peer-max-bytes`` of memory and ``--peer-timeout`` of its start, ``/healthz`` answers
throughout, and then it serves (empty), the refusal logged in one line and counted by reason.

The peers are real HTTP servers (aiohttp, on an event loop in a thread of the test), each a route:
one streams a 1.5 GB ``/dump`` without a length, one a 1.5 GB ``/v1/state`` that is no snapshot,
two declare more than the cap (a snapshot header, a ``Content-Length``), one falls silent
mid-answer, one trickles, and one is a well-formed 79 MB Dynamo ``/dump`` that is loaded while
``/healthz`` is probed (its decoding lets go of the GIL).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.faultkit import free_port, http, serve, stop

CAP = 64 << 20
HUGE = 1536 << 20  # 1.5 GiB
MIB = b"\0" * (1 << 20)
HEALTHZ_WORST = 0.5  # seconds: /healthz while the peer is read and decoded (main: 1.1-3.9 s)
Handler = Callable[[web.Request], Any]


def snapshot_header(body_len: int) -> bytes:
    """The first bytes of a kvindex snapshot (``kvindex.persist.snapshot``) whose body is ``body_len``."""
    header = msgpack.packb({"format": "kvindex-state", "version": 2, "created": 0, "wal_from": 0,
                            "body_len": body_len, "body_crc": 0})
    return len(header).to_bytes(4, "big") + header


class Peer:
    """One peer at ``url``: ``/v1/state`` and ``/dump`` answered by the given handlers (404 if
    none), served from a thread's own event loop; ``sent``: the body bytes it wrote."""

    def __init__(self, state: Handler | None = None, dump: Handler | None = None) -> None:
        self.sent = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.routes = {"/v1/state": state, "/dump": dump}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def stream(self, total: int, *, prefix: bytes = b"", piece: int = len(MIB), pause: float = 0.0,
               length: int | None = None, then_silent: bool = False) -> Handler:
        """A handler writing ``prefix`` then zeros up to ``total`` bytes, ``piece`` at a time with
        ``pause`` seconds between (``then_silent``: one piece, then nothing for a minute)."""
        async def handler(request: web.Request) -> web.StreamResponse:
            r = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            if length is not None:
                r.content_length = length
            await r.prepare(request)
            try:
                await self._write(r, prefix, total, piece, pause, then_silent)
            except (ConnectionError, asyncio.CancelledError):
                pass  # the daemon gave up on us: what the test wants
            return r
        return handler

    async def _write(self, r: web.StreamResponse, prefix: bytes, total: int, piece: int, pause: float,
                     then_silent: bool) -> None:
        await r.write(prefix)
        self.sent += len(prefix)
        deadline = time.monotonic() + 120  # the test's peer stops by itself
        while self.sent < total and time.monotonic() < deadline:
            await r.write(MIB[:piece])
            self.sent += piece
            if then_silent:
                await asyncio.sleep(60)
            elif pause:
                await asyncio.sleep(pause)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        handler = self.routes[request.path]
        return web.Response(status=404) if handler is None else await handler(request)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.add_routes([web.get("/v1/state", self._route), web.get("/dump", self._route)])
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def make_peer() -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def make(**routes: Handler | None) -> Peer:
        made.append(Peer(**routes))
        return made[-1]
    yield make
    for p in made:
        p.close()


class Probe:
    """``GET /healthz`` of ``port`` in a loop from a thread, from the moment it first answers
    until ``stop``: ``worst`` is the slowest answer (seconds)."""

    def __init__(self, port: int) -> None:
        self.url, self.worst, self.answers = f"http://127.0.0.1:{port}/healthz", 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                http(self.url, timeout=60)
            except OSError:  # not listening yet
                time.sleep(0.02)
                continue
            self.worst, self.answers = max(self.worst, time.monotonic() - t0), self.answers + 1
            time.sleep(0.02)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(70)
        return self.worst


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def bare_peak(tmp_path_factory: pytest.TempPathFactory) -> float:
    """The peak RSS (MiB) of a ``kvindex serve`` with no peer: what a peer's read adds is above it."""
    p = serve(free_port(), log=tmp_path_factory.mktemp("bare") / "log")
    try:
        time.sleep(0.5)
        return peak_mib(p.pid)
    finally:
        stop(p)


class Started:
    """A ``kvindex serve --peer`` started while ``/healthz`` is probed, once it serves."""

    def __init__(self, peer: Peer, log: Path, *extra: str) -> None:
        self.port, t0 = free_port(), time.monotonic()
        probe = Probe(self.port)
        self.log = log
        self.proc = serve(self.port, "--peer", peer.url, *extra, log=log)  # returns once the restore is over
        self.took, self.healthz_worst = time.monotonic() - t0, probe.stop()
        self.peak = peak_mib(self.proc.pid)
        self.healthz_answers = probe.answers

    def refusals(self) -> dict[str, float]:
        text = http(f"http://127.0.0.1:{self.port}/metrics")[1].decode()
        return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(text)
                if fam.name == "kvindex_peer_refusals" for s in fam.samples if s.name.endswith("_total")}

    def refusal_lines(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if "cannot load its state" in line]

    def pods(self) -> list[Any]:
        return http(f"http://127.0.0.1:{self.port}/v1/pods")[1]["pods"]

    def summary(self, peer: Peer, bare: float) -> str:
        return (f"serving after {self.took:.1f} s, the peer sent {peer.sent / (1 << 20):.1f} MiB, peak RSS "
                f"{self.peak:.0f} MiB ({self.peak - bare:+.0f} over a bare serve), /healthz worst "
                f"{self.healthz_worst * 1000:.0f} ms over {self.healthz_answers} answers")


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Started]]:
    made: list[Started] = []

    def go(peer: Peer, *extra: str) -> Started:
        made.append(Started(peer, tmp_path / f"log{len(made)}", *extra))
        return made[-1]
    yield go
    for s in made:
        stop(s.proc)


def test_a_dump_streamed_past_the_cap_is_refused_as_the_count_passes_it(
        make_peer: Callable[..., Peer], start: Callable[..., Started], bare_peak: float) -> None:
    """Before: the answer was read whole (a 1.5 GB /dump: every byte of it held, then joined, while
    /healthz waited), only the fixed 60 s timeout bounding it."""
    peer = make_peer()
    peer.routes["/dump"] = peer.stream(HUGE)
    s = start(peer, "--peer-max-bytes", str(CAP))
    print(f"1.5 GiB /dump, no length, cap {CAP >> 20} MiB: {s.summary(peer, bare_peak)}")
    assert s.refusals() == {"too_large": 1.0}
    assert peer.sent < CAP + (64 << 20)  # the cap, and what the sockets' buffers held
    assert s.peak - bare_peak < (CAP >> 20) + 64, s.peak
    assert s.healthz_worst < HEALTHZ_WORST
    assert s.took < 20, s.took
    assert s.pods() == []  # started empty, serving
    (line,) = s.refusal_lines()
    assert f"its /dump is larger than the {CAP} bytes allowed (raise --peer-max-bytes" in line


def test_a_state_that_is_no_snapshot_is_refused_at_its_first_bytes(
        make_peer: Callable[..., Peer], start: Callable[..., Started], bare_peak: float) -> None:
    """With the default cap (4 GiB): a ``/v1/state`` is judged by its header. Before: 1.5 GB read
    whole (RSS up by more than that), then refused as no snapshot."""
    peer = make_peer()
    peer.routes["/v1/state"] = peer.stream(HUGE)
    s = start(peer)
    print(f"1.5 GiB of zeros as /v1/state, default cap: {s.summary(peer, bare_peak)}")
    assert s.refusals() == {"malformed": 1.0}
    assert peer.sent < 64 << 20
    assert s.peak - bare_peak < 64, s.peak
    assert s.healthz_worst < HEALTHZ_WORST
    assert s.pods() == []
    (line,) = s.refusal_lines()
    assert "not a kvindex snapshot" in line


@pytest.mark.parametrize("route", ["/v1/state", "/dump"])
def test_an_answer_declared_past_the_cap_is_refused_unread(
        route: str, make_peer: Callable[..., Peer], start: Callable[..., Started], bare_peak: float) -> None:
    """A snapshot header (``/v1/state``) or a ``Content-Length`` (``/dump``) declaring 1.5 GiB, sent
    1 KiB per 0.1 s: refused at its first bytes, not after 1.5 GiB or the timeout."""
    peer = make_peer()
    if route == "/v1/state":
        peer.routes[route] = peer.stream(HUGE, prefix=snapshot_header(HUGE), piece=1024, pause=0.1)
    else:
        peer.routes[route] = peer.stream(HUGE, piece=1024, pause=0.1, length=HUGE)
    s = start(peer, "--peer-max-bytes", str(CAP))
    print(f"{route} declaring 1.5 GiB: {s.summary(peer, bare_peak)}")
    assert s.refusals() == {"too_large": 1.0}
    assert s.took < 15, s.took
    assert peer.sent < 1 << 20
    (line,) = s.refusal_lines()
    assert f"{route} declares {HUGE + (len(snapshot_header(HUGE)) if route == '/v1/state' else 0)} bytes" in line
    assert "--peer-max-bytes" in line


@pytest.mark.parametrize("kind", ["silent", "trickling"])
def test_a_peer_that_stalls_is_given_up_on(
        kind: str, make_peer: Callable[..., Peer], start: Callable[..., Started], bare_peak: float) -> None:
    """A snapshot header declaring 60 MiB, then 1 KiB and silence (refused after the idle bound:
    30 s, or half of ``--peer-timeout``, here 4 s), or 1 KiB per 0.1 s (never idle; refused at the
    3 s timeout).
    Before: kvindex waited its fixed 60 s for either."""
    peer = make_peer()
    timeout, bound = ("4", 2.0) if kind == "silent" else ("3", 3.0)
    peer.routes["/v1/state"] = peer.stream(60 << 20, prefix=snapshot_header(60 << 20), piece=1024, pause=0.1,
                                            then_silent=kind == "silent")
    s = start(peer, "--peer-timeout", timeout)
    print(f"{kind} peer, --peer-timeout {timeout}: {s.summary(peer, bare_peak)}")
    assert s.refusals() == {"timeout": 1.0}
    assert bound <= s.took < bound + 12, s.took
    assert s.healthz_worst < HEALTHZ_WORST and s.healthz_answers > 0
    assert s.pods() == []
    (line,) = s.refusal_lines()
    assert ("sent nothing for 2 s mid-answer" if kind == "silent" else "not whole within 3 s") in line
    assert "--peer-timeout" in line


def dynamo_dump(workers: int, events: int, blocks: int) -> bytes:
    """A Dynamo indexer's ``/dump`` (``kvindex.dynamo_dump``): per worker, one chain of ``events``
    stored events of ``blocks`` blocks each."""
    out = []
    for w in range(workers):
        for e in range(events):
            first = (w << 40) + e * blocks + 1
            out.append({"worker_id": w + 1, "storage_tier": "device", "residency_domain": "worker", "event": {
                "event_id": e, "data": {"stored": {"parent_hash": None if e == 0 else first - 1, "start_position": None,
                                                   "blocks": [{"block_hash": first + i, "tokens_hash": first + i + 7,
                                                               "mm_extra_info": None} for i in range(blocks)]}},
                "dp_rank": 0}})
    return json.dumps({"m:0": {"block_size": 16, "events": out}}).encode()


def test_a_dynamo_dump_is_decoded_while_http_answers(
        make_peer: Callable[..., Peer], start: Callable[..., Started], bare_peak: float) -> None:
    """Before: ``json.loads`` in a thread held the GIL for the whole dump (the loop with it):
    /healthz waited 1.1 s for a 79 MB one, and its rows were freed on the loop at once."""
    dump = dynamo_dump(16, 3200, 16)  # 819,200 blocks
    peer = make_peer()

    async def answer(request: web.Request) -> web.Response:
        peer.sent += len(dump)
        return web.Response(body=dump, content_type="application/json")
    peer.routes["/dump"] = answer
    s = start(peer)
    print(f"a {len(dump) / 1e6:.0f} MB Dynamo /dump, loaded: {s.summary(peer, bare_peak)}")
    assert s.refusals() == {}
    assert len(s.pods()) == 16
    assert s.healthz_worst < HEALTHZ_WORST and s.healthz_answers > 0, s.healthz_worst
