"""The kv-aware router's cost: expected prefill work after reuse, plus load beyond a band.

Per candidate replica ``r`` (B = tokens per block; hits are capped at ``(prompt − 1) // B``
because the engine always computes the last prompt token; all terms in blocks)::

    prefill(r)  = prompt / B − (gpu_hits + host_credit × host_hits + pending_credit × pending_hits)
    level(r)    = (queue_weight × queued_prefill(r) + decode_weight × decode(r)
                   + recent_weight × recent_prefill(r)) / weight(r)      (queue_weight None: overlap_weight)
    threshold   = max(min_r level + balance_request_share × prompt / B,  balance_rel × min_r level)
    cost(r)     = overlap_weight × prefill(r) / weight(r) + load_weight × max(0, level(r) − threshold)
                  − affinity_credit × [r is the request's home]

``queued_prefill``: tokens routed to r and not yet prefilled; ``decode``: KV blocks held by
r's running requests plus this request's; ``recent_prefill``: prefill tokens dispatched to
r, exponentially decayed (``LoadTracker.half_life_s``) — the replica's recent compute.

Where it comes from:

* NVIDIA Dynamo's KV router (ai-dynamo/dynamo ``docs/architecture/kv_cache_routing.md``,
  ``lib/llm/src/kv_router/scheduler.rs``): ``cost = overlap_score_weight × prefill_blocks +
  decode_blocks``, prefill counting the worker's queued prefill too, decode blocks the
  *potential* active blocks. :meth:`CostModel.dynamo` is exactly that (up to a constant
  shared by all candidates, which never changes the choice).
* SGLang's cache-aware router (``balance_abs_threshold`` / ``balance_rel_threshold``) and
  AIBrix (prefix match unless load > mean + 2σ) follow the cache unless load is
  *imbalanced*. kvgate keeps one cost but only counts load *above a band* over the
  least-loaded candidate: one request's worth of blocks (``balance_request_share``) or
  ``balance_rel`` × the least load, whichever is larger. Inside the band cache affinity
  decides; beyond it every block of excess load weighs like a block of prefill.
* kvgate additions: host-tier hits are credited below GPU hits (``host_credit``, default
  0.75, Dynamo's own default weight for a host-tier hit, ``host_cache_hit_weight`` in
  ``lib/kv-router/src/scheduling/config.rs``: an onboard is a copy, not free; crediting host
  hits fully was measured over the grid and not adopted, docs/architecture.md "Routing");
  blocks that requests in flight on r are computing now are credited (``pending_credit``);
  the registry weight divides a replica's prefill and load (weight 2 = twice the engine);
  recent prefill work is a load signal (``recent_weight``); a request carrying an affinity
  key (``prompt_cache_key``, ``affinity.py``) credits its key's home replica
  (``affinity_credit`` blocks), so requests sharing a key meet before they share a cached
  prefix, unless the home's load is beyond the band; queued prefill's weight in the level can
  be set apart from the prefill's (``queue_weight``; unset, as in Dynamo, both are
  ``overlap_weight``), so that a cost may bound recent work alone (``bench/routing/load_signal.py``).

Why the defaults differ from Dynamo's (measured, docs/benchmarks.md "Routing simulator"):
with Dynamo's cost (T = 0, weight 1) on the Mooncake trace, 4 replicas at 2 %, the
instantaneous load differences between replicas outweigh most prefix hits, so
conversations scatter and the hit rate stays near 60 % of the one-big-pool ceiling; with
the band, and recent prefill work instead of active blocks as the main load signal, it is
98 %, with the busiest replica computing 2 % more prefill than the mean. Which load the band
bounds was chosen over every workload family, replica count, capacity and arrival rate
(``bench/routing/load_signal.py`` on the grid of ``bench/routing/families.py``: its form from a
screen by hand over all families, the choice among the candidates on the tune families alone):
recent prefill work at 0.5 and queued prefill at a quarter (a passing
queue, which the imbalance over a trace never sees, no longer moves a conversation off its
prefix), no decode term, and a band of one request or ×1.2 the least-loaded level. They meet
the targets (≥ 90 % of the ceiling, ≥ the best baseline, imbalance ≤ 1.3) in most but not all
settings (docs/architecture.md, "Routing").

Choice: with ``temperature`` 0 the lowest cost wins; ties go to the highest rendezvous
hash of (request's session key, replica), then the lowest id, so every gateway replica
with the same view picks the same replica and equal-cost new prefixes spread evenly
instead of piling onto one replica. With ``temperature`` T > 0, Dynamo's softmax
sampling: costs normalised by the largest, ``p(r) ∝ exp(−cost(r) / (max cost × T))``,
drawn from the caller's ``random.Random`` (seeded in tests: deterministic).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from retention.routing.types import PrefixMatch, ReplicaId, ReplicaLoad, ReplicaScore, RoutingError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class CostModel:
    """Weights of the cost (module docstring). ``CostModel.dynamo()`` = Dynamo's cost."""

    overlap_weight: float = 1.0
    decode_weight: float = 0.0
    recent_weight: float = 0.5
    host_credit: float = 0.75
    pending_credit: float = 1.0
    balance_request_share: float = 1.0
    balance_rel: float = 1.2
    temperature: float = 0.0
    affinity_credit: float = 1.0
    load_weight: float = 1.0  # weight of load beyond the band (the self-tuning band raises it, tuning.py)
    queue_weight: float | None = 0.25  # weight of queued prefill in the load level; None: overlap_weight (Dynamo's)

    def __post_init__(self) -> None:
        for name in ("overlap_weight", "decode_weight", "recent_weight", "balance_request_share", "temperature",
                     "affinity_credit", "load_weight", "queue_weight"):
            value = getattr(self, name)
            if value is None and name == "queue_weight":  # unset: overlap_weight
                continue
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise RoutingError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("host_credit", "pending_credit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise RoutingError(f"{name} must be within [0, 1], got {value!r}")
        rel = self.balance_rel
        if isinstance(rel, bool) or not (isinstance(rel, (int, float)) and math.isfinite(rel) and rel >= 1):
            raise RoutingError(f"balance_rel must be a finite number >= 1, got {rel!r}")

    @classmethod
    def dynamo(cls, *, overlap_weight: float = 1.0, temperature: float = 0.0, host_credit: float = 0.75) -> CostModel:
        """Dynamo's cost: ``overlap_weight × (queued + new prefill blocks) + potential active blocks``.

        ``host_credit`` defaults to Dynamo's ``host_cache_hit_weight`` (0.75; ai-dynamo/dynamo
        ``lib/kv-router/src/scheduling/config.rs``, applied to host-tier hits in ``scheduling/overlap.rs``).
        Every field is pinned here, so that kvgate's own defaults can change without changing Dynamo's cost
        (``affinity_credit`` acts only on a request that carries an affinity key).
        """
        return cls(
            overlap_weight=overlap_weight, decode_weight=1.0, recent_weight=0.0, host_credit=host_credit,
            pending_credit=1.0, balance_request_share=0.0, balance_rel=1.0, temperature=temperature, queue_weight=None,
            load_weight=1.0, affinity_credit=1.0,  # every field pinned: kvgate's defaults never leak into Dynamo's cost
        )

    def scores(
        self,
        candidates: Sequence[tuple[ReplicaId, PrefixMatch, ReplicaLoad, int]],
        *,
        prompt_tokens: int,
        output_tokens: int,
        tokens_per_block: int,
        home: ReplicaId | None = None,
    ) -> tuple[ReplicaScore, ...]:
        """Every candidate's cost terms; ``candidates`` = (replica, match, load, weight).

        One call over the whole set because the load term is measured against the
        least-loaded candidate (module docstring). ``home``: the replica of the request's
        affinity key, if it has one (its cost is ``affinity_credit`` lower).
        """
        bpt = tokens_per_block
        usable = max(0, (prompt_tokens - 1) // bpt)
        prompt_blocks = prompt_tokens / bpt
        own_blocks = -(-(prompt_tokens + output_tokens) // bpt)
        queue_weight = self.overlap_weight if self.queue_weight is None else self.queue_weight
        rows = []
        for replica, match, load, weight in candidates:
            gpu = min(match.gpu_blocks, usable)
            host = min(match.host_blocks, usable - gpu)
            pending = min(match.pending_blocks, usable - gpu - host)
            prefill = max(0.0, prompt_blocks - (gpu + self.host_credit * host + self.pending_credit * pending))
            queued = load.queued_prefill_tokens / bpt
            decode = float(load.active_blocks + own_blocks)
            recent = load.recent_prefill_tokens / bpt
            level = (queue_weight * queued + self.decode_weight * decode + self.recent_weight * recent) / weight
            rows.append((replica, PrefixMatch(gpu, host, pending), prefill, queued, decode, level, weight))
        floor = min((row[5] for row in rows), default=0.0)
        threshold = max(floor + self.balance_request_share * prompt_blocks, self.balance_rel * floor)
        return tuple(
            ReplicaScore(
                replica, match, prefill, queued, decode, max(0.0, level - threshold),
                self.overlap_weight * prefill / weight + self.load_weight * max(0.0, level - threshold)
                - (self.affinity_credit if replica == home else 0.0),
            )
            for replica, match, prefill, queued, decode, level, weight in rows
        )


def rendezvous(key: int, replica: ReplicaId, weight: int = 1) -> float:
    """Weighted rendezvous (highest-random-weight) score of ``replica`` for ``key``.

    ``−weight / ln(u)`` with ``u`` in (0, 1) from a 64-bit mix of (key, replica)
    (splitmix64's finaliser): stable across processes, and a replica's share of keys is
    proportional to its weight; removing a replica moves only its own keys.
    """
    x = (key * 0x9E3779B97F4A7C15 + (replica + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    u = (x + 0.5) / 2.0**64
    return -weight / math.log(u)


def choose(
    scores: Sequence[ReplicaScore],
    *,
    tie_key: int,
    weights: dict[ReplicaId, int],
    temperature: float = 0.0,
    rng: random.Random | None = None,
) -> ReplicaScore:
    """The chosen candidate: lowest cost (T = 0) or a softmax draw (T > 0); see module docstring."""
    if not scores:
        raise RoutingError("no candidate replicas")
    if temperature <= 0 or len(scores) == 1:
        return min(
            scores,
            key=lambda s: (round(s.cost, 9), -rendezvous(tie_key, s.replica, weights.get(s.replica, 1)), s.replica),
        )
    if rng is None:
        raise RoutingError("a temperature > 0 needs a random source")
    ordered = sorted(scores, key=lambda s: s.replica)
    top = max(s.cost for s in ordered) or 1.0
    logits = [-s.cost / top / temperature for s in ordered]
    peak = max(logits)
    probs = [math.exp(x - peak) for x in logits]
    draw = rng.random() * sum(probs)
    for score, p in zip(ordered, probs, strict=True):
        draw -= p
        if draw < 0:
            return score
    return ordered[-1]
