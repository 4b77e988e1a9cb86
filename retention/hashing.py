"""Chained block hashes: ``hash(parent hash, block tokens, extra key)``, root salted.

TensorRT-LLM chains ``BlockKeyHasher::hash(blockKey, parentHash)``
(``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``) over a block's unique tokens,
their extra ids and the LoRA task id; its PR #7106 mixes a per-request ``cacheSaltID``
into the *root* key so that descendants inherit it. We do the same with SHA-256
truncated to 64 bits (vLLM's ``sha256`` block-hash option), because the gateway
(adaptive statistics) and the pool must agree on hashes across processes and Python's
``hash`` of ``bytes``/``str`` is randomised per process.

    root = H("kvgate-salt" | salt)           (0 when there is no salt)
    h_0  = H(root | extra | tokens[0:B])
    h_i  = H(h_{i-1} | extra | tokens[iB:(i+1)B])

Only full blocks are hashed. Tokens are packed as int32 little-endian bytes, which is
also how blocks store them, so a hash hit is confirmed by a ``bytes`` comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import sha256
from struct import Struct

import numpy as np

from retention.types import BlockHash

UNSALTED_ROOT = 0
_U64 = Struct("<Q")
_U32 = Struct("<I")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class TokenError(ValueError):
    """Token ids that cannot be packed (not integers, or outside int32)."""


def root_hash(salt: str | None) -> int:
    """The parent hash of a chain's first block; different salts never share blocks."""
    if not salt:
        return UNSALTED_ROOT
    digest = sha256(b"kvgate-salt\x00" + salt.encode("utf-8")).digest()
    return _U64.unpack_from(digest)[0]


def pack_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Tokens as int32 little-endian bytes (fast path for numpy int32 arrays)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.dtype("<i4") and tokens.ndim == 1:
        return tokens.tobytes()
    try:
        wide = np.asarray(tokens, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TokenError(f"tokens must be integers: {exc}") from exc
    if wide.ndim != 1:
        raise TokenError(f"tokens must be a flat sequence, got shape {wide.shape}")
    if wide.size and (int(wide.min()) < _INT32_MIN or int(wide.max()) > _INT32_MAX):
        raise TokenError("token ids must fit in int32")
    return wide.astype("<i4").tobytes()


def chain_hash(parent: int, block_bytes: bytes, extra_key: bytes = b"") -> BlockHash:
    """Hash of one full block given its parent's hash (see module docstring).

    Input: parent (u64) [+ len(extra) (u32) + extra] + tokens. Within one pool every block
    has the same byte length, so inputs with and without an extra key cannot coincide.
    """
    h = sha256(_U64.pack(parent))
    if extra_key:
        h.update(_U32.pack(len(extra_key)))
        h.update(extra_key)
    h.update(block_bytes)
    return BlockHash(_U64.unpack_from(h.digest())[0])


def block_hashes(
    tokens: Sequence[int] | np.ndarray | bytes,
    tokens_per_block: int,
    *,
    salt: str | None = None,
    extra_key: bytes = b"",
    limit: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``tokens`` (at most ``limit`` blocks).

    Same function the pool uses, exported for the gateway's reuse statistics.
    """
    packed = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
    return chain_hashes(packed, tokens_per_block, root_hash(salt), extra_key, limit=limit)  # type: ignore[return-value]


def chain_hashes(
    packed: bytes, tokens_per_block: int, parent: int, extra_key: bytes = b"", *, limit: int | None = None
) -> list[int]:
    """``chain_hash`` down the full blocks of ``packed`` (at most ``limit``), starting below ``parent``.

    The one loop both :func:`block_hashes` and the pool run: ``chain_hash`` inlined (the same
    bytes hashed in the same order, so the same results; a test compares the two), because
    hashing every block of every prompt is a replay's hot path.
    """
    width = tokens_per_block * 4
    count = len(packed) // width
    if limit is not None:
        count = min(count, limit)
    extra = _U32.pack(len(extra_key)) + extra_key if extra_key else b""
    pack, unpack, new = _U64.pack, _U64.unpack_from, sha256
    out: list[int] = []
    h = parent
    for i in range(count):
        hasher = new(pack(h))
        if extra:
            hasher.update(extra)
        hasher.update(packed[i * width : (i + 1) * width])
        h = unpack(hasher.digest())[0]
        out.append(h)
    return out
