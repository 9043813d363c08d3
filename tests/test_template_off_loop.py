"""A slow chat template costs only its own request: a real ``kvindex serve`` keeps answering.

A trusted request template (``trust_request_chat_template``) that loops ``x.find`` over an 8 MiB
string renders for its whole 10 s bound (``adapters.template_budget``); meanwhile ``/healthz``
and another chat of the same model are answered at once, and the slow one still ends in its
one-line 400 at the bound.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from adapters.template_budget import MAX_RENDER_SECONDS
from tests.conftest import FIXTURES
from tests.faultkit import KVINDEX, free_port, wait_http

HI = [{"role": "user", "content": "hi"}]
SLOW = ('{% set x = "a" * 8000000 %}{% for i in range(99999) %}{% for j in range(99) %}'
        '{{ x.find("b") and "" }}{% endfor %}{% endfor %}')  # one 8 MiB scan per step, for 10 s


def post(url: str, body: Any, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def timed_get(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        r.read()
    return time.perf_counter() - t0


def test_a_slow_template_does_not_hold_the_event_loop(tmp_path: Path) -> None:
    config = tmp_path / "kvindex.toml"
    config.write_text(f'[models."tiny"]\ntokenizer = "hf"\ntokenizer_path = "{FIXTURES / "tiny-model"}"\n'
                      "trust_request_chat_template = true\n")
    port = free_port()
    p = subprocess.Popen(KVINDEX + ["serve", "--port", str(port), "--config", str(config)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        assert post(base + "/v1/score", {"model": "tiny", "messages": HI})[0] == 200  # warm: the tokenizer loaded
        slow: dict[str, Any] = {}

        def send_slow() -> None:
            t0 = time.perf_counter()
            slow["answer"] = post(base + "/v1/score", {"model": "tiny", "messages": HI, "chat_template": SLOW})
            slow["seconds"] = time.perf_counter() - t0

        sender = threading.Thread(target=send_slow)
        sender.start()
        time.sleep(0.5)  # the render is under way
        latencies = []
        while sender.is_alive() and len(latencies) < 100:
            latencies.append(timed_get(base + "/healthz"))
            time.sleep(0.02)
        t0 = time.perf_counter()
        other = post(base + "/v1/score", {"model": "tiny", "messages": HI, "chat_template": "{{ 'hi' }}"})
        other_seconds = time.perf_counter() - t0
        rendering = sender.is_alive()
        sender.join(timeout=60)
        worst = max(latencies)
        print(f"/healthz while a slow template renders: {len(latencies)} probes, worst {worst * 1000:.1f} ms, "
              f"median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms; another chat {other_seconds * 1000:.1f} "
              f"ms; the slow one answered {slow['answer'][0]} after {slow['seconds']:.1f} s")
        assert worst < 0.1, f"/healthz took {worst:.2f} s while the template rendered"
        assert rendering and len(latencies) >= 20, "the slow template ended before the probes did: it proves nothing"
        assert other[0] == 200 and other[1]["prompt_tokens"] == 1 and other_seconds < 0.5, (other, other_seconds)
        status, answer = slow["answer"]
        assert status == 400 and f"{MAX_RENDER_SECONDS:g} s" in answer["error"], answer
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
