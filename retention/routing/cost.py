"""The kv-aware router's cost: expected prefill work after reuse, plus load; and the choice.

Per candidate replica ``r`` (B = tokens per block, hits capped at ``(prompt − 1) // B``
because the engine always computes the last prompt token)::

    prefill_blocks(r) = (prompt − B × (gpu_hits + host_credit × host_hits
                                      + pending_credit × pending_hits)) / B
    queued_blocks(r)  = queued prefill tokens on r / B
    decode_blocks(r)  = KV blocks held by r's running requests + this request's blocks
    cost(r)           = (overlap_weight × (prefill_blocks + queued_blocks)
                         + decode_weight × decode_blocks) / weight(r)

This is NVIDIA Dynamo's KV-router cost (``cost = overlap_score_weight × prefill_blocks +
decode_blocks`` with prefill counting the worker's queued prefill tokens too, and decode
blocks the *potential* active blocks including the new request's; ai-dynamo/dynamo
``docs/architecture/kv_cache_routing.md``, ``lib/llm/src/kv_router/scheduler.rs``) with
three kvgate additions: host-tier hits are credited below GPU hits (``host_credit``,
default 0.75, the figure issue 13 gives for Dynamo's host-tier credit: an onboard is a copy,
not free), blocks being computed by in-flight requests on the replica are credited
(``pending_credit``), and the replica's registry weight divides its cost (a weight-2
replica is twice the engine).

Choice: with ``temperature`` 0 the lowest cost wins; ties go to the highest rendezvous
hash of (request's session key, replica) and then the lowest id, so every gateway
replica that sees the same indexes picks the same replica, and equal-cost new prefixes
spread evenly instead of piling on replica 0. With ``temperature`` T > 0, Dynamo's softmax
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
    """Weights of the cost (module docstring). Defaults follow Dynamo (weight 1, T = 0)."""

    overlap_weight: float = 1.0
    decode_weight: float = 1.0
    host_credit: float = 0.75
    pending_credit: float = 1.0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        for name in ("overlap_weight", "decode_weight", "temperature"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise RoutingError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("host_credit", "pending_credit"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise RoutingError(f"{name} must be within [0, 1], got {value!r}")

    def score(
        self,
        replica: ReplicaId,
        match: PrefixMatch,
        load: ReplicaLoad,
        *,
        prompt_tokens: int,
        output_tokens: int,
        tokens_per_block: int,
        weight: int = 1,
    ) -> ReplicaScore:
        """One candidate's cost terms (see the module docstring)."""
        bpt = tokens_per_block
        usable = max(0, (prompt_tokens - 1) // bpt)
        gpu = min(match.gpu_blocks, usable)
        host = min(match.host_blocks, usable - gpu)
        pending = min(match.pending_blocks, usable - gpu - host)
        credited = gpu + self.host_credit * host + self.pending_credit * pending
        prefill = max(0.0, prompt_tokens / bpt - credited)
        queued = load.queued_prefill_tokens / bpt
        decode = load.active_blocks + -(-(prompt_tokens + output_tokens) // bpt)
        cost = (self.overlap_weight * (prefill + queued) + self.decode_weight * decode) / weight
        return ReplicaScore(replica, PrefixMatch(gpu, host, pending), prefill, queued, decode, cost)


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
