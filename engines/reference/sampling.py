"""Next-token selection for a batch of rows, with the contract's sampling extensions.

Semantics follow TensorRT-LLM's sampling config as the stock backend exposes it
(``temperature``, ``runtime_top_k``, ``runtime_top_p``, ``random_seed``): temperature 0
is greedy; ``top_k`` 0 means no top-k cut; ``top_p`` 1.0 means no nucleus cut. A
request with a seed owns a ``torch.Generator`` seeded once, so its sampled sequence is
reproducible whatever else shares the batch.

Order of operations on a row's logits (engines/contract.py states the semantics)::

    raw logits ──▶ log_softmax → chosen/top log probabilities (only rows that asked)
        │
        ├─ + logit bias ─▶ repetition penalty (prompt+output) ─▶ presence/frequency (output)
        ├─ min_tokens: end ids → -inf while fewer than min_tokens were generated
        ├─ guide: xgrammar bitmask → -inf for tokens the grammar forbids
        ▼
    greedy argmax | temperature → top-k → top-p → multinomial

Rows with none of the extensions take the old path (one batched argmax), so the plain
decode step pays nothing for them. Rows that need processing are processed together:
one masked/penalized copy of just those rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engines.contract import EngineRequest, SamplingParams, TokenLogProbs
from engines.reference import grammar


class SamplingRow(Protocol):
    """What the sampler reads from a sequence (the scheduler's ``Sequence`` satisfies it)."""

    request: EngineRequest
    generator: torch.Generator | None
    tokens: list[int]  # prompt + generated
    prompt_len: int
    generated: int
    end_ids: frozenset[int]
    matcher: Any


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    log_probs: TokenLogProbs | None = None


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature <= 0.0:
        return None
    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(int(params.seed) & 0xFFFF_FFFF_FFFF_FFFF)
    else:
        generator.seed()
    return generator


def _needs_processing(row: SamplingRow) -> bool:
    s = row.request.sampling
    return bool(s.logit_bias or s.penalized or row.matcher is not None
                or (s.min_tokens and row.generated < s.min_tokens and row.end_ids))


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[Sampled]:
    """One token (and its log probabilities, when asked) per row of ``logits`` ``[N, vocab]``."""
    logprob_rows = [i for i, r in enumerate(rows) if r.request.return_log_probs]
    raw_logprobs = torch.log_softmax(logits[logprob_rows].float(), dim=-1) if logprob_rows else None
    special = [i for i, r in enumerate(rows) if _needs_processing(r)]
    scores = logits
    if special:
        # A copy: the forward's logits are inference tensors (no in-place updates allowed).
        scores = logits.float().clone()
        processed = scores[special]  # advanced indexing: a copy of just those rows
        _process(processed, [rows[i] for i in special])
        scores[special] = processed
    chosen = scores.argmax(dim=-1).tolist()
    for index, row in enumerate(rows):
        p = row.request.sampling
        if p.temperature > 0.0:
            chosen[index] = _sample(scores[index], p, row.generator)
    out: list[Sampled] = []
    position = {row_index: k for k, row_index in enumerate(logprob_rows)}
    for index, row in enumerate(rows):
        token = int(chosen[index])
        if raw_logprobs is None or index not in position:
            out.append(Sampled(token))
            continue
        lp = raw_logprobs[position[index]]
        top: tuple[tuple[int, float], ...] = ()
        n = row.request.num_top_log_probs
        if n:
            values, ids = torch.topk(lp, n)
            top = tuple(zip(ids.tolist(), values.tolist()))
        out.append(Sampled(token, TokenLogProbs(float(lp[token]), top)))
    return out


def _process(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Apply bias, penalties, min_tokens and guides to ``scores`` ``[len(rows), vocab]`` in place."""
    vocab = scores.shape[-1]
    guided: list[int] = []
    for k, row in enumerate(rows):
        s = row.request.sampling
        line = scores[k]
        if s.logit_bias:
            ids = torch.tensor([t for t, _ in s.logit_bias], dtype=torch.int64)
            line.index_add_(0, ids, torch.tensor([v for _, v in s.logit_bias], dtype=line.dtype))
        if s.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.tokens)), dtype=torch.int64)
            picked = line[seen]
            line[seen] = torch.where(picked > 0, picked / s.repetition_penalty, picked * s.repetition_penalty)
        if s.presence_penalty or s.frequency_penalty:
            output = row.tokens[row.prompt_len:]
            if output:
                counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab).to(line.dtype)
                line -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(line.dtype)
        if s.min_tokens and row.generated < s.min_tokens and row.end_ids:
            line[torch.tensor(sorted(row.end_ids), dtype=torch.int64)] = float("-inf")
        if row.matcher is not None:
            guided.append(k)
    if guided:
        bitmask = grammar.token_bitmask(len(rows), vocab)
        for k in guided:
            rows[k].matcher.fill_next_token_bitmask(bitmask, k)
        grammar.apply_bitmask(scores, bitmask, guided)


def _sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    scores = logits.float() / p.temperature
    if p.top_k > 0 and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = cumulative - sorted_probs > p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """Plain sampling without extensions (kept for callers that have no sequences)."""
    chosen = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators)):
        if p.temperature > 0.0:
            chosen[row] = _sample(logits[row], p, generator)
    return chosen
