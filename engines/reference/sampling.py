"""Next-token selection for a batch of rows, with the contract's sampling extensions.

Semantics follow TensorRT-LLM's sampling config as the stock backend exposes it
(``temperature``, ``runtime_top_k``, ``runtime_top_p``, ``random_seed``): temperature 0
is greedy; ``top_k`` 0 means no top-k cut; ``top_p`` 1.0 means no nucleus cut. A
request with a seed owns a ``torch.Generator`` seeded once, so its sampled sequence is
reproducible whatever else shares the batch.

Order of operations on a row's logits is TensorRT-LLM's (engines/contract.py states the
semantics; ``cpp/tensorrt_llm/kernels/penaltyKernels.cu`` ``batchApplyPenalty`` is the source,
tests/engines/reference/test_sampling_order.py re-implements it and compares)::

    raw logits
        ├─ guide: xgrammar bitmask → -inf for tokens the grammar forbids (commutes with the rest)
        ├─ + logit bias ─▶ × 1/(temperature + 1e-6) (sampling only, as the kernel)
        ├─ tokens seen in prompt+output: repetition ─▶ presence ─▶ frequency × occurrences
        ├─ min_tokens: end ids → -inf while fewer than min_tokens were generated
        ▼
    processed logits ──▶ log_softmax → chosen/top log probabilities (only rows that asked)
        ▼
    greedy argmax | top-k → top-p → multinomial

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
    return bool(s.temperature > 0.0 or s.logit_bias or s.penalized or row.matcher is not None
                or (s.min_tokens and row.generated < s.min_tokens and row.end_ids))


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[Sampled]:
    """One token (and its log probabilities, when asked) per row of ``logits`` ``[N, vocab]``."""
    special = [i for i, r in enumerate(rows) if _needs_processing(r)]
    scores = logits
    if special:
        # A copy: the forward's logits are inference tensors (no in-place updates allowed).
        scores = logits.float().clone()
        processed = scores[special]  # advanced indexing: a copy of just those rows
        _process(processed, [rows[i] for i in special])
        scores[special] = processed
    logprob_rows = [i for i, r in enumerate(rows) if r.request.return_log_probs]
    # Log probabilities of the processed distribution, before any top-k/top-p cut (the contract).
    log_probs = torch.log_softmax(scores[logprob_rows].float(), dim=-1) if logprob_rows else None
    chosen = scores.argmax(dim=-1).tolist()
    for index, row in enumerate(rows):
        p = row.request.sampling
        if p.temperature > 0.0:
            chosen[index] = _sample(scores[index], p, row.generator)
    out: list[Sampled] = []
    position = {row_index: k for k, row_index in enumerate(logprob_rows)}
    for index, row in enumerate(rows):
        token = int(chosen[index])
        if log_probs is None or index not in position:
            out.append(Sampled(token))
            continue
        lp = log_probs[position[index]]
        top: tuple[tuple[int, float], ...] = ()
        n = row.request.num_top_log_probs
        if n:
            values, ids = torch.topk(lp, n)
            top = tuple(zip(ids.tolist(), values.tolist()))
        out.append(Sampled(token, TokenLogProbs(float(lp[token]), top)))
    return out


def process_row(line: torch.Tensor, s: SamplingParams, tokens: Sequence[int], generated: int,
                end_ids: frozenset[int]) -> None:
    """Bias, temperature, penalties and min_tokens on one row of FP32 logits, in place, in
    ``batchApplyPenalty``'s order (penaltyKernels.cu): bias → temperature → repetition →
    presence → frequency, occurrences counted over ``tokens`` (prompt and output), then the
    min-length mask of the end ids."""
    vocab = line.shape[-1]
    if s.logit_bias:
        ids = torch.tensor([t for t, _ in s.logit_bias], dtype=torch.int64)
        line.index_add_(0, ids, torch.tensor([v for _, v in s.logit_bias], dtype=line.dtype))
    if s.temperature > 0.0 and s.temperature != 1.0:
        # The kernel multiplies by 1 / (temperature + 1e-6); greedy requests send no temperature.
        line.mul_(1.0 / (s.temperature + 1e-6))
    if s.penalized and tokens:
        seen = torch.tensor([t for t in tokens if 0 <= t < vocab], dtype=torch.int64)
        counts = torch.bincount(seen, minlength=vocab)[:vocab].to(line.dtype)
        occurred = counts > 0
        if s.repetition_penalty != 1.0:
            line.copy_(torch.where(occurred & (line < 0), line * s.repetition_penalty,
                                   torch.where(occurred, line / s.repetition_penalty, line)))
        if s.presence_penalty:
            line.sub_(s.presence_penalty * occurred.to(line.dtype))
        if s.frequency_penalty:
            line.sub_(s.frequency_penalty * counts)
    if s.min_tokens and generated < s.min_tokens and end_ids:
        line[torch.tensor(sorted(end_ids), dtype=torch.int64)] = float("-inf")


def _process(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Apply guides, bias, temperature, penalties and min_tokens to ``scores`` ``[len(rows), vocab]`` in place."""
    vocab = scores.shape[-1]
    guided: list[int] = []
    for k, row in enumerate(rows):
        process_row(scores[k], row.request.sampling, row.tokens, row.generated, row.end_ids)
        if row.matcher is not None:
            guided.append(k)
    if guided:
        bitmask = grammar.token_bitmask(len(rows), vocab)
        for k in guided:
            rows[k].matcher.fill_next_token_bitmask(bitmask, k)
        grammar.apply_bitmask(scores, bitmask, guided)


def _sample(scores: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw from processed (temperature-scaled) logits after the top-k and top-p cuts."""
    scores = scores.float()
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
