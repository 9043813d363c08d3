"""``kvindex replay-routing``: the shared Mooncake trace through simulated engines, once per
policy, routed by the policies the picker runs (kvindex.route.policies)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvindex.tools.replay_routing import (
    BlockLRU,
    ReplayOptions,
    TraceRequest,
    read_trace,
    replay,
    run,
)
from tests.conftest import ROOT

TRACE = ROOT / "fixtures" / "traces" / "mooncake_conversation_trace.jsonl.gz"


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return read_trace(TRACE)


def test_the_trace_is_the_shared_one(trace: list[TraceRequest]) -> None:
    assert len(trace) == 12031 and trace[0].hash_ids[:3] == (0, 1, 2) and trace[-1].t == 3536.999


def test_same_seed_same_table_and_the_order_of_policies(trace: list[TraceRequest]) -> None:
    opts = ReplayOptions(seed=3)
    rows = run(trace, ["precise", "approx", "round_robin"], opts, progress=False)
    assert rows == run(trace, ["precise", "approx", "round_robin"], opts, progress=False)
    hit = {r["policy"]: r["hit_rate"] for r in rows}
    assert hit["precise"] >= hit["approx"] >= hit["round_robin"] > 0, hit
    rr = rows[2]
    assert rr["requests_per_engine_max"] - rr["requests_per_engine_min"] <= 1  # round-robin spreads evenly
    assert all(r["requests"] == len(trace) and r["prompt_tokens"] == sum(q.input_length for q in trace) for r in rows)


def test_lru_eviction_and_the_last_block_is_never_a_hit() -> None:
    lru = BlockLRU(3)
    lru.touch([1, 2, 3])
    assert lru.matched([1, 2, 3, 4]) == 3
    lru.touch([1, 9])  # (0, 1) recent again, (1, 9) new: (1, 2) goes, the least recent
    assert lru.matched([1, 2]) == 1 and lru.matched([1, 9]) == 2 and len(lru) == 3
    one = [TraceRequest(0.0, 1024, 1, (7, 8))] * 2  # two 512-token blocks: only the first may hit
    result = replay(one, "precise", ReplayOptions(engines=1))
    assert result.cached_tokens == 512


def test_ttft_is_the_wait_for_earlier_prefills_plus_its_own() -> None:
    reqs = [TraceRequest(0.0, 1000, 1, (1, 2)), TraceRequest(0.0, 1000, 1, (3, 4))]
    r = replay(reqs, "round_robin", ReplayOptions(engines=1, prefill_seconds_per_token=1e-3))
    assert r.ttft == [pytest.approx(1.0), pytest.approx(2.0)]  # the second waits for the first


def test_the_command_writes_table_json_and_svg(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kvindex", "replay-routing", str(TRACE), "--limit", "300",
                           "--engines", "4", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for policy in ("precise", "approx", "kthena", "load", "dynamo", "round_robin"):
        assert f"\n{policy} " in proc.stdout
    doc = json.loads((out / "replay-routing.json").read_text())
    assert [r["policy"] for r in doc["policies"]][0] == "precise" and doc["options"]["engines"] == 4
    svg = ET.fromstring((out / "replay-routing.svg").read_text())
    bars = [e for e in svg.iter() if e.tag.endswith("rect") and any(c.tag.endswith("title") for c in e)]
    assert svg.tag.endswith("svg") and len(bars) == 6 * 3  # per policy: a hit rate, a TTFT p50 and a p99


@pytest.mark.parametrize("args,words", [
    (["--policies", "precise,nope"], "unknown policy 'nope'"),
    (["--speed", "-1"], "--speed must be >= 0"),
])
def test_bad_arguments_exit_2_with_one_line(args: list[str], words: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvindex", "replay-routing", str(TRACE), "--limit", "5",
                           "--out", str(tmp_path), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a Mooncake trace line"):
        read_trace(bad)
