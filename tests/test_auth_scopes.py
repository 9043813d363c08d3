"""What the bearer token guards (``--auth writes|all``), checked on every route of the real app.

The routes are enumerated from the app's own router, so a route added later fails here until it
is classified below (and then it is checked under every setting). Expected scopes are written
out here, not read from kvindex: OPEN (health checks, the static dashboard page), WRITE (every
mutation and the bulk exports), READ (everything else)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from yarl import URL

from kvindex.config import Config
from kvindex.tools.capture import load_capture
from tests.conftest import FIXTURES, engine_config, ipc_endpoint

TOKEN = "s3cret"
POD = "127.0.0.1:8000"

OPEN_ROUTES = {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/health"), ("GET", "/")}
WRITE_ROUTES = {("DELETE", "/v1/pods/{pod}"), ("POST", "/v1/pods/{pod}/resync"), ("POST", "/register"),
                ("POST", "/unregister"), ("POST", "/v1/decisions"), ("GET", "/v1/state"), ("GET", "/dump")}
READ_ROUTES = {("GET", "/metrics"), ("GET", "/v1/pods"), ("GET", "/v1/pods/{pod}"), ("POST", "/v1/score"),
               ("POST", "/v1/approx/explain"), ("GET", "/v1/drift"), ("GET", "/v1/decisions"), ("GET", "/v1/whatif"), ("GET", "/v1/drift/history"),
               ("GET", "/v1/drift/pods/{pod}"), ("GET", "/workers"), ("POST", "/query"), ("POST", "/query_by_hash"),
               ("POST", "/query_tiered_by_hash"), ("GET", "/v1/models")}


def app_routes(h: Any) -> set[tuple[str, str]]:
    """(method, path) of every route the running app serves (HEAD folded into GET)."""
    out = set()
    for route in h.daemon.app.router.routes():
        method = "GET" if route.method == "HEAD" else route.method
        out.add((method, route.resource.canonical))
    return out


async def status_of(h: Any, method: str, path: str, headers: dict[str, str]) -> int:
    url = URL(h.url + path.replace("{pod}", "x"), encoded=True)
    kw: dict[str, Any] = {"json": {}} if method == "POST" else {}
    async with h.session.request(method, url, headers=headers, **kw) as r:
        await r.read()
        return r.status


@pytest.mark.parametrize("auth,token", [("writes", TOKEN), ("all", TOKEN), ("writes", None)])
async def test_every_route_is_guarded_as_its_scope_says(make_harness: Any, auth: str, token: str | None) -> None:
    h = await make_harness(Config(auth=auth), token=token)
    routes = app_routes(h)
    assert routes == OPEN_ROUTES | WRITE_ROUTES | READ_ROUTES, "a route is missing or not classified here"
    for method, path in sorted(routes):
        if token is None or (method, path) in OPEN_ROUTES:
            guarded = False
        else:
            guarded = (method, path) in WRITE_ROUTES or auth == "all"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            status = await status_of(h, method, path, headers)
            assert (status == 401) == guarded, (auth, method, path, headers, status)
        status = await status_of(h, method, path, {"Authorization": f"Bearer {TOKEN}"})
        assert status != 401, (auth, method, path, status)


async def test_auth_all_hides_a_salted_tenants_hashes_and_keeps_health_open(make_harness: Any, make_engine: Any,
                                                                            tmp_path: Path) -> None:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),), auth="all"), token=TOKEN)
    await h.wait_connected()
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    for c in captured:
        await engine.publish(c.frames)
    await h.wait_seq(POD, int.from_bytes(captured[-1].frames[1], "big"))
    ok = {"Authorization": f"Bearer {TOKEN}"}
    async with h.session.get(h.url + "/dump") as r:
        assert r.status == 401 and json.loads(await r.read())["field"] == "Authorization"
    async with h.session.get(h.url + "/dump", headers=ok) as r:
        assert r.status == 200 and len(await r.read()) > 1000  # the token holder sees every block
    for path in ("/healthz", "/health", "/"):
        async with h.session.get(h.url + path) as r:
            assert r.status == 200, path
    async with h.session.get(h.url + "/readyz") as r:
        assert r.status in (200, 503)
    async with h.session.get(h.url + "/no/such/route") as r:  # not a route: 404, the token or not
        assert r.status == 404


def body(r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "tiny"}
    out.update({"prompt": r["prompt"]} if "prompt" in r else {"messages": r["messages"]})
    return out


async def test_an_unauthenticated_score_cannot_change_what_a_decision_reports(make_harness: Any, make_engine: Any,
                                                                               tmp_path: Path) -> None:
    """A score remembers its prediction for the decision only when its caller may write decisions:
    an anonymous (or wrong-token) score before the engine held the prompt does not make the
    authenticated decision report the stale prediction and a large precise error."""
    meta = json.loads((FIXTURES / "small" / "meta.json").read_text())
    reqs = sorted(meta["requests"], key=lambda r: r["t_sent"])
    captured = load_capture(FIXTURES / "small" / "events.jsonl")
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),)), token=TOKEN)
    await h.wait_connected()
    ok = {"Authorization": f"Bearer {TOKEN}"}
    # the attacker scores every prompt before the engine publishes anything (nothing held: 0 blocks)
    for i, r in enumerate(reqs):
        headers = ok if i % 3 == 0 else {} if i % 3 == 1 else {"Authorization": "Bearer wrong"}
        status, s = await h.post("/v1/score", {**body(r), "token_ids": r["prompt_token_ids"], "pods": [POD]},
                                 headers=headers)
        assert status == 200 and s["pods"][POD]["precise"]["blocks"] == 0
    for c in captured:
        await engine.publish(c.frames)
    await h.wait_seq(POD, int.from_bytes(captured[-1].frames[1], "big"))
    remembered = fresh = 0
    for i, r in enumerate(reqs):
        status, d = await h.post("/v1/decisions", {"pod": POD, "request": body(r), "token_ids": r["prompt_token_ids"],
                                                   "cached_tokens": r["cached_tokens"]}, headers=ok)
        assert status == 200, d
        if i % 3 == 0:  # the token holder's own score is the prediction the decision is judged by
            assert d["precise_from"] == "score"
            remembered += 1
        else:
            assert d["precise_from"] == "decision", (i, d)
            fresh += 1
    assert remembered and fresh


async def test_a_caller_without_the_token_is_refused_before_its_body_is_read(make_harness: Any) -> None:
    """A guarded route answers 401 as soon as the headers say who is calling: the server never
    buffers (up to 8 MiB, for up to body_timeout) the body of a caller it is going to refuse."""
    h = await make_harness(Config(auth="all", body_timeout=20.0), token=TOKEN)
    port = int(h.url.rsplit(":", 1)[1])
    for path in ("/register", "/query"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {4 << 20}\r\n\r\n{{".encode())  # 4 MiB announced, 1 byte sent
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), 5)  # before: 408 after body_timeout
            assert status_line.split()[1] == b"401", status_line
        finally:
            writer.close()
