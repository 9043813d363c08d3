"""kvindex's own XXH3-64 (kvindex/kx_xxh3.h) against libxxhash's, measured in the same run.

  python benchmarks/xxh3.py [--repeat 15]

Both sides are ``kvindex/_keys.c`` built the way setup.py builds it (setuptools' build_ext, the
same compiler and flags) into a temporary directory: once as it is, and once beside a stand-in
``kx_xxh3.h`` that maps ``kx_xxh3_64`` onto libxxhash's ``XXH3_64bits_withSeed`` inlined from the
system's ``xxhash.h`` (``XXH_INLINE_ALL``, as kvindex built it before; Debian's libxxhash-dev,
needed by this baseline only: without it the baseline is skipped, saying so). Same C around the
hash, so the ratio is the hash's. Figures, each the minimum over ``--repeat`` interleaved runs:

- 64 B, 256 B and 8 KiB inputs (a block of 16 or 64 tokens; a long input): ns per hash,
  ``xxh3_64_slices`` over 1 MiB (no Python int per hash);
- prompt keys: ``prompt_keys`` of an 8k-token prompt (512 blocks of 16 tokens: a seeded 64-byte
  hash and a 16-byte chain hash per block), µs per prompt, the path the query and ingest take;
- the xxhash package (libxxhash called from Python, one call per input): ns per call.

kvindex's is also built with ``KX_XXH3_NO_SIMD=1`` (the scalar long-input loop hosts without SSE2
run), in brackets. Ratios are kvindex / baseline (below 1: kvindex's is faster). Both builds' answers are compared
on every measured input first (a mismatch ends the run).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import xxhash
from setuptools import Distribution, Extension

ROOT = Path(__file__).resolve().parent.parent
LIBXXHASH_HEADERS = ("/usr/include/xxhash.h", "/usr/local/include/xxhash.h")
STAND_IN = """/* benchmarks/xxh3.py's baseline: libxxhash's XXH3, inlined from the system's header. */
#define XXH_INLINE_ALL
#include <xxhash.h>
#define kx_xxh3_64(data, len, seed) XXH3_64bits_withSeed((data), (len), (seed))
"""
LOCAL_SEED = 1337
MIB = 1 << 20


def build(workdir: Path, header: str | None, defines: tuple[tuple[str, str], ...] = ()) -> ModuleType:
    """_keys.c in ``workdir``, beside kvindex/kx_xxh3.h (``header`` None) or the given stand-in."""
    workdir.mkdir()
    shutil.copy(ROOT / "kvindex" / "_keys.c", workdir / "_keys.c")
    if header is None:
        shutil.copy(ROOT / "kvindex" / "kx_xxh3.h", workdir / "kx_xxh3.h")
    else:
        (workdir / "kx_xxh3.h").write_text(header)
    ext = Extension("_keys", [str(workdir / "_keys.c")], extra_compile_args=["-O3"], define_macros=list(defines))
    cmd = Distribution({"ext_modules": [ext], "script_name": "xxh3.py"}).get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp = str(workdir / "lib"), str(workdir / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    spec = importlib.util.spec_from_file_location("_keys", cmd.get_ext_fullpath("_keys"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of one sample of ``calls`` calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def cases(mod: ModuleType, data: bytes, tokens: array) -> dict[str, tuple[Callable[[], object], float, int]]:
    """name -> (one call, the unit it is divided into, calls per sample)."""
    return {
        "64 B, seed 1337 (ns/hash)": (lambda: mod.xxh3_64_slices(data, 64, LOCAL_SEED), len(data) / 64 / 1e9, 3),
        "256 B, seed 1337 (ns/hash)": (lambda: mod.xxh3_64_slices(data, 256, LOCAL_SEED), len(data) / 256 / 1e9, 3),
        "8 KiB, seed 0 (ns/hash)": (lambda: mod.xxh3_64_slices(data, 8192, 0), len(data) / 8192 / 1e9, 3),
        "8 KiB, seed 1337 (ns/hash)": (lambda: mod.xxh3_64_slices(data, 8192, LOCAL_SEED), len(data) / 8192 / 1e9, 3),
        "prompt keys, 8k tokens (us/prompt)": (lambda: mod.prompt_keys(7, tokens, 16), 1e-6, 50),
    }


def check_equal(ours: ModuleType, base: ModuleType | None, data: bytes, tokens: array) -> None:
    for width, seed in ((64, LOCAL_SEED), (256, LOCAL_SEED), (8192, 0), (8192, LOCAL_SEED)):
        expected = 0
        for at in range(0, len(data) - width + 1, width):
            expected ^= xxhash.xxh3_64_intdigest(data[at:at + width], seed)
        got = [m.xxh3_64_slices(data, width, seed) for m in (ours, base) if m is not None]
        assert set(got) == {expected}, f"answers differ at width {width}, seed {seed}"
    if base is not None:
        assert ours.prompt_keys(7, tokens, 16) == base.prompt_keys(7, tokens, 16), "prompt keys differ"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    rnd = random.Random(3)
    data = rnd.randbytes(MIB)
    tokens = array("I", [rnd.randrange(200_000) for _ in range(512 * 16 + 1)])
    header = next((h for h in LIBXXHASH_HEADERS if os.path.exists(h)), None)
    with tempfile.TemporaryDirectory() as tmp:
        ours = build(Path(tmp) / "kvindex", None)
        scalar = build(Path(tmp) / "scalar", None, (("KX_XXH3_NO_SIMD", "1"),))
        base = build(Path(tmp) / "libxxhash", STAND_IN) if header else None
    check_equal(ours, base, data, tokens)
    check_equal(scalar, base, data, tokens)
    sides = {"kvindex": cases(ours, data, tokens), "scalar": cases(scalar, data, tokens)}
    sides |= {"libxxhash": cases(base, data, tokens)} if base else {}
    small, big = data[:64], data[:8192]
    package = {"64 B, seed 1337 (ns/hash)": (lambda: xxhash.xxh3_64_intdigest(small, LOCAL_SEED), 1e-9, 20000),
               "8 KiB, seed 1337 (ns/hash)": (lambda: xxhash.xxh3_64_intdigest(big, LOCAL_SEED), 1e-9, 2000)}
    times: dict[tuple[str, str], float] = {}
    for _ in range(args.repeat):  # interleaved: a noisy neighbour slows both sides alike
        for side, table in [*sides.items(), ("xxhash package", package)]:
            for name, (fn, unit, calls) in table.items():
                t = best(fn, calls) / unit
                times[side, name] = min(t, times.get((side, name), t))
    print(f"XXH3-64: kvindex/kx_xxh3.h vs libxxhash ({header or 'no xxhash.h: baseline skipped'}), "
          f"min of {args.repeat} runs; python {sys.version.split()[0]}")
    for name in sides["kvindex"]:
        line = f"  {name:36s} kvindex {times['kvindex', name]:8.2f} (scalar loop {times['scalar', name]:8.2f})"
        if base is not None:
            line += f"  libxxhash inline {times['libxxhash', name]:8.2f}  ratio {times['kvindex', name] / times['libxxhash', name]:.2f}x"
            line += f" (scalar {times['scalar', name] / times['libxxhash', name]:.2f}x)"
        if ("xxhash package", name) in times:
            line += f"  xxhash package (a Python call each) {times['xxhash package', name]:7.2f}"
        print(line)


if __name__ == "__main__":
    main()
