"""TensorRT-LLM KV cache events → kvgate block hashes, for routers (``engines/kv_events.py``).

The executor's ``KVCacheEventManager.get_latest_events`` (nanobind/executor/bindings.cpp,
submodule ``kv_cache``) reports blocks by TensorRT-LLM's own block hash
(``BlockKeyHasher`` in ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``), which
depends on the build and mixes the request's ``cacheSaltID`` in ways the gateway cannot
reproduce. So the router never sees it: every stored block is re-hashed with kvgate's
chain hash over the tokens the event carries (``KVCacheStoredBlockData.tokens``, each a
``UniqueToken`` with ``token_id``), and TensorRT-LLM's hash is only a key to find the
kvgate hash again for later *removed* / *updated* events::

    stored(parent=P, blocks=[b1 b2])   kv(b1) = chain_hash(kv(P) or root(salt), tokens(b1))
                                       kv(b2) = chain_hash(kv(b1), tokens(b2))
    removed([b1])                      → REMOVED kv(b1); the map entry is dropped
    updated(b2, cache_level 0→1)       → MOVED kv(b2) to host

Roots: a block without a parent starts a chain whose kvgate root depends on the request's
salt, which events do not carry. As ``kv_ledger.TenantBlockLedger`` does for tenants, the
translator matches a root block's tokens against the first block of requests enqueued
and not yet seen (``note_request`` / ``forget_request``), oldest first. A root that
matches no pending request, or a block whose parent is unknown (its chain was never
translated), is not reported: the router then simply does not credit that prefix.

Invariants: the map from TensorRT-LLM hash to kvgate hash only holds blocks currently
reported cached (removal drops the entry) and never exceeds ``max_blocks`` (when it
would, it is cleared and every poller resyncs); a gap in TensorRT-LLM's ``event_id``
sequence (its bounded ``event_buffer_max_size`` dropped events) makes every poller resync.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engines.kv_events import MOVED, REMOVED, STORED, KvEventLog
from retention.hashing import chain_hash, pack_tokens, root_hash


@dataclass(slots=True)
class KvEventTranslator:
    tokens_per_block: int
    log: KvEventLog = field(init=False)
    max_blocks: int = 1 << 20
    max_pending: int = 4096
    _kv: dict[int, int] = field(default_factory=dict)  # TensorRT-LLM block hash -> kvgate hash
    _tier: dict[int, int] = field(default_factory=dict)  # kvgate hash -> cache level (0 GPU, 1 host)
    _pending: dict[tuple[int, ...], deque[str | None]] = field(default_factory=dict)
    _pending_total: int = 0
    _last_event_id: int | None = None

    def __post_init__(self) -> None:
        self.log = KvEventLog(lambda: dict(self._tier))

    # Requests ------------------------------------------------------------------------
    def note_request(self, salt: str | None, input_ids: tuple[int, ...] | list[int]) -> None:
        """A request with this salt may store a root block holding ``input_ids[:tokens_per_block]``."""
        if len(input_ids) < self.tokens_per_block:
            return  # a partial first block is never stored for reuse
        key = tuple(int(t) for t in input_ids[: self.tokens_per_block])
        self._pending.setdefault(key, deque()).append(salt or None)
        self._pending_total += 1
        if self._pending_total > self.max_pending:  # bounded: forget the oldest expectation
            self._pop(next(iter(self._pending)))

    def forget_request(self, salt: str | None, input_ids: tuple[int, ...] | list[int]) -> None:
        """A finished request whose root block was reused (no stored event) stops being expected."""
        key = tuple(int(t) for t in input_ids[: self.tokens_per_block])
        queue = self._pending.get(key)
        if queue is None or len(input_ids) < self.tokens_per_block:
            return
        try:
            queue.remove(salt or None)
        except ValueError:
            return
        self._pending_total -= 1
        if not queue:
            del self._pending[key]

    def _pop(self, key: tuple[int, ...]) -> tuple[bool, str | None]:
        queue = self._pending.get(key)
        if not queue:
            return False, None
        salt = queue.popleft()
        self._pending_total -= 1
        if not queue:
            del self._pending[key]
        return True, salt

    # Events --------------------------------------------------------------------------
    def apply(self, events: Any) -> None:
        """Translate a batch from ``get_latest_events`` (read by attribute, as the ledger does)."""
        for event in events:
            event_id = getattr(event, "event_id", None)
            if event_id is not None:
                if self._last_event_id is not None and int(event_id) != self._last_event_id + 1:
                    self.log.invalidate()
                self._last_event_id = int(event_id)
            self._apply_one(getattr(event, "data", event))

    def _apply_one(self, data: Any) -> None:
        if hasattr(data, "num_blocks_per_cache_level"):  # KVCacheCreatedData: a fresh pool
            self._kv.clear()
            self._tier.clear()
            self.log.invalidate()
        elif hasattr(data, "blocks") and hasattr(data, "parent_hash"):  # KVCacheStoredData
            self._stored(data.parent_hash, data.blocks)
        elif hasattr(data, "block_hashes"):  # KVCacheRemovedData
            gone = [kv for kv in (self._kv.pop(int(h), None) for h in data.block_hashes) if kv is not None]
            for kv in gone:
                self._tier.pop(kv, None)
            self.log.append(REMOVED, gone)
        elif hasattr(data, "block_hash"):  # KVCacheUpdatedData (cache_level: KVCacheEventDiffInt | None)
            diff = getattr(data, "cache_level", None)
            kv = self._kv.get(int(data.block_hash))
            if diff is None or kv is None or int(diff.old_value) == int(diff.new_value):
                return
            self._tier[kv] = int(diff.new_value)
            self.log.append(MOVED, (kv,), int(diff.new_value))

    def _stored(self, parent_hash: Any, blocks: Any) -> None:
        if parent_hash is not None:
            parent = self._kv.get(int(parent_hash))
            if parent is None:
                return  # the chain above was never translated: nothing below can be hashed
        else:
            first = blocks[0] if blocks else None
            if first is None:
                return
            found, salt = self._pop(self._tokens(first))
            if not found:
                return  # no request expected this root: its salt is unknown
            parent = root_hash(salt)
        by_level: dict[int, list[int]] = {}
        for block in blocks:
            tokens = self._tokens(block)
            if len(tokens) != self.tokens_per_block:
                break  # kvgate hashes full blocks only
            kv = chain_hash(parent, pack_tokens(tokens))
            self._kv[int(block.block_hash)] = kv
            level = int(getattr(block, "cache_level", 0) or 0)
            self._tier[kv] = level
            by_level.setdefault(level, []).append(kv)
            parent = kv
        for level, hashes in by_level.items():
            self.log.append(STORED, hashes, level)
        if len(self._kv) > self.max_blocks:  # events were lost somewhere: start over, resync pollers
            self._kv.clear()
            self._tier.clear()
            self.log.invalidate()

    @staticmethod
    def _tokens(block: Any) -> tuple[int, ...]:
        return tuple(int(getattr(t, "token_id", t)) for t in block.tokens)
