"""kvgate reproduces TensorRT-LLM's block hash (engines/trtllm/block_key.py) bit for bit.

The expected values were computed by a C++ transcription of ``BlockKeyHasher::hash``
(batch_manager/kvCacheManager.cpp, 1.2-era; same arithmetic as blockKey.cpp's ``hash32Mix`` /
``hash64Mix`` later) built with g++ on x86-64 (``size_t`` = 64 bits), not by this Python: they pin
the 32-bit wrap of ``a + 0x9e3779b9`` in the token mix and the salt entering the root only.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engines.trtllm.block_key import trt_block_hash, trt_root_hash
from engines.trtllm.executor_args import cache_salt_id
from tests.engines.triton.fake_block_manager import block_key_hash

SALT_ID = 12345678901234567890


def test_known_answers_from_a_cpp_build():
    root = trt_block_hash([1, 2, 3, 4])
    assert root == 924206229973855
    assert trt_block_hash([5, 6, 7, 8], root) == 2728178455351807326
    salted = trt_block_hash([1, 2, 3, 4], 0, SALT_ID)
    assert salted == 12167144777448705069
    assert trt_block_hash([5, 6, 7, 8], salted, SALT_ID) == 16580007635805867622  # salt ignored below the root
    assert trt_block_hash([5, 6, 7, 8], salted) == 16580007635805867622
    assert trt_block_hash([100000, 2147483647, 0, 128255], 0, 1) == 4946645567925558168
    assert trt_block_hash([1, 2, 3]) == 14332563581206  # a partial block: the length seeds the hash


def test_a_salt_changes_the_root_and_only_the_root():
    tokens = list(range(32))
    assert trt_root_hash(tokens, "a") == trt_block_hash(tokens, 0, cache_salt_id("a"))
    assert len({trt_root_hash(tokens, s) for s in (None, "a", "b")}) == 3
    assert trt_root_hash(tokens, None) == trt_block_hash(tokens)  # no cache_salt_id: nothing mixed in


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=64), st.integers(0, 2**64 - 1),
       st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_the_double_hashes_as_the_translator_does(tokens, parent, salt_id):
    # two transcriptions of the C++ (the double's and kvgate's) agree on every key
    assert block_key_hash(tokens, parent, salt_id) == trt_block_hash(tokens, parent, salt_id)
    assert block_key_hash(tokens, 0, salt_id) == trt_block_hash(tokens, 0, salt_id)
