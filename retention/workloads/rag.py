"""RAG over a shared document set: system prompt + retrieved documents + question.

::

    request:    [ system (S blocks) | doc d1 | doc d2 | … | doc dk | question (partial) ]
    follow-up:  [ … the same prompt … | answer | question' (partial) ]

``documents`` documents of ``doc_blocks`` blocks each (fixed per document, uniform in the
range) are retrieved with Zipf popularity (``doc_zipf``); a query retrieves ``docs_per_query``
distinct documents, most relevant first, so two queries share a prefix beyond the system
prompt only when their top documents agree. Queries arrive as a Poisson process
(``queries_per_s``); with probability ``follow_up`` a query gets a follow-up question after a
lognormal gap (median ``follow_up_median_s``), repeatedly (geometric). Two system prompts
(``system_prompts``) split the traffic evenly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from retention.workloads.common import IdSpace, Zipf, finish, lognormal, partial, prompt_line


@dataclass(frozen=True, slots=True)
class RagSpec:
    duration_s: float = 1800.0
    block_size: int = 512
    queries_per_s: float = 1.5
    system_prompts: int = 2
    system_blocks: int = 2
    documents: int = 3000
    doc_blocks: tuple[int, int] = (2, 6)
    doc_zipf: float = 0.9
    docs_per_query: int = 3
    follow_up: float = 0.3
    follow_up_median_s: float = 30.0
    follow_up_sigma: float = 1.0
    answer_blocks: int = 1
    output_tokens: int = 256
    tenant: str | None = None

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.queries_per_s <= 0 or self.follow_up_median_s <= 0:
            raise ValueError("duration, query rate and follow-up median must be > 0")
        if self.block_size < 4 or self.system_prompts < 1 or self.system_blocks < 0:
            raise ValueError("block_size >= 4, system_prompts >= 1, system_blocks >= 0")
        if not 1 <= self.docs_per_query <= self.documents or not 1 <= self.doc_blocks[0] <= self.doc_blocks[1]:
            raise ValueError("need 1 <= docs_per_query <= documents and 1 <= doc_blocks low <= high")
        if not 0.0 <= self.follow_up < 1.0:
            raise ValueError("follow_up must be within [0, 1)")


def rag_trace(spec: RagSpec = RagSpec(), *, seed: int = 0) -> list[dict]:
    """Trace lines (JSON-ready dicts) sorted by timestamp; deterministic for (spec, seed)."""
    rng = random.Random(seed)
    bs = spec.block_size
    ids = IdSpace(spec.system_prompts * spec.system_blocks)
    systems = [list(range(p * spec.system_blocks, (p + 1) * spec.system_blocks)) for p in range(spec.system_prompts)]
    docs = [ids.fresh(rng.randint(*spec.doc_blocks)) for _ in range(spec.documents)]
    # Popularity rank -> document: a fixed shuffle, so popular documents are not the low ids.
    order = list(range(spec.documents))
    rng.shuffle(order)
    popularity = Zipf(spec.documents, spec.doc_zipf)
    lines: list[dict] = []
    at = rng.expovariate(spec.queries_per_s)
    while at < spec.duration_s:
        chosen: list[int] = []
        while len(chosen) < spec.docs_per_query:
            doc = order[popularity.draw(rng)]
            if doc not in chosen:
                chosen.append(doc)
        context = list(systems[rng.randrange(spec.system_prompts)])
        system_blocks = len(context)
        for doc in chosen:
            context += docs[doc]
        when = at
        while when < spec.duration_s:
            question = ids.fresh(1)
            lines.append(prompt_line(
                when, context + question, block_size=bs, tail_tokens=partial(rng, bs), output_tokens=spec.output_tokens,
                tenant=spec.tenant, system_blocks=system_blocks, context_blocks=len(context),
            ))
            if rng.random() >= spec.follow_up:
                break
            context = context + question + ids.fresh(spec.answer_blocks)
            when += lognormal(rng, spec.follow_up_median_s, spec.follow_up_sigma)
        at += rng.expovariate(spec.queries_per_s)
    return finish(lines)
