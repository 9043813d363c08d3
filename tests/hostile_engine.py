"""A misbehaving engine for the replay-bound tests, run as its own process:
``python -m tests.hostile_engine PUB ROUTER KIND``.

Its PUB socket publishes batches of a simulated vLLM engine with every other seq missing (each
one a gap kvindex asks the replay endpoint to fill); its ROUTER answers every replay request with
an endless stream of frames of another topic and never the end marker: 1 MiB each (``huge``) or a
few bytes each (``tiny``). Runs until killed."""

from __future__ import annotations

import sys
import threading
import time

import zmq

from tests.faultkit import stream

MIB = 1 << 20


def answer_forever(router: zmq.Socket, kind: str, stop: threading.Event) -> None:
    payload = b"\x00" * (MIB if kind == "huge" else 4)
    peers: list[bytes] = []
    seq = 0
    while not stop.is_set():
        while router.poll(0):
            ident, *_ = router.recv_multipart()
            peers.append(ident)  # the request of a DEALER that may already have given up: answer anyway
        if not peers:
            router.poll(50)
            continue
        for ident in peers[-4:]:
            try:  # another topic's frames: skipped by the client, never ending the answer
                router.send_multipart([ident, b"", b"kv@elsewhere@m", seq.to_bytes(8, "big"), payload],
                                      flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                time.sleep(0.001)
        seq += 1


def main(pub_endpoint: str, router_endpoint: str, kind: str) -> None:
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for s in (pub, router):
        s.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 64)
    pub.bind(pub_endpoint)
    router.bind(router_endpoint)
    stop = threading.Event()
    answering = threading.Thread(target=answer_forever, args=(router, kind, stop), daemon=True)
    answering.start()
    frames, _ = stream(2000, pod="hostile", seed=9)
    try:
        for i, (topic, seq, payload) in enumerate(frames):
            if i % 2 == 0:  # every odd seq is missing: a gap per batch
                pub.send_multipart([topic, seq, payload])
            time.sleep(0.05)
    finally:
        stop.set()
        answering.join(5)
        ctx.destroy(linger=0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
