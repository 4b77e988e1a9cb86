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

The data classes differ across builds (nanobind vs pybind, fields added over releases), so
the ledger reads them by attribute, never by class. None of them carries a salt.

Attribution: the events carry no request or tenant id. A stored block inherits the
tenant of its parent; a root block (``parent_hash`` None) is matched by its TensorRT-LLM
``block_hash``, which mixes the request's ``cacheSaltID`` into the root
(``engines/trtllm/block_key.py``), against the root hash of each noted request's first block
under its salt. With ``salted`` (or ``dedicated``) isolation a hash belongs to one tenant, so
attribution is exact whatever the order of requests, reused roots (no stored event) or late
events. Tenants without a salt (``shared``) have the same hash for the same first block: among
them the root goes to the oldest noted request not yet attributed or forgotten, and when none
is left (an event later than the end of its request) to the last tenant that claimed it — a
shared prefix counts for one of the tenants sharing it, which is what a quota wants.

Invariant: ``tier_blocks[level]`` equals the number of live hashes at that level, and
the per-tenant counts sum to it minus the unattributed blocks.

Lost events. The executor's buffer keeps ``event_buffer_max_size`` events and erases the oldest
past it ("Events have been discarded", ``KVCacheEventManager::worker``, kvCacheEventManager.cpp);
event ids come from one counter, so a lost event is a gap in them, counted in ``gaps`` and logged
as a warning (raise the buffer). The blocks are kept: forgetting them would leave every block
stored later under a prefix cached before the gap unattributed for good (TensorRT-LLM sends
nothing for a reused block), while a removal among the lost events over-counts only that block,
until its hash is stored again and removed, or the engine restarts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from engines.trtllm.block_key import trt_root_hash

UNATTRIBUTED = ""
log = logging.getLogger("kvgate.trtllm.ledger")


@dataclass(slots=True)
class _Block:
    tenant: str
    level: int


@dataclass(slots=True)
class _Root:
    """Noted requests whose first block has one TensorRT-LLM root hash (one salt)."""

    tokens: tuple[int, ...]
    last: str  # the tenant a root with no pending request left is given (late events)
    pending: deque[str] = field(default_factory=deque)


@dataclass(slots=True)
class TenantBlockLedger:
    tokens_per_block: int
    max_pending: int = 4096
    max_roots: int = 4096
    level_capacity: list[int] = field(default_factory=lambda: [0, 0])
    offloaded: int = 0
    onboarded: int = 0
    evicted: int = 0
    _blocks: dict[int, _Block] = field(default_factory=dict)
    _counts: dict[str, list[int]] = field(default_factory=dict)
    _roots: OrderedDict[int, _Root] = field(default_factory=OrderedDict)  # TensorRT-LLM root hash, newest last
    _pending_total: int = 0
    _last_event_id: int | None = None
    gaps: int = 0  # times events were lost (a gap in their ids) and the blocks were forgotten

    # Requests ------------------------------------------------------------------------
    def note_request(self, tenant: str | None, input_ids: tuple[int, ...] | list[int], salt: str | None = None) -> None:
        """``tenant`` may store the root holding ``input_ids[:tokens_per_block]`` under ``salt``."""
        if len(input_ids) < self.tokens_per_block:
            return  # its root is stored only at release, filled with generated tokens: not matched
        tokens = tuple(int(t) for t in input_ids[: self.tokens_per_block])
        owner = tenant or UNATTRIBUTED
        key = trt_root_hash(tokens, salt or None)
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = _Root(tokens, owner)
        self._roots.move_to_end(key)
        root.pending.append(owner)
        self._pending_total += 1
        while self._pending_total > self.max_pending:  # bounded: forget the oldest expectations
            oldest = next(root for root in self._roots.values() if root.pending)
            oldest.pending.popleft()
            self._pending_total -= 1
        while len(self._roots) > self.max_roots:
            _, dropped = self._roots.popitem(last=False)
            self._pending_total -= len(dropped.pending)

    def forget_request(self, tenant: str | None, input_ids: tuple[int, ...] | list[int], salt: str | None = None) -> None:
        """A finished request stops being pending; its root hash still resolves (late events)."""
        if len(input_ids) < self.tokens_per_block:
            return
        root = self._roots.get(trt_root_hash(input_ids[: self.tokens_per_block], salt or None))
        if root is None:
            return
        try:
            root.pending.remove(tenant or UNATTRIBUTED)
        except ValueError:
            return
        self._pending_total -= 1

    def _root_tenant(self, block: Any) -> str:
        root = self._roots.get(int(block.block_hash))
        if root is None or root.tokens != tuple(int(getattr(t, "token_id", t)) for t in block.tokens):
            return UNATTRIBUTED
        if root.pending:
            root.last = root.pending.popleft()
            self._pending_total -= 1
        return root.last

    # Events --------------------------------------------------------------------------
    def apply(self, events: Any) -> None:
        for event in events:
            event_id = getattr(event, "event_id", None)
            if event_id is not None:
                if self._last_event_id is not None and int(event_id) != self._last_event_id + 1:
                    self.gaps += 1
                    log.warning("KV cache events %d..%d were lost (raise event_buffer_max_size): a block they "
                                "removed stays counted for its tenant until its hash is stored again",
                                self._last_event_id + 1, int(event_id) - 1)
                self._last_event_id = int(event_id)
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

        Only a root is matched, by its TensorRT-LLM hash; a chain under an unknown parent stays
        unattributed (its tokens may equal some root's without being one).
        """
        parent = self._blocks.get(int(parent_hash)) if parent_hash is not None else None
        tenant: str | None = parent.tenant if parent is not None else None
        for index, block in enumerate(blocks):
            if parent_hash is None and index == 0:
                tenant = self._root_tenant(block)
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
