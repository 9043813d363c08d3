"""Which native accelerators kvindex runs on: C twins of its hottest Python loops.

Invariants:
- Every accelerator has a pure-Python twin that defines its behaviour; tests compare the two on
  the same inputs, so the C code can only be faster:
  ``kvindex._keys``        the chained keys of ``kvindex.keys`` (``py_prompt_keys``, ...);
  ``kvindex._jsontokens``  a body's token ids (``msgspec.json.decode`` / ``go_json_loads``);
  ``kvindex._walk``        the prefix walk (``kvindex.index.walk.walk``);
  ``kvindex._apply``       the store, remove and rehash loops of ``kvindex.index.precise`` / ``.table``;
  ``adapters._vllm``       the vLLM decoder's typed path (``VllmDecoder.decode_python``).
- ``load(name)`` (a module path) returns the compiled module, or None when it is not built (no C
  compiler or no libxxhash-dev at install time) or ``KVINDEX_PURE_PYTHON=1`` is set.
  ``KVINDEX_REQUIRE_NATIVE=1`` turns a missing build into an ImportError (CI sets it: a silent
  fallback would hide a slow path).
- Chosen once, at import of the module that uses it; nothing here changes afterwards.
- ``status()`` names what is really missing (``fix()``): no C compiler, or only the xxHash header
  (``_keys`` alone needs ``xxhash.h``), with the one Debian package line that brings it; it never
  asks for a compiler that is installed.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

ACCELERATORS = ("kvindex._keys", "kvindex._jsontokens", "kvindex._walk", "kvindex._apply", "adapters._vllm")
NEEDS_XXHASH = ("kvindex._keys",)  # built against Debian's libxxhash-dev (xxhash.h)
HINT = "install a C compiler and libxxhash-dev (Debian), then pip install -e . again"
COMPILERS = ("cc", "gcc", "clang")
XXHASH_HEADERS = ("/usr/include/xxhash.h", "/usr/local/include/xxhash.h")
REBUILD = "then pip install -e . again (or python setup.py build_ext --inplace)"


def fix(missing: list[str], headers: tuple[str, ...] = XXHASH_HEADERS) -> str:
    """What to install for the ``missing`` accelerators, from what this machine lacks."""
    compiler = os.environ.get("CC") or next((c for c in COMPILERS if shutil.which(c)), None)
    if compiler is None or not shutil.which(compiler.split()[0]):
        return f"no C compiler found: apt-get install gcc libc6-dev libxxhash-dev, {REBUILD}"
    header = any(os.path.exists(h) for h in headers)
    if not header and set(missing) <= set(NEEDS_XXHASH):
        return f"xxhash.h not found (C compiler {compiler} is installed): apt-get install libxxhash-dev, {REBUILD}"
    if not header:
        return f"xxhash.h not found: apt-get install libxxhash-dev, {REBUILD} (its build log says why the others failed)"
    return f"{compiler} and xxhash.h are installed: {REBUILD}, and read its warnings for why the build failed"


def pure_python() -> bool:
    return os.environ.get("KVINDEX_PURE_PYTHON", "") not in ("", "0")


def load(name: str) -> ModuleType | None:
    if pure_python():
        return None
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("KVINDEX_REQUIRE_NATIVE", "") not in ("", "0"):
            raise ImportError(f"{name} is not built ({exc}); {HINT}") from None
        return None


def status() -> str:
    """One line for the startup log: which accelerators are in use."""
    if pure_python():
        return "pure Python (KVINDEX_PURE_PYTHON is set)"
    missing = [n for n in ACCELERATORS if load(n) is None]
    if not missing:
        return "native: " + ", ".join(ACCELERATORS)
    return f"pure Python for {', '.join(missing)} (not built: {fix(missing)})"
