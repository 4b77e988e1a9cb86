"""Tool loops sharing the pool with other tenants' one-shot traffic (the ``agent-mixed`` family).

::

    tenant "agents": agent-loop runs (Responses chains, tools offered, a message ends a run)
    tenant "api":    single-turn requests behind Zipf system prompts (``retention/workloads/api.py``)

Both draw from their own random sources (``seed`` and ``seed + 1``) over the same duration;
the one-shots' hash ids start past the runs' so the tenants share no block. This is the case
the conversation hold is for: held runs compete with traffic that is never held.
"""

from __future__ import annotations

from dataclasses import dataclass

from retention.workloads.agent import AgentSpec, agent_trace
from retention.workloads.api import ApiSpec, api_trace
from retention.workloads.common import finish


@dataclass(frozen=True, slots=True)
class MixedSpec:
    agent: AgentSpec = AgentSpec(responses=True, delete_share=0.5, tenant="agents")
    api: ApiSpec = ApiSpec(duration_s=1800.0, requests_per_s=1.5, tenant="api")

    def __post_init__(self) -> None:
        if self.agent.block_size != self.api.block_size:
            raise ValueError("one trace has one block size")
        if self.agent.tenant is None or self.api.tenant is None or self.agent.tenant == self.api.tenant:
            raise ValueError("the agent and api traffic need two distinct tenants")


def mixed_trace(spec: MixedSpec = MixedSpec(), *, seed: int = 0) -> list[dict]:
    """Trace lines (requests and delete events) sorted by timestamp; deterministic for (spec, seed)."""
    runs = agent_trace(spec.agent, seed=seed)
    offset = 1 + max((max(line["hash_ids"]) for line in runs if line.get("hash_ids")), default=-1)
    shots = api_trace(spec.api, seed=seed + 1)
    for line in shots:
        line["hash_ids"] = [h + offset for h in line["hash_ids"]]
    return finish(runs + shots)


__all__ = ["MixedSpec", "mixed_trace"]
