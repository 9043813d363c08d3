"""The benchmark's text table, rendered from the result document (see run.py).

``python benchmarks/report.py A.json B.json C.json`` prints the README's table from several runs:
per headline figure and workload, kvindex's and Dynamo's values in the run whose ratio is the
median, and the median ratio with the lowest and highest in brackets.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

Row = tuple[str, str, str, str, str, str]
HEAD: Row = ("metric", "kvindex", "baseline", "kv/base", "Dynamo", "kv/Dynamo")


def _k(x: float | None) -> str:
    """Thousands, e.g. 1,234k."""
    return "-" if x is None else f"{x / 1000:,.0f}k"


def _us(x: float | None) -> str:
    """Microseconds."""
    return "-" if x is None else (f"{x:,.0f}µs" if x >= 10 else f"{x:.1f}µs")


def _r(a: float | None, b: float | None) -> str:
    """a / b with two decimals, "-" when either is missing."""
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _bytes(x: float | None) -> str:
    """Bytes, e.g. 54 B."""
    return "-" if x is None else f"{x:.0f} B"


_FMT = {"k": _k, "us": _us, "B": _bytes}  # a summary cell's unit -> its format


def _ingest_rows(r: dict) -> list[Row]:
    """In-process and end-to-end ingest rows."""
    ip, ref, kv = r.get("ingest_inproc"), r["e2e_reference"], r["e2e_kvindex"]
    dyn = r.get("dynamo", {}).get("ingest") if "error" not in r.get("dynamo", {}) else None
    d = dyn["blocks_per_s"] if dyn else None
    gaps = f" gaps={kv['gaps']} unsynced={kv['unsynced']} msgs={kv['messages']}/{kv['expected_messages']}"
    if dyn and "expected_events" in dyn:  # Dynamo's applied-events count when its timing ended
        gaps += f" Dynamo events={dyn['events_ok']:.0f}/{dyn['expected_events']}"
    rows: list[Row] = [] if ip is None else [
        ("ingest in-process blocks/s", _k(ip["kvindex_blocks_per_s"]), _k(ip["reference_blocks_per_s"]),
         _r(ip["kvindex_blocks_per_s"], ip["reference_blocks_per_s"]), "-", "-")]
    rows += [
        ("ingest e2e ZMQ blocks/s" + gaps, _k(kv["blocks_per_s"]), _k(ref["blocks_per_s"]),
         _r(kv["blocks_per_s"], ref["blocks_per_s"]), _k(d), _r(kv["blocks_per_s"], d)),
    ]
    if "e2e_kvindex_workers" in r:  # the same core budget as Dynamo's --threads
        w = r["e2e_kvindex_workers"]
        rows.append((f"ingest e2e ZMQ blocks/s, --workers {w['workers']} (gaps={w['gaps']} "
                     f"msgs={w['messages']}/{w['expected_messages']})", _k(w["blocks_per_s"]), "-", "-", _k(d),
                     _r(w["blocks_per_s"], d)))
    copy_ms = None if ip is None else ip.get("export_tables_ms", ip.get("frozen_copy_ms"))  # (the old name)
    if copy_ms is not None:  # snapshot capture on the event loop vs copying per-replica dicts
        rows.append(("snapshot copy on the event loop (export_tables) ms", f"{copy_ms:,.1f}",
                     f"{ip['reference_copy_ms']:,.1f}", _r(copy_ms, ip["reference_copy_ms"]), "-", "-"))
    return rows


def _query_rows(r: dict) -> list[Row]:
    """In-process lookup rows (p50, p99)."""
    q = r.get("query_inproc")
    rows: list[Row] = []
    if q is None:
        return rows
    for p in ("p50_us", "p99_us"):
        rows.append((f"lookup in-process 512 blocks {p[:3]} (mismatch={q['depth_mismatches']})",
                     _us(q["kvindex"][p]), _us(q["reference"][p]), _r(q["kvindex"][p], q["reference"][p]), "-", "-"))
    return rows


def _http_rows(r: dict) -> list[Row]:
    """HTTP endpoint rows against the GET /health round trip and Dynamo."""
    lat = r["http_kvindex"]["latency"]
    dyn = r.get("dynamo", {}).get("http", {}).get("latency", {})
    base = lat["GET /health"]["p50_us"]
    rows: list[Row] = []
    for ep in ("/query", "/query_by_hash", "/v1/score"):
        for p in ("p50_us", "p99_us"):
            d = dyn.get(ep, {}).get(p)
            rows.append((f"HTTP {ep} {p[:3]}", _us(lat[ep][p]), _us(base) + " health",
                         _r(lat[ep][p], base), _us(d), _r(lat[ep][p], d)))
    floor = r.get("http_floor", {}).get("latency", {})
    for ep in ("/query", "/query_by_hash"):
        for p in ("p50_us", "p99_us"):
            if ep in floor:
                d = dyn.get(ep, {}).get(p)
                rows.append((f"HTTP {ep} {p[:3]} floor: empty aiohttp handler", _us(floor[ep][p]), "-", "-",
                             _us(d), _r(floor[ep][p], d)))
    kv_srv = r["http_kvindex"].get("server_mean_us", {})
    dyn_srv = r.get("dynamo", {}).get("http", {}).get("server_mean_us", {})
    for ep in ("/query", "/query_by_hash", "/v1/score"):
        if ep in kv_srv:
            rows.append((f"HTTP {ep} server-side mean (own histogram)", _us(kv_srv[ep]), "-", "-",
                         _us(dyn_srv.get(ep)), _r(kv_srv[ep], dyn_srv.get(ep))))
    return rows


def _check_rows(r: dict) -> list[Row]:
    """Matched-token checks and process RSS growth."""
    rows: list[Row] = []
    for ep, c in r["match_check"].items():
        if not isinstance(c, dict) or "vs_expected_mismatches" not in c:
            label = {"dynamo_vs_expected": "Dynamo: mismatches vs expected (last pass)",
                     "dynamo_first_pass_vs_expected": "Dynamo: mismatches vs expected (right after ingest)"}.get(ep)
            if label:
                rows.append((label, "-", "-", "-", " ".join(f"{k}={v}" for k, v in c.items()), "-"))
            elif ep == "kvindex_answers_changed_after_ingest":
                d = r["match_check"].get("dynamo_answers_changed_after_ingest", "-")
                rows.append(("answers that changed after the first pass", str(c), "-", "-", str(d), "-"))
            continue
        rows.append((f"matched tokens {ep}: mismatches vs expected / vs Dynamo", str(c["vs_expected_mismatches"]),
                     "-", "-", str(c.get("vs_dynamo_mismatches", "-")), "-"))
    kv = r["e2e_kvindex"]["rss_bytes_per_entry"]
    d = r.get("dynamo", {}).get("ingest", {}).get("rss_bytes_per_entry")
    rows.append(("process RSS growth per entry during e2e ingest", f"{kv:.0f}B", "-", "-",
                 "-" if d is None else f"{d:.0f}B", _r(kv, d)))
    return rows


def _global_rows(doc: dict) -> list[Row]:
    """Approximate-index and RSS-per-entry rows."""
    rows: list[Row] = []
    for pods, a in doc["approx"].items():
        rows.append((f"approx hash+record+score 8KB p50, {pods} pods", _us(a["record_plus_score_p50_us"]),
                     _us(a["reference_xxh64_slices"]["p50_us"]) + " xxh64", f"{a['ratio_vs_reference']:.1f}", "-", "-"))
    for n, row in doc["rss"].items():
        kv, ref = row["kvindex"], row["reference"]
        rows.append((f"RSS per (block, pod) entry, {kv['entries'] / 1e6:.2f}M entries, {kv['pods']} pods",
                     f"{kv['bytes_per_entry']:.0f}B", f"{ref['bytes_per_entry']:.0f}B",
                     f"{row['ratio_vs_reference']:.2f}", "-", "-"))
    return rows


def _table(rows: list[Row]) -> str:
    """Aligned text table; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]
    lines = []
    for n, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def _load(doc: dict) -> str:
    """The 1/5/15-minute load averages before and after the run (the machine may be shared)."""
    def three(key: str) -> str:
        return "/".join(f"{x:.1f}" for x in doc.get(key) or ()) or "-"
    return (f"load average before {three('load_average_before')}, after {three('load_average_after')} "
            f"({doc['machine']['cores']} cores)")


def _trace_section(r: dict) -> str:
    """The Mooncake trace replay's table (end-to-end figures only), or why it was skipped."""
    if "skipped" in r:
        return f"\n== Mooncake trace: skipped ({r['skipped']})"
    w = r["workload"]
    lo, mid, hi = w["query_tokens_min_median_max"]
    head = (f"\n== Mooncake trace: {w['requests']:,} requests on {w['replicas']} replicas ({w['capacity_blocks']:,}-block "
            f"LRU each, hit rate {w['hit_rate']:.1%}): {w['batches']:,} batches, {w['block_ops']:,} block-ops "
            f"({w['block_removed']:,} removed), {w['entries_held']:,} entries held; {w['queries']} queries of "
            f"{lo:,}/{mid:,}/{hi:,} tokens (min/median/max)")
    dyn = r.get("dynamo", {})
    fail = [f"Dynamo failed: {dyn['error']}"] if "error" in dyn else []
    return "\n".join([head, *fail, _table([HEAD, *_ingest_rows(r), *_http_rows(r), *_check_rows(r)])])


def _summary_cells(r: dict) -> list[tuple[str, float | None, float | None, str]]:
    """(metric, kvindex, Dynamo, unit) of one workload's headline figures."""
    dyn = r.get("dynamo", {}) if "error" not in r.get("dynamo", {}) else {}
    di, dl = dyn.get("ingest", {}), dyn.get("http", {}).get("latency", {}).get("/query", {})
    kl = r["http_kvindex"]["latency"]["/query"]
    w = r.get("e2e_kvindex_workers", {})
    return [("ingest, end to end over ZeroMQ, one process", r["e2e_kvindex"]["blocks_per_s"], di.get("blocks_per_s"), "k"),
            ("ingest, `--workers 2`", w.get("blocks_per_s"), di.get("blocks_per_s"), "k"),
            ("`/query` p50", kl["p50_us"], dl.get("p50_us"), "us"),
            ("`/query` p99", kl["p99_us"], dl.get("p99_us"), "us"),
            ("process RSS growth per entry", r["e2e_kvindex"]["rss_bytes_per_entry"], di.get("rss_bytes_per_entry"), "B")]


def _workloads(doc: dict) -> dict[str, dict]:
    """The run's workloads by their table name: synthetic per replica count, then the trace."""
    runs = {f"synthetic, {n} replicas": r for n, r in doc["replicas"].items()}
    if "mooncake" in doc and "skipped" not in doc["mooncake"]:
        runs[f"Mooncake trace, {doc['mooncake']['workload']['replicas']} replicas"] = doc["mooncake"]
    return runs


def median_summary(docs: list[dict]) -> str:
    """The README's table over several runs: the median run's values and ratio (lowest–highest)."""
    runs = [{name: _summary_cells(r) for name, r in _workloads(doc).items()} for doc in docs]
    lines = [f"| median of {len(docs)} runs | kvindex | Dynamo | kvindex / Dynamo (lowest–highest) |",
             "|---|---|---|---|"]
    first = runs[0]
    metrics = [cell[0] for cell in next(iter(first.values()))]
    for i, metric in enumerate(metrics):
        for name in first:
            cells = sorted((c[1] / c[2], c) for run in runs if name in run
                           for c in [run[name][i]] if c[1] and c[2])
            if not cells:
                continue
            ratio, (_m, kv, d, unit) = cells[(len(cells) - 1) // 2]
            lines.append(f"| {metric} — {name} | {_FMT[unit](kv)} | {_FMT[unit](d)} | "
                         f"**{ratio:.2f}** ({cells[0][0]:.2f}–{cells[-1][0]:.2f}) |")
    counts = [_mismatches(r) for doc in docs for r in _workloads(doc).values()]
    truth, dyn_truth, vs_dyn = (sum(c[k] for c in counts if c[k] is not None) for k in range(3))
    lines.append(f"| matched-token mismatches, every workload of every run: vs the simulator's truth / vs each other "
                 f"| {truth} / {vs_dyn} | {dyn_truth} | |")
    return "\n".join(lines)


def summary(doc: dict) -> str:
    """One markdown table, kvindex / Dynamo / ratio: each headline metric on every workload of the run."""
    runs = _workloads(doc)
    if not runs:
        return "(no workload measured)"
    lines = ["| | kvindex | Dynamo | kvindex / Dynamo |", "|---|---|---|---|"]
    cells = {name: _summary_cells(r) for name, r in runs.items()}
    for i, (metric, *_rest) in enumerate(next(iter(cells.values()))):
        for name, c in cells.items():
            _m, kv, d, unit = c[i]
            lines.append(f"| {metric} — {name} | {_FMT[unit](kv)} | {_FMT[unit](d)} | {_r(kv, d)} |")
    for name, r in runs.items():
        truth, dyn_truth, vs_dyn = _mismatches(r)
        lines.append(f"| matched-token mismatches vs the simulator's truth — {name} | "
                     f"{truth} | {'-' if dyn_truth is None else dyn_truth} | vs each other: "
                     f"{'-' if vs_dyn is None else vs_dyn} |")
    return "\n".join(lines)


def _mismatches(r: dict) -> tuple[int, int | None, int | None]:
    """A workload's matched-token mismatches: kvindex vs the simulator's truth, Dynamo vs it, and
    kvindex vs Dynamo (None without Dynamo)."""
    checks = {ep: v for ep, v in r["match_check"].items() if isinstance(v, dict) and "vs_expected_mismatches" in v}
    truth = sum(v["vs_expected_mismatches"] for v in checks.values())
    vs_dyn = [v["vs_dynamo_mismatches"] for v in checks.values() if "vs_dynamo_mismatches" in v]
    if not vs_dyn:
        return truth, None, None
    return truth, sum(r["match_check"].get("dynamo_vs_expected", {}).values()), sum(vs_dyn)


def render(doc: dict) -> str:
    """Machine header, then one table per replica count and one for approx/RSS."""
    m = doc["machine"]
    pk = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
    g = m.get("git") or {}
    tree = f"git {g.get('commit')}" + (f" + uncommitted {', '.join(g['modified'])}" if g.get("modified") else "")
    out = [f"machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}; {pk}; {tree}",
           _load(doc), f"Dynamo: {doc['dynamo']['status']}" + (f" ({doc['dynamo'].get('reason')})" if doc["dynamo"].get("reason") else "")]
    if "realistic" in doc:  # issue 38's workload first
        import realistic

        out.append(realistic.render(doc["realistic"]))
    for n, r in doc["replicas"].items():
        w = r["workload"]
        out.append(f"\n== {n} replicas: {w['batches']:,} batches, {w['block_ops']:,} block-ops "
                   f"({w['block_removed']:,} removed), {w['entries_held']:,} entries held at the end")
        dyn = r.get("dynamo", {})
        if "error" in dyn:
            out.append(f"Dynamo failed: {dyn['error']}")
        out.append(_table([HEAD, *_ingest_rows(r), *_query_rows(r), *_http_rows(r), *_check_rows(r)]))
    if "mooncake" in doc:
        out.append(_trace_section(doc["mooncake"]))
    if "approx" in doc:
        out.append("\n== approximate index and memory")
        out.append(_table([HEAD, *_global_rows(doc)]))
    out.append("\n== summary (the README's table)\n" + summary(doc))
    out.append(f"\ntotal {doc['seconds']:.0f}s; baselines: plain-Python dict per replica (ingest, lookup, RSS), "
               "pyzmq+msgpack loop (e2e), GET /health (HTTP), XXH64 slices (approx)")
    return "\n".join(out)


if __name__ == "__main__":
    print(median_summary([json.loads(Path(f).read_text()) for f in sys.argv[1:]]))
