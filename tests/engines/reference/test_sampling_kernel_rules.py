"""The reference sampler follows TensorRT-LLM's kernels where a row is degenerate or cut.

Sources (NVIDIA/TensorRT-LLM):

* ``cpp/tensorrt_llm/kernels/penaltyKernels.cu`` ``batchApplyPenalty`` (3c44cb97): every logit is
  clamped to ±FLT_MAX after bias, temperature and penalties ("do clamp to prevent overflow"),
  and the min-length mask writes ``MASK_VAL = -FLT_MAX`` (finite) to the end id.
* ``cpp/tensorrt_llm/kernels/samplingTopPKernels.cu`` ``topPSsampling`` (03cff08f): ``randNumS =
  curand_uniform(..) * probThreshold``, the first token in descending order whose inclusive
  cumulative probability reaches it (``randNumS <= threadOffset``).
* ``cpp/tensorrt_llm/kernels/samplingTopKKernels.cu`` ``topKStage2Sampling`` (03961722): stage 1
  selects exactly k ids; ``randNum = curand_uniform(..) * probThreshold * sSum``, minus each
  sorted top-k probability until ``randNum <= 0``.

Synthetic rows, no model: the engine-level consequences (a guide with min_tokens, a tiny
repetition penalty, each next to a bystander request) are in test_sampling_extensions.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from engines.contract import EngineRequest, SamplingParams
from engines.reference.sampling import FLT_MAX, _sample, make_generator, process_row, sample
from retention.types import RetentionPlan
from tests.engines.triton.fake_trtllm import batch_apply_penalty

VOCAB = 40
END_ID = 7
PROMPT = [3, 5, 5, 9]


@dataclass
class Row:
    request: EngineRequest
    tokens: list[int]
    prompt_len: int
    generated: int
    end_ids: frozenset[int] = frozenset({END_ID})
    matcher: Any = None
    generator: torch.Generator | None = field(default=None)


def _row(sampling: SamplingParams, *, matcher: Any = None, end_id: int = END_ID, log_probs: bool = True) -> Row:
    request = EngineRequest(input_ids=tuple(PROMPT), max_new_tokens=16, end_id=end_id, streaming=False,
                            sampling=sampling, retention=RetentionPlan(), cache_salt=None, tenant_id=None,
                            return_log_probs=log_probs)
    return Row(request, list(PROMPT), len(PROMPT), 0, frozenset({end_id}), matcher, make_generator(sampling))


class OnlyEndAllowed:
    """A grammar matcher whose grammar is complete: its bitmask allows only the end token."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = 0
        bitmask[index, END_ID // 32] = 1 << (END_ID % 32)


class NothingAllowed:
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = 0


class BrokenMatcher:
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        raise RuntimeError("matcher state corrupted")


def _logits(seed: int = 0, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_min_tokens_and_a_completed_guide_end_the_sequence_instead_of_an_all_minus_inf_row(temperature):
    """min_tokens masks the end id with the kernel's finite -FLT_MAX; the guide allows only the end
    id: the end id is the one candidate left (greedy and sampled), with log probability 0."""
    row = _row(SamplingParams(temperature=temperature, seed=1, min_tokens=5), matcher=OnlyEndAllowed())
    [sampled] = sample(_logits(), [row])
    assert sampled.error is None
    assert sampled.token == END_ID
    assert sampled.log_probs.logprob == pytest.approx(0.0)


def test_min_tokens_masks_the_end_id_with_minus_flt_max_as_the_kernel():
    s = SamplingParams(min_tokens=3, presence_penalty=0.5)
    logits = _logits(2)[0]
    line = logits.clone()
    process_row(line, s, PROMPT, 0, frozenset({END_ID}))
    assert float(line[END_ID]) == -FLT_MAX
    expected = batch_apply_penalty(logits.numpy(), prompt=PROMPT, output=[], presence_penalty=0.5,
                                   min_length=3, end_id=END_ID)
    assert line.double().numpy() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_tiny_repetition_penalty_is_clamped_to_flt_max_not_inf(temperature):
    """repetition_penalty 1e-38 divides a positive logit of a seen token past FLT_MAX: the kernel
    clamps it to FLT_MAX, so the row stays finite, log probabilities are numbers and a draw works."""
    logits = _logits(3)
    logits[0, PROMPT] = torch.tensor([20.0, 10.0, 10.0, 5.0])  # seen tokens, positive: x / 1e-38 > FLT_MAX
    s = SamplingParams(temperature=temperature, seed=5, repetition_penalty=1e-38)
    line = logits[0].clone()
    process_row(line, s, PROMPT, 0, frozenset())
    assert torch.isfinite(line).all()
    expected = batch_apply_penalty(logits[0].numpy(), prompt=PROMPT, output=[],
                                   temperature=temperature or None, repetition_penalty=1e-38)
    assert np.isfinite(expected).all() and line.double().numpy() == pytest.approx(expected, rel=1e-6)
    [sampled] = sample(logits, [_row(s)])
    assert sampled.error is None and sampled.token in PROMPT  # the seen tokens now dominate
    assert np.isfinite(sampled.log_probs.logprob) and sampled.log_probs.logprob <= 0.0


def test_one_rows_failure_fails_that_row_only_and_leaves_the_others_draws_unchanged():
    """A row whose processing raises comes back with an error; its neighbours are sampled exactly
    as without it (same seeded tokens, same log probabilities)."""
    logits = _logits(4, rows=3)
    bystander = SamplingParams(temperature=0.9, seed=11)
    alone = [sample(logits[i:i + 1], [_row(bystander)])[0] for i in (0, 2)]
    rows = [_row(bystander), _row(SamplingParams(), matcher=BrokenMatcher()), _row(bystander)]
    first, failed, third = sample(logits, rows)
    assert failed.error is not None and "matcher state corrupted" in failed.error
    for got, want in zip((first, third), alone):
        assert got.error is None and got.token == want.token
        assert got.log_probs.logprob == pytest.approx(want.log_probs.logprob)


def test_a_row_that_cannot_be_drawn_fails_alone():
    """A sampled row whose guide forbids every token has nothing to draw: its error, not the batch's."""
    logits = _logits(5, rows=2)
    out = sample(logits, [_row(SamplingParams(temperature=1.0, seed=2), log_probs=False),
                          _row(SamplingParams(temperature=1.0, seed=3), matcher=NothingAllowed(), log_probs=False)])
    assert out[0].error is None and 0 <= out[0].token < VOCAB
    assert out[1].error is not None


# Top-p / top-k: the kernels' draw, checked as a distribution ---------------------------------

def _kernel_distribution(probs: list[float], top_k: int, top_p: float) -> np.ndarray:
    """Exact P(token) of topPSsampling / topKStage2Sampling for a row with these probabilities:
    token i (descending) is chosen when c_{i-1} < u·P·S <= c_i, u uniform in (0, 1]."""
    p = np.asarray(probs, np.float64)
    order = np.argsort(-p, kind="stable")
    if top_k:
        order = order[:top_k]
    kept = p[order]
    threshold = top_p * kept.sum()  # S: the top-k mass (1 without top-k)
    cumulative = np.cumsum(kept)
    mass = np.minimum(cumulative, threshold) - np.minimum(cumulative - kept, threshold)
    out = np.zeros_like(p)
    out[order] = mass / threshold
    return out


@pytest.mark.parametrize(("probs", "top_k", "top_p"), [
    ([0.5, 0.3, 0.2, 0.0], 0, 0.6),    # boundary token 1 keeps 0.1 of its 0.3: P = 1/6, not 0.375
    ([0.5, 0.3, 0.2, 0.0], 2, 0.7),    # top-k 2 then top-p over the top-k mass: P(1) = 0.075/0.7
    ([0.6, 0.4, 0.0, 0.0], 0, 0.61),   # P(1) = 0.01/0.61
    ([0.25, 0.25, 0.25, 0.25], 0, 0.9),
])
def test_top_p_samples_the_kernels_distribution(probs, top_k, top_p):
    expected = _kernel_distribution(probs, top_k, top_p)
    logits = torch.tensor(probs, dtype=torch.float32).clamp_min(1e-30).log()
    s = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=0)
    generator = make_generator(s)
    n = 4000
    counts = np.bincount([_sample(logits, s, generator) for _ in range(n)], minlength=len(probs))
    observed = counts / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(observed - expected) <= 4 * sigma + 2e-3), (observed, expected)
    assert np.all(counts[expected == 0] == 0)


def test_seeded_top_p_draws_are_reproducible():
    logits = _logits(6)[0] / 6.0  # a flat row: many tokens inside the nucleus
    s = SamplingParams(temperature=1.0, top_k=20, top_p=0.8, seed=42)
    first = [_sample(logits, s, g) for g in [make_generator(s)] for _ in range(50)]
    second = [_sample(logits, s, g) for g in [make_generator(s)] for _ in range(50)]
    assert first == second and len(set(first)) > 1


def test_top_k_keeps_exactly_k_ids_even_when_logits_tie():
    """The kernel selects k ids; a cut by value (< the k-th) would keep every tied token."""
    tied_max = torch.tensor([1.0, 3.0, 3.0, 0.0, -1.0])
    picks = {_sample(tied_max, SamplingParams(temperature=1.0, top_k=1, seed=seed),
                     make_generator(SamplingParams(temperature=1.0, seed=seed))) for seed in range(40)}
    assert len(picks) == 1 and picks <= {1, 2}  # top_k 1 is greedy, ties or not
    tied_kth = torch.tensor([5.0, 3.0, 3.0, 3.0, 0.0])
    s = SamplingParams(temperature=1.0, top_k=2, seed=0)
    generator = make_generator(s)
    drawn = {_sample(tied_kth, s, generator) for _ in range(400)}
    assert len(drawn) == 2 and 0 in drawn
