"""The dashboard at ``GET /`` in a real headless browser (Debian's ``chromium``) against a live
daemon fed by a recorded vLLM capture and routing decisions. The page must show the pods and the
figures the API returns; a screenshot is kept in tests/artifacts/dashboard.png.

Without chromium the test is skipped saying why (the apt-get line); in CI (``$CI`` set, as .ci/run
does) it fails: CI installs it (tests/programs.py)."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from kvindex.config import Config
from kvindex.settings import DriftSettings
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, ROOT, engine_config, ipc_endpoint
from tests.programs import need

CAPTURE = FIXTURES / "two_engines"
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1440,1500", "--virtual-time-budget=5000"]


def chromium() -> str:
    """The browser's path; missing, the test skips naming it and the apt-get line (fails in CI)."""
    found = next((path for path in map(shutil.which, CHROMIUM_NAMES) if path), None)
    return need("chromium", found, "chromium")


async def run_chromium(url: str, *args: str) -> str:
    """Run headless chromium on ``url`` with a fresh profile; return its stdout. The daemon shares
    this event loop, so the browser runs as an asyncio subprocess."""
    with tempfile.TemporaryDirectory(prefix="kvi-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(
            chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError("chromium did not finish within 60 s") from None
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


class Dom(HTMLParser):
    """Rows ``tr[data-pod]`` and ``tr[data-prefix]`` with their ``td[data-field]`` values, overall
    cards, chart shapes, texts, line styles and coincidence notes, table headers."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.prefixes: dict[str, dict[str, str]] = {}
        self.policies: dict[str, dict[str, str]] = {}  # the what-if table's rows
        self.overall: dict[str, str] = {}
        self.fields: dict[str, str] = {}
        self.body: dict[str, str] = {}
        self.shapes: dict[str, dict[str, int]] = {}
        self.texts: dict[str, list[str]] = {}
        self.lines: dict[str, list[tuple[str, str, str]]] = {}  # svg -> (series, dasharray, width)
        self.coincide: dict[str, str] = {}
        self.headers: list[str] = []
        self._row: dict[str, str] | None = None
        self._svg: str | None = None
        self._in_overall = False
        self._in_th = False
        self._in_svg_text = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "data-field" in a and tag != "td":
            self.fields[a["data-field"]] = a.get("data-value", "")
        if tag == "body":
            self.body = a
        elif tag == "tr" and "data-pod" in a:
            self._row = self.rows.setdefault(a["data-pod"], {})
        elif tag == "tr" and "data-prefix" in a:
            self._row = self.prefixes.setdefault(a["data-prefix"], {})
        elif tag == "tr" and "data-policy" in a:
            self._row = self.policies.setdefault(a["data-policy"], {})
        elif tag == "th":
            self._in_th = True
            self.headers.append("")
        elif tag == "td" and self._row is not None and "data-field" in a:
            self._row[a["data-field"]] = a.get("data-value", "")
        elif tag == "div" and a.get("id") == "overall":
            self._in_overall = True
        elif tag == "section":
            self._in_overall = False
        elif self._in_overall and "data-field" in a:
            self.overall[a["data-field"]] = a.get("data-value", "")
        elif tag == "svg" and a.get("id"):
            self._svg = a["id"]
            self.shapes[self._svg] = {}
            self.texts[self._svg] = []
            self.lines[self._svg] = []
        elif self._svg is not None:
            self.shapes[self._svg][tag] = self.shapes[self._svg].get(tag, 0) + 1
            if tag == "text":
                self._in_svg_text = True
                self.texts[self._svg].append("")
                if "data-coincide" in a:
                    self.coincide[self._svg] = a["data-coincide"]
            elif tag == "path":
                self.lines[self._svg].append((a.get("data-series", ""), a.get("stroke-dasharray", ""), a.get("stroke-width", "")))

    def handle_data(self, data: str) -> None:
        if self._in_th:
            self.headers[-1] += data
        if self._in_svg_text and self._svg is not None:
            self.texts[self._svg][-1] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = None
        elif tag == "th":
            self._in_th = False
        elif tag == "text":
            self._in_svg_text = False
        elif tag == "svg":
            self._svg = None


def request_body(r: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny"}
    body.update({"prompt": r["prompt"]} if "prompt" in r else {"messages": r["messages"]})
    return body


REQUESTS = 60  # of the capture's, in the order they were sent
BYPASS = ("T1", 1)  # a second router sends tenant T1's requests to 127.0.0.1:8001 and tells kvindex nothing
SAMPLE = 24  # the drift sample, smaller than the decisions recorded


async def feed(h: Any, engine: Any) -> tuple[dict[str, int], int]:
    """Publish the capture, posting the decisions of ``REQUESTS`` requests at the times they were
    sent, but for ``BYPASS``'s (its engine still caches them: unseen); two drift re-checks. Returns
    the last seq per pod, all applied, and the decisions posted."""
    captured = load_capture(CAPTURE / "events.jsonl")
    reqs = sorted(json.loads((CAPTURE / "meta.json").read_text())["requests"], key=lambda r: r["t_sent"])
    last: dict[str, int] = {}
    pos = posted = 0
    for r in reqs[:REQUESTS]:
        while pos < len(captured) and captured[pos].t < r["t_sent"]:
            await engine.publish(captured[pos].frames)
            last[captured[pos].frames[0].decode().split("@")[1]] = int.from_bytes(captured[pos].frames[1], "big")
            pos += 1
        if r is reqs[3]:
            await h.get("/v1/drift?recheck=1")  # a first point of drift history, caches still cold
        if (r["tenant"], r["i"] % 2) == BYPASS:
            continue
        for pod, seq in last.items():  # what the engines sent before the request, applied before its decision
            await h.wait_seq(pod, seq)
        # the router scores each request first (so every decision is shadowed: the what-if table)
        status, _ = await h.post("/v1/score", {**request_body(r), "token_ids": r["prompt_token_ids"],
                                               "pods": ["127.0.0.1:8000", "127.0.0.1:8001"]})
        assert status == 200
        status, _ = await h.post("/v1/decisions", {"pod": f"127.0.0.1:800{r['i'] % 2}", "request": request_body(r),
                                                   "token_ids": r["prompt_token_ids"], "cached_tokens": r["cached_tokens"],
                                                   "prompt_tokens": r["prompt_tokens"]})
        assert status == 200
        posted += 1
    for c in captured[pos:]:
        await engine.publish(c.frames)
        last[c.frames[0].decode().split("@")[1]] = int.from_bytes(c.frames[1], "big")
    for pod, seq in last.items():
        await h.wait_seq(pod, seq)
    await h.get("/v1/drift?recheck=1")
    return last, posted


def nice_max(v: float) -> float:
    """The page's axis maximum for data up to ``v`` (niceMax in dashboard.html)."""
    if v <= 0:
        return 4
    step = v / 4
    p = 10 ** math.floor(math.log10(step))
    f = step / p
    return 4 * max(1, (1 if f <= 1 else 2 if f <= 2 else 5 if f <= 5 else 10) * p)


def short(n: float) -> str:
    return f"{n / 1000:.0f}k" if n >= 10000 else f"{n / 1000:.1f}k" if n >= 1000 else f"{round(n * 100) / 100:g}"


def coinciding(series: dict[str, list[tuple[float, Any]]]) -> str:
    """What the page must say of lines that lie on each other (the groups of equal non-null series)."""
    names, groups, done = list(series), [], set()
    for i, a in enumerate(names):
        if a in done:
            continue
        va = [p for p in series[a] if p[1] is not None]
        group = [a] + [b for b in names[i + 1:] if b not in done and va and va == [p for p in series[b] if p[1] is not None]]
        done.update(group)
        if len(group) > 1:
            groups.append("=".join(group))
    return ";".join(groups)


def check_page(dom: Dom, pods: dict[str, Any], drift: dict[str, Any], history: dict[str, Any], last: dict[str, int],
               posted: int) -> None:
    """The rendered page shows exactly the API's figures."""
    assert int(dom.body.get("data-refreshes") or 0) >= 1, "the page never rendered the API's data"
    assert set(dom.rows) == {v["pod"] for v in pods["pods"]} == {"127.0.0.1:8000", "127.0.0.1:8001"}
    for view in pods["pods"]:
        row, d = dom.rows[view["pod"]], drift["pods"][view["pod"]]
        assert int(row["blocks"]) == view["blocks"]["gpu"] > 0, (row, view)
        assert int(row["approx_entries"]) == view["approx_entries"] > 0
        assert int(row["last_seq"]) == view["last_seq"] == last[view["pod"]]
        assert row["connected"] == "true" and row["endpoint"] == view["endpoint"]
        assert int(row["stale"]) == d["stale"] and int(row["unseen"]) == d["unseen"] and int(row["sampled"]) == d["sampled"]
        for k in ("approx_hit_rate", "precise_hit_rate", "actual_hit_rate"):
            assert float(row[k]) == pytest.approx(d[k]), k
    o = drift["overall"]
    # "Decisions (last 300 s)" counts every decision recorded, not the sample's SAMPLE
    assert int(dom.overall["decisions"]) == o["recorded"] == posted > SAMPLE
    assert int(dom.fields["decisions_sampled"]) == o["decisions"] == SAMPLE
    assert int(dom.overall["stale"]) == o["stale"]
    # the requests routed past the router leave prefixes the engines hold and the router never recorded there
    assert int(dom.overall["unseen"]) == o["unseen"] > 0, o
    # engine blocks and router entries: different units, so each on its own chart and axis, units named
    held = [v["blocks"]["gpu"] for v in pods["pods"]]
    believed = [v["approx_entries"] for v in pods["pods"]]
    assert dom.shapes["chart-holdings"].get("rect", 0) == 2 and dom.shapes["chart-believed"].get("rect", 0) == 2
    for chart, values in (("chart-holdings", held), ("chart-believed", believed)):
        assert {short(v) for v in values} <= set(dom.texts[chart]), (chart, dom.texts[chart])
        assert short(nice_max(max(values))) in dom.texts[chart], (chart, dom.texts[chart])  # its own axis
    assert any("16-token" in h for h in dom.headers) and any("64-byte" in h for h in dom.headers), dom.headers
    assert dom.shapes["chart-hits"].get("rect", 0) == 6  # approx, precise, actual per pod
    for chart in ("chart-stale", "chart-unseen", "chart-blocks", "chart-believed-time", "chart-hitrate"):
        assert dom.shapes[chart].get("path", 0) >= 1, (chart, dom.shapes[chart])
        styles = [(dash, width) for _, dash, width in dom.lines[chart]]
        assert len(set(styles)) == len(styles), (chart, styles)  # no two lines drawn alike
    # lines that lie on each other are named under their chart, exactly those
    points = history["points"]
    names = sorted({p for s in points for p in s["pods"]})
    for chart, key in (("chart-stale", "stale"), ("chart-unseen", "unseen"), ("chart-blocks", "blocks"),
                       ("chart-believed-time", "approx_entries")):
        series = {n: [(s["t"], s["pods"][n][key] if n in s["pods"] else None) for s in points] for n in names}
        assert dom.coincide.get(chart, "") == coinciding(series), (chart, dom.coincide)
    def weighted(key: str) -> list[tuple[float, Any]]:  # the page's all-pods hit rate
        out: list[tuple[float, Any]] = []
        for s in points:
            n, total = 0, 0.0
            for v in s["pods"].values():
                if v[key] is not None and v["decisions"]:
                    n += v["decisions"]
                    total += v[key] * v["decisions"]
            out.append((s["t"], total / n if n else None))
        return out
    hits = {"actual": weighted("actual_hit_rate"), "predicted · precise": weighted("precise_hit_rate"),
            "predicted · approx": weighted("approx_hit_rate")}
    # cold caches at the first re-check, then kvindex's precise prediction equals the engines' actual
    assert dom.coincide.get("chart-hitrate") == coinciding(hits) == "actual=predicted · precise", dom.coincide


def check_pod_view(dom: Dom, pod: str, view: dict[str, Any], drift: dict[str, Any], held_blocks: int) -> None:
    """The picked pod's prefixes, as /v1/drift/pods/{pod} says, with the prompts' first characters."""
    assert dom.fields["detail_pod"] == pod
    prefixes = view["prefixes"]
    assert prefixes and list(dom.prefixes) == [g["prefix"] for g in prefixes]
    for g in prefixes:
        row = dom.prefixes[g["prefix"]]
        assert row["label"] == g["label"] and int(row["tokens_held"]) == g["tokens_held"] <= held_blocks * 16
        assert int(row["requests"]) == g["requests"] and int(row["routed_here"]) == g["routed_here"]
        assert float(row["held"]) == pytest.approx(g["held"]) and float(row["believed"]) == pytest.approx(g["believed"])
        unseen = g["held"] - g["believed"] >= drift["threshold"]
        assert (row["status"] == "unseen") == unseen
    assert any(g["tokens_held"] > 0 and g["label"] for g in prefixes)
    assert any(g["routed_here"] > 0 for g in prefixes)


async def test_dashboard_shows_the_pods_and_the_api_figures(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    chromium()  # fail first and clearly when the browser is missing
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),),
                                  drift=DriftSettings(recheck_seconds=3600, sample_size=SAMPLE)))
    await h.wait_connected()
    last, posted = await feed(h, engine)

    status, page = await h.get("/")
    assert status == 200 and b"<svg" in page
    assert b"<script src" not in page and b"<link" not in page and b"https://" not in page  # offline: nothing fetched
    _, pods = await h.get("/v1/pods")
    _, drift = await h.get("/v1/drift")
    _, history = await h.get("/v1/drift/history")
    assert len(history["points"]) == 2 and pods["pods"]

    _, whatif = await h.get("/v1/whatif?window=300")
    assert whatif["decisions"] > 0 and whatif["actual"]["decided_by"] == {"router": whatif["decisions"]}

    dom = Dom()
    dom.feed(await run_chromium(h.url + "/", "--dump-dom"))
    check_page(dom, pods, drift, history, last, posted)
    assert set(dom.policies) == {"actual (realized)", *whatif["policies"]}
    for policy, row in whatif["policies"].items():  # the what-if table shows the API's figures
        assert int(dom.policies[policy]["decisions"]) == row["decisions"] == whatif["decisions"]
        assert math.isclose(float(dom.policies[policy]["hit_rate"]), row["predicted_hit_rate"])

    pod = "127.0.0.1:8001"  # the pod the bypassed requests went to
    status, view = await h.get(f"/v1/drift/pods/{pod}")
    assert status == 200 and view["pod"] == pod
    dom = Dom()
    dom.feed(await run_chromium(h.url + f"/#pod={pod}", "--dump-dom"))
    assert dom.rows[pod].get("pod") == pod
    check_pod_view(dom, pod, view, drift, next(v["blocks"]["gpu"] for v in pods["pods"] if v["pod"] == pod))

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    await run_chromium(h.url + f"/#pod={pod}", f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
