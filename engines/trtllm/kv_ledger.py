"""KV cache events → blocks per tenant per tier, plus offload/onboard/evict counters.

The executor reports block life cycles through ``KVCacheEventManager.get_latest_events``
(nanobind/executor/bindings.cpp, submodule ``kv_cache``). Each ``KVCacheEvent`` has
``event_id``, ``window_size`` and ``data``, one of:

* ``KVCacheCreatedData(num_blocks_per_cache_level)`` — pool sizes per level (0 GPU, 1 host);
* ``KVCacheStoredData(parent_hash, blocks)``, each block ``KVCacheStoredBlockData(block_hash,
  tokens, cache_level, priority, ...)`` — blocks entered the reuse tree. One event carries
  every block of one store call, each the child of the one before; ``parent_hash`` is the
  first block's predecessor, None when the first block is a root (batch_manager/
  kvCacheEventManager.cpp ``enqueueStoredEvent``);
* ``KVCacheRemovedData(block_hashes)`` — blocks dropped from the tree (evicted);
* ``KVCacheUpdatedData(block_hash, cache_level, priority)`` — ``cache_level`` is an optional
  ``KVCacheEventDiffInt(old_value, new_value)``: 0→1 is an offload, 1→0 an onboard.

The data classes differ across builds (nanobind vs pybind, later additions such as
``cache_salt``), so the ledger reads them by attribute, never by class.

Attribution: the events carry no request or tenant id. A stored block inherits the
tenant of its parent; a root block (no known parent) is matched on its tokens against
the first block of requests enqueued but not yet attributed, oldest first. With
``salted`` isolation, chains never cross tenants, so this is exact up to two tenants
sending the same first block at the same moment; with ``shared`` isolation a shared
prefix counts for the tenant that stored it first — documented, and what a quota wants.

Invariant: ``tier_blocks[level]`` equals the number of live hashes at that level, and
the per-tenant counts sum to it minus the unattributed blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

UNATTRIBUTED = ""


@dataclass(slots=True)
class _Block:
    tenant: str
    level: int


@dataclass(slots=True)
class TenantBlockLedger:
    tokens_per_block: int
    max_pending: int = 4096
    level_capacity: list[int] = field(default_factory=lambda: [0, 0])
    offloaded: int = 0
    onboarded: int = 0
    evicted: int = 0
    _blocks: dict[int, _Block] = field(default_factory=dict)
    _counts: dict[str, list[int]] = field(default_factory=dict)
    _pending: dict[tuple[int, ...], deque[str]] = field(default_factory=dict)
    _pending_total: int = 0

    # Requests ------------------------------------------------------------------------
    def note_request(self, tenant: str | None, input_ids: tuple[int, ...] | list[int]) -> None:
        """Remember that ``tenant`` may store a root block holding ``input_ids[:tokens_per_block]``."""
        if len(input_ids) < self.tokens_per_block:
            return  # a partial first block is never stored for reuse
        key = tuple(int(t) for t in input_ids[: self.tokens_per_block])
        queue = self._pending.setdefault(key, deque())
        queue.append(tenant or UNATTRIBUTED)
        self._pending_total += 1
        if self._pending_total > self.max_pending:  # bounded: forget the oldest expectation
            oldest_key = next(iter(self._pending))
            self._pop_pending(oldest_key)

    def forget_request(self, tenant: str | None, input_ids: tuple[int, ...] | list[int]) -> None:
        """A finished request whose root block was reused (no stored event) stops being expected."""
        if len(input_ids) < self.tokens_per_block:
            return
        key = tuple(int(t) for t in input_ids[: self.tokens_per_block])
        queue = self._pending.get(key)
        if queue is None:
            return
        try:
            queue.remove(tenant or UNATTRIBUTED)
        except ValueError:
            return
        self._pending_total -= 1
        if not queue:
            del self._pending[key]

    def _pop_pending(self, key: tuple[int, ...]) -> str | None:
        queue = self._pending.get(key)
        if not queue:
            return None
        tenant = queue.popleft()
        self._pending_total -= 1
        if not queue:
            del self._pending[key]
        return tenant

    # Events --------------------------------------------------------------------------
    def apply(self, events: Any) -> None:
        for event in events:
            self.apply_one(getattr(event, "data", event))

    def apply_one(self, data: Any) -> None:
        if hasattr(data, "num_blocks_per_cache_level"):
            levels = list(data.num_blocks_per_cache_level)
            self.level_capacity = [int(v) for v in levels] + [0] * (2 - len(levels))
        elif hasattr(data, "blocks") and hasattr(data, "parent_hash"):
            self._stored(data.parent_hash, data.blocks)
        elif hasattr(data, "block_hashes"):
            for block_hash in data.block_hashes:
                if self._drop(int(block_hash)):
                    self.evicted += 1
        elif hasattr(data, "block_hash"):
            self._updated(int(data.block_hash), getattr(data, "cache_level", None))

    def _stored(self, parent_hash: Any, blocks: Any) -> None:
        """One stored event: a chain of blocks; the first is a root iff ``parent_hash`` is None.

        Only a root is matched against pending requests by its tokens; a chain under an unknown
        parent stays unattributed (its tokens may equal some root's without being one).
        """
        parent = self._blocks.get(int(parent_hash)) if parent_hash is not None else None
        tenant: str | None = parent.tenant if parent is not None else None
        for index, block in enumerate(blocks):
            if parent_hash is None and index == 0:
                tokens = tuple(int(getattr(t, "token_id", t)) for t in block.tokens)
                tenant = self._pop_pending(tokens)
            owner = tenant if tenant is not None else UNATTRIBUTED
            block_hash = int(block.block_hash)
            self._drop(block_hash)  # a re-stored hash replaces its old entry
            level = int(getattr(block, "cache_level", 0) or 0)
            self._blocks[block_hash] = _Block(owner, level)
            self._count(owner)[level] += 1

    def _updated(self, block_hash: int, diff: Any) -> None:
        if diff is None:
            return
        block = self._blocks.get(block_hash)
        if block is None:
            return
        old, new = int(diff.old_value), int(diff.new_value)
        if old == new:
            return
        self._count(block.tenant)[block.level] -= 1
        block.level = new
        self._count(block.tenant)[new] += 1
        if old == 0 and new == 1:
            self.offloaded += 1
        elif old == 1 and new == 0:
            self.onboarded += 1

    def _drop(self, block_hash: int) -> bool:
        block = self._blocks.pop(block_hash, None)
        if block is None:
            return False
        counts = self._count(block.tenant)
        counts[block.level] -= 1
        if block.tenant != UNATTRIBUTED and counts == [0, 0]:
            del self._counts[block.tenant]
        return True

    def _count(self, tenant: str) -> list[int]:
        return self._counts.setdefault(tenant, [0, 0])

    # Views ---------------------------------------------------------------------------
    def tier_blocks(self) -> list[int]:
        totals = [0, 0]
        for counts in self._counts.values():
            totals[0] += counts[0]
            totals[1] += counts[1]
        return totals

    def tenants(self) -> dict[str, list[int]]:
        """``{tenant: [primary_blocks, secondary_blocks]}`` for attributed tenants."""
        return {t: list(c) for t, c in sorted(self._counts.items()) if t != UNATTRIBUTED and c != [0, 0]}
