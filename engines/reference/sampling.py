"""Next-token selection for a batch of rows (greedy in one argmax, sampled rows one by one).

Semantics follow TensorRT-LLM's sampling config as the stock backend exposes it
(``temperature``, ``runtime_top_k``, ``runtime_top_p``, ``random_seed``): temperature 0
is greedy; ``top_k`` 0 means no top-k cut; ``top_p`` 1.0 means no nucleus cut. A
request with a seed owns a ``torch.Generator`` seeded once, so its sampled sequence is
reproducible whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.contract import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature <= 0.0:
        return None
    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(int(params.seed) & 0xFFFF_FFFF_FFFF_FFFF)
    else:
        generator.seed()
    return generator


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """One token per row of ``logits`` ``[N, vocab]``."""
    chosen = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators)):
        if p.temperature <= 0.0:
            continue
        chosen[row] = _sample(logits[row], p, generator)
    return chosen


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
