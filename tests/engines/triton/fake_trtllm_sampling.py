"""The decoding kernels' arithmetic that the ``fake_trtllm`` double and the reference-sampler tests share.

``regularize_top_k_top_p`` is what every sampling layer makes of an unset top-k / top-p pair (an unset
pair is greedy); ``batch_apply_penalty`` and ``sampled_log_prob`` re-implement, in numpy, one row of the
logit processing and the log probability the CUDA kernels produce (penaltyKernels.cu,
samplingTopKKernels.cu), so tests can compare kvgate's reference sampler with them. Pure functions:
no state, inputs are never modified.
"""

from __future__ import annotations

from typing import Any

# cpp/tensorrt_llm/layers/defaultDecodingParams.h: getTopK() = 0, getTopP() = 0.0f — what an
# unset SamplingConfig.top_k / top_p becomes in the decoding layers.
DEFAULT_TOP_K = 0
DEFAULT_TOP_P = 0.0


def regularize_top_k_top_p(top_k: int, top_p: float) -> tuple[int, float]:
    """cpp/tensorrt_llm/kernels/samplingTopKKernels.h ``regularizeTopKTopP``, applied by every sampling layer.

    (0, 0.0) → top_k 1 (greedy: "topp = 0.0f ... equivalent to greedy search");
    (k > 0, 0.0) → top_p 1.0 (top-k only).
    """
    if top_k == 0 and top_p == 0.0:
        top_k = 1
    if top_k > 0 and top_p == 0.0:
        top_p = 1.0
    return top_k, top_p


FLT_MAX = 3.4028234663852886e38  # penaltyKernels.cu MASK_VAL for float logits (-FLT_MAX)


def batch_apply_penalty(logits: Any, *, prompt: list[int], output: list[int], bias: Any = None,
                        temperature: float | None = None, repetition_penalty: float | None = None,
                        presence_penalty: float | None = None, frequency_penalty: float | None = None,
                        min_length: int = 0, end_id: int | None = None) -> Any:
    """One row (beam 1) of cpp/tensorrt_llm/kernels/penaltyKernels.cu ``batchApplyPenalty``, in numpy.

    Read at NVIDIA/TensorRT-LLM 249d93d5 (a 2024-25 main snapshot; the 1.2.1 tag could not be
    read, the kernel has not changed shape across the snapshots in the index). Per token of
    the vocabulary: ``logit + bias``, then ``× 1/(temperature + 1e-6)`` when the temperature is
    not 1 (``DefaultDecodingParams::getTemperature``), then — only for tokens whose occurrence
    count is > 0, counted over the prompt in the context phase and every generated token since
    — repetition (``logit < 0 ? logit × p : logit / p``), presence (``- p``), frequency
    (``- p × count``), then every logit is clamped to ±FLT_MAX ("do clamp to prevent overflow",
    seen at 3c44cb97: ``logit > -MASK_VAL`` → ``-MASK_VAL``, ``logit < MASK_VAL`` → ``MASK_VAL``; a
    NaN passes both comparisons unchanged). Then, while ``currentStep - inputLen < minLength``, the
    end id's logit becomes ``-FLT_MAX``: ``outLogitsPtr[endIds[batchSlot]]``, unguarded — with end
    id -1 (how ``ignore_eos`` is sent) that is a write before the row, which this re-implementation
    refuses.
    """
    import numpy as np

    out = np.asarray(logits, dtype=np.float32).astype(np.float64)
    vocab = out.shape[-1]
    if bias is not None:
        out = out + np.asarray(bias, dtype=np.float64)
    if temperature is not None and abs(temperature - 1.0) >= 1e-9:
        out = out * (1.0 / (temperature + 1e-6))
    defaults = (repetition_penalty in (None, 1.0), presence_penalty in (None, 0.0), frequency_penalty in (None, 0.0))
    if not all(defaults):  # accumulateVocab
        counts = np.zeros(vocab, dtype=np.int64)
        for token in list(prompt) + list(output):
            if token < vocab:  # "if (penaltyIndex < vocabSize)"
                counts[token] += 1
        seen = counts > 0
        if repetition_penalty is not None:
            out = np.where(seen & (out < 0), out * repetition_penalty, np.where(seen, out / repetition_penalty, out))
        if presence_penalty is not None:
            out = np.where(seen, out - presence_penalty, out)
        if frequency_penalty is not None:
            out = np.where(seen, out - frequency_penalty * counts, out)
    out = np.clip(out, -FLT_MAX, FLT_MAX)  # the kernel's clamp (NaN stays NaN, as there)
    if min_length > 0 and len(output) < min_length:
        if end_id is None or end_id < 0:
            raise RuntimeError(f"penaltyKernels.cu batchApplyPenalty: min length writes logits[endIds[slot]] "
                               f"unguarded; end id {end_id} is out of bounds")
        out[end_id] = -FLT_MAX
    return out


def sampled_log_prob(processed: Any, token: int, *, top_k: int, normalize_log_probs: bool) -> float:
    """The log probability ``topKStage2Sampling`` (cpp/tensorrt_llm/kernels/samplingTopKKernels.cu,
    03961722) writes for ``token`` when output log probs are asked: the sampling layer first turns
    the processed logits into probabilities over the whole vocabulary (layers/samplingLayer.cpp:
    ``invokeAddBiasSoftMax`` when ``mOutputLogProbs``, ``probsComputed``), then
    ``normalizeLogProbs ? log(p) - log(sum of the top-k p) : log(p)`` — "NOT normalized (same way
    as OpenAI does)" vs "log P(i | i is in top-k)". Greedy is top_k 1: normalised, always 0."""
    import numpy as np

    row = np.asarray(processed, dtype=np.float64)
    shifted = row - row.max()
    probs = np.exp(shifted) / np.exp(shifted).sum()
    log_p = float(np.log(probs[token]))
    if not normalize_log_probs:
        return log_p
    top = np.sort(probs)[::-1][:max(top_k, 1)]
    return log_p - float(np.log(top.sum()))
