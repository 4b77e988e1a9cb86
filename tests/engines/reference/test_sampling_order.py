"""One contract, both engines: the reference sampler against TensorRT-LLM's order of operations.

The GPU engine is the product, so the reference sampler must process logits exactly as
TensorRT-LLM's ``batchApplyPenalty`` (cpp/tensorrt_llm/kernels/penaltyKernels.cu) does and report
log probabilities as ``topKStage2Sampling`` (samplingTopKKernels.cu) does with
``normalize_log_probs`` false. Both are re-implemented, with their sources, in the executor
double (tests/engines/triton/fake_trtllm.py ``batch_apply_penalty`` / ``sampled_log_prob``);
here the real sampler (engines/reference/sampling.py) is run on the same token histories.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from engines.contract import EngineRequest, SamplingParams
from engines.reference.sampling import make_generator, sample
from retention.types import RetentionPlan
from tests.engines.triton.fake_trtllm import batch_apply_penalty, sampled_log_prob

VOCAB = 48
END_ID = 7
PROMPT = [3, 5, 5, 7, 11, 11, 11]  # the end id occurs in the prompt: it is penalised too
OUTPUT = [5, 9, 12, 12]


@dataclass
class Row:
    request: EngineRequest
    tokens: list[int]
    prompt_len: int
    generated: int
    end_ids: frozenset[int] = frozenset({END_ID})
    matcher: Any = None
    generator: torch.Generator | None = field(default=None)


def _row(sampling: SamplingParams, prompt=PROMPT, output=OUTPUT) -> Row:
    request = EngineRequest(input_ids=tuple(prompt), max_new_tokens=32, end_id=END_ID, streaming=False,
                            sampling=sampling, retention=RetentionPlan(), cache_salt=None, tenant_id=None,
                            return_log_probs=True, num_top_log_probs=5)
    return Row(request, list(prompt) + list(output), len(prompt), len(output), generator=make_generator(sampling))


def _trtllm(logits: torch.Tensor, s: SamplingParams, prompt=PROMPT, output=OUTPUT) -> np.ndarray:
    """What the executor computes for the same row: kvgate sends bias as embedding_bias, the
    temperature only when sampling (engines/trtllm/executor_args.py sampling_config)."""
    bias = np.zeros(VOCAB)
    for token, value in s.logit_bias:
        bias[token] = value
    return batch_apply_penalty(
        logits.numpy(), prompt=prompt, output=output, bias=bias,
        temperature=s.temperature if s.temperature > 0 else None,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty != 1.0 else None,
        presence_penalty=s.presence_penalty or None, frequency_penalty=s.frequency_penalty or None,
        min_length=s.min_tokens, end_id=END_ID)


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(repetition_penalty=1.7, presence_penalty=-0.6, frequency_penalty=0.9),
    SamplingParams(logit_bias=((11, 3.0), (20, -4.0)), repetition_penalty=0.6, frequency_penalty=2.0),
    SamplingParams(temperature=0.5, presence_penalty=1.0, frequency_penalty=0.5, seed=3),
    SamplingParams(temperature=1.8, top_k=5, repetition_penalty=1.3, logit_bias=((5, 2.0),), seed=4),
    SamplingParams(min_tokens=6, presence_penalty=0.4),
    SamplingParams(),  # no extension: the model's own distribution
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_sampler_matches_the_tensorrt_llm_order_and_log_probs(case):
    s = CASES[case]
    generator = torch.Generator().manual_seed(100 + case)
    logits = torch.randn(1, VOCAB, generator=generator) * 3.0
    [sampled] = sample(logits, [_row(s)])
    processed = _trtllm(logits[0], s)
    expected = torch.log_softmax(torch.tensor(processed), dim=-1)
    # The chosen token's log probability: the processed distribution, not renormalised.
    assert sampled.log_probs.logprob == pytest.approx(
        sampled_log_prob(processed, sampled.token, top_k=max(s.top_k, 1), normalize_log_probs=False), abs=1e-4)
    # The top alternatives come from the same distribution.
    ids, values = zip(*sampled.log_probs.top)
    assert list(ids) == expected.topk(5).indices.tolist()
    assert list(values) == pytest.approx(expected.topk(5).values.tolist(), abs=1e-4)
    if s.temperature == 0.0:
        assert sampled.token == int(np.argmax(processed))  # greedy picks the processed argmax


def test_prompt_tokens_count_for_presence_and_frequency_and_penalties_follow_temperature():
    """The two points where the reference engine used to differ from the GPU engine."""
    logits = torch.zeros(1, VOCAB)
    # A token only in the prompt is penalised (TensorRT-LLM counts the context phase too).
    [greedy] = sample(logits, [_row(SamplingParams(frequency_penalty=1.0), output=[])])
    lp = dict(greedy.log_probs.top)
    assert 11 not in lp  # three prompt occurrences: pushed below the untouched tokens
    # Penalties are subtracted after temperature: at T = 0.5 a presence penalty of 1 moves the
    # logit by 1, not by 2 (which "penalise, then divide by T" would give).
    s = SamplingParams(temperature=0.5, presence_penalty=1.0, seed=1)
    [row_out] = sample(logits, [_row(s, output=[])])
    processed = _trtllm(logits[0], s, output=[])
    assert processed[3] == pytest.approx(-1.0, abs=1e-5) and processed[0] == pytest.approx(0.0)
    expected = torch.log_softmax(torch.tensor(processed), dim=-1)
    assert row_out.log_probs.logprob == pytest.approx(float(expected[row_out.token]), abs=1e-5)


def test_greedy_log_probs_are_not_zero_but_normalised_tensorrt_llm_ones_would_be():
    """Why the Triton model sets normalize_log_probs=False: with the 1.2 binding's default (true)
    a greedy (top-k 1) token's log probability is log P(i | i in top-1) = 0 for every token."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(9))
    [sampled] = sample(logits, [_row(SamplingParams())])
    processed = _trtllm(logits[0], SamplingParams())
    assert sampled.log_probs.logprob < -1e-3
    assert sampled_log_prob(processed, sampled.token, top_k=1, normalize_log_probs=True) == pytest.approx(0.0, abs=1e-9)
    assert sampled.log_probs.logprob == pytest.approx(
        sampled_log_prob(processed, sampled.token, top_k=1, normalize_log_probs=False), abs=1e-5)
