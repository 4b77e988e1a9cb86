"""The contract's sampling extensions, log probabilities and guides → the 1.2 executor's arguments.

Every keyword below was read in the 1.2-era nanobind sources of NVIDIA/TensorRT-LLM:

* ``SamplingConfig(beam_width=1, *, ..., min_tokens=, repetition_penalty=, presence_penalty=,
  frequency_penalty=, ...)`` — cpp/tensorrt_llm/nanobind/executor/request.cpp; the stock
  Python model passes the same names from the same tensors (triton_backend/all_models/
  inflight_batcher_llm/tensorrt_llm/1/model.py ``get_sampling_config_from_request``).
* ``OutputConfig(return_log_probs=False, ...)`` and ``Result.log_probs``
  (``std::optional<std::vector<std::vector<float>>>``, one list per beam) — request.cpp;
  the stock model: ``get_output_config_from_request``.
* ``Request(..., *, end_id=, embedding_bias=, guided_decoding_params=, ...)`` — request.cpp
  (``end_id`` is ``std::optional<SizeType32>``; ``embedding_bias`` is ``std::optional<Tensor>``).
  ``ignore_eos`` is ``end_id=-1``, as the LLM API does it (tensorrt_llm/executor/
  base_worker.py: ``end_id=-1 if request.sampling_params.ignore_eos else ...``).
* ``GuidedDecodingParams(guide_type, guide=None)`` with ``GuideType.{JSON, JSON_SCHEMA, REGEX,
  EBNF_GRAMMAR, STRUCTURAL_TAG}`` — request.cpp; the string → type mapping is the stock
  model's (``get_guided_decoding_params_from_request``) and the C++ backend's
  (triton_backend/inflight_batcher_llm/src/utils.cc ``getGuidedDecodingParamsFromTensors``).
* ``GuidedDecodingConfig(backend, encoded_vocab=None, tokenizer_str=None, stop_token_ids=None)``
  with ``GuidedDecodingBackend.XGRAMMAR`` — cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp;
  the vocabulary is the tokenizer's tokens sorted by id and ``tokenizer_str`` the
  ``tokenizer.json`` text (docs/source/legacy/advanced/executor.md, "Structured output with
  guided decoding").

Not mapped: ``num_top_log_probs`` > 0. The 1.2 C++ executor returns the chosen token's log
probability only; alternatives would need ``return_generation_logits`` and an engine built
with ``--gather_generation_logits``. The Triton model refuses such a request by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from engines.contract import IGNORE_EOS, ContractError, EngineRequest, SamplingParams
from engines.trtllm.engine_config import BiasLayout

GUIDE_TYPE_NAMES = {"json": "JSON", "json_schema": "JSON_SCHEMA", "regex": "REGEX", "ebnf_grammar": "EBNF_GRAMMAR"}


class ExtensionUnsupportedError(RuntimeError):
    """The request asks for something this executor build or configuration cannot do."""


def sampling_extension_kwargs(s: SamplingParams) -> dict[str, Any]:
    """Extra ``SamplingConfig`` keywords; only the non-default ones (unset = off in the executor)."""
    kwargs: dict[str, Any] = {}
    if s.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = float(s.repetition_penalty)
    if s.presence_penalty != 0.0:
        kwargs["presence_penalty"] = float(s.presence_penalty)
    if s.frequency_penalty != 0.0:
        kwargs["frequency_penalty"] = float(s.frequency_penalty)
    if s.min_tokens:
        kwargs["min_tokens"] = int(s.min_tokens)
    return kwargs


def output_config_kwargs(request: EngineRequest) -> dict[str, Any]:
    if request.num_top_log_probs:
        raise ExtensionUnsupportedError(
            "num_top_log_probs: the TensorRT-LLM 1.2 executor returns only the chosen token's log probability"
        )
    return {"return_log_probs": True} if request.return_log_probs else {}


def embedding_bias(request: EngineRequest, layout: BiasLayout | None) -> Any | None:
    """The dense ``[1, vocab_size]`` bias tensor, in the engine's logits dtype, for the request's
    sparse logit bias (``layout`` from the engine's config.json: engine_config.bias_layout, which
    cites createNewDecoderRequests.cpp getEmbeddingBias / initializeEmbeddingBias)."""
    if not request.sampling.logit_bias:
        return None
    if layout is None or layout.refusal is not None:
        reason = layout.refusal if layout is not None else "the pool's engine layout is unknown"
        raise ExtensionUnsupportedError(f"logit_bias_token_ids: this pool cannot apply a logit bias: {reason}")
    import torch  # in the Triton container; only needed for a request with a bias

    # On the CPU: getEmbeddingBias requires host memory to convert, and the executor copies it itself.
    bias = torch.zeros((1, layout.vocab_size), dtype=getattr(torch, layout.logits_dtype))
    for token, value in request.sampling.logit_bias:
        bias[0, token] = value
    return bias


def refuse_unsafe_combinations(request: EngineRequest) -> None:
    """What the 1.2 executor cannot be sent safely (a ContractError: the gateway answers 400).

    ``ignore_eos`` with ``min_tokens``: ``ignore_eos`` is sent as ``end_id=-1`` and the penalty
    kernel's min-length mask writes ``outLogitsPtr[endIds[batchSlot]]`` with no bound check
    (cpp/tensorrt_llm/kernels/penaltyKernels.cu ``batchApplyPenalty``, read at NVIDIA/TensorRT-LLM
    249d93d5 and in a 2023 snapshot 3c44cb97) — a write before the row's logits. Another snapshot in
    the code index (one that also passes ``finished`` to the kernel) adds ``&& endIds[batchSlot] > -1``,
    but which release first has it could not be established and the 1.2.1 tag could not be read:
    refused until the 1.2.x kernel is shown to carry that guard.
    """
    if request.ignore_eos and request.sampling.min_tokens:
        raise ContractError(
            "ignore_eos cannot be combined with min_tokens on a TensorRT-LLM pool (ignore_eos is end id -1, "
            "which the 1.2 penalty kernel's min_tokens mask would index out of bounds)", tensor=IGNORE_EOS.name,
        )


def guided_decoding_params(trtllm: ModuleType, request: EngineRequest, *, guided_supported: bool) -> Any | None:
    guide = request.guide
    if guide is None:
        return None
    if not guided_supported:
        raise ExtensionUnsupportedError(
            "guided_decoding_guide_type: this pool's executor has no guided decoding config "
            "(set the model's tokenizer_dir parameter)"
        )
    kind = guide.kind
    if kind == "json" and guide.text:
        # `json` with a schema text is a schema guide in the contract (parse_guide validates it as one, the
        # reference engine compiles it). GuideType.JSON would not enforce it: TensorRT-LLM's
        # batch_manager/guidedDecoder.cpp compiles kJSON as CompileBuiltinJSONGrammar() and ignores the guide.
        kind = "json_schema"
    guide_type = getattr(trtllm.GuidedDecodingParams.GuideType, GUIDE_TYPE_NAMES[kind])
    return trtllm.GuidedDecodingParams(guide_type=guide_type, guide=guide.text or None)


def request_extension_kwargs(trtllm: ModuleType, request: EngineRequest, *, bias_layout: BiasLayout | None,
                             guided_supported: bool) -> dict[str, Any]:
    """Extra ``Request`` keywords (``end_id`` is overridden to -1 for ignore_eos)."""
    refuse_unsafe_combinations(request)
    kwargs: dict[str, Any] = {}
    if request.ignore_eos:
        kwargs["end_id"] = -1
    bias = embedding_bias(request, bias_layout)
    if bias is not None:
        kwargs["embedding_bias"] = bias
    params = guided_decoding_params(trtllm, request, guided_supported=guided_supported)
    if params is not None:
        kwargs["guided_decoding_params"] = params
    return kwargs


def guided_decoding_config(trtllm: ModuleType, tokenizer_dir: str, stop_token_ids: list[int]) -> Any:
    """``GuidedDecodingConfig(XGRAMMAR, encoded_vocab, tokenizer_str, stop_token_ids)`` from a
    Hugging Face ``tokenizer.json`` in ``tokenizer_dir`` (the stock backend's ``tokenizer_dir``)."""
    text = (Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8")
    data = json.loads(text)
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = int(added["id"])
    encoded_vocab = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    return trtllm.GuidedDecodingConfig(
        backend=trtllm.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR,
        encoded_vocab=encoded_vocab, tokenizer_str=text, stop_token_ids=list(stop_token_ids),
    )


def chosen_log_probs(result: Any, num_tokens: int) -> list[float] | None:
    """The log probabilities of the last ``num_tokens`` output tokens of beam 0 (``Result.log_probs``);
    None when the executor returned none or too few (the caller answers with an error)."""
    per_beam = getattr(result, "log_probs", None)
    if not per_beam or len(per_beam[0]) < num_tokens:
        return None
    values = [float(v) for v in per_beam[0]]
    return values[len(values) - num_tokens:] if num_tokens else []
