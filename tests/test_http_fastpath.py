"""The HTTP fast path (kvindex.http.fastpath) against the aiohttp path it stands in front of.

Two real daemons fed by the same engine over ZeroMQ (the same index state), one with the fast
path and one with ``http_fast_path = false``. The same bytes go to both over raw TCP: good
queries, malformed and refused ones, oversize bodies, bodies and heads split across writes,
pipelined requests, keep-alive and ``Connection: close``, other routes on the same connection.
Each answer must be the same: status, body bytes, and the headers a client relies on
(Content-Type, Content-Length, Connection), and afterwards the connection open or closed alike;
the rejection and query metrics must agree. The fast path must have answered the good queries
itself (``kvindex_http_fast_path_answers``), or the comparison would prove nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgpack

from kvindex.config import Config
from kvindex.keys import local_hashes
from kvindex.http.fastpath import FastRoute, read_head
from tests.conftest import engine_config, ipc_endpoint, wait_for
from tests.test_http import meta_requests, publish_capture

POD = "127.0.0.1:8000"
BS = 32
MAX_BODY = 1 << 16
Step = tuple[str, Any]  # ("send", bytes) | ("read", n) | ("pause", None)


def request(path: str, body: bytes = b"", *, method: str = "POST", version: str = "HTTP/1.1",
            headers: dict[str, str] | None = None) -> bytes:
    hs = {"Host": "kvindex", "Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in hs.items() if v is not None)
    return f"{method} {path} {version}\r\n{lines}\r\n".encode() + body


def bodies() -> tuple[list[bytes], list[bytes]]:
    """/query and /query_by_hash bodies of the capture's prompts (the ones the engine cached first)."""
    reqs = [r for r in meta_requests() if r["cached_tokens"]][:3] + meta_requests()[:1]
    q = [json.dumps({"model_name": "tiny", "token_ids": r["prompt_token_ids"]}).encode() for r in reqs]
    hashed = [json.dumps({"model_name": "tiny", "block_hashes": [h - (1 << 64) if h >= 1 << 63 else h for h in
                                                                 local_hashes(r["prompt_token_ids"], BS)]}).encode()
              for r in reqs]
    return q, hashed


def scenarios() -> dict[str, list[Step]]:
    q, hb = bodies()
    good, by_hash = request("/query", q[0]), request("/query_by_hash", hb[0])
    bad_json = request("/query", b'{"model_name": "tiny", "token_ids": [1, 2,')
    health = b"GET /healthz HTTP/1.1\r\nHost: kvindex\r\n\r\n"
    big = json.dumps({"model_name": "tiny", "token_ids": list(range(MAX_BODY // 5))}).encode()
    chunked = (b"POST /query HTTP/1.1\r\nHost: kvindex\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(q[1]), q[1]))
    split = request("/query", q[2])
    return {
        "keep-alive": [("send", good), ("read", 1), ("send", request("/query", q[1])), ("read", 1),
                       ("send", by_hash), ("read", 1), ("send", request("/query_by_hash", hb[1])), ("read", 1)],
        "pipelined": [("send", good + by_hash + request("/query", q[3]) + bad_json + health + good), ("read", 6)],
        "pipelined, other routes between": [("send", health + good + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" + by_hash),
                                            ("read", 4)],
        "other routes first": [("send", health), ("read", 1), ("send", good), ("read", 1)],
        "split body": [("send", split[:len(split) - len(q[2]) + 7]), ("pause", None), ("send", split[-len(q[2]) + 7:-50]),
                       ("pause", None), ("send", split[-50:]), ("read", 1), ("send", good), ("read", 1)],
        "split head": [("send", good[:20]), ("pause", None), ("send", good[20:40]), ("pause", None), ("send", good[40:]),
                       ("read", 1)],
        "split, then pipelined": [("send", good + by_hash[:30]), ("pause", None), ("send", by_hash[30:] + good), ("read", 3)],
        "connection close": [("send", request("/query", q[1], headers={"Connection": "close"})), ("read", 1)],
        "close, pipelined after": [("send", request("/query", q[1], headers={"Connection": "close"}) + good), ("read", 1)],
        "keep-alive said": [("send", request("/query_by_hash", hb[2], headers={"Connection": "keep-alive"})), ("read", 1)],
        "other headers": [("send", request("/query", q[0], headers={"X-Request-Id": "abc", "Accept": "*/*",
                                                                   "User-Agent": "t"})), ("read", 1)],
        "lowercase names": [("send", good.replace(b"Content-Type", b"content-type").replace(b"Host", b"host")), ("read", 1)],
        "malformed json": [("send", bad_json), ("read", 1), ("send", good), ("read", 1)],
        "not an object": [("send", request("/query", b"[1, 2]")), ("read", 1)],
        "empty body": [("send", request("/query", b"")), ("read", 1)],
        "missing model": [("send", request("/query", b'{"token_ids": [1, 2, 3]}')), ("read", 1)],
        "bad token": [("send", request("/query", b'{"model_name": "tiny", "token_ids": [1, -2]}')), ("read", 1)],
        "unknown model": [("send", request("/query", b'{"model_name": "nope", "token_ids": [1, 2]}')), ("read", 1)],
        "bad hashes": [("send", request("/query_by_hash", b'{"model_name": "tiny", "block_hashes": ["a"]}')), ("read", 1)],
        "salted hashes": [("send", request("/query_by_hash", b'{"model_name": "tiny", "block_hashes": [1], "cache_salt": "s"}')),
                          ("read", 1)],
        "oversize": [("send", request("/query", big)), ("read", 1)],
        "oversize declared": [("send", request("/query", b"{}", headers={"Content-Length": str(MAX_BODY + 1)})), ("read", 1)],
        "query string": [("send", request("/query?x=1", q[0])), ("read", 1)],
        "GET": [("send", request("/query", method="GET")), ("read", 1)],
        "HEAD": [("send", request("/query", method="HEAD")), ("read", 1)],
        "HTTP/1.0": [("send", request("/query", q[0], version="HTTP/1.0")), ("read", 1)],
        "chunked": [("send", chunked), ("read", 1)],
        "expect": [("send", request("/query", q[0], headers={"Expect": "100-continue"})), ("read", 2)],
        "msgpack": [("send", request("/query", msgpack.packb({"model_name": "tiny", "token_ids": [1, 2, 3]}),
                                     headers={"Content-Type": "application/msgpack"})), ("read", 1)],
        "charset": [("send", request("/query", q[0], headers={"Content-Type": "application/json; charset=utf-8"})),
                    ("read", 1)],
        "no host": [("send", request("/query", q[0], headers={"Host": None})), ("read", 1)],
        "two lengths": [("send", good.replace(b"Host: kvindex", b"Host: kvindex\r\nContent-Length: 3")), ("read", 1)],
        "mooncake": [("send", request("/query", b'{"modelname": "tiny", "tokens": [1, 2, 3]}')), ("read", 1)],
    }


async def read_response(reader: asyncio.StreamReader, head_only: bool) -> dict[str, Any]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    status = int(status_line.split()[1])
    length = int(headers.get("content-length", 0)) if not head_only and status >= 200 else 0
    body = await asyncio.wait_for(reader.readexactly(length), 10) if length else b""
    return {"status": status, "version": status_line.split()[0], "body": body,
            **{k: headers.get(k) for k in ("content-type", "content-length", "connection")}}


async def exchange(port: int, steps: list[Step], head_only: bool) -> list[Any]:
    """What the server answered to ``steps``; then whether the connection is still open (a
    ``/healthz`` with ``Connection: close`` answered) or was closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out: list[Any] = []
    for kind, arg in steps:
        if kind == "send":
            writer.write(arg)
            await writer.drain()
        elif kind == "pause":
            await asyncio.sleep(0.05)  # the next bytes arrive in another read
        else:
            for _ in range(arg):
                resp = await read_response(reader, head_only)
                out.append(resp)
                if resp["status"] == 100:
                    continue
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: kvindex\r\nConnection: close\r\n\r\n")
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 10)
    except ConnectionError:
        rest = b""
    out.append("open" if rest.startswith(b"HTTP/1.1 200") else "closed")
    writer.close()
    return out


def counted(h: Any) -> dict[str, float]:
    """The rejection counts and query observations the daemon's registry holds."""
    out = {}
    for fam in h.daemon.metrics.registry.collect():
        if fam.name in ("kvindex_http_rejections", "kvindex_query_duration_seconds"):
            for s in fam.samples:
                if s.name.endswith(("_total", "_count")):
                    out[s.name + repr(sorted(s.labels.items()))] = s.value
    return out


def fast_answers(h: Any) -> float:
    return sum(s.value for fam in h.daemon.metrics.registry.collect() if fam.name == "kvindex_http_fast_path_answers"
               for s in fam.samples if s.name.endswith("_total"))


async def two_daemons(make_harness: Any, make_engine: Any, tmp_path: Path, **extra: Any) -> tuple[Any, Any]:
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    cfg = {"engines": (engine_config(engine, pod=POD),), "max_body_bytes": MAX_BODY, **extra}
    fast = await make_harness(Config(**cfg))
    slow = await make_harness(Config(**cfg, http_fast_path=False))
    await fast.wait_connected()
    await publish_capture(fast, engine, POD)
    await slow.wait_seq(POD, fast.stream(POD).last_seq)
    return fast, slow


async def test_fast_path_answers_as_aiohttp_does(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    fast, slow = await two_daemons(make_harness, make_engine, tmp_path)
    for h in (fast, slow):
        status, doc = await h.post("/query", json.loads(bodies()[0][0]))
        assert status == 200 and doc["scores"].get(POD), doc  # a real answer: the comparison means something
    assert fast_answers(fast) == 1
    for name, steps in scenarios().items():
        got = await exchange(fast.daemon.port, steps, name == "HEAD")
        want = await exchange(slow.daemon.port, steps, name == "HEAD")
        assert got == want, name
    # answered here: the first post, keep-alive 4, pipelined 3, split 2 + 1 + 3, the close 1, keep-alive said,
    # other headers, lowercase names, an unknown model (an empty answer) 1 each; the rest went to aiohttp
    assert fast_answers(fast) == 19 and fast_answers(slow) == 0
    assert counted(fast) == counted(slow)


async def test_client_gone_mid_body_is_counted_alike(make_harness: Any, make_engine: Any, tmp_path: Path) -> None:
    fast, slow = await two_daemons(make_harness, make_engine, tmp_path)
    q, _ = bodies()
    cut = request("/query", q[0])[:-10]
    for h in (fast, slow):
        _, writer = await asyncio.open_connection("127.0.0.1", h.daemon.port)
        writer.write(cut)
        await writer.drain()
        await asyncio.sleep(0.05)  # the head is read (and aiohttp's handler waits for the body)
        writer.close()
        await wait_for(lambda h=h: any("body_incomplete" in k for k in counted(h)), 5, "the incomplete body counted")
    assert counted(fast) == counted(slow)
    assert fast_answers(fast) == 0


def test_read_head_answers_only_what_it_recognises_exactly() -> None:
    async def answer(svc: Any, raw: bytes, ctype: str, t0: float) -> Any:
        return None
    lines = {b"POST /query HTTP/1.1": FastRoute("/query", answer, None)}
    ok = b"POST /query HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    head = read_head(ok, lines, 100)
    assert head is not None and (head.size, head.length, head.close) == (len(ok) - 2, 2, False)
    assert read_head(ok.replace(b"Host: h", b"Host: h\r\nConnection: close"), lines, 100).close  # type: ignore[union-attr]
    for bad in (ok.replace(b"Length: 2", b"Length: 200"),  # over the cap
                ok.replace(b"Host: h\r\n", b""), ok.replace(b"Host: h", b"Host: h\r\nHost: i"),
                ok.replace(b"Host: h", b"Host: h\r\n folded"), ok.replace(b"Host: h", b"Host : h"),
                ok.replace(b"Host: h", b"Host: h\r\nExpect: 100-continue"),
                ok.replace(b"Host: h", b"Host: h\r\nTransfer-Encoding: chunked"),
                ok.replace(b"Host: h", b"Host: h\r\nContent-Encoding: gzip"),
                ok.replace(b"Host: h", b"Host: h\r\nConnection: upgrade"),
                ok.replace(b"Host: h", b"Host: \xff"), ok.replace(b"Length: 2", b"Length: +2"),
                ok.replace(b"json", b"json; charset=utf-8"), ok.replace(b"/query", b"/query?a"),
                ok.replace(b"POST", b"post"), ok.replace(b"HTTP/1.1", b"HTTP/1.0"), ok[:-6]):
        assert read_head(bad, lines, 100) is None, bad


async def test_a_route_that_needs_the_token_is_never_answered_here(make_harness: Any) -> None:
    body = request("/query", b'{"model_name": "tiny", "token_ids": [1, 2]}')
    for auth, status in (("all", 401), ("writes", 200)):  # /query is READ: the token only with auth = "all"
        h = await make_harness(Config(auth=auth), token="s3cret")
        got = await exchange(h.daemon.port, [("send", body), ("read", 1)], False)
        assert got[0]["status"] == status, got
        assert fast_answers(h) == (status == 200)


async def test_on_the_redis_store_answers_run_in_tasks_and_agree(make_harness: Any, make_engine: Any, tmp_path: Path,
                                                                 redis_url: str) -> None:
    """Two replicas on one Redis (the store's clients need a current task: no answer runs eagerly)."""
    fast, slow = await two_daemons(make_harness, make_engine, tmp_path, store=redis_url)
    steps = scenarios()
    for name in ("keep-alive", "pipelined", "split body", "malformed json", "connection close"):
        assert await exchange(fast.daemon.port, steps[name], False) == await exchange(slow.daemon.port, steps[name], False), name
    assert fast_answers(fast) == 4 + 3 + 2 + 1 and fast_answers(slow) == 0
    assert counted(fast) == counted(slow)
