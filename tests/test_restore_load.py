"""Loading a saved state (issue 13, class 10): linear per table, exact (the C store loop and the
Python one give the original index back), and, in a real ``kvindex serve``, HTTP up answering 503
"loading" meanwhile and SIGTERM honoured. ``benchmarks/restore.py`` measures the figures."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import subprocess
import sys
import time
from array import array
from pathlib import Path
from typing import Any

import pytest

from kvindex.config import Config
from kvindex.events import BlockStored
from kvindex.index.precise import PreciseIndex
from kvindex.persist import snapshot as snapshots
from kvindex.types import Entry
from tests.faultkit import KVINDEX, free_port, http, stop, wait_until

M64 = (1 << 64) - 1


def one_pod_in_slot_order(n: int) -> list[Entry]:
    """``n`` entries of one (pod, rank, medium) table as a snapshot holds them: in slot order."""
    index = PreciseIndex()
    index.load_entries([Entry("big", 0, "GPU", ((2 * i + 1) * 0x9E3779B97F4A7C15) & M64, i, 1) for i in range(n)])
    return list(index.export_entries())


def test_loading_one_big_table_in_slot_order_is_linear() -> None:
    """The old load re-inserted a table's entries in slot order into a table growing as they came:
    they piled into one probe run at its front (40k entries took 9.5 s, 80k 78 s)."""
    n = 150_000
    entries = one_pod_in_slot_order(n)
    index = PreciseIndex()
    t = time.process_time()
    assert index.load_entries(entries) == n
    took = time.process_time() - t
    assert took < 5.0, f"{n} entries took {took:.1f} CPU s to load"
    assert index.blocks_held("big")["gpu"] == n


def random_index(seed: int) -> PreciseIndex:
    """Several pods, ranks and media; repeated stores (copies), keyless offload copies (orphans),
    one key held twice by a worker (two hashes, the same tokens)."""
    rng = random.Random(seed)
    index = PreciseIndex()
    for _ in range(300):
        pod, rank = f"p{rng.randrange(3)}", rng.randrange(2)
        hashes = tuple(rng.randrange(1, 400) for _ in range(rng.randrange(1, 6)))
        if rng.random() < 0.2:  # offloaded: no tokens, so no keys
            ev = BlockStored(hashes, None, array("I"), 4, medium=rng.choice(["CPU", "DISK"]))
        else:
            tokens = array("I", [rng.randrange(8) for _ in range(4 * len(hashes))])
            ev = BlockStored(hashes, None, tokens, 4, medium=rng.choice(["GPU", "GPU", "CPU"]))
        index.apply_batch(pod, "m", rank, [ev])
    return index


@pytest.mark.parametrize("seed", range(4))
def test_load_gives_the_original_back_c_and_python_entries_and_rows(seed: int) -> None:
    original = random_index(seed)
    exported = list(original.export_entries())
    assert any(e.copies > 1 for e in exported) and any(e.key is None for e in exported)
    rng = random.Random(seed)
    queries = [[k for k in rng.sample(sorted({e.key for e in exported if e.key is not None}), 6)] for _ in range(30)]
    tables = original.export_tables()
    for form in ("entries", "rows", "tables"):
        data = snapshots.encode(snapshots.State(block_sizes=original.block_sizes(), entries=exported if form != "tables" else [],
                                                tables=tables if form == "tables" else []))
        state = snapshots.decode(data)
        index = PreciseIndex()
        index.reserve_tables(state.tables)
        for pod, rank, medium, rows in state.tables:  # in parts, as a restore does
            for i in range(0, len(rows), 7 * 24):
                index.load_tables([(pod, rank, medium, memoryview(rows)[i:i + 7 * 24])])
        for i in range(0, len(state.entries), 7):
            index.load_entries(state.entries[i:i + 7])
        assert sorted(index.export_entries()) == sorted(exported), form
        for pod in original.pods():
            assert index.blocks_held(pod) == original.blocks_held(pod)
        for q in queries:
            assert index.match(q) == original.match(q)


def test_serve_answers_loading_and_honours_sigterm_while_a_big_state_loads(tmp_path: Path) -> None:
    n = 1_500_000
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    snap = state_dir / snapshots.SNAPSHOT_NAME
    rows = [("big", 0, "GPU", ((2 * i + 1) * 0x9E3779B97F4A7C15) & M64, i, 1) for i in range(n)]
    snapshots.write_atomic(snap, snapshots.encode(snapshots.State(block_sizes={"m": 16}, entries=rows)))
    del rows
    digest = hashlib.sha256(snap.read_bytes()).hexdigest()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "daemon.log", "wb") as err:
        p = subprocess.Popen(KVINDEX + ["serve", "--port", str(port), "--state-dir", str(state_dir)],
                             stdout=subprocess.DEVNULL, stderr=err)
    try:
        def up() -> bool:
            try:
                return http(url + "/healthz", timeout=1)[0] == 200
            except OSError:
                return False

        wait_until(up, 30, "HTTP up")
        status, body = http(url + "/readyz")
        assert status == 503 and body["reasons"][0].startswith("loading"), (status, body)
        status, body = http(url + "/v1/pods")
        assert status == 503 and body["error"].startswith("loading"), (status, body)
        t = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
        assert time.monotonic() - t < 15
    finally:
        stop(p, signal.SIGKILL)
    assert hashlib.sha256(snap.read_bytes()).hexdigest() == digest, "a partly loaded state was saved"
    with open(tmp_path / "daemon.log", "ab") as err:
        p = subprocess.Popen(KVINDEX + ["serve", "--port", str(port), "--state-dir", str(state_dir)],
                             stdout=subprocess.DEVNULL, stderr=err)
    try:
        def loaded() -> bool:
            try:
                status, body = http(url + "/v1/pods", timeout=2)
            except OSError:
                return False
            return status == 200 and body

        body = wait_until(loaded, 120, "the state loaded")
        assert [(v["pod"], v["blocks"]["gpu"]) for v in body["pods"]] == [("big", n)]
    finally:
        assert stop(p) == 0


def test_restore_benchmark_runs_and_checks_exactness() -> None:
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "restore.py"), "--entries", "20000", "40000",
                           "--json"], capture_output=True, text=True, timeout=120, check=False, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["entries"] for r in rows] == [20000, 40000]
    assert all({"decode_s", "load_s", "restore_s", "restore_cpu_s", "restore_s_per_million", "apply_s",
                "ratio_restore_to_apply"} <= set(r) for r in rows)


async def test_a_peers_state_loads_linearly_too(make_harness: Any) -> None:
    """``--peer`` goes through the same load (the old one took minutes for this)."""
    n = 200_000
    donor = await make_harness(Config())
    assert donor.daemon.index.load_entries(one_pod_in_slot_order(n)) == n
    t = time.process_time()
    h = await make_harness(Config(peer=donor.url))
    took = time.process_time() - t  # the donor's encoding included: one process
    assert h.daemon.restored_from == "peer"
    assert h.daemon.index.blocks_held("big") == donor.daemon.index.blocks_held("big") == {**h.daemon.index.blocks_held("big"), "gpu": n}
    assert took < 10, f"a peer's {n} entries took {took:.1f} CPU s"
