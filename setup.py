"""Native accelerators: optional C extensions, each with a pure-Python twin that defines it.

A C compiler is all they need: XXH3 is kvindex's own (``kvindex/kx_xxh3.h``), no system library.
A machine without one still installs kvindex: ``optional=True`` turns a failed build into a
warning, and kvindex runs on the Python twins (``kvindex.native`` reports which is in use;
``KVINDEX_REQUIRE_NATIVE=1`` makes that an error).
A skipped accelerator is never silent: after the build a warning block on stderr names each one
not built, why (no compiler, or the compiler's error) and the apt-get line that
fixes it. (``pip install`` shows a build's output only with ``-v``; the block is also written to
``build/kvindex-native-warnings.txt`` and ``kvindex serve`` logs the same at start.)
"""

import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FLAGS = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]
APT = "apt-get install -y gcc libc6-dev"


class LoudBuildExt(build_ext):
    """``build_ext`` that says, loudly and at the end, which optional accelerators were not built."""

    def run(self):
        self.not_built = []
        super().run()
        if self.not_built:
            report(self.not_built)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # optional=True: setuptools warns in passing; we keep the reason
            self.not_built.append((ext.name, reason(ext.name, exc)))
            raise


def reason(name, exc):
    cc = (os.environ.get("CC") or "cc").split()[0]
    if not shutil.which(cc) and (os.environ.get("CC") or not shutil.which("gcc")):
        return f"no C compiler ({cc} is not on PATH)"
    return f"the compiler failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"


def report(not_built):
    bar = "!" * 78
    lines = [bar, "kvindex: native accelerators NOT built (kvindex works, on the slower pure-Python twins):"]
    lines += [f"  - {name}: {why}" for name, why in not_built]
    lines += [f"  fix: {APT}", "       then pip install -e . again (or python setup.py build_ext --inplace)",
              "  check: python -c 'from kvindex import native; print(native.status())'", bar]
    text = "\n".join(lines)
    print("\n" + text + "\n", file=sys.stderr)
    try:
        os.makedirs("build", exist_ok=True)
        with open(os.path.join("build", "kvindex-native-warnings.txt"), "w") as f:
            f.write(text + "\n")
    except OSError:
        pass


setup(
    cmdclass={"build_ext": LoudBuildExt},
    ext_modules=[
        Extension("kvindex._keys", ["kvindex/_keys.c"], depends=["kvindex/kx_xxh3.h", "kvindex/kx_xxh64.h", "kvindex/kx_u64s.h"], extra_compile_args=FLAGS,
                  optional=True),
        Extension("kvindex._jsontokens", ["kvindex/_jsontokens.c"], extra_compile_args=FLAGS, optional=True),
        Extension("adapters._vllm", ["adapters/_vllm.c"], depends=["kvindex/kx_u64s.h"], extra_compile_args=FLAGS,
                  optional=True),
        Extension("adapters._llmd_sim", ["adapters/_llmd_sim.c"], depends=["kvindex/kx_u64s.h"], extra_compile_args=FLAGS,
                  optional=True),
        Extension("kvindex.index._core", ["kvindex/index/_core.c"], depends=["kvindex/kx_u64s.h", "kvindex/kx_xxh3.h"],
                  extra_compile_args=FLAGS, optional=True),
        Extension("kvindex.ingest._drain", ["kvindex/ingest/_drain.c"], extra_compile_args=FLAGS, optional=True),
    ],
)
