"""A real ``redis-server`` process for tests (Debian's redis-server 7; .ci/run installs it).

``RedisServer(dir).start()`` runs one on a unix socket in ``dir`` (no TCP port to collide on) with
persistence off; ``.url`` is what ``kvindex serve --store`` takes. ``stop()`` kills it (SIGKILL by
default: a crash, not a clean shutdown) and ``start()`` again brings up a new, empty server on the
same socket: what a store restart without persistence looks like to kvindex.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def available() -> bool:
    return os.path.exists(REDIS_SERVER)


def require() -> str:
    """redis-server's path; else the test skips saying why (fails in CI: ``tests.programs.need``)."""
    from tests.programs import need

    return need("redis-server", REDIS_SERVER, "redis-server")


class RedisServer:
    def __init__(self, directory: Path, *, port: int = 0, appendonly: bool = False) -> None:
        require()  # missing: the test skips naming the program and the apt-get line (fails in CI)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # unix socket paths are limited to ~107 bytes
        self.socket = Path("/tmp") / f"kvi-redis-{os.getpid()}-{abs(hash(str(self.directory))) % 10**8}.sock"
        self.port = port
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket}?db=0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--unixsocket", str(self.socket),
                "--unixsocketperm", "700", "--dir", str(self.directory), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--protected-mode", "no",
                "--daemonize", "no", "--logfile", str(self.directory / "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            if self._ping():
                return self
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING in time")

    def _ping(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                s.connect(str(self.socket))
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)
        self.proc = None
        if self.socket.exists():
            self.socket.unlink()

    def flush(self) -> None:
        """FLUSHALL (between tests sharing one server)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.socket))
            s.sendall(b"FLUSHALL\r\n")
            if not s.recv(16).startswith(b"+OK"):
                raise RuntimeError("FLUSHALL failed")
