"""The noisy neighbour (Mooncake format): premium chat sessions next to a flooding tenant.

A *premium* tenant runs multi-turn chat sessions over one shared system prompt; a *noisy*
tenant floods unique long prompts at ``flood_factor`` × the premium request rate::

    premium turn t:  [ system (S blocks, shared) | u0 a0 | u1 a1 | … | u(t-1) a(t-1) | u_t (partial) ]
                       system_tokens ─┘             context_tokens ─┘                 └─ turn
    noisy request:   [ n unique blocks ]            (never reused)

Turn ``t+1`` of a session repeats turn ``t``'s prompt up to ``a(t-1)``, then adds the user
block ``u_t`` (now full) and the answer ``a_t``, so its reusable prefix is the system prompt
plus every earlier turn. Arrivals are Poisson (sessions start at ``premium_rps / turns``
per second; turns follow each other after exponential gaps). Deterministic for a seed.
Lines carry ``tenant``, ``system_tokens`` and ``context_tokens`` (see ``retention/trace.py``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NoisyNeighbourSpec:
    duration_s: float = 600.0
    block_size: int = 512
    system_blocks: int = 8
    turns: int = 6
    premium_rps: float = 0.5
    turn_gap_s: float = 12.0
    flood_factor: float = 10.0
    noisy_blocks: int = 24
    output_tokens: int = 128
    premium: str = "premium"
    noisy: str = "noisy"

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.premium_rps <= 0 or self.turn_gap_s <= 0 or self.flood_factor < 0:
            raise ValueError("duration, rates and gaps must be positive (flood_factor >= 0)")
        if self.block_size < 2 or self.system_blocks < 0 or self.turns < 1 or self.noisy_blocks < 1:
            raise ValueError("block_size >= 2, system_blocks >= 0, turns >= 1, noisy_blocks >= 1")


def noisy_neighbour_trace(spec: NoisyNeighbourSpec = NoisyNeighbourSpec(), *, seed: int = 0,
                          include_noisy: bool = True) -> list[dict]:
    """Trace lines (dicts, JSON-ready), sorted by timestamp. ``include_noisy=False`` = premium alone."""
    rng = random.Random(seed)
    bs = spec.block_size
    next_id = spec.system_blocks  # ids 0..S-1 are the shared system prompt
    lines: list[dict] = []

    def fresh(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    session_rate = spec.premium_rps / spec.turns
    start = rng.expovariate(session_rate)
    system = list(range(spec.system_blocks))
    while start < spec.duration_s:
        history: list[int] = []
        at = start
        for _turn in range(spec.turns):
            if at >= spec.duration_s:
                break
            user = fresh(1)[0]
            partial = bs // 2 + rng.randrange(bs // 2)  # the new user message fills part of a block
            ids = system + history + [user]
            lines.append({
                "timestamp": round(at * 1000.0, 3),
                "input_length": (len(ids) - 1) * bs + partial,
                "output_length": spec.output_tokens,
                "hash_ids": ids,
                "tenant": spec.premium,
                "system_tokens": len(system) * bs,
                "context_tokens": (len(system) + len(history)) * bs,
            })
            history = history + [user] + fresh(1)  # the answer becomes history too
            at += rng.expovariate(1.0 / spec.turn_gap_s)
        start += rng.expovariate(session_rate)
    if include_noisy and spec.flood_factor > 0:
        at = rng.expovariate(spec.premium_rps * spec.flood_factor)
        while at < spec.duration_s:
            ids = fresh(spec.noisy_blocks)
            lines.append({
                "timestamp": round(at * 1000.0, 3),
                "input_length": spec.noisy_blocks * bs - rng.randrange(1, bs // 2),
                "output_length": spec.output_tokens,
                "hash_ids": ids,
                "tenant": spec.noisy,
            })
            at += rng.expovariate(spec.premium_rps * spec.flood_factor)
    lines.sort(key=lambda line: line["timestamp"])
    return lines
