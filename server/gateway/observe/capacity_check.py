"""Registry vs engine: does a pool's registered KV capacity match what its engine allocated?

Operators register ``tokens_per_block``, ``primary_blocks`` and ``secondary_blocks`` by hand
(or from ``kvgate plan``); the engine decides the real numbers when it starts (TensorRT-LLM
sizes its pools from free memory × ``free_gpu_memory_fraction`` and ``host_cache_size``; the
reference engine from its flags). The stats side channel (``engines.contract.PoolStatsReport``)
reports them. :func:`capacity_mismatch` compares the two; the engine's figures win for every
computation that depends on capacity (quota limits), the registry's stay what was asked for.

Pure: no I/O, no clock. The pool monitor calls it on every poll.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.contract import PoolStatsReport
from tenants.snapshots import PoolSnapshot


@dataclass(frozen=True, slots=True)
class CapacityCheck:
    pool: str
    registered_primary: int
    registered_secondary: int
    registered_tokens_per_block: int
    reported_primary: int
    reported_secondary: int
    reported_tokens_per_block: int

    @property
    def mismatch(self) -> bool:
        return (self.registered_primary, self.registered_secondary, self.registered_tokens_per_block) != (
            self.reported_primary, self.reported_secondary, self.reported_tokens_per_block)

    @property
    def effective_primary(self) -> int:
        """Primary blocks to compute with: the engine's, unless it reports none (not started yet)."""
        return self.reported_primary if self.reported_primary > 0 else self.registered_primary

    def message(self) -> str:
        parts = []
        for label, registered, reported in (
            ("primary_blocks", self.registered_primary, self.reported_primary),
            ("secondary_blocks", self.registered_secondary, self.reported_secondary),
            ("tokens_per_block", self.registered_tokens_per_block, self.reported_tokens_per_block),
        ):
            if registered != reported:
                parts.append(f"{label} registered {registered}, engine reports {reported}")
        return (f"pool {self.pool!r}: registry and engine disagree ({'; '.join(parts)}); "
                "quota arithmetic uses the engine's figures — update the pool (kvgate plan gives the values)")


def capacity_mismatch(pool: PoolSnapshot, stats: PoolStatsReport) -> CapacityCheck:
    """Compare a pool's registry row with one engine stats report."""
    return CapacityCheck(
        pool=pool.name,
        registered_primary=pool.primary_blocks,
        registered_secondary=pool.secondary_blocks,
        registered_tokens_per_block=pool.tokens_per_block,
        reported_primary=stats.primary.max_blocks,
        reported_secondary=stats.secondary.max_blocks,
        reported_tokens_per_block=stats.tokens_per_block,
    )
