"""The benchmark's smoke run: it must run end to end and write the documented JSON (no timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_smoke_run_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--no-dynamo",
                           "--out", str(out)], capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert {"machine", "args", "dynamo", "replicas", "approx", "rss", "seconds"} <= set(doc)
    assert doc["dynamo"]["status"] == "skipped"
    assert {"cpu", "cores", "python", "packages"} <= set(doc["machine"])
    assert doc["replicas"], "no replica count was measured"
    for run in doc["replicas"].values():
        assert {"workload", "ingest_inproc", "query_inproc", "e2e_reference", "e2e_kvindex",
                "http_kvindex", "match_check"} <= set(run)
        assert run["e2e_kvindex"]["messages"] == run["e2e_kvindex"]["expected_messages"]
        assert run["e2e_kvindex"]["gaps"] == 0
        assert run["query_inproc"]["depth_mismatches"] == 0
        assert {"/query", "/query_by_hash", "/v1/score", "GET /health"} <= set(run["http_kvindex"]["latency"])
        checks = [c for c in run["match_check"].values() if isinstance(c, dict) and "vs_expected_mismatches" in c]
        assert len(checks) == 3 and all(c["vs_expected_mismatches"] == 0 for c in checks)
    assert {"8", "64"} == set(doc["approx"])
    assert all({"kvindex", "reference", "ratio_vs_reference"} <= set(r) for r in doc["rss"].values())
    assert "ingest e2e ZMQ blocks/s" in proc.stdout
    real = doc["realistic"]["targets"]["kvindex"]  # issue 38's workload, reported first
    assert real["vs_expected_mismatches"] == {"/query": 0, "/query_by_hash": 0}
    assert all(s["gaps"] == 0 and not s["unsynced"] for s in real["state"])
    assert proc.stdout.index("realistic workload") < proc.stdout.index("ingest e2e ZMQ blocks/s")


@pytest.mark.timeout(120)
def test_tokenizer_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "tokenizer.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tokenizer.py"), "--tokens", "512",
                           "--repeat", "3", "--out", str(out)], capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["body"]["tokens"] >= 512
    assert {"baseline_raw_encode_s", "cold_s", "cached_s", "cold_vs_baseline", "cached_vs_baseline",
            "loop_stall_inline_s", "loop_stall_daemon_path_s"} <= set(doc)
    assert "baseline raw tokenizers encode" in proc.stdout


@pytest.mark.timeout(120)
def test_routes_benchmark_runs_and_answers_right() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "routes.py"), "--smoke"],
                          capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["queries"] > 0 and doc["mismatches"] == {"/query": 0, "/query_by_hash": 0}
    assert set(doc["routes_us"]) == {"/query", "/query_by_hash"} and all(v > 0 for v in doc["routes_us"].values())
    assert "store.match" in doc["query_by_hash_steps_us"]
