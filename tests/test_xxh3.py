"""kvindex's own XXH3-64 (kvindex/kx_xxh3.h) against the xxhash package, the independent oracle.

The C module exports it alone (``_keys.xxh3_64``, ``_keys.xxh3_64_slices``); every path of the
specification is crossed: every length 0..4096 (0, 1-3, 4-8, 9-16, 17-128, 129-240 bytes, then
stripes, blocks and their tails) with seed 0, 1337 (the local hash's) and a 64-bit seed (the
derived secret past 240 bytes), and random inputs of random lengths up to 64 KiB with random
seeds. The header's other paths (the scalar long-input loop; bytes assembled and 32-bit halves
of the 128-bit product) are compiled into a small driver and checked the same way. The build uses no ``xxhash.h``.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import xxhash

from kvindex import native
from tests.conftest import ROOT, need_native
from tests.programs import need

_keys = native.load("kvindex._keys")
SEEDS = (0, 1337, 0xDEADBEEFCAFEF00D)
MAX_LEN = 4096


def require() -> None:
    need_native(_keys, "kvindex._keys")


def pseudo_random(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_length_to_4096_equals_xxhash(seed: int) -> None:
    require()
    data = memoryview(pseudo_random(MAX_LEN, seed))
    wrong = [n for n in range(MAX_LEN + 1) if _keys.xxh3_64(data[:n], seed) != xxhash.xxh3_64_intdigest(data[:n], seed)]
    assert wrong == [], f"lengths whose hash differs with seed {seed}: {wrong[:20]}"


def test_random_inputs_up_to_64k_equal_xxhash() -> None:
    require()
    rnd = random.Random(16)
    pool = memoryview(rnd.randbytes(1 << 20))
    for _ in range(3000):
        n = rnd.randrange((64 << 10) + 1)
        start = rnd.randrange(len(pool) - n + 1)  # any alignment
        seed = rnd.choice([0, rnd.getrandbits(64), rnd.getrandbits(16), (1 << 64) - 1])
        data = pool[start:start + n]
        assert _keys.xxh3_64(data, seed=seed) == xxhash.xxh3_64_intdigest(data, seed), (start, n, seed)


def test_the_slices_entry_folds_each_slice() -> None:
    require()
    data = pseudo_random(1000, 7)
    for width, seed in ((64, 1337), (16, 0), (300, 1 << 63), (1001, 5)):
        expected = 0
        for at in range(0, len(data) - width + 1, width):
            expected ^= xxhash.xxh3_64_intdigest(data[at:at + width], seed)
        assert _keys.xxh3_64_slices(data, width, seed) == expected, (width, seed)


def test_bad_arguments_are_refused() -> None:
    require()
    with pytest.raises(OverflowError):
        _keys.xxh3_64(b"x", -1)
    with pytest.raises(OverflowError):
        _keys.xxh3_64(b"x", 1 << 64)
    with pytest.raises(TypeError):
        _keys.xxh3_64("text", 0)
    with pytest.raises(ValueError):
        _keys.xxh3_64_slices(b"abc", 0)
    assert _keys.xxh3_64(bytearray(b"abc")) == xxhash.xxh3_64_intdigest(b"abc")


DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include "kx_xxh3.h"

/* argv: a data file, its length, a seed: prints the hash of every prefix, one a line. */
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    size_t n = strtoull(argv[2], NULL, 10);
    uint64_t seed = strtoull(argv[3], NULL, 10);
    unsigned char *buf = malloc(n + 1);
    FILE *f = fopen(argv[1], "rb");
    if (!buf || !f || fread(buf, 1, n, f) != n) return 3;
    for (size_t len = 0; len <= n; len++) printf("%llu\n", (unsigned long long)kx_xxh3_64(buf, len, seed));
    return 0;
}
"""


def compiler() -> str:
    return need("cc", shutil.which(os.environ.get("CC", "cc").split()[0]) or shutil.which("gcc"), "gcc libc6-dev")


@pytest.mark.parametrize("mode", ["", "-DKX_XXH3_NO_SIMD=1", "-DKX_XXH3_PORTABLE=1"])
def test_the_header_alone_in_strict_c99_on_each_of_its_paths(tmp_path: Path, mode: str) -> None:
    """As built (SSE2 on x86-64), the scalar long-input loop other hosts run, and the fallbacks a
    big-endian host or a compiler without __int128 takes (bytes assembled, 32-bit halves)."""
    cc = compiler()
    (tmp_path / "driver.c").write_text(DRIVER)
    exe = tmp_path / "driver"
    build = [cc, "-std=c99", "-O1", "-Wall", "-Wextra", "-Werror", "-pedantic", *filter(None, [mode]),
             f"-I{ROOT / 'kvindex'}", str(tmp_path / "driver.c"), "-o", str(exe)]
    subprocess.run(build, check=True, capture_output=True, timeout=120)
    data = pseudo_random(2500, len(mode))  # past two 1024-byte blocks: scrambles and the tail
    (tmp_path / "data").write_bytes(data)
    for seed in SEEDS:
        out = subprocess.run([str(exe), str(tmp_path / "data"), str(len(data)), str(seed)], check=True,
                             capture_output=True, text=True, timeout=60).stdout.split()
        expected = [str(xxhash.xxh3_64_intdigest(data[:n], seed)) for n in range(len(data) + 1)]
        assert out == expected, f"seed {seed}: first wrong length {next(i for i, (a, b) in enumerate(zip(out, expected)) if a != b)}"


def test_no_source_includes_xxhash_h_and_the_build_reads_none(tmp_path: Path) -> None:
    """The native build needs a compiler only: no source names xxhash.h, and preprocessing _keys.c
    as setup.py compiles it opens no header of that name (``-H`` lists every header opened)."""
    sources = sorted(ROOT.glob("kvindex/*.[ch]")) + sorted(ROOT.glob("adapters/*.[ch]"))
    assert Path(ROOT / "kvindex" / "_keys.c") in sources
    assert [p.name for p in sources if "xxhash.h" in p.read_text()] == []
    cc = compiler()
    r = subprocess.run([cc, "-E", "-H", f"-I{sysconfig.get_paths()['include']}", str(ROOT / "kvindex" / "_keys.c"),
                        "-o", str(tmp_path / "keys.i")], capture_output=True, text=True, timeout=120, check=True)
    opened = [line.lstrip(". ") for line in r.stderr.splitlines() if line.startswith(".")]
    names = {Path(h).name for h in opened}
    assert "kx_xxh3.h" in names, opened
    assert names.isdisjoint({"xxhash.h", "xxh3.h", "xxh_x86dispatch.h"}), opened  # libxxhash-dev's headers
