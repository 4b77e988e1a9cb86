"""Registry vs engine: does a pool's registered KV capacity match what its engine allocated?

Operators register ``tokens_per_block``, ``primary_blocks`` and ``secondary_blocks`` by hand
(or from ``kvgate plan``); the engine decides the real numbers when it starts (TensorRT-LLM
sizes its pools from free memory × ``free_gpu_memory_fraction`` and ``host_cache_size``; the
reference engine from its flags). The stats side channel (``engines.pool_stats.PoolStatsReport``)
reports them, per replica. :func:`capacity_mismatch` compares each replica's own figures with
the registration (which is per replica); the engine's figures win for every computation that
depends on capacity (quota limits), the registry's stay what was asked for.

Pure: no I/O, no clock. The pool monitor calls it on every poll.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engines.pool_stats import PoolStatsReport
from tenants.snapshots import PoolSnapshot


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """What one replica's engine reports (its own pool, not the sum over the pool's replicas)."""

    replica: str
    primary: int
    secondary: int
    tokens_per_block: int


@dataclass(frozen=True, slots=True)
class CapacityCheck:
    """The registry's per-replica figures against every replica's own report.

    Invariant: ``mismatch`` iff some started replica's own (primary, secondary, tokens per
    block) differs from the registration, which is per replica (two replicas of 1,024 blocks
    each match a registration of 1,024); a replica reporting 0 primary blocks has not sized
    its pool yet and is compared with nothing. ``reported_*`` are the first disagreeing replica's
    figures, else the first replica's; ``effective_primary`` is the pool's GPU blocks to
    compute quotas with: the sum of the replicas' own, a replica that reports none yet
    counting as registered."""

    pool: str
    registered_primary: int
    registered_secondary: int
    registered_tokens_per_block: int
    replicas: tuple[ReplicaCapacity, ...]

    def _differs(self, r: ReplicaCapacity) -> bool:
        if r.primary <= 0:  # not started yet: what effective_primary counts as registered
            return False
        return (r.primary, r.secondary, r.tokens_per_block) != (
            self.registered_primary, self.registered_secondary, self.registered_tokens_per_block)

    @property
    def mismatch(self) -> bool:
        return any(self._differs(r) for r in self.replicas)

    @property
    def shown(self) -> ReplicaCapacity | None:
        """The replica whose figures ``reported_*`` show: the first that disagrees, else the first."""
        return next((r for r in self.replicas if self._differs(r)), self.replicas[0] if self.replicas else None)

    @property
    def reported_primary(self) -> int:
        return self.shown.primary if self.shown else 0

    @property
    def reported_secondary(self) -> int:
        return self.shown.secondary if self.shown else 0

    @property
    def reported_tokens_per_block(self) -> int:
        return self.shown.tokens_per_block if self.shown else 0

    @property
    def effective_primary(self) -> int:
        """The pool's primary blocks to compute with: each replica's engine figure, unless it
        reports none (not started yet), then the registration."""
        if not self.replicas:
            return self.registered_primary
        return sum(r.primary if r.primary > 0 else self.registered_primary for r in self.replicas)

    def message(self) -> str:
        parts = []
        for r in self.replicas:
            if not self._differs(r):
                continue
            for label, registered, reported in (
                ("primary_blocks", self.registered_primary, r.primary),
                ("secondary_blocks", self.registered_secondary, r.secondary),
                ("tokens_per_block", self.registered_tokens_per_block, r.tokens_per_block),
            ):
                if registered != reported:
                    where = f"replica {r.replica!r} " if len(self.replicas) > 1 else ""
                    parts.append(f"{where}{label} registered {registered}, engine reports {reported}")
        return (f"pool {self.pool!r}: registry and engine disagree ({'; '.join(parts)}); "
                "quota arithmetic uses the engine's figures — update the pool (kvgate plan gives the values; "
                "block counts are per replica)")


def capacity_mismatch(pool: PoolSnapshot, reports: Mapping[str, PoolStatsReport]) -> CapacityCheck:
    """Compare a pool's registry row (per replica) with each replica's own stats report.

    ``reports``: replica name -> its own report. Never a sum over replicas
    (``routing.sum_reports``): its capacity is N × the registration."""
    return CapacityCheck(
        pool=pool.name,
        registered_primary=pool.primary_blocks,
        registered_secondary=pool.secondary_blocks,
        registered_tokens_per_block=pool.tokens_per_block,
        replicas=tuple(ReplicaCapacity(name, r.primary.max_blocks, r.secondary.max_blocks, r.tokens_per_block)
                       for name, r in sorted(reports.items())),
    )
