"""A lane's connection as its log tells it: subscribing, connected, and silence warned about.

Invariants:
- At start the lane logs that it is *subscribing to* (or binding) the endpoint: ZeroMQ connects
  lazily, so nothing is connected yet. "connected" is logged only on the socket monitor's connect
  (or accept) event, "disconnected" when the last peer goes (libzmq re-dials by itself).
- ``warn_if_silent`` (one owned task per lane, cancelled with it) warns once when the engine has
  not connected within ``silent_seconds`` of the start, and once when it is connected but has
  published nothing by then; each warning names the endpoint and what to check. A later connect
  or first message is logged at info, so the log never keeps saying a stale thing.
- Each peer count goes to ``LaneState.connected_peers`` (what /v1/pods, /readyz and
  ``kvindex_engine_connected`` read).
"""

from __future__ import annotations

import asyncio
import logging

from kvindex.config import EngineConfig
from kvindex.ingest.streams import LaneState

log = logging.getLogger("kvindex.ingest.lane")  # every line about a lane under the lane's name
SILENT_SECONDS = 10.0  # an engine not connected, or silent, this long after the start is warned about


class ConnectionWatch:
    def __init__(self, engine: EngineConfig, state: LaneState, silent_seconds: float = SILENT_SECONDS) -> None:
        self.engine = engine
        self.state = state
        self.silent_seconds = silent_seconds
        self.ever_connected = False
        self._warned = False

    def starting(self) -> None:
        e = self.engine
        log.info("engine %s: %s %s (dialect %s, replay %s); waiting for it to connect", e.name,
                 "binding" if e.bind else "subscribing to", e.endpoint, e.dialect, e.replay or "none")

    def peers(self, n: int) -> None:
        """The socket monitor's peer count changed to ``n``."""
        before, self.state.connected_peers = self.state.connected_peers, n
        e = self.engine
        if n and not before:
            self.ever_connected = True
            log.log(logging.WARNING if self._warned else logging.INFO, "engine %s: connected %s %s", e.name,
                    "(a publisher dialled) on" if e.bind else "to", e.endpoint)
        elif before and not n:
            log.warning("engine %s: disconnected from %s (ZeroMQ reconnects by itself)", e.name, e.endpoint)

    async def warn_if_silent(self) -> None:
        """Once, ``silent_seconds`` after the start: not connected, or connected and nothing published."""
        await asyncio.sleep(self.silent_seconds)
        e = self.engine
        if not self.ever_connected:
            self._warned = True
            log.warning("engine %s: not connected to %s after %g s: is the engine running, and is this its "
                        "KV-event publisher (vLLM: --kv-events-config endpoint)? Host and port reachable from here?",
                        e.name, e.endpoint, self.silent_seconds)
        elif self.state.frames == 0:
            self._warned = True
            log.warning("engine %s: connected to %s but nothing published in %g s: are KV events enabled "
                        "(vLLM: --kv-events-config with enable_kv_cache_events true) and prefix caching on?",
                        e.name, e.endpoint, self.silent_seconds)
