"""Store URLs: which ``--store`` values kvindex can use, and how they are shown.

``memory://`` (the default: this process) or a Redis server shared by every kvindex replica:
``redis://host:port/db``, ``rediss://host:port/db`` (TLS) or ``unix:///path/to/redis.sock?db=N``.

Vocabulary (stdlib only): the config validates with it, ``kvindex.index.factory`` picks a backend
with it. Invariants: ``check_store_url`` raises a one-line ``ValueError`` naming the URL for
anything else; ``describe`` never shows a password.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

MEMORY = "memory://"
SCHEMES = ("memory", "redis", "rediss", "unix")


def check_store_url(url: str) -> str:
    """``url`` if kvindex can use it as a store; ``ValueError`` (one line) otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or "://" not in url:
        raise ValueError(f"store {url!r}: expected memory:// or redis://host:port/db, rediss://host:port/db, "
                         "unix:///path?db=N")
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
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return parts._replace(netloc=netloc).geturl()
    return url
