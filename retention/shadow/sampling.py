"""Spatial sampling of block chains (SHARDS, Waldspurger et al., FAST '15).

A block's chained hash (``retention/hashing.py``) names the whole prefix chain that ends
at it, and SHA-256 makes it uniform over 64 bits. A :class:`HashSample` keeps a block iff
its hash falls in a fixed slice of the hash space: ``((h >> 32) - start × 2^32) mod 2^32 <
rate × 2^32`` (``start`` = 0 by default; other starts give independent samples). The slice is
the same for every request, every pool and every process (no RNG), so a kept chain is kept
on every use, and a cache of ``C × rate`` blocks fed only the kept blocks sees the same
reuse pattern as a cache of ``C`` blocks fed everything — its hit ratio estimates the full
cache's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

_SPACE = 1 << 32


@dataclass(frozen=True, slots=True)
class HashSample:
    """The fixed slice ``[start, start + rate)`` (mod 1) of the upper 32 bits of the block-hash space."""

    rate: float
    start: float = 0.0
    threshold: int = field(init=False)
    _low: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"sampling rate must be within (0, 1], got {self.rate!r}")
        if not 0.0 <= self.start < 1.0:
            raise ValueError(f"sample start must be within [0, 1), got {self.start!r}")
        object.__setattr__(self, "threshold", max(1, round(self.rate * _SPACE)))
        object.__setattr__(self, "_low", round(self.start * _SPACE) % _SPACE)

    def keeps(self, block_hash: int) -> bool:
        return ((block_hash >> 32) - self._low) % _SPACE < self.threshold

    def indices(self, hashes: Sequence[int]) -> list[int]:
        """Positions of the kept hashes, in chain order. O(len(hashes))."""
        threshold, low = self.threshold, self._low
        if not low:
            return [i for i, h in enumerate(hashes) if (h >> 32) < threshold]
        return [i for i, h in enumerate(hashes) if ((h >> 32) - low) % _SPACE < threshold]

    def scale(self, blocks: int) -> int:
        """A capacity of ``blocks`` scaled to the sample (at least 1 when ``blocks`` > 0)."""
        return 0 if blocks <= 0 else max(1, round(blocks * self.rate))
