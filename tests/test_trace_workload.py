"""benchmarks/trace_workload.py: the Mooncake trace replay must be exact input for the benchmark.

A small trace in the release's format (written here, so the test needs nothing from shared/) is
replayed by the real script; its message file is fed, frame by frame, through kvindex's own vLLM
decoder into a real PreciseIndex, and every held-out query's ``expected`` blocks per replica must
equal what that index matches. Also: same arguments give byte-identical files, evictions happen,
equal hash ids give equal tokens, and a follow-up turn is placed on the replica holding its prefix.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from random import Random

import msgpack

from adapters.dialects import DIALECTS
from kvindex import keys as K
from kvindex.index.precise import PreciseIndex
from kvindex.ingest.streams import split_topic
from kvindex.tools.workload import read_messages

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"


def write_trace(path: Path, conversations: int = 30, turns: int = 3) -> None:
    """Mooncake-format records: one shared first block, conversations growing turn by turn."""
    rng = Random(5)
    next_id, lines, t = 1, [], 0
    live: list[list[int]] = []
    for _ in range(conversations * turns):
        if live and rng.random() < 0.6:
            ids = live.pop(rng.randrange(len(live)))
        else:
            ids = [0]
        ids = ids + list(range(next_id, next_id + rng.randint(1, 3)))
        next_id = ids[-1] + 1
        live.append(ids)
        length = (len(ids) - 1) * 512 + rng.randint(1, 512)
        lines.append(json.dumps({"timestamp": t, "input_length": length, "output_length": rng.randint(1, 200),
                                 "hash_ids": ids}))
        t += rng.randint(0, 400)
    path.write_text("\n".join(lines) + "\n")


def generate(tmp: Path, name: str, trace: Path, *extra: str) -> tuple[Path, dict]:
    out = tmp / name
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trace_workload.py"), str(out), "--trace", str(trace),
           "--replicas", "3", "--capacity", "400", "--queries", "12", "--model", MODEL, "--quiet", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=120)
    return out, json.loads(out.with_name(out.name + ".json").read_text())


def test_replay_matches_a_real_index_and_is_deterministic(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    path, side = generate(tmp_path, "a.bin", trace)
    again, _ = generate(tmp_path, "b.bin", trace)
    assert path.read_bytes() == again.read_bytes()
    stats = side["stats"]
    assert stats["block_removed"] > 0, "the caches must be small enough to evict"
    assert stats["requests"] == 90 - 12 and sum(stats["requests_per_replica"]) == stats["requests"]
    assert min(stats["requests_per_replica"]) > 0, "placement must spread the load"

    decode = DIALECTS["vllm"].decoder().decode
    index = PreciseIndex()
    index.set_block_size(MODEL, 16)
    seqs: dict[str, int] = {}
    for topic, seq, payload in read_messages(path):
        assert seq == seqs.get(topic, -1) + 1  # seq counts from 0 per replica
        seqs[topic] = seq
        raw = msgpack.unpackb(payload)
        assert len(raw) == 3 and raw[2] == 0
        batch = decode(payload)
        for ev in batch.events:
            index.apply(split_topic(topic)[0], MODEL, batch.dp_rank, ev)
    pods = [split_topic(t)[0] for t in side["topics"]]
    root = K.root_key(MODEL)
    deep = 0
    for q in side["queries"]:
        got = index.match(K.prompt_keys(root, q["token_ids"][:-1], 16))
        assert [got[p].gpu if p in got else 0 for p in pods] == q["expected"]
        assert len(q["token_ids"]) % 16, "the pad token keeps the last block partial"
        deep += max(q["expected"]) > 32
    assert deep, "some held-out turn must find its conversation's prefix beyond the shared first block"


def test_equal_hash_ids_give_equal_tokens_and_prefix_placement(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import trace_workload as tw

    assert tw.tokens_of(7) == tw.tokens_of(7) and tw.tokens_of(7) != tw.tokens_of(8)
    a = tw.prompt_of({"hash_ids": [0, 1, 2], "input_length": 1100})
    b = tw.prompt_of({"hash_ids": [0, 1, 3], "input_length": 1536})
    assert len(a) == 1100 and len(b) == 1536 and a[:1024] == b[:1024] and a[1024:] != b[1024:1100]
    trace = tmp_path / "trace.jsonl"
    # a long first turn fills replica 0; the second turn (same prefix) must follow it there even
    # though replica 0 is busier; an unrelated prompt goes elsewhere
    recs = [{"timestamp": 0, "input_length": 2048, "output_length": 10, "hash_ids": [10, 11, 12, 13]},
            {"timestamp": 0, "input_length": 700, "output_length": 10, "hash_ids": [20, 21]},
            {"timestamp": 0, "input_length": 2500, "output_length": 10, "hash_ids": [10, 11, 12, 13, 14]},
            {"timestamp": 1, "input_length": 600, "output_length": 10, "hash_ids": [30, 31]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "p.bin"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_workload.py"), str(out), "--trace", str(trace),
                    "--replicas", "2", "--capacity", "1000", "--queries", "1", "--quiet"], check=True, cwd=ROOT,
                   timeout=60)
    topics = [t for t, _, _ in read_messages(out)]
    assert topics == ["kv@pod-0@bench-model", "kv@pod-1@bench-model", "kv@pod-0@bench-model"]
    side = json.loads(out.with_name(out.name + ".json").read_text())
    assert side["stats"]["cached_tokens"] == 2048 and side["stats"]["block_removed"] == 0
