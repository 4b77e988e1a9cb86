"""Agent / tool loops: a shared tool-laden system prompt, then a context that grows every step.

::

    step 0:   [ system + tools (S blocks, one of P agents) | task (T blocks) (partial) ]
    step i:   [ … step i-1's prompt … | call_(i-1) | tool output_(i-1) | (partial) ]

Agent runs start as a Poisson process (``runs_per_s``), pick an agent kind (Zipf over
``agents``), and take ``steps`` model calls (uniform in the range). Between calls the tool
runs for a lognormal time (median ``tool_median_s``); with probability ``human_wait`` a step
instead waits for a human (lognormal, median ``human_median_s``). Each step appends the
model's tool call (``call_blocks``) and the tool's output (``output_blocks``, uniform), so
prompts grow long and every step reuses the previous one's whole prompt.

With ``responses`` the runs are OpenAI Responses agent runs (the ``agent-loop`` family): step
*i* stores its response (``resp-agent-<run>-<i>``), continues step *i-1*'s and offers tools;
each line says what its response was (``output_kind``): a function call, or a message when
the run ends there or the next step waits for a human (the model asked). When a run ends
its client deletes all its responses with probability ``delete_share``
(after a lognormal ``delete_median_s``), else abandons them to the store's expiry. The
deletions draw from their own random source, so the requests are the same either way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from retention.workloads.common import IdSpace, Zipf, deletions, finish, lognormal, partial, prompt_line, respond


@dataclass(frozen=True, slots=True)
class AgentSpec:
    duration_s: float = 1800.0
    block_size: int = 512
    runs_per_s: float = 0.2
    agents: int = 3
    system_blocks: int = 8
    agent_zipf: float = 1.0
    task_blocks: tuple[int, int] = (1, 3)
    steps: tuple[int, int] = (3, 25)
    call_blocks: int = 1
    output_blocks: tuple[int, int] = (1, 4)
    tool_median_s: float = 3.0
    tool_sigma: float = 0.8
    human_wait: float = 0.05
    human_median_s: float = 90.0
    human_sigma: float = 1.0
    output_tokens: int = 128
    tenant: str | None = None
    responses: bool = False  # Responses-style runs: response ids, stored chains, tools offered
    delete_share: float = 0.0  # of runs whose client deletes their responses when they end
    delete_median_s: float = 5.0  # run end -> deletion (lognormal, sigma 1)

    def __post_init__(self) -> None:
        if not 0.0 <= self.delete_share <= 1.0 or self.delete_median_s <= 0:
            raise ValueError("delete_share within [0, 1], delete_median_s > 0")
        if self.duration_s <= 0 or self.runs_per_s <= 0 or self.tool_median_s <= 0 or self.human_median_s <= 0:
            raise ValueError("duration, run rate and wait medians must be > 0")
        if self.block_size < 4 or self.agents < 1 or self.system_blocks < 0 or self.call_blocks < 0:
            raise ValueError("block_size >= 4, agents >= 1, system_blocks >= 0, call_blocks >= 0")
        for lo, hi in (self.task_blocks, self.steps, self.output_blocks):
            if not 1 <= lo <= hi:
                raise ValueError("ranges must satisfy 1 <= low <= high")
        if not 0.0 <= self.human_wait <= 1.0:
            raise ValueError("human_wait must be within [0, 1]")


def agent_trace(spec: AgentSpec = AgentSpec(), *, seed: int = 0) -> list[dict]:
    """Trace lines (JSON-ready dicts) sorted by timestamp; deterministic for (spec, seed)."""
    rng = random.Random(seed)
    bs = spec.block_size
    ids = IdSpace(spec.agents * spec.system_blocks)
    systems = [list(range(a * spec.system_blocks, (a + 1) * spec.system_blocks)) for a in range(spec.agents)]
    pick_agent = Zipf(spec.agents, spec.agent_zipf)
    lines: list[dict] = []
    ends = random.Random(f"{seed}-deletes")  # its own source: the requests never depend on it
    conversation = 0  # its number is the conversation's prompt_cache_key
    start = rng.expovariate(spec.runs_per_s)
    while start < spec.duration_s:
        system = systems[pick_agent.draw(rng)]
        conversation += 1
        context = system + ids.fresh(rng.randint(*spec.task_blocks))
        at = start
        run: list[str] = []  # the run's response ids
        last = at
        steps = rng.randint(*spec.steps)
        for step in range(steps):
            if at >= spec.duration_s:
                break
            line = prompt_line(
                at, context, block_size=bs, tail_tokens=partial(rng, bs), output_tokens=spec.output_tokens,
                tenant=spec.tenant, cache_key=f"agent-{conversation}", system_blocks=len(system), context_blocks=len(context) - 1,
            )
            if spec.responses:
                run.append(f"resp-agent-{conversation}-{step}")
                respond(line, run[-1], run[-2] if len(run) > 1 else None, tools=True)
            lines.append(line)
            last = at
            context = context + ids.fresh(spec.call_blocks + rng.randint(*spec.output_blocks))
            human = rng.random() < spec.human_wait
            if spec.responses:  # the last step answers; a step before a human's turn asks (no tool call)
                line["output_kind"] = "message" if human or step == steps - 1 else "tool_call"
            if human:
                at += lognormal(rng, spec.human_median_s, spec.human_sigma)
            else:
                at += lognormal(rng, spec.tool_median_s, spec.tool_sigma)
        if run and ends.random() < spec.delete_share:
            lines += deletions(last + lognormal(ends, spec.delete_median_s, 1.0), run, spec.tenant)
        start += rng.expovariate(spec.runs_per_s)
    return finish(lines)
