"""TensorRT-LLM's own block hash, reproduced, so a stored root block is matched to its salt exactly.

A ``KVCacheStoredData`` event carries each block's ``block_hash`` (``KVCacheStoredBlockData``,
nanobind/executor/bindings.cpp) but no salt and no request id. That hash is
``KVCacheBlock::getHash()``, set by ``WindowBlockManager::storeBlocks``
(batch_manager/kvCacheManager.cpp) as ``BlockKeyHasher()(blockKey, searchRoot->getHash())``,
where the search starts at ``mCachedBlocksRoot`` whose hash is 0 (``KVCacheBlock`` ctor:
``mHash{0}``). ``BlockKeyHasher::hash`` (kvCacheManager.cpp in the 1.2-era snapshot b35ac1b6,
the one docs/architecture.md cites for executorImpl.cpp; moved to batch_manager/blockKey.cpp
later, with the mixing steps factored into ``__hash32``/``__hash64`` in batch_manager/common.h
and then ``hash32Mix``/``hash64Mix`` (0bd2980d) — the same arithmetic; the ``v1.2.1`` tag
itself could not be read here) is::

    seed = len(tokens) ^ parent * 0xbf58476d1ce4e5b9            (size_t, i.e. mod 2**64)
    if parent == 0 and cacheSaltID:  seed = mix64(cacheSaltID, seed)   # the root only
    for t in tokens:                 seed = mix32(uint32(t), seed)
        (+ mix64(extra id) per token if the request has input_token_extra_ids)
    (+ mix64(loraTaskId) if set; + multimodal extra keys)

    mix32(a, seed): a = ((a >> 16) ^ a) * 0x45d9f3b  (twice, uint32), a ^= a >> 16,
                    seed ^= (a + 0x9e3779b9 mod 2**32) + (seed << 6) + (seed >> 2)
    mix64(c, seed): splitmix64's finaliser on c, seed ^= c + 0x9e3779b9 + (seed << 6) + (seed >> 2)

kvgate sends no extra token ids, no LoRA and no multimodal input, so those terms never apply;
``cacheSaltID`` is ``Request(cache_salt_id=...)`` (:func:`engines.trtllm.executor_args.cache_salt_id`).
Note the ``uint32_t`` addition in ``mix32``: ``a + 0x9e3779b9`` wraps at 32 bits before it is
widened (both operands are 32-bit unsigned), which tests pin with vectors from a C++ build.

Invariant: ``trt_block_hash`` equals TensorRT-LLM's hash for every block key of that shape; if a
build changed the function, roots simply stop matching (nothing is misattributed) and the
translator's ``unmatched_roots`` counter shows it.
"""

from __future__ import annotations

from collections.abc import Iterable

from engines.trtllm.executor_args import cache_salt_id

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1


def _mix32(a: int, seed: int) -> int:
    a = (((a >> 16) ^ a) * 0x45D9F3B) & _M32
    a = (((a >> 16) ^ a) * 0x45D9F3B) & _M32
    a = (a >> 16) ^ a
    return (seed ^ ((((a + 0x9E3779B9) & _M32) + (seed << 6) + (seed >> 2)) & _M64)) & _M64


def _mix64(c: int, seed: int) -> int:
    c = ((c ^ (c >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    c = ((c ^ (c >> 27)) * 0x94D049BB133111EB) & _M64
    c = c ^ (c >> 31)
    return (seed ^ ((c + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _M64)) & _M64


def trt_block_hash(tokens: Iterable[int], parent_hash: int = 0, salt_id: int | None = None) -> int:
    """``BlockKeyHasher::hash(BlockKey{tokens, cacheSaltID=salt_id}, parent_hash)`` (see module docstring)."""
    tokens = [int(t) & _M32 for t in tokens]  # static_cast<uint32_t>(uniqueToken.tokenId)
    seed = (len(tokens) ^ (parent_hash * 0xBF58476D1CE4E5B9)) & _M64
    if parent_hash == 0 and salt_id is not None:  # `if (parentHash == 0 && blockKey.cacheSaltID)`: has_value()
        seed = _mix64(int(salt_id), seed)
    for token in tokens:
        seed = _mix32(token, seed)
    return seed


def trt_root_hash(tokens: Iterable[int], salt: str | None) -> int:
    """The hash TensorRT-LLM gives the first block holding ``tokens`` for a request with ``salt``.

    ``salt`` as parsed from the request (``cache_salt``, never empty: the contract makes "" None); the
    executor gets ``cache_salt_id(salt)`` exactly when it is not None (``executor_args.build_request``).
    """
    return trt_block_hash(tokens, 0, cache_salt_id(salt) if salt is not None else None)
