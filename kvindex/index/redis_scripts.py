"""The Redis backends' Lua scripts, read from ``kvindex/index/lua/*.lua`` (package data).

Job: turn the ``.lua`` files into the exact script sources the stores register and load at
``open()``. Nothing here talks to Redis.

Invariants:
- The files ship with the package (``[tool.setuptools.package-data]`` in pyproject.toml) and are
  read with ``importlib.resources``: an installed (non-editable) kvindex finds them too.
- A source is read once per process (cached): every store built afterwards gets the same string,
  so the same SHA1 for EVALSHA.
- Every script defines the store's guard first (``store_guard.lua``: evictions watched, a
  cluster's masters; ``kvindex.index.redis_cluster``). The precise store's script is then one
  file, ``redis_precise.lua``. Each approximate-index script is its shebang line (``#!lua``: a
  write script Redis refuses up front when out of memory; ``#!lua flags=no-writes``: a read
  script), the guard, the shared prelude ``approx_prelude.lua``, then the fragments it uses, then
  its own body ``approx_<name>.lua``.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

WRITE = "#!lua\n"
READ = "#!lua flags=no-writes\n"

# script name -> (shebang line, the files after the prelude, in order)
APPROX: dict[str, tuple[str, tuple[str, ...]]] = {
    "record_kthena": (WRITE, ("approx_record_kthena",)),
    "record_gie": (WRITE, ("approx_record_gie",)),
    "match_kthena": (READ, ("approx_match_kthena",)),
    "match_gie": (READ, ("approx_match_gie",)),
    "believes": (READ, ("approx_believes",)),
    "entries": (READ, ("approx_entries",)),
    "evictions": (READ, ("approx_evictions",)),
    "pods": (READ, ("approx_pods",)),
    "remove_pod": (WRITE, ("approx_forget_pod", "approx_remove_pod")),
    "export": (READ, ("approx_export",)),
    "load": (WRITE, ("approx_forget_pod", "approx_load")),
}


@cache
def lua(name: str) -> str:
    """The text of ``kvindex/index/lua/<name>.lua``."""
    return (files("kvindex.index") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def precise_script() -> str:
    """The precise store's one script (every op; see redis_precise.lua)."""
    return lua("store_guard") + lua("redis_precise")


@cache
def approx_scripts() -> dict[str, str]:
    """The approximate store's scripts by name, each a complete source."""
    return {name: shebang + lua("store_guard") + lua("approx_prelude") + "".join(lua(part) for part in parts)
            for name, (shebang, parts) in APPROX.items()}
