"""Per-replica block indexes in kvgate's salted block-hash space: precise and approximate.

Both answer one question for the router: *how long a prefix of this request's chain does
the replica hold, and in which tier?* (:meth:`BlockIndex.match`). Hashes are kvgate's own
(``retention.hashing.block_hashes``), never an engine's internal hash, so a salted tenant's
chain (root mixed with its salt) can never match another tenant's blocks.

``PreciseIndex`` — fed by the replica's KV events (``retention/pool/events.py``, shaped like
TensorRT-LLM's ``KVCacheEvent``): *stored* (hashes, tier), *removed* (hashes), *updated*
with a cache-level change (GPU→host offload, host→GPU onboard); *created* means the
engine (re)started, so the index is cleared. The reference engine forwards its
``BlockPool.take_events()`` unchanged. Same idea as NVIDIA Dynamo's ``KvIndexer`` (a radix
tree fed by worker KV events; ai-dynamo/dynamo ``docs/architecture/kv_cache_routing.md``)
and llm-d's *precise* prefix-cache scorer. A flat hash → tier map suffices because the
hashes are chained: ``h_i`` present implies the whole prefix it was computed from.

``ApproximateIndex`` — for engines without events (orchestrator-mode TensorRT-LLM): what
the router itself sent to the replica, aged by a model of the replica's capacity. Dynamo's
``ApproxKvIndexer`` keeps routed prefixes for a fixed TTL (120 s); SGLang's cache-aware
router keeps an approximate radix tree per worker evicted by size. kvgate models the pool
it fronts: an LRU of ``primary_blocks`` GPU blocks whose victims move to an LRU of
``secondary_blocks`` host blocks (offload), then drop; an optional ``ttl_s`` also ages
entries out. Within one request the chain's tail is the least recently used, as the pool
releases leaf first::

    record(h0 h1 h2)  →  GPU LRU: … h2 h1 h0 (MRU)   overflow → host LRU … → dropped

Pure: no clock is read; ``now`` (seconds) is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from retention.pool.events import CreatedEvent, KvEvent, RemovedEvent, StoredEvent, UpdatedEvent
from retention.routing.types import PrefixMatch, RoutingError
from retention.types import Tier

_GPU, _HOST = Tier.PRIMARY, Tier.SECONDARY


class BlockIndex(Protocol):
    """What the router asks of a replica's index."""

    mode: str  # "precise" | "approximate"

    def match(self, hashes: Sequence[int], *, now: float) -> PrefixMatch:
        """Longest held prefix of ``hashes`` (stop at the first miss), split GPU / host."""
        ...

    def record(self, hashes: Sequence[int], *, now: float) -> None:
        """The router sent a request with these prompt hashes to this replica."""
        ...

    def clear(self) -> None:
        """Forget everything (replica restarted, or taken out of rotation)."""
        ...

    def __len__(self) -> int: ...


class PreciseIndex:
    """Block hash → tier, maintained from the replica's KV events.

    Invariant: after :meth:`apply` of a pool's complete event stream, the index holds
    exactly the pool's cached blocks with their tiers (tests replay a real pool).
    ``missed_events`` counts gaps in ``event_id`` (an event buffer overflowed); the
    index is then possibly stale until the blocks concerned are stored or removed again.
    """

    mode = "precise"
    __slots__ = ("_tier", "_last_event_id", "missed_events")

    def __init__(self) -> None:
        self._tier: dict[int, Tier] = {}
        self._last_event_id: int | None = None
        self.missed_events = 0

    def __len__(self) -> int:
        return len(self._tier)

    def tier_of(self, block_hash: int) -> Tier | None:
        return self._tier.get(block_hash)

    def apply(self, events: Iterable[KvEvent]) -> None:
        """Apply events in order (stored / removed / tier moves; created = engine restart)."""
        tiers = self._tier
        for event in events:
            last = self._last_event_id
            if last is not None and event.event_id > last + 1:
                self.missed_events += event.event_id - last - 1
            self._last_event_id = event.event_id
            if isinstance(event, StoredEvent):
                for block in event.blocks:
                    tiers[block.block_hash] = Tier(block.cache_level)
            elif isinstance(event, RemovedEvent):
                for block_hash in event.block_hashes:
                    tiers.pop(block_hash, None)
            elif isinstance(event, UpdatedEvent):
                if event.cache_level is not None and event.block_hash in tiers:
                    tiers[event.block_hash] = Tier(event.cache_level[1])
            elif isinstance(event, CreatedEvent):
                tiers.clear()

    def match(self, hashes: Sequence[int], *, now: float) -> PrefixMatch:
        tiers = self._tier
        gpu = host = 0
        for h in hashes:
            tier = tiers.get(h)
            if tier is None:
                break
            if tier == _GPU:
                gpu += 1
            else:
                host += 1
        return PrefixMatch(gpu, host)

    def record(self, hashes: Sequence[int], *, now: float) -> None:
        return None  # events say what the replica stored; the router's guess is not needed

    def clear(self) -> None:
        self._tier.clear()
        self._last_event_id = None


@dataclass(frozen=True, slots=True)
class CapacityModel:
    """How much an approximate index assumes a replica keeps.

    ``primary_blocks`` / ``secondary_blocks``: the pool's GPU / host block counts (the
    registry's ``primary_blocks`` / ``secondary_blocks``). ``ttl_s``: also forget blocks
    not routed for that long (Dynamo's approximate mode uses 120 s); None = size only.
    """

    primary_blocks: int
    secondary_blocks: int = 0
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        if self.primary_blocks < 1 or self.secondary_blocks < 0:
            raise RoutingError("primary_blocks must be >= 1 and secondary_blocks >= 0")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise RoutingError("ttl_s must be > 0 or None")


class ApproximateIndex:
    """What the router sent to one replica, in a two-tier LRU the size of its pool.

    Invariants: ``len(gpu) <= primary_blocks``, ``len(host) <= secondary_blocks``, a hash
    is in at most one tier; entries older than ``ttl_s`` never match.
    """

    mode = "approximate"
    __slots__ = ("capacity", "_gpu", "_host")

    def __init__(self, capacity: CapacityModel) -> None:
        self.capacity = capacity
        self._gpu: OrderedDict[int, float] = OrderedDict()  # hash -> last routed (s); MRU last
        self._host: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._gpu) + len(self._host)

    def _fresh(self, touched: float | None, now: float) -> bool:
        ttl = self.capacity.ttl_s
        return touched is not None and (ttl is None or now - touched <= ttl)

    def match(self, hashes: Sequence[int], *, now: float) -> PrefixMatch:
        gpu = host = 0
        for h in hashes:
            if self._fresh(self._gpu.get(h), now):
                gpu += 1
            elif self._fresh(self._host.get(h), now):
                host += 1
            else:
                break
        return PrefixMatch(gpu, host)

    def record(self, hashes: Sequence[int], *, now: float) -> None:
        """Touch the chain (tail first, so the root ends most recent), then enforce capacity."""
        gpu, host = self._gpu, self._host
        for h in reversed(hashes):
            host.pop(h, None)
            gpu[h] = now
            gpu.move_to_end(h)
        cap = self.capacity
        while len(gpu) > cap.primary_blocks:
            h, touched = gpu.popitem(last=False)
            if cap.secondary_blocks:
                host[h] = touched
        while len(host) > cap.secondary_blocks:
            host.popitem(last=False)
        if cap.ttl_s is not None:  # LRU order is touch order when ``now`` never goes back
            for segment in (gpu, host):
                while segment:
                    h, touched = next(iter(segment.items()))
                    if now - touched <= cap.ttl_s:
                        break
                    del segment[h]

    def clear(self) -> None:
        self._gpu.clear()
        self._host.clear()
