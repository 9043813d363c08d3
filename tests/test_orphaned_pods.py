"""A pod no engine publishes for any more is never synced (issue 37, item 6): the engine removed
from the configuration, and kvindex restarted on its state dir with the pod's blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvindex.config import Config
from tests.conftest import engine_config, ipc_endpoint
from tests.test_http import POD, publish_capture


async def test_a_pod_without_an_engine_after_a_restart_is_unsynced(make_harness: Any, make_engine: Any,
                                                                     tmp_path: Path) -> None:
    state = tmp_path / "state"
    engine = await make_engine(ipc_endpoint(tmp_path, "pub"), replay_endpoint=ipc_endpoint(tmp_path, "replay"))
    h = await make_harness(Config(engines=(engine_config(engine),), state_dir=state))
    await h.wait_connected()
    await publish_capture(h, engine, POD)
    status, before = await h.get(f"/v1/pods/{POD}")
    assert status == 200 and before["synced"] and before["blocks"]["gpu"] > 0, before
    await h.daemon.stop()  # writes the snapshot
    again = await make_harness(Config(state_dir=state))  # the engine is no longer configured
    status, after = await again.get(f"/v1/pods/{POD}")
    assert status == 200 and after["blocks"] == before["blocks"], after  # its state is kept, as it was
    assert after["synced"] is False and "no configured or registered engine" in after["unsynced_reason"], after
    status, text = await again.get("/metrics")
    assert f'kvindex_pod_synced{{pod="{POD}"}} 0.0' in text.decode()
