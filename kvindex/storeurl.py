"""Store URLs: which ``--store`` values kvindex can use, and how they are shown.

``memory://`` (the default: this process) or a Redis server shared by every kvindex replica:
``redis://host:port/db``, ``rediss://host:port/db`` (TLS) or ``unix:///path/to/redis.sock?db=N``;
or a Redis Cluster (or Valkey cluster): ``redis+cluster://host:port,host:port,...`` (``rediss+cluster://``:
TLS), any of its nodes as seeds, optionally ``user:password@`` before the first (database 0 only).

Vocabulary (stdlib only): the config validates with it, ``kvindex.index.factory`` picks a backend
with it. Invariants: ``check_store_url`` raises a one-line ``ValueError`` naming the URL for
anything else; ``describe`` never shows a password; ``cluster_seeds`` is the one parser of a
cluster URL.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

MEMORY = "memory://"
SCHEMES = ("memory", "redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


@dataclass(frozen=True, slots=True)
class ClusterSeeds:
    """A cluster URL's parts: the seed nodes, TLS, the credentials (None: none)."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None
    password: str | None


def is_cluster(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def cluster_seeds(url: str) -> ClusterSeeds:
    """The seeds of ``redis+cluster://[user:password@]host:port,host:port,...``; one-line
    ``ValueError`` otherwise (a port is required: a cluster has no default port to assume)."""
    scheme, sep, rest = url.partition("://")
    if scheme not in CLUSTER_SCHEMES or not sep:
        raise ValueError(f"store {url!r}: expected redis+cluster://host:port,host:port,...")
    netloc, slash, path = rest.partition("/")
    if path.strip("/") not in ("", "0") or "?" in rest or "#" in rest:
        raise ValueError(f"store {describe(url)!r}: a cluster has database 0 only and takes no path or options")
    creds, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = creds.partition(":")
        username, password = unquote(user) or None, unquote(secret) if colon else None
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"store {describe(url)!r}: each cluster node is host:port, got {item!r}")
        nodes.append((host, int(port)))
    return ClusterSeeds(tuple(nodes), scheme == "rediss+cluster", username, password)


def check_store_url(url: str) -> str:
    """``url`` if kvindex can use it as a store; ``ValueError`` (one line) otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or "://" not in url:
        raise ValueError(f"store {url!r}: expected memory:// or redis://host:port/db, rediss://host:port/db, "
                         "unix:///path?db=N, redis+cluster://host:port,host:port,...")
    if parts.scheme in CLUSTER_SCHEMES:
        cluster_seeds(url)
        return url
    if parts.scheme == "memory":
        if url.rstrip("/") != "memory:":
            raise ValueError(f"store {url!r}: memory:// takes no host, path or options")
        return url
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"store {url!r}: unix:// needs the socket path, e.g. unix:///run/redis.sock?db=0")
        db = parse_qs(parts.query).get("db", ["0"])[0]
    else:
        if not parts.hostname:
            raise ValueError(f"store {url!r}: {parts.scheme}:// needs a host, e.g. {parts.scheme}://127.0.0.1:6379/0")
        try:
            parts.port
        except ValueError:
            raise ValueError(f"store {url!r}: the port is not a number") from None
        db = parts.path.strip("/") or "0"
    if not db.isdigit():
        raise ValueError(f"store {url!r}: the database must be a number, got {db!r}")
    return url


def is_memory(url: str) -> bool:
    return urlsplit(url).scheme == "memory"


def describe(url: str) -> str:
    """The URL without a password (for logs and errors)."""
    scheme, sep, rest = url.partition("://")
    if scheme in CLUSTER_SCHEMES and sep:
        creds, at, hosts = rest.rpartition("@")
        return f"{scheme}://{creds.partition(':')[0]}:***@{hosts}" if at and ":" in creds else url
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return parts._replace(netloc=netloc).geturl()
    return url
