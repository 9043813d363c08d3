"""In-process measurements: ingest, precise lookup, approximate record/score, RSS per entry.

Each kvindex figure has a plain-Python reference measured in the same run (performance.md §3):
- ingest: ``msgpack.unpackb`` + one ``{engine hash: copies}`` dict per replica;
- lookup: the same dicts walked replica by replica (O(replicas × depth));
- approximate: hashing the 8 KB prompt in 64-byte slices with XXH64 (no index);
- RSS: the per-replica dicts holding the same (block, pod) entries.

``python benchmarks/inproc.py rss --impl kvindex|reference --entries N --pods P`` is the fresh
subprocess the RSS figure comes from (prints one JSON line).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BLOCK_SIZE, MODEL, QUERY_BLOCKS, Workload, latency_summary, rss_bytes  # noqa: E402

from adapters.dialects import DIALECTS  # noqa: E402
from kvindex import keys as K  # noqa: E402
from kvindex.approx.hashing import hash_request  # noqa: E402
from kvindex.events import BlockStored  # noqa: E402
from kvindex.index.approx import ApproxIndex
from kvindex.index.precise import PreciseIndex
from kvindex.ingest.streams import split_topic
from kvindex.settings import ApproxConfig
from kvindex.tools.engine_sim import block_hashes


# -- ingest -------------------------------------------------------------------------------------
def kvindex_ingest(wl: Workload) -> tuple[PreciseIndex, float]:
    """Decode + apply every message into a fresh PreciseIndex; returns it and the seconds taken."""
    decode = DIALECTS["vllm"].decoder().decode
    index = PreciseIndex()
    index.set_block_size(MODEL, BLOCK_SIZE)
    pods = {t: split_topic(t)[0] for t in wl.topics}
    apply = index.apply
    t0 = time.perf_counter()
    for topic, _seq, payload in wl.messages:
        batch = decode(payload)
        pod, rank = pods[topic], batch.dp_rank
        for ev in batch.events:
            apply(pod, MODEL, rank, ev)
    return index, time.perf_counter() - t0


def kvindex_decode_only(wl: Workload) -> float:
    """Seconds to decode every payload (no apply)."""
    decode = DIALECTS["vllm"].decoder().decode
    t0 = time.perf_counter()
    for _topic, _seq, payload in wl.messages:
        decode(payload)
    return time.perf_counter() - t0


def reference_ingest(wl: Workload) -> tuple[dict[str, dict[int, int]], float]:
    """The reference loop: msgpack + a per-replica ``{hash: copies}`` dict."""
    held: dict[str, dict[int, int]] = {t: {} for t in wl.topics}
    unpack = msgpack.unpackb
    t0 = time.perf_counter()
    for topic, _seq, payload in wl.messages:
        d = held[topic]
        for ev in unpack(payload)[1]:
            kind = ev["type"]
            if kind == "BlockStored":
                for h in ev["block_hashes"]:
                    d[h] = d.get(h, 0) + 1
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    n = d.get(h, 0) - 1
                    if n > 0:
                        d[h] = n
                    else:
                        d.pop(h, None)
            else:
                d.clear()
    return held, time.perf_counter() - t0


def ingest(wl: Workload) -> tuple[dict, PreciseIndex, dict[str, dict[int, int]]]:
    """In-process ingest figures for kvindex and the reference, with their ratio."""
    index, kv_s = kvindex_ingest(wl)
    held, ref_s = reference_ingest(wl)
    dec_s = kvindex_decode_only(wl)
    ops = wl.block_ops
    out = {"block_ops": ops, "messages": len(wl.messages),
           "kvindex_blocks_per_s": ops / kv_s, "reference_blocks_per_s": ops / ref_s,
           "kvindex_decode_share": dec_s / kv_s}
    # what a snapshot costs the event loop: PreciseIndex.export_tables vs copying the reference's dicts
    t0 = time.perf_counter()
    copy = index.export_tables()
    t1 = time.perf_counter()
    ref_copy = [d.copy() for d in held.values()]
    t2 = time.perf_counter()
    del copy, ref_copy
    out["export_tables_ms"], out["reference_copy_ms"] = (t1 - t0) * 1e3, (t2 - t1) * 1e3
    out["ratio_vs_reference"] = out["kvindex_blocks_per_s"] / out["reference_blocks_per_s"]
    return out, index, held


# -- queries ------------------------------------------------------------------------------------
def _time_calls(fn: Callable[[], object], repeat: int) -> list[float]:
    """Wall seconds of ``repeat`` calls of ``fn`` (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def reference_match(held: dict[str, dict[int, int]], hashes: list[int]) -> dict[str, int]:
    """Per replica: how many leading engine hashes it holds (the per-replica dict walk)."""
    out = {}
    for topic, d in held.items():
        n = 0
        for h in hashes:
            if h not in d:
                break
            n += 1
        out[topic] = n
    return out


def query(wl: Workload, index: PreciseIndex, held: dict[str, dict[int, int]],
          queries: list[dict], repeat: int) -> dict:
    """p50/p99 of ``PreciseIndex.match`` on 512 keys vs the reference walk; checks the depths."""
    root = K.root_key(MODEL)
    pods = [split_topic(t)[0] for t in wl.topics]
    kv_times: list[float] = []
    ref_times: list[float] = []
    mismatches = 0
    deep = []
    for q in queries:
        keys = K.prompt_keys(root, q["token_ids"][:-1], BLOCK_SIZE)[:QUERY_BLOCKS]
        hashes = block_hashes(q["token_ids"][:-1], BLOCK_SIZE)[:QUERY_BLOCKS]
        got = index.match(keys)
        depths = [got[p].gpu if p in got else 0 for p in pods]
        mismatches += depths != q["expected"]
        deep.append(sorted(depths, reverse=True)[:4])
        per = max(1, repeat // len(queries))
        kv_times += _time_calls(lambda: index.match(keys), per)
        ref_times += _time_calls(lambda: reference_match(held, hashes), per)
    kv, ref = latency_summary(kv_times), latency_summary(ref_times)
    return {"pods": len(pods), "blocks": QUERY_BLOCKS, "queries": len(queries), "depth_mismatches": mismatches,
            "top_depths_example": deep[0] if deep else [], "kvindex": kv, "reference": ref,
            "p50_ratio_vs_reference": kv["p50_us"] / ref["p50_us"],
            "p99_ratio_vs_reference": kv["p99_us"] / ref["p99_us"]}


# -- approximate --------------------------------------------------------------------------------
def _prompt_8kb(n: int) -> str:
    """A deterministic 8 KB prompt."""
    words = " ".join(f"w{(n * 7919 + i * 104729) % 32000}" for i in range(2000))
    return words[:8192]


def approx(pods: int, repeat: int) -> dict:
    """Approximate index: hash + record + score of an 8 KB prompt, ``pods`` pods pre-filled."""
    idx = ApproxIndex(ApproxConfig())
    names = [f"pod-{i}" for i in range(pods)]
    for i in range(pods * 4):
        idx.record(names[i % pods], MODEL, hash_request(idx.config, MODEL, {"prompt": _prompt_8kb(i)}))
    body = {"prompt": _prompt_8kb(1)}
    hashes = hash_request(idx.config, MODEL, body)
    hash_t = _time_calls(lambda: hash_request(idx.config, MODEL, body), repeat)
    rec_t = _time_calls(lambda: idx.record(names[0], MODEL, hashes), repeat)
    score_t = _time_calls(lambda: idx.score(MODEL, hashes, names), repeat)
    raw = body["prompt"].encode()
    base_t = _time_calls(lambda: [xxhash.xxh64_intdigest(raw[i:i + 64]) for i in range(0, len(raw), 64)], repeat)
    out = {"pods": pods, "hashes": len(hashes), "hash": latency_summary(hash_t),
           "record": latency_summary(rec_t), "score": latency_summary(score_t),
           "reference_xxh64_slices": latency_summary(base_t)}
    total = out["hash"]["p50_us"] + out["record"]["p50_us"] + out["score"]["p50_us"]
    out["record_plus_score_p50_us"] = total
    out["ratio_vs_reference"] = total / out["reference_xxh64_slices"]["p50_us"]
    return out


# -- memory (run in a fresh subprocess) ------------------------------------------------------------
PROMPT_BLOCKS = 64


def _fill_events(entries: int, pods: int) -> Iterator[tuple[str, BlockStored]]:
    """(pod, BlockStored) pairs totalling ``entries`` (block, pod) entries; each prompt on 2 pods.

    Built lazily, one fresh event (fresh u64 hash objects) per pod, as decoding would make them.
    """
    for g in range(max(1, entries // (PROMPT_BLOCKS * 2))):
        base = g * PROMPT_BLOCKS
        tokens = array("I", range(base * BLOCK_SIZE, (base + PROMPT_BLOCKS) * BLOCK_SIZE))
        for pod in (g % pods, (g + pods // 2) % pods):
            hashes = tuple((1 << 63) + base + b for b in range(PROMPT_BLOCKS))
            yield f"pod-{pod}", BlockStored(hashes, None, tokens, BLOCK_SIZE)


def rss_child(impl: str, entries: int, pods: int) -> dict:
    """RSS delta per (block, pod) entry after filling ``impl`` (kvindex or reference)."""
    gc.collect()
    before = rss_bytes()
    n = 0
    if impl == "kvindex":
        index = PreciseIndex()
        for pod, ev in _fill_events(entries, pods):
            index.apply(pod, MODEL, 0, ev)
            n += len(ev.block_hashes)
    else:
        held: dict[str, dict[int, int]] = {f"pod-{p}": {} for p in range(pods)}
        for pod, ev in _fill_events(entries, pods):
            d = held[pod]
            for h in ev.block_hashes:
                d[h] = d.get(h, 0) + 1
            n += len(ev.block_hashes)
    gc.collect()
    after = rss_bytes()
    return {"impl": impl, "entries": n, "pods": pods, "rss_delta_bytes": after - before,
            "bytes_per_entry": (after - before) / n}


def main(argv: list[str] | None = None) -> None:
    """Subprocess entry point (``rss``)."""
    p = argparse.ArgumentParser(description="in-process benchmark children")
    p.add_argument("what", choices=["rss"])
    p.add_argument("--impl", choices=["kvindex", "reference"], required=True)
    p.add_argument("--entries", type=int, required=True)
    p.add_argument("--pods", type=int, default=64)
    a = p.parse_args(argv)
    print(json.dumps(rss_child(a.impl, a.entries, a.pods)))


if __name__ == "__main__":
    main()
