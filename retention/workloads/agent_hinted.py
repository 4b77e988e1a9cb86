"""Agent loops whose client marks what to keep, next to unhinted one-shot traffic.

The agent family (:mod:`~retention.workloads.agent`) as an Anthropic-style client would send
it: a cache breakpoint after the system prompt + tools with a 1 h TTL, and one at the end of
the growing conversation with a 5 min TTL (``cache_control`` on the last message)::

    step i:   [ system + tools | task | calls & tool outputs so far | (partial) ]
                  bp 1 h ─────┘                         bp 5 min ─────────────┘

Beside the agents (tenant ``agents``), a second tenant (``batch``) sends one-shot prompts
with no hint at ``background_per_s`` (lognormal length, median ``background_blocks``), so
hinted and unhinted blocks compete for the same GPU and host blocks. Stripping the hint
fields from the lines gives the same traffic without hints: the bench's comparison.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from retention.policy.hints import TTL_1H_MS, TTL_5M_MS
from retention.workloads.agent import AgentSpec, agent_trace
from retention.workloads.common import IdSpace, finish, lognormal, partial, prompt_line


@dataclass(frozen=True, slots=True)
class HintedAgentSpec:
    agent: AgentSpec = field(default_factory=lambda: AgentSpec(tenant="agents"))
    system_ttl_ms: int = TTL_1H_MS
    conversation_ttl_ms: int = TTL_5M_MS
    background_per_s: float = 1.0
    background_blocks: float = 6.0  # median one-shot prompt length, in blocks
    background_sigma: float = 0.6
    background_tenant: str = "batch"

    def __post_init__(self) -> None:
        if self.system_ttl_ms <= 0 or self.conversation_ttl_ms <= 0:
            raise ValueError("hint TTLs must be > 0 ms")
        if self.background_per_s < 0 or self.background_blocks < 1:
            raise ValueError("background_per_s >= 0 and background_blocks >= 1")


def hinted_agent_trace(spec: HintedAgentSpec = HintedAgentSpec(), *, seed: int = 0) -> list[dict]:
    """Trace lines (JSON-ready dicts) sorted by timestamp; deterministic for (spec, seed)."""
    lines = agent_trace(spec.agent, seed=seed)
    for line in lines:
        points = []
        system = line.get("system_tokens", 0)
        if 0 < system < line["input_length"]:
            points.append([system, spec.system_ttl_ms])
        points.append([line["input_length"], spec.conversation_ttl_ms])
        line["cache_breakpoints"] = points
    rng = random.Random(seed + 1)
    bs = spec.agent.block_size
    ids = IdSpace(1 + max((max(line["hash_ids"]) for line in lines if line["hash_ids"]), default=-1))
    at = rng.expovariate(spec.background_per_s) if spec.background_per_s > 0 else spec.agent.duration_s
    while at < spec.agent.duration_s:
        blocks = max(1, round(lognormal(rng, spec.background_blocks, spec.background_sigma)))
        lines.append(prompt_line(at, ids.fresh(blocks), block_size=bs, tail_tokens=partial(rng, bs),
                                 output_tokens=spec.agent.output_tokens, tenant=spec.background_tenant))
        at += rng.expovariate(spec.background_per_s)
    return finish(lines)


def strip_hints(lines: list[dict]) -> list[dict]:
    """The same lines without their hint fields (the same traffic, nothing marked)."""
    return [{k: v for k, v in line.items() if k not in ("cache_breakpoints", "prompt_cache_retention")}
            for line in lines]
