"""What the ``fake_trtllm`` executor makes of an enqueued request: the error it fails it with, or the
tokens and Responses it will produce (its ``ActiveRequest``), decided once, at enqueue.

The executor (``fake_trtllm_executor.Executor``) then plays the plan out one token per iteration.
Tokens are deterministic: greedy decoding gives ``(t * 7 + 3) % 1000 + 10`` per prompt token, sampling
shifts them (so a test can tell the two apart), and with an end id ≥ 0 the request samples it after those
tokens when ``max_tokens`` leaves room (or earlier, where one of them is the end id); log probabilities are
simulated (below).

A sampled end id ends the request without joining it, as in the C++ decoder (beam width 1):
``kernels/samplingTopKKernels.cu`` (03961722) ``topKStage2Sampling`` writes it at ``outputIds[seqLen]`` but
does not advance the sequence length ("Do not increase seq len when EOS is generated. Seq len should always
contain only tokens to be outputted"; the top-p kernels alike), ``trtGptModelInflightBatching.cpp``
(b35ac1b6) ``updateRequests`` calls ``LlmRequest::addNewToken`` only for ``seqLen - getNumTokens(beam)``
tokens (the end id is dropped, and gets no log probability: ``setLogProbs`` covers ``seqLen - mPromptLen``),
and ``llmRequest.cpp`` (119c6e60) ``createResult`` slices ``outputTokenIds`` from ``getTokens(beam)``. So
the end id is in no ``Result.output_token_ids``, not in the request's tokens (what ``releaseBlocks``
stores), and the iteration that samples it appends nothing: streaming, its Result is final and empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.engines.triton.fake_trtllm_bound import Bindings
    from tests.engines.triton.fake_trtllm_executor import Executor

# executor/executorImpl.cpp fetchNewRequests: a request that fails validation gets an error Response
# "Encountered an error when fetching new request: " + e.what(); batch_manager/llmRequest.cpp
# LlmRequest::validate (NVIDIA/TensorRT-LLM 119c6e60) throws, for a prompt over the model's maximum
# input length, TLLM_THROW("Prompt length (%d) exceeds maximum input length (%d). Set log level to info
# and check TRTGptModel logs for how maximum input length is set"). TllmException::what()
# (common/tllmException.cpp) appends " (<file>:<line>)" and a backtrace after a newline; the double
# writes the file relative to the source tree, line 0, and no backtrace.
FETCH_ERROR = "Encountered an error when fetching new request: "
PROMPT_TOO_LONG = ("Prompt length ({}) exceeds maximum input length ({}). Set log level to info and check "
                   "TRTGptModel logs for how maximum input length is set")
LLM_REQUEST_THROW_AT = " (cpp/tensorrt_llm/batch_manager/llmRequest.cpp:0)"


@dataclass(slots=True)
class ActiveRequest:
    """A request between enqueue and release: its planned tokens and responses (see Executor.step).

    ``generated`` are the tokens the request keeps (appended to its tokens, returned), never its end id;
    ``ends_on_end_id``: after them one more iteration samples the end id, which appends nothing (module
    docstring). ``steps`` is the request's iterations, one sampled token each. ``planned`` is one Response
    per iteration when streaming (the last one final; the end id's carries no token), else a single final
    Response with every kept token; ``sampled`` counts the iterations run so far (``<= steps``; the tokens
    appended are the first ``min(sampled, len(generated))``); ``scheduled`` is set at the request's first
    iteration, when ``kv`` (the KvCacheMetrics its responses carry) is filled in.
    """

    request: Any
    generated: list[int]
    planned: list[Any]
    kv: Any  # the KvCacheMetrics its responses carry, filled when it is scheduled
    ends_on_end_id: bool = False
    scheduled: bool = False
    sampled: int = 0

    @property
    def steps(self) -> int:
        return len(self.generated) + (1 if self.ends_on_end_id else 0)


def request_error(executor: Executor, request: Any) -> str | None:
    """The error message the executor fails ``request`` with (an error Response), or None."""
    # executorImpl.cpp fetchNewRequests: newReq->validate(mModel->getMaxInputLen(), ...) before anything else;
    # its exception becomes the request's error Response (see FETCH_ERROR).
    if len(request.input_token_ids) > executor.max_input_len:
        message = PROMPT_TOO_LONG.format(len(request.input_token_ids), executor.max_input_len)
        return FETCH_ERROR + message + LLM_REQUEST_THROW_AT
    return decoder_request_error(executor, request)


def decoder_request_error(executor: Executor, request: Any) -> str | None:
    """What batch_manager/createNewDecoderRequests.cpp throws for this request (an error Response:
    the executor reports a failure of the decoder setup to the request, not to the caller of
    enqueue_request), or None. May add a warning to ``executor.warnings``."""
    bias = request.embedding_bias
    if bias is not None:
        dtype = str(bias.dtype).removeprefix("torch.")
        if dtype != executor.logits_dtype:
            # getEmbeddingBias: FP32 for FP16 logits is converted (CPU tensors of shape [1, V] only),
            # anything else is TLLM_THROW.
            if not (dtype == "float32" and executor.logits_dtype == "float16"):
                return "[TensorRT-LLM][ERROR] Embedding bias data type must be same as model logits type."
            executor.warnings.append("Embedding bias data type must be same as model logits type, will copy the "
                                     "tensor from float to half")
            if bias.device.type != "cpu":
                return "[TensorRT-LLM][ERROR] Embedding bias tensor needs to be in CPU memory for casting"
        # initializeEmbeddingBias: TLLM_CHECK(nbDims == 2), TLLM_CHECK(d[0] == 1), d[1] == getVocabSize()
        if bias.dim() != 2:
            return "[TensorRT-LLM][ERROR] Assertion failed: embeddingBiasTensor->getShape().nbDims == 2"
        if bias.shape[0] != 1:
            return "[TensorRT-LLM][ERROR] Assertion failed: embeddingBiasTensor->getShape().d[0] == 1"
        if bias.shape[1] != executor.vocab_size:
            return ("[TensorRT-LLM][ERROR] The embedding bias shape is not as expected. Expected last dimension "
                    f"to be same as vocab size: {executor.vocab_size}.")
        # BufferManager::copy into the request's row of the joint buffer (vocabSizePadded wide)
        if executor.vocab_size != executor.vocab_size_padded:
            return "[TensorRT-LLM][ERROR] Incompatible buffer sizes"
    sampling = request.sampling_config
    if sampling is not None and sampling.min_tokens and request.end_id is not None and request.end_id < 0:
        # penaltyKernels.cu batchApplyPenalty writes outLogitsPtr[endIds[batchSlot]] unguarded: with end
        # id -1 the real kernel writes out of bounds (undefined behaviour); the double refuses loudly.
        return ("double: penaltyKernels.cu min-length mask would write logits[-1] (end_id -1 with min_tokens): "
                "undefined behaviour on a GPU")
    return None


def plan_request(bindings: Bindings, request_id: int, request: Any, *, normalize_log_probs: bool) -> ActiveRequest:
    """The tokens and Responses of a valid request; blocks are matched, stored and released by ``step``."""
    # KvCacheMetrics are filled in when the request is scheduled (KVCacheManager::addSequence).
    metrics = bindings.RequestPerfMetrics(bindings.KvCacheMetrics())
    ids = request.input_token_ids
    sampling = request.sampling_config  # None: every field unset -> (0, 0.0) -> greedy
    # Greedy decoding gives the deterministic tokens; sampling (what regularizeTopKTopP leaves
    # non-greedy) gives different ones, so a test can tell the two apart from the output.
    greedy = sampling is None or sampling.greedy
    shift = 0 if greedy else 1 + (sampling.seed or 0) % 999  # never a multiple of 1000: never greedy's tokens
    generated = [(t * 7 + 3 + shift) % 1000 + 10 for t in ids][: request.max_tokens]
    # The end id (-1: none, ignore_eos) is sampled after them when max_tokens leaves room, or where one of them
    # is the end id; either way it ends the request and is not kept (module docstring).
    ends_on_end_id = False
    if request.end_id is not None and request.end_id >= 0:
        if request.end_id in generated:
            generated, ends_on_end_id = generated[: generated.index(request.end_id)], True
        elif len(generated) < request.max_tokens:
            ends_on_end_id = True
    # Simulated log probabilities: -0.5 - 0.01 * token, returned only with return_log_probs.
    # ExecutorConfig.normalize_log_probs (binding default true, executorConfig.cpp) is copied
    # into each request (batch_manager/createNewDecoderRequests.cpp: samplingConfig.normalizeLogProbs
    # = mIsNormalizeLogProbs) and topKStage2Sampling (samplingTopKKernels.cu) then returns log P
    # within the top-k set: for a greedy (top-k 1) request exactly 0.0 per token (sampled_log_prob).
    asked = request.output_config.return_log_probs
    normalized_greedy = greedy and normalize_log_probs
    lps = [0.0 if normalized_greedy else -0.5 - 0.01 * t for t in generated]
    planned = []
    finish = bindings.FinishReason
    reason = finish.END_ID if ends_on_end_id else finish.LENGTH
    if request.streaming:
        # one Result per iteration (createResult: isFinished(), or new tokens since the last one)
        for i, token in enumerate(generated):
            last = i == len(generated) - 1 and not ends_on_end_id
            planned.append(bindings.Response(request_id, bindings.Result(
                [token], last, metrics, lps[i:i + 1] if asked else None, reason if last else None)))
        if ends_on_end_id:  # the iteration that sampled the end id: finished, no new token
            planned.append(bindings.Response(request_id, bindings.Result(
                [], True, metrics, [] if asked else None, reason)))
    else:
        planned.append(bindings.Response(request_id, bindings.Result(
            generated, True, metrics, lps if asked else None, reason)))
    return ActiveRequest(request, generated, planned, metrics.kv_cache_metrics, ends_on_end_id)
