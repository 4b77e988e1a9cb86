"""What an engine's stats call returns: its KV pool's tiers, counters and per-tenant holdings.

Part of the engine-model contract (engines/contract.py: a request with ``kv_stats`` set is answered
with one :class:`PoolStatsReport` as JSON in ``kv_cache_stats``); every engine fills it, the gateway
reads it (pool monitor, routing, capacity checks, metrics). Invariant: ``from_json(to_json())``
round-trips every field, and counters are cumulative since the engine started.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from engines.kv_events import KvEventsReport


@dataclass(slots=True)
class TierStats:
    max_blocks: int
    free_blocks: int
    used_blocks: int


@dataclass(slots=True)
class PoolStatsReport:
    """What the stats call returns (KvCacheStats-like plus per-tenant counts).

    ``tenants`` maps a tenant id to ``[primary_blocks, secondary_blocks]`` it holds
    (in use or cached). Counters are cumulative since engine start.
    """

    tokens_per_block: int
    primary: TierStats
    secondary: TierStats
    reused_blocks: int = 0
    missed_blocks: int = 0
    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0
    evicted_blocks: int = 0
    cache_hit_rate: float = 0.0
    secondary_offload_min_priority: int = 30
    tenants: dict[str, list[int]] = field(default_factory=dict)
    kv_events: KvEventsReport | None = None  # only when the request asked (kv_events_since)
    unknown_fields: tuple[str, ...] = ()  # set by the reader only (from_json), never sent: fields it ignored

    def to_json(self) -> str:
        events = self.kv_events
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("kv_events", "unknown_fields")}
        data["primary"], data["secondary"] = asdict(self.primary), asdict(self.secondary)
        if events is not None:
            data["kv_events"] = events.to_dict()
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> PoolStatsReport:
        """The report; fields this reader does not know (a newer engine's) are ignored and named in
        ``unknown_fields`` (the poller logs them), so a gateway one version behind its engines keeps
        reading their stats."""
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        tier_known = {f.name for f in fields(TierStats)}
        ignored = [name for name in data if name not in known]
        for tier in ("primary", "secondary"):
            ignored += [f"{tier}.{name}" for name in data[tier] if name not in tier_known]
            data[tier] = TierStats(**{k: v for k, v in data[tier].items() if k in tier_known})
        events = data.pop("kv_events", None)
        data = {k: v for k, v in data.items() if k in known and k != "unknown_fields"}
        return cls(**data, kv_events=None if events is None else KvEventsReport.from_dict(events),
                   unknown_fields=tuple(ignored))
