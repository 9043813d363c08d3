"""Restore time: a snapshot of N entries in one pod (one (pod, rank, medium) table, the case that
was quadratic) decoded and loaded as ``kvindex.persist.restore.Recovery`` does at start.

For each size it prints the wall seconds to decode the snapshot bytes and to load the entries
into a fresh ``PreciseIndex`` (tables sized up front, loaded in chunks between event-loop turns),
their sum and its CPU seconds (on a shared machine wall time includes waiting), the sum per
million entries (flat when restore is linear: it was quadratic, 40k entries took 9.5 s), and a
baseline measured in the same run: building the same index by applying the engine's
``BlockStored`` events (``restore/apply`` = restore seconds / apply seconds). The restored index is
checked against the original (entry by entry up to 1M entries, by its counts above).

    python benchmarks/restore.py                 # 100k, 1M, 5M entries
    python benchmarks/restore.py --entries 200000 1000000
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvindex.events import BlockStored
from kvindex.index.precise import PreciseIndex
from kvindex.persist import snapshot as snapshots
from kvindex.persist.restore import LOAD_CHUNK

BLOCKS_PER_EVENT = 64
BLOCK_SIZE = 16


def build(n: int, seed: int = 0) -> tuple[PreciseIndex, float]:
    """An index of ``n`` engine hashes in one pod, by applying events; and the seconds applying took."""
    rng = random.Random(seed)
    batches = []
    per = BLOCKS_PER_EVENT * BLOCK_SIZE
    for i in range(0, n, BLOCKS_PER_EVENT):
        hashes = tuple(rng.getrandbits(63) | 1 for _ in range(BLOCKS_PER_EVENT))
        tokens = array("I", range(i * BLOCK_SIZE, i * BLOCK_SIZE + per))  # distinct prompts: distinct keys
        batches.append(BlockStored(hashes, None, tokens, BLOCK_SIZE))
    index = PreciseIndex()
    t = time.perf_counter()
    for ev in batches:
        index.apply_batch("pod-0", "m", 0, [ev])
    return index, time.perf_counter() - t


def restore(data: bytes) -> tuple[PreciseIndex, float, float, float]:
    """The snapshot decoded and loaded as at start: (index, decode s, load s, CPU s of both)."""
    gc.disable()  # as Recovery.restore does
    try:
        return _restore(data)
    finally:
        gc.enable()


def _restore(data: bytes) -> tuple[PreciseIndex, float, float, float]:
    t, cpu = time.perf_counter(), time.process_time()
    state = snapshots.decode(data)  # as Recovery reads it
    decoded = time.perf_counter()
    index = PreciseIndex()
    for model, bs in state.block_sizes.items():
        index.set_block_size(model, bs)
    index.reserve_tables(state.tables)
    step = LOAD_CHUNK * 24  # in parts, as Recovery loads them (the loop gets turns)
    for pod, rank, medium, rows in state.tables:
        for i in range(0, len(rows), step):
            index.load_tables([(pod, rank, medium, memoryview(rows)[i:i + step])])
    return index, decoded - t, time.perf_counter() - decoded, time.process_time() - cpu


def measure(n: int) -> dict[str, float]:
    original, apply_s = build(n)
    data = snapshots.encode(snapshots.State(block_sizes=original.block_sizes(), tables=original.export_tables()))
    gc.collect()
    restored, decode_s, load_s, cpu_s = restore(data)
    assert restored.blocks_held("pod-0") == original.blocks_held("pod-0"), "restore is not exact"
    if n <= 1_000_000:  # entry by entry (sorting millions of entries would dwarf the restore)
        assert sorted(restored.export_entries()) == sorted(original.export_entries()), "restore is not exact"
    total = decode_s + load_s
    return {"entries": n, "snapshot_mb": round(len(data) / 1e6, 1), "decode_s": round(decode_s, 3),
            "load_s": round(load_s, 3), "restore_s": round(total, 3), "restore_cpu_s": round(cpu_s, 3),
            "restore_s_per_million": round(total / n * 1e6, 3), "apply_s": round(apply_s, 3),
            "ratio_restore_to_apply": round(total / apply_s, 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, nargs="+", default=[100_000, 1_000_000, 5_000_000])
    p.add_argument("--json", action="store_true", help="one JSON line per size instead of the table")
    args = p.parse_args(argv)
    if not args.json:
        print(f"{'entries':>10} {'MB':>7} {'decode s':>9} {'load s':>8} {'restore s':>10} {'cpu s':>7} {'s/M':>7} "
              f"{'apply s':>8} {'restore/apply':>13}")
    for n in args.entries:
        r = measure(n)
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{n:>10} {r['snapshot_mb']:>7} {r['decode_s']:>9} {r['load_s']:>8} {r['restore_s']:>10} "
                  f"{r['restore_cpu_s']:>7} "
                  f"{r['restore_s_per_million']:>7} {r['apply_s']:>8} {r['ratio_restore_to_apply']:>13}", flush=True)


if __name__ == "__main__":
    main()
