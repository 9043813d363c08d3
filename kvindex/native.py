"""Which native accelerators kvindex runs on: C twins of its hottest Python loops.

Invariants:
- Every accelerator has a pure-Python twin that defines its behaviour; tests compare the two on
  the same inputs, so the C code can only be faster:
  ``kvindex._keys``        the chained keys of ``kvindex.keys`` (``py_prompt_keys``, ...);
  ``kvindex._jsontokens``  a body's token ids (``msgspec.json.decode`` / ``go_json_loads``);
  ``kvindex.index._core``  the precise index's memory and loops (``PreciseIndex``); its twin is the
                           readable ``kvindex.index.reference.ReferenceIndex``, which serves without it;
  ``adapters._vllm``       the vLLM decoder's typed path (``VllmDecoder.decode_python``);
  ``adapters._llmd_sim``   llm-d-inference-sim's dummy tokenizer (``llmd_sim.py_tokenize_prompt``);
  ``kvindex.ingest._drain`` a socket's queued messages in one call (``transport.queued``, through
                           pyzmq), on the libzmq pyzmq loaded (``kvindex.ingest.libzmq``).
- A C compiler is all the build needs (XXH3 is kvindex's own, ``kvindex/kx_xxh3.h``).
- ``load(name)`` (a module path) returns the compiled module, or None when it is not built (no C
  compiler at install time) or ``KVINDEX_PURE_PYTHON=1`` is set.
  ``KVINDEX_REQUIRE_NATIVE=1`` turns a missing build into an ImportError (CI sets it: a silent
  fallback would hide a slow path).
- Chosen once, at import of the module that uses it; nothing here changes afterwards.
- ``status()`` names what is really missing (``fix()``): no C compiler, with the one Debian package
  line that brings it; it never asks for a compiler that is installed (then the build log says why).
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

ACCELERATORS = ("kvindex._keys", "kvindex._jsontokens", "kvindex.index._core", "adapters._vllm", "adapters._llmd_sim",
                "kvindex.ingest._drain")
HINT = "install a C compiler (Debian: apt-get install gcc libc6-dev), then pip install -e . again"
COMPILERS = ("cc", "gcc", "clang")
REBUILD = "then pip install -e . again (or python setup.py build_ext --inplace)"


def fix(missing: list[str]) -> str:
    """What to do for the ``missing`` accelerators, from what this machine lacks."""
    compiler = os.environ.get("CC") or next((c for c in COMPILERS if shutil.which(c)), None)
    if compiler is None or not shutil.which(compiler.split()[0]):
        return f"no C compiler found: apt-get install gcc libc6-dev, {REBUILD}"
    return f"C compiler {compiler} is installed: {REBUILD}, and read its warnings for why the build failed"


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
