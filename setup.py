"""Native accelerators: optional C extensions, each with a pure-Python twin that defines it.

A machine without a C compiler (or without Debian's libxxhash-dev for ``_keys``) still installs
kvindex: ``optional=True`` turns a failed build into a warning, and kvindex runs on the Python
twins (``kvindex.native`` reports which is in use; ``KVINDEX_REQUIRE_NATIVE=1`` makes that an error).
"""

from setuptools import Extension, setup

FLAGS = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

setup(
    ext_modules=[
        Extension("kvindex._keys", ["kvindex/_keys.c"], extra_compile_args=FLAGS, optional=True),
        Extension("kvindex._jsontokens", ["kvindex/_jsontokens.c"], extra_compile_args=FLAGS, optional=True),
        Extension("kvindex._walk", ["kvindex/_walk.c"], extra_compile_args=FLAGS, optional=True),
        Extension("adapters._vllm", ["adapters/_vllm.c"], extra_compile_args=FLAGS, optional=True),
        Extension("kvindex._apply", ["kvindex/_apply.c"], extra_compile_args=FLAGS, optional=True),
    ],
)
