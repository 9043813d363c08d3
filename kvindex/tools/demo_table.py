"""The demo's summary table: kvindex's view of each pod next to the simulated engines' own counters.

Pure formatting of ``/v1/pods``, ``/v1/drift`` and the replicas' counters (no I/O); ``kvindex demo``
prints it live and once more at the end.
"""

from __future__ import annotations

from typing import Any


def _fmt_rate(x: Any) -> str:
    return "    -" if x is None else f"{x:5.2f}"


def summary_table(pods: list[dict[str, Any]], drift: dict[str, Any], replicas: dict[str, dict[str, int]]) -> str:
    """The compact per-pod table the demo prints (kvindex's view plus the engines' own counters)."""
    head = (f"{'pod':<8} {'conn':<6} {'blocks':>6} {'believed':>8} {'stale':>5} {'unseen':>6} {'reqs':>5} "
            f"{'evicted':>7}   hit rate: {'approx':>6} {'precise':>7} {'actual':>6}")
    lines = [head, "-" * len(head)]
    per_pod = drift.get("pods", {})
    for v in pods:
        d, r = per_pod.get(v["pod"], {}), replicas.get(v["pod"], {})
        conn = ("up" if v.get("connected") else "down") + ("" if v.get("synced", True) else "!")
        lines.append(f"{v['pod']:<8} {conn:<6} {v['blocks']['gpu']:>6} {v['approx_entries']:>8} {d.get('stale', 0):>5} "
                     f"{d.get('unseen', 0):>6} {r.get('requests', 0):>5} {r.get('evicted', 0):>7}             "
                     f"{_fmt_rate(d.get('approx_hit_rate')):>6} {_fmt_rate(d.get('precise_hit_rate')):>7} "
                     f"{_fmt_rate(d.get('actual_hit_rate')):>6}")
    o = drift.get("overall", {})
    lines.append(f"all: {o.get('recorded', o.get('decisions', 0))} decisions in the last {drift.get('window_seconds', 0):.0f} s; "
                 f"hit rate approx {_fmt_rate(o.get('approx_hit_rate')).strip()} precise "
                 f"{_fmt_rate(o.get('precise_hit_rate')).strip()} actual {_fmt_rate(o.get('actual_hit_rate')).strip()}"
                 f"  (blocks = engine blocks kvindex holds; believed = router's entries; '!' = unsynced)")
    return "\n".join(lines)
