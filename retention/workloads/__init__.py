"""Synthetic workload families (Mooncake-format trace lines) for the simulator and the benches.

Every generator is deterministic for a (spec, seed) pair and returns JSON-ready dicts sorted
by timestamp (``retention.trace.parse_trace`` reads them after ``json.dumps``). The
parameters are documented on each spec dataclass.

| family | module | role |
|---|---|---|
| ``synthetic`` | the public Mooncake trace (``../shared/traces``; read by the bench) | tune |
| ``chat`` | :mod:`~retention.workloads.chat` (median think 20 s, σ 1, up to 16 turns; stored Responses conversations, half deleted after the last turn) | tune |
| ``noisy-neighbour`` | :mod:`~retention.workloads.noisy` (premium chat + 10× flood) | tune |
| ``chat-long`` | chat with slow, heavy-tailed think times (median 60 s, σ 1.5), longer turns | report only |
| ``rag`` | :mod:`~retention.workloads.rag` (Zipf documents, follow-ups) | report only |
| ``agent`` | :mod:`~retention.workloads.agent` (tool loops, growing context) | report only |
| ``api`` | :mod:`~retention.workloads.api` (single turn, 200 Zipf system prompts) | report only |
| ``agent-hinted`` | :mod:`~retention.workloads.agent_hinted` (agent loops marking system + tools 1 h and the conversation 5 min, beside unhinted one-shot traffic; ``bench/retention/hints.py``) | report only |
| ``agent-loop`` | :mod:`~retention.workloads.agent` as Responses runs (each step continues the previous stored response and offers tools; half the runs deleted when they end, the rest abandoned; ``bench/retention/conversation.py``) | report only |
| ``agent-mixed`` | :mod:`~retention.workloads.mixed` (agent-loop runs of one tenant beside another tenant's api one-shots, 1.5/s; ``bench/retention/conversation.py``) | report only |
| ``rag-chat`` | :mod:`~retention.workloads.rag_chat` (the design notes' RAG chat: 1.5K system, 8K retrieved, 6 turns; ``bench/retention/rag_chat.py``) | report only |

*Tune* families are the ones retention policies may be tuned on (``adaptive`` was built
on ``synthetic`` and the noisy neighbour before this table existed; its selection on
``synthetic`` and ``chat``); *report only* families are held out: the evaluation
(``bench/retention/generalize.py``) reports them but nobody picks a parameter by looking at them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from retention.workloads.agent import AgentSpec, agent_trace
from retention.workloads.agent_hinted import HintedAgentSpec, hinted_agent_trace
from retention.workloads.api import ApiSpec, api_trace
from retention.workloads.chat import ChatSpec, chat_trace
from retention.workloads.common import phased
from retention.workloads.mixed import MixedSpec, mixed_trace
from retention.workloads.noisy import NoisyNeighbourSpec, noisy_neighbour_trace
from retention.workloads.rag import RagSpec, rag_trace
from retention.workloads.rag_chat import RagChatSpec, rag_chat_trace

Role = Literal["tune", "report"]

CHAT_LONG = ChatSpec(
    sessions_per_s=0.3, system_prompts=8, turn_choices=(2, 4, 8, 24), turn_weights=(0.3, 0.3, 0.25, 0.15),
    think_median_s=60.0, think_sigma=1.5, user_blocks=(1, 4), answer_blocks=(1, 3),
)

# The chat family's requests are ChatSpec()'s; the Responses fields and deletions only add to them.
CHAT = ChatSpec(responses=True, delete_share=0.5)
AGENT_LOOP = AgentSpec(responses=True, delete_share=0.5)


@dataclass(frozen=True, slots=True)
class Family:
    """A named generator with its role in the evaluation."""

    name: str
    role: Role
    generate: Callable[[int], list[dict]]  # seed -> trace lines
    description: str


def families() -> tuple[Family, ...]:
    """The generated families (the public synthetic trace is read from its file by the bench)."""
    return (
        Family("chat", "tune", lambda seed: chat_trace(CHAT, seed=seed),
               "multi-turn chat, 4 system prompts, 1–16 turns, lognormal think time (median 20 s, σ 1); "
               "stored Responses conversations, half deleted after their last turn"),
        Family("noisy-neighbour", "tune", lambda seed: noisy_neighbour_trace(NoisyNeighbourSpec(), seed=seed),
               "premium 6-turn chat next to a tenant flooding unique prompts at 10× its rate"),
        Family("chat-long", "report", lambda seed: chat_trace(CHAT_LONG, seed=seed),
               "multi-turn chat, 8 system prompts, 2–24 turns, lognormal think time (median 60 s, σ 1.5)"),
        Family("rag", "report", lambda seed: rag_trace(RagSpec(), seed=seed),
               "system + 3 of 3,000 Zipf(0.9) documents + question; 30 % follow-ups"),
        Family("agent", "report", lambda seed: agent_trace(AgentSpec(), seed=seed),
               "tool loops of 3–25 steps over 3 agent prompts, context grows 2–5 blocks a step"),
        Family("api", "report", lambda seed: api_trace(ApiSpec(), seed=seed),
               "single-turn requests behind 200 Zipf(1.1) system prompts of 2–16 blocks"),
        Family("agent-hinted", "report", lambda seed: hinted_agent_trace(HintedAgentSpec(), seed=seed),
               "agent tool loops with cache breakpoints (system + tools 1 h, conversation 5 min) beside unhinted one-shot prompts"),
        Family("agent-loop", "report", lambda seed: agent_trace(AGENT_LOOP, seed=seed),
               "the agent family as Responses runs: each step continues the previous stored response and offers "
               "tools; half the runs deleted when they end, the rest abandoned"),
        Family("agent-mixed", "report", lambda seed: mixed_trace(MixedSpec(), seed=seed),
               "agent-loop runs (tenant agents) sharing the pool with api one-shots of another tenant (1.5/s, "
               "200 Zipf system prompts)"),
        Family("rag-chat", "report", lambda seed: rag_chat_trace(RagChatSpec(), seed=seed),
               "1.5K shared system + 4 of 5,000 Zipf(1) documents (8K) + 6 turns, exponential think time (mean 45 s)"),
    )


__all__ = [
    "AgentSpec", "ApiSpec", "ChatSpec", "Family", "HintedAgentSpec", "MixedSpec", "mixed_trace", "hinted_agent_trace", "NoisyNeighbourSpec", "RagSpec", "agent_trace", "api_trace",
    "chat_trace", "families", "noisy_neighbour_trace", "phased", "rag_trace",
]
