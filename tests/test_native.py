"""The native accelerators against their Python twins, on the same inputs.

CI builds them (libxxhash-dev) and sets KVINDEX_REQUIRE_NATIVE=1, so a failed build fails there;
on a machine without a compiler these tests fail with the hint, never skip.
"""

from __future__ import annotations

import random
from array import array

import pytest

from kvindex import keys as K
from kvindex import native

_keys = native.load("_keys")


def require(mod: object, name: str) -> None:
    assert mod is not None, f"kvindex.{name} is not in use: {native.status()}"


@pytest.mark.parametrize("block_size", [1, 4, 16, 64, 128, 1000])
def test_native_keys_equal_python(block_size: int) -> None:
    require(_keys, "_keys")
    rnd = random.Random(block_size)
    for n in (0, block_size - 1, block_size, 3 * block_size + 1, 8192):
        tokens = array("I", [rnd.randrange(1 << 32) for _ in range(n)])
        root = K.root_key("m", "lora", f"salt-{n}")
        assert _keys.prompt_keys(root, tokens, block_size) == K.py_prompt_keys(root, tokens, block_size)
        for limit in (0, 1, 7):
            assert _keys.prompt_keys(root, tokens, block_size, limit) == K.py_prompt_keys(root, tokens, block_size, limit)
        locals_ = K.py_local_hashes(tokens, block_size)
        assert _keys.local_hashes(tokens, block_size) == locals_
        assert _keys.chain_keys(root, locals_) == K.py_chain_keys(root, locals_)


def test_native_keys_match_dynamo_vector_and_public_api() -> None:
    require(_keys, "_keys")
    assert _keys.local_hashes(array("I", range(1000, 1032)), 16) == [17863182269597592868, 14340445833846710668]
    assert K.prompt_keys is not K.py_prompt_keys  # the public names run on the C twin
    assert K.prompt_keys(7, list(range(40)), 4, limit=3) == K.py_prompt_keys(7, list(range(40)), 4, limit=3)


def test_native_keys_refuse_bad_input_like_python() -> None:
    require(_keys, "_keys")
    with pytest.raises(ValueError):
        _keys.prompt_keys(1, array("I", [1, 2]), 0)
    with pytest.raises(OverflowError):
        _keys.prompt_keys(1 << 64, array("I", [1, 2]), 1)
    with pytest.raises(OverflowError):
        _keys.chain_keys(1, [-1])
    with pytest.raises(TypeError):
        _keys.prompt_keys(1, array("Q", [1, 2]), 1)  # 8-byte items are not token ids
    assert _keys.prompt_keys(1, b"", 16) == []


def test_status_names_what_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.status() == "native: " + ", ".join(native.ACCELERATORS)
    monkeypatch.setenv("KVINDEX_PURE_PYTHON", "1")
    assert native.load("_keys") is None and native.status().startswith("pure Python")
    monkeypatch.delenv("KVINDEX_PURE_PYTHON")
    monkeypatch.setenv("KVINDEX_REQUIRE_NATIVE", "1")
    with pytest.raises(ImportError, match="libxxhash-dev"):
        native.load("_no_such_accelerator")
