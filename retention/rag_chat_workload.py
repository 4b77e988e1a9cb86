"""Synthetic RAG-chat traces (Mooncake format): the design notes' benchmark shape.

A session is one user talking about retrieved documents: a system prompt shared by every
session, ``docs_per_session`` documents retrieved once at the session's start from a shared
corpus with a popularity skew (Zipf), then ``turns`` user turns, each answered::

    turn t:  [ system (shared) | doc d1 | doc d2 | … | u1 a1 | u2 a2 | … | u(t-1) a(t-1) | u_t ]
              system_tokens ─┘  retrieved context (context_tokens)      history ─┘        └─ turn

Turn ``t+1`` repeats turn ``t``'s prompt and appends ``a_t`` and ``u_(t+1)``, so its reusable
prefix is everything before. Documents sit right after the system prompt in retrieval order
(the most relevant first), so two sessions share a cached prefix up to the first document
where their retrievals differ — prefix caching cannot reuse a popular document that comes
second behind a different first one, as in the engines the design notes measured.

Hash ids (one per ``block_size`` prompt tokens, as Mooncake): ids ``0..S-1`` are the system
prompt, then ``tokens_per_doc / block_size`` ids per corpus document, then fresh ids for each
session's conversation stream (user turns and answers, back to back, cut into blocks; the
partial last block of one turn's prompt is the first part of a full block in the next turn's,
so a pool with smaller blocks reuses its full sub-blocks, as TensorRT-LLM with 32-token blocks
does). Sessions arrive as a Poisson process; turns follow after exponential think times.
Answers are output tokens of one turn and prompt tokens (history) of the next. Lines carry
``tenant``, ``system_tokens`` and ``context_tokens`` (system + documents + history) for the
``class`` policy. Deterministic for a seed. Pure: no I/O.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RagChatSpec:
    duration_s: float = 1800.0
    sessions_per_s: float = 1.0
    block_size: int = 512  # tokens per hash id
    system_tokens: int = 1536  # 1.5K-token system prompt
    context_tokens: int = 8192  # 8K tokens of retrieved context per session
    docs_per_session: int = 4  # so one document is context_tokens / docs_per_session tokens
    corpus_docs: int = 5000
    popularity_skew: float = 1.0  # Zipf exponent: document of rank r is drawn with weight r^-skew
    user_tokens: int = 200
    answer_tokens: int = 300
    turns: int = 6
    turn_gap_s: float = 45.0  # mean think time between an answer and the next turn
    tenant: str = "rag"

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.sessions_per_s <= 0 or self.turn_gap_s <= 0:
            raise ValueError("duration, session rate and turn gap must be positive")
        if self.block_size < 2 or self.turns < 1 or self.user_tokens < 1 or self.answer_tokens < 0:
            raise ValueError("block_size >= 2, turns >= 1, user_tokens >= 1, answer_tokens >= 0")
        if self.docs_per_session < 1 or self.corpus_docs < self.docs_per_session:
            raise ValueError("need 1 <= docs_per_session <= corpus_docs")
        if self.popularity_skew < 0:
            raise ValueError("popularity_skew must be >= 0 (0 = uniform)")
        # Shared segments must start and end on hash-id boundaries, or equal documents
        # would not produce equal blocks in different sessions.
        if self.system_tokens % self.block_size or self.context_tokens % (self.docs_per_session * self.block_size):
            raise ValueError("system_tokens and each document (context_tokens / docs_per_session) "
                             "must be whole multiples of block_size")

    @property
    def tokens_per_doc(self) -> int:
        return self.context_tokens // self.docs_per_session

    def prompt_tokens(self, turn: int) -> int:
        """Prompt length of turn ``turn`` (1-based)."""
        return self.system_tokens + self.context_tokens + (turn - 1) * (self.user_tokens + self.answer_tokens) + self.user_tokens


def rag_chat_trace(spec: RagChatSpec = RagChatSpec(), *, seed: int = 0) -> list[dict]:
    """Trace lines (dicts, JSON-ready), sorted by timestamp."""
    rng = random.Random(seed)
    bs = spec.block_size
    system_ids = list(range(spec.system_tokens // bs))
    ids_per_doc = spec.tokens_per_doc // bs
    doc_base = len(system_ids)
    next_id = doc_base + spec.corpus_docs * ids_per_doc
    cumulative = list(itertools.accumulate((rank + 1) ** -spec.popularity_skew for rank in range(spec.corpus_docs)))
    total_weight = cumulative[-1]
    stream_tokens = spec.turns * (spec.user_tokens + spec.answer_tokens)
    lines: list[dict] = []

    def retrieve() -> list[int]:
        chosen: list[int] = []
        while len(chosen) < spec.docs_per_session:  # weighted draws without replacement
            doc = bisect.bisect_left(cumulative, rng.random() * total_weight)
            doc = min(doc, spec.corpus_docs - 1)
            if doc not in chosen:
                chosen.append(doc)
        return chosen

    start = rng.expovariate(spec.sessions_per_s)
    while start < spec.duration_s:
        docs = retrieve()
        doc_ids = [doc_base + d * ids_per_doc + j for d in docs for j in range(ids_per_doc)]
        conversation = list(range(next_id, next_id + -(-stream_tokens // bs)))
        next_id += len(conversation)
        stream = system_ids + doc_ids + conversation
        at = start
        for turn in range(1, spec.turns + 1):
            if at >= spec.duration_s:
                break
            length = spec.prompt_tokens(turn)
            lines.append({
                "timestamp": round(at * 1000.0, 3),
                "input_length": length,
                "output_length": spec.answer_tokens,
                "hash_ids": stream[: -(-length // bs)],
                "tenant": spec.tenant,
                "system_tokens": spec.system_tokens,
                "context_tokens": length - spec.user_tokens,
                "session_docs": docs,
            })
            at += rng.expovariate(1.0 / spec.turn_gap_s)
        start += rng.expovariate(spec.sessions_per_s)
    lines.sort(key=lambda line: line["timestamp"])
    return lines
