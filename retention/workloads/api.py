"""Single-turn API traffic behind shared system prompts (few-shot templates, product prompts).

::

    request:  [ system prompt p (blocks_p, shared) | user input (U blocks, last partial) ]

``prompts`` system prompts of ``prompt_blocks`` blocks each (uniform in the range, fixed per
prompt) are used with Zipf popularity (``prompt_zipf``); requests arrive as a Poisson process
(``requests_per_s``), or in bursts when ``burst`` > 1 (that many requests of one prompt within
``burst_spread_s``, as batch jobs do). The user input is unique, so the only reuse is the
system prompts — the workload where "keep what is shared" is everything.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from retention.workloads.common import IdSpace, Zipf, finish, partial, prompt_line


@dataclass(frozen=True, slots=True)
class ApiSpec:
    duration_s: float = 1200.0
    block_size: int = 512
    requests_per_s: float = 3.0
    prompts: int = 200
    prompt_blocks: tuple[int, int] = (2, 16)
    prompt_zipf: float = 1.1
    user_blocks: tuple[int, int] = (1, 4)
    burst: int = 1
    burst_spread_s: float = 5.0
    output_tokens: int = 128
    tenant: str | None = None

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.requests_per_s <= 0 or self.burst < 1 or self.burst_spread_s < 0:
            raise ValueError("duration and rate must be > 0, burst >= 1, burst_spread_s >= 0")
        if self.block_size < 4 or self.prompts < 1:
            raise ValueError("block_size >= 4 and prompts >= 1")
        for lo, hi in (self.prompt_blocks, self.user_blocks):
            if not 1 <= lo <= hi:
                raise ValueError("ranges must satisfy 1 <= low <= high")


def api_trace(spec: ApiSpec = ApiSpec(), *, seed: int = 0) -> list[dict]:
    """Trace lines (JSON-ready dicts) sorted by timestamp; deterministic for (spec, seed)."""
    rng = random.Random(seed)
    bs = spec.block_size
    ids = IdSpace()
    prompts = [ids.fresh(rng.randint(*spec.prompt_blocks)) for _ in range(spec.prompts)]
    order = list(range(spec.prompts))
    rng.shuffle(order)
    popularity = Zipf(spec.prompts, spec.prompt_zipf)
    lines: list[dict] = []
    at = rng.expovariate(spec.requests_per_s / spec.burst)
    while at < spec.duration_s:
        system = prompts[order[popularity.draw(rng)]]
        for k in range(spec.burst):
            when = at + (rng.uniform(0.0, spec.burst_spread_s) if k else 0.0)
            prompt = system + ids.fresh(rng.randint(*spec.user_blocks))
            lines.append(prompt_line(
                when, prompt, block_size=bs, tail_tokens=partial(rng, bs), output_tokens=spec.output_tokens,
                tenant=spec.tenant, system_blocks=len(system), context_blocks=len(system),
            ))
        at += rng.expovariate(spec.requests_per_s / spec.burst)
    return finish(lines)
