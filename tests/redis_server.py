"""A real ``redis-server`` process for tests (Debian's redis-server 7; .ci/run installs it).

``RedisServer(dir).start()`` runs one on a unix socket in ``dir`` (no TCP port to collide on) with
persistence off; ``.url`` is what ``kvindex serve --store`` takes. ``stop()`` kills it (SIGKILL by
default: a crash, not a clean shutdown) and ``start()`` again brings up a new, empty server on the
same socket: what a store restart without persistence looks like to kvindex.

``RedisClusterServers(dir, masters=3, replicas=0).start()`` runs a real Redis Cluster (TCP ports,
``redis-cli --cluster create``); ``.url`` is its ``redis+cluster://`` store URL.
"""

from __future__ import annotations

import os
import random
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


REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def cluster_port() -> int:
    """A loopback port free now whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randrange(20000, 40000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


def cli(port: int, *args: str, timeout: float = 10.0) -> str:
    """``redis-cli -p port args...``'s output (raises on a non-zero exit)."""
    done = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"redis-cli -p {port} {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


class ClusterNode:
    """One ``redis-server --cluster-enabled yes`` on a TCP port, persistence off."""

    def __init__(self, directory: Path, port: int, node_timeout_ms: int) -> None:
        self.directory, self.port, self.node_timeout_ms = directory, port, node_timeout_ms
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--logfile", str(self.directory / "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self, on: bool) -> None:
        """SIGSTOP (``on``) or SIGCONT: a node that stops answering, its replication link included."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP if on else signal.SIGCONT)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def info(self, section: str) -> dict[str, str]:
        out = {}
        for line in cli(self.port, "INFO", section).splitlines():
            name, sep, value = line.strip().partition(":")
            if sep:
                out[name] = value
        return out

    def node_id(self) -> str:
        return cli(self.port, "CLUSTER", "MYID").strip()

    def role(self) -> str:
        return self.info("replication")["role"]


class RedisClusterServers:
    """A real Redis Cluster: ``masters`` masters, each with ``replicas`` replicas, on free loopback
    ports, created with ``redis-cli --cluster create`` (slots split evenly). ``.url`` is what
    ``kvindex serve --store`` takes (``redis+cluster://...``)."""

    def __init__(self, directory: Path, *, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000) -> None:
        require()
        from tests.programs import need

        need("redis-cli", REDIS_CLI, "redis-tools")
        self.directory = Path(directory)
        self.masters, self.replicas = masters, replicas
        self.nodes = [ClusterNode(self.directory / f"node{i}", cluster_port(), node_timeout_ms)
                      for i in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:self.masters])

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        for n in self.nodes:
            n.start()
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            while True:
                try:
                    if cli(n.port, "PING").strip() == "PONG":
                        break
                except RuntimeError:
                    pass
                if time.monotonic() > deadline or not n.alive():
                    raise RuntimeError(f"cluster node {n.port} did not start: "
                                       f"{(n.directory / 'redis.log').read_text(errors='replace')[-1000:]}")
                time.sleep(0.02)
        cli(self.nodes[0].port, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
            "--cluster-replicas", str(self.replicas), "--cluster-yes", timeout=timeout)
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and every live replica's link is up."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(self._settled(n) for n in self.nodes if n.alive()):
                    return
            except RuntimeError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok in time")
            time.sleep(0.05)

    def _settled(self, n: ClusterNode) -> bool:
        if "cluster_state:ok" not in cli(n.port, "CLUSTER", "INFO"):
            return False
        info = n.info("replication")
        return info["role"] == "master" or info.get("master_link_status") == "up"

    def replica_of(self, master: ClusterNode) -> ClusterNode:
        return next(n for n in self.nodes if n.alive() and n is not master
                    and n.info("replication").get("master_port") == str(master.port))

    def live_masters(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive() and n.role() == "master"]

    def owner_of(self, key: str) -> ClusterNode:
        """The live master serving ``key``'s slot."""
        slot = int(cli(self.nodes[0].port if self.nodes[0].alive() else self.live_masters()[0].port,
                       "CLUSTER", "KEYSLOT", key).strip())
        for n in self.live_masters():
            for line in cli(n.port, "CLUSTER", "NODES").splitlines():
                fields = line.split()
                if "myself" in fields[2]:
                    for part in fields[8:]:
                        lo, _, hi = part.partition("-")
                        if not part.startswith("[") and int(lo) <= slot <= int(hi or lo):
                            return n
        raise RuntimeError(f"no live master serves slot {slot}")

    def keys_per_master(self) -> dict[int, int]:
        """port -> DBSIZE of every live master."""
        return {n.port: int(cli(n.port, "DBSIZE").strip()) for n in self.live_masters()}

    def flush(self) -> None:
        """FLUSHALL on every master (between tests sharing one cluster)."""
        for n in self.live_masters():
            cli(n.port, "FLUSHALL")

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()
