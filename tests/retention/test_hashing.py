from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from retention.hashing import TokenError, block_hashes, chain_hash, pack_tokens, root_hash


def test_chain_depends_on_parent_tokens_salt_and_extra_key() -> None:
    tokens = list(range(16))
    base = block_hashes(tokens, 4)
    assert len(base) == 4 and len(set(base)) == 4
    assert block_hashes(tokens + [1, 2], 4) == base  # partial tail is not hashed
    assert block_hashes(tokens, 4, salt="a") != base
    assert block_hashes(tokens, 4, salt="a")[0] != block_hashes(tokens, 4, salt="b")[0]
    assert block_hashes(tokens, 4, extra_key=b"lora-7") != base
    changed = tokens.copy()
    changed[1] = 99
    other = block_hashes(changed, 4)
    assert other[0] != base[0] and other[1] != base[1]  # a change propagates down the chain
    assert block_hashes(tokens, 4, limit=2) == base[:2]


def test_pack_accepts_lists_and_int32_arrays_equally() -> None:
    assert pack_tokens([1, 2, 3]) == pack_tokens(np.array([1, 2, 3], np.int32)) == pack_tokens(np.array([1, 2, 3]))
    with pytest.raises(TokenError):
        pack_tokens([2**31])
    with pytest.raises(TokenError):
        pack_tokens(["a"])


def test_hashes_are_stable_across_processes() -> None:
    code = "from retention.hashing import block_hashes; print(block_hashes(list(range(8)), 4, salt='x'))"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."}).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    assert str(block_hashes(list(range(8)), 4, salt="x")) + "\n" in outs


def test_root_hash_unsalted_is_zero() -> None:
    assert root_hash(None) == root_hash("") == 0
    assert chain_hash(0, b"\x00" * 16) != chain_hash(1, b"\x00" * 16)
