"""Multi-turn chat: sessions over a few shared system prompts, lognormal think times.

::

    turn t of a session:  [ system (S blocks, one of P prompts) | u0 a0 | … | u(t-1) a(t-1) | u_t (partial) ]

Sessions start as a Poisson process (``sessions_per_s``); each picks a system prompt
(Zipf over ``system_prompts``), a length in turns (``turn_choices`` / ``turn_weights``),
and between turns the user thinks for a lognormal time (median ``think_median_s``, shape
``think_sigma``: σ = 1 puts 16 % of gaps beyond 2.7× the median, σ = 1.5 beyond 4.5×).
A user message is ``user_blocks`` blocks (uniform in the range), an answer
``answer_blocks``; both become history, so turn t+1 reuses turn t's whole prompt but its
last, partial block. Lines carry ``system_tokens`` and ``context_tokens``.

With ``responses`` every turn stores its response (``resp-chat-<session>-<turn>``) and
continues the previous turn's (OpenAI Responses ``previous_response_id``, no tools); after a
session's last turn its client deletes its responses with probability ``delete_share``
(after a lognormal ``delete_median_s``), else leaves them to expire. The deletions draw from
their own random source, so the requests are the same either way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from retention.workloads.common import (
    IdSpace,
    Zipf,
    deletions,
    finish,
    lognormal,
    partial,
    prompt_line,
    respond,
    weighted_choice,
)


@dataclass(frozen=True, slots=True)
class ChatSpec:
    duration_s: float = 1800.0
    block_size: int = 512
    sessions_per_s: float = 0.5
    system_prompts: int = 4
    system_blocks: int = 4
    system_zipf: float = 1.0
    turn_choices: tuple[int, ...] = (1, 2, 4, 8, 16)
    turn_weights: tuple[float, ...] = (0.25, 0.25, 0.25, 0.15, 0.10)
    think_median_s: float = 20.0
    think_sigma: float = 1.0
    user_blocks: tuple[int, int] = (1, 2)
    answer_blocks: tuple[int, int] = (1, 2)
    output_tokens: int = 256
    tenant: str | None = None
    responses: bool = False  # stored Responses conversations: response ids and previous_response_id chains
    delete_share: float = 0.0  # of sessions whose client deletes their responses after the last turn
    delete_median_s: float = 60.0  # last turn -> deletion (lognormal, sigma 1)

    def __post_init__(self) -> None:
        if not 0.0 <= self.delete_share <= 1.0 or self.delete_median_s <= 0:
            raise ValueError("delete_share within [0, 1], delete_median_s > 0")
        if self.duration_s <= 0 or self.sessions_per_s <= 0 or self.think_median_s <= 0 or self.think_sigma < 0:
            raise ValueError("duration, session rate and think median must be > 0, think_sigma >= 0")
        if self.block_size < 4 or self.system_prompts < 1 or self.system_blocks < 0:
            raise ValueError("block_size >= 4, system_prompts >= 1, system_blocks >= 0")
        if not self.turn_choices or len(self.turn_choices) != len(self.turn_weights) or min(self.turn_choices) < 1:
            raise ValueError("turn_choices (each >= 1) and turn_weights must have the same non-zero length")
        for lo, hi in (self.user_blocks, self.answer_blocks):
            if not 0 <= lo <= hi:
                raise ValueError("block ranges must satisfy 0 <= low <= high")


def chat_trace(spec: ChatSpec = ChatSpec(), *, seed: int = 0) -> list[dict]:
    """Trace lines (JSON-ready dicts) sorted by timestamp; deterministic for (spec, seed)."""
    rng = random.Random(seed)
    bs = spec.block_size
    ids = IdSpace(spec.system_prompts * spec.system_blocks)
    systems = [list(range(p * spec.system_blocks, (p + 1) * spec.system_blocks)) for p in range(spec.system_prompts)]
    pick_system = Zipf(spec.system_prompts, spec.system_zipf)
    lines: list[dict] = []
    ends = random.Random(f"{seed}-deletes")  # its own source: the requests never depend on it
    conversation = 0  # its number is the conversation's prompt_cache_key
    start = rng.expovariate(spec.sessions_per_s)
    while start < spec.duration_s:
        system = systems[pick_system.draw(rng)]
        conversation += 1
        turns = weighted_choice(rng, spec.turn_choices, spec.turn_weights)
        history: list[int] = []
        at = start
        session: list[str] = []  # the session's response ids
        last = at
        for turn in range(turns):
            if at >= spec.duration_s:
                break
            user = ids.fresh(max(1, rng.randint(*spec.user_blocks)))
            prompt = system + history + user
            line = prompt_line(
                at, prompt, block_size=bs, tail_tokens=partial(rng, bs), output_tokens=spec.output_tokens,
                tenant=spec.tenant, cache_key=f"chat-{conversation}", system_blocks=len(system), context_blocks=len(system) + len(history),
            )
            if spec.responses:
                session.append(f"resp-chat-{conversation}-{turn}")
                respond(line, session[-1], session[-2] if len(session) > 1 else None, tools=False)
            lines.append(line)
            last = at
            history = history + user + ids.fresh(rng.randint(*spec.answer_blocks))
            at += lognormal(rng, spec.think_median_s, spec.think_sigma)
        if session and ends.random() < spec.delete_share:
            lines += deletions(last + lognormal(ends, spec.delete_median_s, 1.0), session, spec.tenant)
        start += rng.expovariate(spec.sessions_per_s)
    return finish(lines)
