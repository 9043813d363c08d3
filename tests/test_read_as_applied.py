"""Issue 38, item 2: a burst is applied as it arrives; the backlog waits in ZeroMQ's queues, not in kvindex.

A real ``kvindex serve`` subprocess and a real ZeroMQ PUB in this process send a burst of ~100 MB
of batches far faster than kvindex applies them (each stores 400 blocks and removes them again,
so the index itself does not grow):
- with a publisher whose queue holds the whole burst (SNDHWM unlimited), every batch is applied,
  no gap, the pod synced, nothing dropped by kvindex, and kvindex's RSS grows by far less than the
  burst (before: the burst was read into kvindex's memory as fast as it came, +100 MB and more);
- with a publisher whose queue is small (SNDHWM 100, as an engine whose HWM is reached), the
  publisher drops what kvindex has not read: kvindex sees the seq gap, and with no replay
  endpoint the pod says unsynced: the loss is reported, not silent.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq

from kvindex.tools.engine_sim import block_removed, block_stored, encode_batch
from tests.faultkit import free_port, http, pods, rss_kib, serve, stop, wait_until

MIB = 1 << 20
BATCHES = 4000
TOPIC = b"kv@burst@m"


def _payload() -> bytes:
    """~26 KB: 400 blocks stored, then each removed (net zero in the index)."""
    hashes = [(7 << 40) | j for j in range(400)]
    events = [block_stored(hashes, None, [j % 5000 + 1 for j in range(1600)], 4)]
    events += [block_removed(h) for h in hashes]
    return encode_batch(events, time.time())


def _run_burst(tmp_path: Path, sndhwm: int) -> tuple[dict, float, str]:
    """Publish the burst at a fresh kvindex; (the pod's view once it stopped moving, peak RSS growth
    in MiB, /metrics)."""
    pub_port, port = free_port(), free_port()
    config = tmp_path / "kvindex.toml"
    config.write_text(f'[[engines]]\nendpoint = "tcp://127.0.0.1:{pub_port}"\npod = "burst"\nmodel = "m"\n')
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, sndhwm)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    daemon = serve(port, "--config", str(config), log=tmp_path / "kvindex.log")
    payload = _payload()
    try:
        wait_until(lambda: pods(port).get("burst", {}).get("connected"), 15, "the SUB to connect")
        deadline = time.monotonic() + 15
        while pods(port).get("burst", {}).get("last_seq") is None:  # slow joiner: seq 0 until seen
            pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), payload])
            time.sleep(0.05)
            assert time.monotonic() < deadline, "the first batch never arrived"
        time.sleep(0.5)
        before = rss_kib(daemon.pid)
        peak = [before]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_kib(daemon.pid))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for seq in range(1, BATCHES):
            pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
        last = [-1, time.monotonic()]

        def settled() -> bool:  # last_seq reached the end, or has not moved for 2 s
            seq = pods(port)["burst"]["last_seq"]
            if seq != last[0]:
                last[:] = [seq, time.monotonic()]
            return seq == BATCHES - 1 or time.monotonic() - last[1] > 2.0

        wait_until(settled, 120, "the burst to be applied")
        done.set()
        watcher.join()
        return pods(port)["burst"], (peak[0] - before) / 1024, http(f"http://127.0.0.1:{port}/metrics")[1].decode()
    finally:
        stop(daemon)
        ctx.destroy(linger=0)


def test_a_burst_the_publisher_queues_is_applied_whole_without_kvindex_holding_it(tmp_path: Path) -> None:
    view, growth_mib, metrics = _run_burst(tmp_path, sndhwm=0)
    burst_mib = BATCHES * len(_payload()) / MIB
    assert view["last_seq"] == BATCHES - 1 and view["gaps"] == 0 and view["synced"], view
    assert 'kvindex_receive_dropped_batches_total{engine="burst"} 0.0' in metrics
    # the SUB socket's RCVHWM (1,000 batches of 26 KB) + the read-ahead + the heap's noise, not the burst
    assert growth_mib < burst_mib / 2, f"RSS grew {growth_mib:.0f} MiB for a {burst_mib:.0f} MiB burst"
    print(f"burst of {burst_mib:.0f} MiB applied whole; kvindex RSS +{growth_mib:.0f} MiB at its peak")


def test_what_a_full_publisher_drops_is_a_gap_and_the_pod_says_unsynced(tmp_path: Path) -> None:
    view, growth_mib, _ = _run_burst(tmp_path, sndhwm=100)
    assert view["gaps"] >= 1 and not view["synced"], view
    assert view["unsynced_reason"], view
    print(f"publisher dropped past its HWM: gaps {view['gaps']}, unsynced ({view['unsynced_reason']}); "
          f"kvindex RSS +{growth_mib:.0f} MiB")
