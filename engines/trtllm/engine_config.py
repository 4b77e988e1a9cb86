"""What a built engine's ``config.json`` says about KV reuse, read the way the executor reads it.

``trtllm-build`` writes ``<engine_dir>/config.json``; the executor parses it in
``cpp/tensorrt_llm/runtime/gptJsonConfig.cpp`` (``parseJson`` → ``parsePluginConfig``):
with an engine ``version``, the plugin options are ``build_config.plugin_config``
(``context_fmha``, ``use_paged_context_fmha``, ``tokens_per_block``, all required:
``pluginConfig.at(...)``), and the quantization is ``pretrained_config.quantization``
(``quant_algo``, ``kv_cache_quant_algo``).

Why it matters: ``tensorrt_llm/builder.py`` (``build()``, "Logics to control
paged_context_fmha and fp8_context_fmha") silently turns ``use_paged_context_fmha`` off
when the KV cache is FP8 and the weights are not FP8 / W4A8_AWQ / NVFP4, or when the
build GPU is below SM 89; the executor then turns block reuse off with only a warning
(``cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp`` ``fixExecutorConfig``:
"KV cache reuse disabled because model was not built with paged context FMHA support").
A pool that promises reuse must refuse such an engine instead of serving without it.

What it says about the logits (``gptJsonConfig.cpp`` ``createModelConfig``, same snapshots):
``pretrained_config.vocab_size`` (required) and ``pretrained_config.logits_dtype`` (default
``"float32"``; only ``float32`` / ``float16`` are accepted, anything else throws "Unsupported
logits data type"). ``ModelConfig::getVocabSizePadded(worldSize)`` rounds the vocabulary up to
a multiple of the world size (``runtime/modelConfig.h``). A request's ``embedding_bias`` must
match both (``batch_manager/createNewDecoderRequests.cpp``, see :func:`bias_layout`).

Invariant: :func:`check_reuse` raises whenever reuse is promised and the engine cannot
provide it; it never raises for an engine that can.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.json"


class EngineConfigError(RuntimeError):
    """The engine's config.json is missing, unreadable, or contradicts the pool's promises."""


@dataclass(frozen=True, slots=True)
class EngineFacts:
    path: str
    context_fmha: bool
    paged_context_fmha: bool
    tokens_per_block: int
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    vocab_size: int = 0
    logits_dtype: str = "float32"
    world_size: int = 1

    @property
    def vocab_size_padded(self) -> int:
        """``ModelConfig::getVocabSizePadded(worldSize)`` (runtime/modelConfig.h): up to a multiple of the world size."""
        return (self.vocab_size + self.world_size - 1) // self.world_size * self.world_size


def read_engine_config(engine_dir: str | Path) -> EngineFacts:
    """Parse ``<engine_dir>/config.json`` (gptJsonConfig.cpp field names; engines with a ``version``)."""
    path = Path(engine_dir) / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise EngineConfigError(f"{path}: cannot read the engine config ({exc.strerror}); was the engine built?") from exc
    except ValueError as exc:
        raise EngineConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or "version" not in data:
        raise EngineConfigError(f"{path}: no engine 'version': not an engine built by trtllm-build of TensorRT-LLM 1.x")
    try:
        plugin = data["build_config"]["plugin_config"]
        pretrained = data.get("pretrained_config", {}) or {}
        quant = pretrained.get("quantization", {}) or {}
        mapping = pretrained.get("mapping", {}) or {}
        world = int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1)) * int(mapping.get("cp_size", 1))
        return EngineFacts(
            path=str(path),
            context_fmha=bool(plugin["context_fmha"]),
            paged_context_fmha=bool(plugin["use_paged_context_fmha"]),
            tokens_per_block=int(plugin["tokens_per_block"]),
            quant_algo=quant.get("quant_algo"),
            kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
            vocab_size=int(pretrained["vocab_size"]) if "vocab_size" in pretrained else 0,
            logits_dtype=str(pretrained.get("logits_dtype") or "float32"),
            world_size=max(world, 1),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineConfigError(f"{path}: build_config.plugin_config lacks {exc} (gptJsonConfig.cpp reads it)") from exc


def check_reuse(facts: EngineFacts, *, enable_block_reuse: bool, tokens_per_block: int) -> None:
    """Refuse an engine on which the executor would silently run without the pool's block reuse."""
    if facts.tokens_per_block != tokens_per_block:
        raise EngineConfigError(
            f"{facts.path}: engine built with tokens_per_block {facts.tokens_per_block}, the spec says {tokens_per_block}: "
            "rebuild the engine from this spec"
        )
    if enable_block_reuse and not (facts.context_fmha and facts.paged_context_fmha):
        raise EngineConfigError(
            f"{facts.path}: the pool promises KV block reuse but the engine was built without paged context FMHA "
            f"(build_config.plugin_config.use_paged_context_fmha={facts.paged_context_fmha}, "
            f"quant_algo={facts.quant_algo}, kv_cache_quant_algo={facts.kv_cache_quant_algo}); TensorRT-LLM would "
            "disable reuse with only a warning (trtGptModelInflightBatching.cpp fixExecutorConfig). tensorrt_llm/"
            "builder.py drops paged context FMHA for FP8 KV without FP8/W4A8_AWQ/NVFP4 weights and on GPUs below "
            "SM 89: rebuild with quantization.weights: fp8 on an Ada/Hopper/Blackwell GPU"
        )


def check_chunked_context(facts: EngineFacts, *, max_input_len: int, max_num_tokens: int) -> None:
    """Refuse an engine on which the executor would silently refuse the pool's longer prompts.

    kvgate builds the executor with ``enable_chunked_context=True`` (executor_args.py) because the spec
    allows ``max_num_tokens < max_input_len``: without chunking, an engine with context FMHA and packed
    input takes at most ``min(max_seq_len - 1, max_num_tokens)`` prompt tokens (batch_manager/trtGptModel.h,
    TrtGptModel constructor) and answers longer prompts with "Prompt length (%d) exceeds maximum input
    length (%d)" (batch_manager/llmRequest.cpp ``validate``). On an engine without paged context FMHA the
    executor turns chunked context off with only a warning (executor/executorImpl.cpp ``fixExecutorConfig``,
    NVIDIA/TensorRT-LLM b35ac1b6: "Chunked context is not supported for this configuration and will be
    disabled"), so such a pool must not start on it.
    """
    if max_num_tokens >= max_input_len or not facts.context_fmha or facts.paged_context_fmha:
        return
    raise EngineConfigError(
        f"{facts.path}: the spec's max_num_tokens {max_num_tokens} is below its max_input_len {max_input_len}, which "
        "needs chunked context, but the engine was built without paged context FMHA "
        f"(build_config.plugin_config.use_paged_context_fmha={facts.paged_context_fmha}); TensorRT-LLM would turn "
        "chunked context off with only a warning (executorImpl.cpp fixExecutorConfig) and refuse every prompt over "
        f"{max_num_tokens} tokens (trtGptModel.h: max input = min(max_seq_len - 1, max_num_tokens)). Rebuild with "
        "paged context FMHA (quantization.weights: fp8 on an Ada/Hopper/Blackwell GPU) or raise max_num_tokens to "
        "max_input_len"
    )


LOGITS_DTYPES = ("float32", "float16")  # gptJsonConfig.cpp createModelConfig: anything else throws


@dataclass(frozen=True, slots=True)
class BiasLayout:
    """How a request's ``embedding_bias`` must look for this engine; ``refusal`` set when none can."""

    logits_dtype: str  # a torch dtype name: "float32" | "float16"
    vocab_size: int
    refusal: str | None = None


def bias_layout(facts: EngineFacts) -> BiasLayout:
    """The ``embedding_bias`` this engine accepts (``batch_manager/createNewDecoderRequests.cpp``,
    read at NVIDIA/TensorRT-LLM 2025-26 main snapshots; release/1.2 has the same checks in every
    snapshot of the file in the index, older ones in ``runtime/gptDecoderBatched.cpp``):

    * ``getEmbeddingBias``: the tensor's dtype must be the model's logits dtype; FP32 for FP16
      logits is converted with a warning ("will copy the tensor from float to half"), anything
      else throws "Embedding bias data type must be same as model logits type.";
    * ``initializeEmbeddingBias``: ``TLLM_CHECK(nbDims == 2)``, ``d[0] == 1`` and
      ``d[1] == modelConfig.getVocabSize()`` — shape ``[1, vocab_size]`` (the comment in
      getEmbeddingBias says ``[1, vocabSizePadded]``; the check is the unpadded size) — then
      ``BufferManager::copy`` into the request's row of the joint bias buffer, which requires
      equal byte sizes (runtime/bufferManager.cpp) while the penalty kernel reads that row with a
      ``vocabSizePadded`` stride (penaltyKernels.cu ``biasBase``). An engine whose vocabulary is
      not a multiple of its world size can therefore take no bias at all: refused by name.
    """
    if facts.vocab_size <= 0:
        return BiasLayout(facts.logits_dtype, 0, "the engine's config.json has no pretrained_config.vocab_size")
    if facts.logits_dtype not in LOGITS_DTYPES:
        return BiasLayout(facts.logits_dtype, facts.vocab_size,
                          f"the engine's logits dtype {facts.logits_dtype!r} is not one TensorRT-LLM accepts")
    if facts.vocab_size_padded != facts.vocab_size:
        return BiasLayout(facts.logits_dtype, facts.vocab_size,
                          f"the engine's vocabulary ({facts.vocab_size}) is padded to {facts.vocab_size_padded} "
                          f"for {facts.world_size} ranks; TensorRT-LLM's embedding_bias needs both to be equal")
    return BiasLayout(facts.logits_dtype, facts.vocab_size)


def check_vocabulary(facts: EngineFacts, *, vocab_size: int) -> None:
    """Refuse an engine whose vocabulary differs from the spec's (token ids and biases would be wrong)."""
    if facts.vocab_size and facts.vocab_size != vocab_size:
        raise EngineConfigError(
            f"{facts.path}: engine built with vocab_size {facts.vocab_size} (pretrained_config.vocab_size), "
            f"the spec says {vocab_size}: fix triton.vocab_size or rebuild the engine"
        )
    if facts.logits_dtype not in LOGITS_DTYPES:
        raise EngineConfigError(
            f"{facts.path}: pretrained_config.logits_dtype {facts.logits_dtype!r} is not float32 or float16; "
            "TensorRT-LLM's gptJsonConfig.cpp refuses it (\"Unsupported logits data type\")"
        )
