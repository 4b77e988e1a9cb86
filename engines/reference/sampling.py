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
        ├─ clamp to ±FLT_MAX (the kernel's "do clamp to prevent overflow"; NaN → -FLT_MAX)
        ├─ min_tokens: end ids → -FLT_MAX (the kernel's MASK_VAL, finite) while fewer than
        │  min_tokens were generated
        ▼
    processed logits ──▶ log_softmax → chosen/top log probabilities (only rows that asked)
        ▼
    greedy argmax | top-k → top-p → one draw

The guide's -inf and the min-length mask's -FLT_MAX never leave a row without a finite
maximum: when a completed guide allows only the end token while min_tokens still masks it,
the end token (-FLT_MAX) is the only candidate and the sequence ends — the grammar wins.
(On TensorRT-LLM the bitmask runs before ``batchApplyPenalty``, whose clamp lifts the guide's
-inf to -FLT_MAX too, leaving an all-equal row: a token the grammar then refuses. The
reference does not copy that.)

Top-k keeps exactly ``top_k`` ids (``torch.topk``'s, as the kernel's stage 1 selects k ids
whatever the ties). Top-p is the kernel's draw (``samplingTopPKernels.cu`` ``topPSsampling``;
with top-k, ``samplingTopKKernels.cu`` ``topKStage2Sampling``): u ∈ (0, 1], threshold u·P (·the
top-k mass), the first token in descending order whose cumulative probability reaches it. So
the boundary token keeps only the part of its mass below P: token i (sorted) has probability
(min(c_i, P) - min(c_{i-1}, P)) / P, c the cumulative probabilities. The reference draws that
distribution with one ``torch.multinomial`` on the request's generator.

Rows with none of the extensions take the old path (one batched argmax), so the plain
decode step pays nothing for them. Rows that need processing are processed together:
one masked/penalized copy of just those rows. A row whose processing or draw fails gets
``Sampled.error`` (its sequence fails); the other rows of the step are sampled as usual.
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


FLT_MAX = float(torch.finfo(torch.float32).max)  # penaltyKernels.cu: MASK_VAL = -FLT_MAX, clamp to ±FLT_MAX


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    log_probs: TokenLogProbs | None = None
    error: str | None = None  # this row could not be sampled: its sequence fails, the step goes on


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
    """One token (and its log probabilities, when asked) per row of ``logits`` ``[N, vocab]``.

    A failure confined to one row (its processing, its guide's bitmask, its draw) fails that
    row only: it comes back with ``error`` set and the others are sampled as usual, each
    generator drawn exactly as it would have been without the failing row."""
    errors: dict[int, str] = {}
    special = [i for i, r in enumerate(rows) if _needs_processing(r)]
    scores = logits
    if special:
        # A copy: the forward's logits are inference tensors (no in-place updates allowed).
        scores = logits.float().clone()
        processed = scores[special]  # advanced indexing: a copy of just those rows
        for k, message in _process(processed, [rows[i] for i in special]).items():
            errors[special[k]] = message
        scores[special] = processed
    logprob_rows = [i for i, r in enumerate(rows) if r.request.return_log_probs and i not in errors]
    # Log probabilities of the processed distribution, before any top-k/top-p cut (the contract).
    log_probs = torch.log_softmax(scores[logprob_rows].float(), dim=-1) if logprob_rows else None
    chosen = scores.argmax(dim=-1).tolist()
    for index, row in enumerate(rows):
        p = row.request.sampling
        if p.temperature > 0.0 and index not in errors:
            try:
                chosen[index] = _sample(scores[index], p, row.generator)
            except Exception as exc:  # noqa: BLE001 - one row's failure must not fail the batch
                errors[index] = f"sampling failed: {exc}"
    out: list[Sampled] = []
    position = {row_index: k for k, row_index in enumerate(logprob_rows)}
    for index, row in enumerate(rows):
        if index in errors:
            out.append(Sampled(-1, error=errors[index]))
            continue
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
    clamp to ±FLT_MAX ("do clamp to prevent overflow": a repetition_penalty of 1e-38 or a tiny
    temperature would otherwise make +inf and NaN probabilities; the kernel leaves a NaN as it is,
    the reference makes it -FLT_MAX), then the min-length mask of the end ids with the kernel's
    finite MASK_VAL (-FLT_MAX), so the end token stays a candidate when nothing else is left."""
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
    line.nan_to_num_(nan=-FLT_MAX, posinf=FLT_MAX, neginf=-FLT_MAX)
    if s.min_tokens and generated < s.min_tokens and end_ids:
        line[torch.tensor(sorted(end_ids), dtype=torch.int64)] = -FLT_MAX


def _process(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> dict[int, str]:
    """Apply bias, temperature, penalties, min_tokens and guides to ``scores`` ``[len(rows), vocab]`` in
    place; returns the rows that failed (index → message), whose scores are then meaningless."""
    vocab = scores.shape[-1]
    errors: dict[int, str] = {}
    guided: list[int] = []
    bitmask = None
    for k, row in enumerate(rows):
        try:
            process_row(scores[k], row.request.sampling, row.tokens, row.generated, row.end_ids)
            if row.matcher is not None:
                if bitmask is None:
                    bitmask = grammar.token_bitmask(len(rows), vocab)
                row.matcher.fill_next_token_bitmask(bitmask, k)
                guided.append(k)
        except Exception as exc:  # noqa: BLE001 - one row's failure must not fail the batch
            errors[k] = f"sampling failed: {exc}"
    if guided:
        grammar.apply_bitmask(scores, bitmask, guided)
    return errors


def _sample(scores: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw from processed (temperature-scaled) logits after the top-k and top-p cuts, as TensorRT-LLM's
    sampling kernels do (module docstring): exactly ``top_k`` ids, and the top-p boundary token kept
    only up to the mass P."""
    scores = scores.float()
    if 0 < p.top_k < scores.shape[-1]:
        values, ids = torch.topk(scores, p.top_k)  # descending; exactly k ids, ties or not
        probs = torch.softmax(values, dim=-1)
    elif p.top_p < 1.0:
        probs, ids = torch.sort(torch.softmax(scores, dim=-1), descending=True, stable=True)  # ties: lower id first
    else:
        return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).item())
    if p.top_p < 1.0:
        # topPSsampling / topKStage2Sampling: the first token whose cumulative probability reaches
        # u·P, u ∈ (0, 1]. Token i is drawn when c_{i-1} < u·P <= c_i: mass min(c_i, P) - min(c_{i-1}, P).
        cumulative = probs.cumsum(dim=-1)
        bound = torch.full_like(cumulative, p.top_p)
        probs = (torch.minimum(cumulative, bound) - torch.minimum(cumulative - probs, bound)).clamp_min_(0.0)
    return int(ids[torch.multinomial(probs, 1, generator=generator).item()].item())
