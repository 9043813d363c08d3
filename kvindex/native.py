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
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

ACCELERATORS = ("kvindex._keys", "kvindex._jsontokens", "kvindex._walk", "kvindex._apply", "adapters._vllm")
HINT = "install a C compiler and libxxhash-dev (Debian), then pip install -e . again"


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
    return f"pure Python for {', '.join(missing)} (not built: {HINT})"
