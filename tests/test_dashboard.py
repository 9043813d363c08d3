"""The dashboard at ``GET /`` in a real headless browser (Debian's ``chromium``) against a live
daemon fed by a recorded vLLM capture and routing decisions. The page must show the pods and the
figures the API returns; a screenshot is kept in tests/artifacts/dashboard.png.

Without chromium the test is skipped saying why (the apt-get line); in CI (``$CI`` set, as .ci/run
does) it fails: CI installs it (tests/programs.py)."""

from __future__ import annotations

import asyncio
import json
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
    """Rows ``tr[data-pod]`` with their ``td[data-field]`` values, overall cards, chart shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.overall: dict[str, str] = {}
        self.body: dict[str, str] = {}
        self.shapes: dict[str, dict[str, int]] = {}
        self._pod: str | None = None
        self._svg: str | None = None
        self._in_overall = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        elif tag == "tr" and "data-pod" in a:
            self._pod = a["data-pod"]
            self.rows[self._pod] = {}
        elif tag == "td" and self._pod is not None and "data-field" in a:
            self.rows[self._pod][a["data-field"]] = a.get("data-value", "")
        elif tag == "div" and a.get("id") == "overall":
            self._in_overall = True
        elif tag == "section":
            self._in_overall = False
        elif self._in_overall and "data-field" in a:
            self.overall[a["data-field"]] = a.get("data-value", "")
        elif tag == "svg" and a.get("id"):
            self._svg = a["id"]
            self.shapes[self._svg] = {}
        elif self._svg is not None:
            self.shapes[self._svg][tag] = self.shapes[self._svg].get(tag, 0) + 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._pod = None
        elif tag == "svg":
            self._svg = None


def request_body(r: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny"}
    body.update({"prompt": r["prompt"]} if "prompt" in r else {"messages": r["messages"]})
    return body


async def feed(h: Any, engine: Any) -> dict[str, int]:
    """Publish the capture, posting 40 decisions at the times they were sent; two drift re-checks.
    Returns the last seq per pod, all applied."""
    captured = load_capture(CAPTURE / "events.jsonl")
    reqs = sorted(json.loads((CAPTURE / "meta.json").read_text())["requests"], key=lambda r: r["t_sent"])
    last: dict[str, int] = {}
    pos = 0
    for r in reqs[:40]:
        while pos < len(captured) and captured[pos].t < r["t_sent"]:
            await engine.publish(captured[pos].frames)
            last[captured[pos].frames[0].decode().split("@")[1]] = int.from_bytes(captured[pos].frames[1], "big")
            pos += 1
        status, _ = await h.post("/v1/decisions", {"pod": f"127.0.0.1:800{r['i'] % 2}", "request": request_body(r),
                                                   "token_ids": r["prompt_token_ids"], "cached_tokens": r["cached_tokens"],
                                                   "prompt_tokens": r["prompt_tokens"]})
        assert status == 200
        if r is reqs[20]:
            await h.get("/v1/drift?recheck=1")  # a first point of drift history
    for c in captured[pos:]:
        await engine.publish(c.frames)
        last[c.frames[0].decode().split("@")[1]] = int.from_bytes(c.frames[1], "big")
    for pod, seq in last.items():
        await h.wait_seq(pod, seq)
    await h.get("/v1/drift?recheck=1")
    return last


def check_page(dom: Dom, pods: dict[str, Any], drift: dict[str, Any], last: dict[str, int]) -> None:
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
    assert int(dom.overall["pods"]) == 2 and int(dom.overall["decisions"]) == drift["overall"]["decisions"] == 40
    assert int(dom.overall["stale"]) == drift["overall"]["stale"]
    assert dom.shapes["chart-holdings"].get("rect", 0) == 4  # two bars per pod
    assert dom.shapes["chart-hits"].get("rect", 0) == 6  # approx, precise, actual per pod
    for chart in ("chart-stale", "chart-unseen", "chart-blocks", "chart-hitrate"):
        assert dom.shapes[chart].get("path", 0) >= 1, (chart, dom.shapes[chart])


async def test_dashboard_shows_the_pods_and_the_api_figures(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    chromium()  # fail first and clearly when the browser is missing
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),), drift=DriftSettings(recheck_seconds=3600)))
    await h.wait_connected()
    last = await feed(h, engine)

    status, page = await h.get("/")
    assert status == 200 and b"<svg" in page
    assert b"<script src" not in page and b"<link" not in page and b"https://" not in page  # offline: nothing fetched
    _, pods = await h.get("/v1/pods")
    _, drift = await h.get("/v1/drift")
    _, history = await h.get("/v1/drift/history")
    assert len(history["points"]) == 2 and pods["pods"]

    dom = Dom()
    dom.feed(await run_chromium(h.url + "/", "--dump-dom"))
    check_page(dom, pods, drift, last)

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    await run_chromium(h.url + "/", f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
