"""TensorRT-LLM KV cache events → kvgate block hashes, for routers (``engines/kv_events.py``).

The executor's ``KVCacheEventManager.get_latest_events`` (nanobind/executor/bindings.cpp,
submodule ``kv_cache``) reports blocks by TensorRT-LLM's own block hash (``BlockKeyHasher``,
reproduced in :mod:`engines.trtllm.block_key`). The router never sees it: every stored block
is re-hashed with kvgate's chain hash over the tokens the event carries
(``KVCacheStoredBlockData.tokens``, each a ``UniqueToken`` with ``token_id``), and
TensorRT-LLM's hash is only a key to find the kvgate hash again for later *removed* /
*updated* events::

    stored(parent=P, blocks=[b1 b2])   kv(b1) = chain_hash(kv(P) or root(salt), tokens(b1))
                                       kv(b2) = chain_hash(kv(b1), tokens(b2))
    removed([b1])                      → REMOVED kv(b1); the map entry is dropped
    updated(b2, cache_level 0→1)       → MOVED kv(b2) to host

Roots: a block without a parent starts a chain whose kvgate root depends on the request's
salt, which events do not carry. TensorRT-LLM mixes the request's ``cacheSaltID`` into the
root's hash, so the salt is recovered *exactly*: ``note_request`` computes the TensorRT-LLM
hash of the request's first block under its salt (``block_key.trt_root_hash``) and keeps
``hash -> (salt, tokens)`` in a bounded most-recently-noted map; a stored root is
translated only when its ``block_hash`` and tokens equal an entry. A root of another salt
has another hash, so it can never be filed under this salt, whatever the order of requests,
reused roots (which emit nothing) and late or batched events. Entries are facts, not
expectations: they are not consumed by a match nor dropped when a request ends, so an event
that arrives after its request finished is still translated; the bound only forgets the
least recently noted first blocks. A root that matches no entry (a prompt shorter than one
block whose root filled with generated tokens, an entry forgotten under load, a build whose
hash differs) and a block whose parent is unknown are not reported: the router then simply
does not credit that prefix (``unmatched_roots`` counts the former).

Invariants: every STORED hash is ``block_hashes(tokens of its chain, salt=s)[-1]`` for the
salt ``s`` whose ``cacheSaltID`` produced the root's TensorRT-LLM hash; the map from
TensorRT-LLM hash to kvgate hash only holds blocks currently reported cached (removal drops
the entry) and never exceeds ``max_blocks`` (when it would, it is cleared and every poller
resyncs); a gap in TensorRT-LLM's ``event_id`` sequence (its bounded ``event_buffer_max_size``
dropped events) makes every poller resync.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from engines.kv_events import MOVED, REMOVED, STORED, KvEventLog
from engines.trtllm.block_key import trt_root_hash
from retention.hashing import chain_hash, pack_tokens, root_hash


@dataclass(slots=True)
class KvEventTranslator:
    tokens_per_block: int
    log: KvEventLog = field(init=False)
    max_blocks: int = 1 << 20
    max_roots: int = 4096
    matched_roots: int = 0
    unmatched_roots: int = 0
    _kv: dict[int, int] = field(default_factory=dict)  # TensorRT-LLM block hash -> kvgate hash
    _tier: dict[int, int] = field(default_factory=dict)  # kvgate hash -> cache level (0 GPU, 1 host)
    # TensorRT-LLM root hash -> (salt, first-block tokens), most recently noted last
    _roots: OrderedDict[int, tuple[str | None, tuple[int, ...]]] = field(default_factory=OrderedDict)
    _last_event_id: int | None = None

    def __post_init__(self) -> None:
        self.log = KvEventLog(lambda: dict(self._tier))

    # Requests ------------------------------------------------------------------------
    def note_request(self, salt: str | None, input_ids: tuple[int, ...] | list[int]) -> None:
        """Remember which salt a root holding ``input_ids[:tokens_per_block]`` would come from.

        Call it before (or while) the request is enqueued. Prompts shorter than a block are not
        noted: their root is stored only at release, filled with generated tokens.
        """
        if len(input_ids) < self.tokens_per_block:
            return
        tokens = tuple(int(t) for t in input_ids[: self.tokens_per_block])
        key = trt_root_hash(tokens, salt or None)
        self._roots[key] = (salt or None, tokens)
        self._roots.move_to_end(key)
        while len(self._roots) > self.max_roots:
            self._roots.popitem(last=False)

    def hash_mismatch_suspected(self, threshold: int = 32) -> bool:
        """True when ``threshold`` stored roots arrived and none matched a noted request.

        What a TensorRT-LLM build whose ``BlockKeyHasher`` differs from ``block_key.py`` looks like:
        nothing is misattributed, but nothing is reported either.
        """
        return self.matched_roots == 0 and self.unmatched_roots >= threshold

    # Events --------------------------------------------------------------------------
    def apply(self, events: Any) -> None:
        """Translate a batch from ``get_latest_events`` (read by attribute, as the ledger does)."""
        for event in events:
            event_id = getattr(event, "event_id", None)
            if event_id is not None:
                if self._last_event_id is not None and int(event_id) != self._last_event_id + 1:
                    # events were lost (the executor's buffer overflowed): pollers resync from the
                    # snapshot. The maps are kept: TensorRT-LLM sends nothing for a reused block, so
                    # forgetting a hot prefix would leave every block stored under it unknown for good;
                    # a removal among the lost events leaves that block listed until its hash is
                    # stored again (and then removed) or the engine restarts (the ledger warns)
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
        if not blocks:
            return
        if parent_hash is not None:
            parent = self._kv.get(int(parent_hash))
            if parent is None:
                return  # the chain above was never translated: nothing below can be hashed
        else:
            first = blocks[0]
            entry = self._roots.get(int(first.block_hash))
            if entry is None or entry[1] != self._tokens(first):
                self.unmatched_roots += 1
                return  # no noted request has this root under its salt
            self.matched_roots += 1
            parent = root_hash(entry[0])
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
