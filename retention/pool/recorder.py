"""What the pool reports: KV cache events, traffic counters, per-tenant block counts.

The pool's moves (``tiers.py``) and its tree (``block_pool.py``) report here and read
nothing back, so the emission is one concern in one place, as vLLM keeps its KV events and
``v1/metrics/stats.py`` apart from ``BlockPool``'s moves. Events mirror the points where
TensorRT-LLM's ``WindowBlockManager`` calls ``mEventManager->enqueue*Event``
(``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``); counters follow ``KvCacheStats``
(see ``stats.py``).

Invariants: event ids start at 1 and grow by one per queued event, in emission order; an
event is built only when events are on (``event_buffer_max_size != 0``); a tenant's
``(primary, secondary)`` count is the number of tree or in-use blocks it owns in each tier.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from retention.pool.blocks import Block
from retention.pool.events import CreatedEvent, KvEvent
from retention.pool.stats import PoolCounters, PoolStats
from retention.pool.types import PoolConfig
from retention.types import Tier


class PoolRecorder:
    """The event queue, the cumulative counters and the per-tenant block counts of one pool."""

    __slots__ = ("counters", "events_on", "_events", "_event_id", "_tenants")

    def __init__(self, config: PoolConfig) -> None:
        self.counters = PoolCounters()
        maxlen = config.event_buffer_max_size
        self.events_on = maxlen != 0
        self._events: deque[KvEvent] = deque(maxlen=maxlen)
        self._event_id = 0
        self._tenants: dict[str, list[int]] = {}
        self.emit(lambda i: CreatedEvent(i, (config.primary_blocks, config.secondary_blocks)))

    def emit(self, make: Callable[[int], KvEvent]) -> None:
        """Queue ``make(next event id)``; ``make`` is not called when events are off."""
        if self.events_on:
            self._event_id += 1
            self._events.append(make(self._event_id))

    def take_events(self) -> list[KvEvent]:
        """Drain and return the queued events, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events

    def count(self, block: Block, tier: Tier, delta: int) -> None:
        """Add ``delta`` to the count of ``block``'s owner in ``tier`` (no owner: nothing)."""
        tenant = block.tenant
        if tenant is not None:
            counts = self._tenants.get(tenant)
            if counts is None:
                counts = self._tenants[tenant] = [0, 0]
            counts[tier] += delta

    def moved_to_host(self, block: Block) -> None:
        """``block`` was offloaded: its owner holds one primary block fewer, one host block more."""
        if block.tenant is not None:
            counts = self._tenants[block.tenant]
            counts[0] -= 1
            counts[1] += 1

    def tenant_blocks(self) -> dict[str, tuple[int, int]]:
        """tenant -> (primary, secondary) blocks it holds, in use or cached (owner = who allocated it)."""
        return {t: (c[0], c[1]) for t, c in self._tenants.items() if c[0] or c[1]}

    def stats(self, config: PoolConfig, *, num_free_primary: int, host_empty: int, num_cached: int) -> PoolStats:
        """A snapshot from the tiers' occupancy and the counters.

        Invariant: ``used_num_blocks + free_num_blocks == max_num_blocks``.
        """
        c = self.counters
        in_use = config.primary_blocks - num_free_primary
        host_cached = config.secondary_blocks - host_empty
        return PoolStats(
            tokens_per_block=config.tokens_per_block,
            max_num_blocks=config.primary_blocks,
            free_num_blocks=num_free_primary,
            used_num_blocks=in_use,
            secondary_max_blocks=config.secondary_blocks,
            secondary_free_blocks=host_empty,
            secondary_used_blocks=host_cached,
            cached_primary_blocks=num_cached - host_cached,
            alloc_total_blocks=c.alloc_total_blocks,
            alloc_new_blocks=c.alloc_new_blocks,
            reused_blocks=c.reused_blocks,
            reused_primary_blocks=c.reused_primary_blocks,
            reused_secondary_blocks=c.reused_secondary_blocks,
            missed_blocks=c.missed_blocks,
            offloaded_blocks=c.offloaded_blocks,
            onboarded_blocks=c.onboarded_blocks,
            evicted_primary_blocks=c.evicted_primary_blocks,
            evicted_secondary_blocks=c.evicted_secondary_blocks,
            expired_blocks=c.expired_blocks,
        )
