"""The engine directory of the ``fake_trtllm`` double: the ``config.json`` trtllm-build writes, and what
the executor reads back from it (cpp/tensorrt_llm/runtime/gptJsonConfig.cpp).

``write_engine_config`` writes only the fields the double uses; the three readers each read the file
afresh, in the order ``Executor.__init__`` calls them (``read_plugin`` first: it alone checks that the
file exists, as ``GptJsonConfig::parse`` does), and raise what the C++ raises (nanobind: RuntimeError).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple


def write_engine_config(engine_dir: str | Path, *, tokens_per_block: int = 32, paged_context_fmha: bool = True,
                        context_fmha: bool = True, quant_algo: str | None = "FP8", kv_cache_quant_algo: str | None = "FP8",
                        tp_size: int = 1, vocab_size: int = 128256, logits_dtype: str | None = "float32",
                        max_input_len: int = 7168, max_seq_len: int = 8192, max_num_tokens: int = 8192) -> Path:
    """The fields of a trtllm-build ``config.json`` that runtime/gptJsonConfig.cpp reads and this double uses.

    ``logits_dtype`` None leaves the key out (gptJsonConfig.cpp createModelConfig then takes "float32").
    ``max_input_len`` / ``max_seq_len`` / ``max_num_tokens`` are ``build_config`` keys as trtllm-build's
    BuildConfig (tensorrt_llm/builder.py) writes them; gptJsonConfig.cpp reads ``max_input_len`` and
    ``max_num_tokens`` (optional) there — the snapshot in the index derives the sequence length from
    ``max_output_len``, so the key a 1.2 reader takes ``max_seq_len`` from is unconfirmed."""
    path = Path(engine_dir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "version": "1.2.1",
        "pretrained_config": {
            "architecture": "LlamaForCausalLM",
            "mapping": {"tp_size": tp_size, "pp_size": 1},
            "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo},
            "vocab_size": vocab_size,
            **({} if logits_dtype is None else {"logits_dtype": logits_dtype}),
        },
        "build_config": {"max_input_len": max_input_len, "max_seq_len": max_seq_len, "max_num_tokens": max_num_tokens,
                         "plugin_config": {
            "context_fmha": context_fmha, "use_paged_context_fmha": paged_context_fmha,
            "tokens_per_block": tokens_per_block, "paged_kv_cache": True, "remove_input_padding": True,
        }},
    }))
    return path


class EnginePlugin(NamedTuple):
    """build_config.plugin_config fields that decide reuse and the block size."""

    paged_context_fmha: bool
    tokens_per_block: int


class EngineLimits(NamedTuple):
    """The engine's length limits; ``max_num_tokens`` is None when the key is absent (it is optional)."""

    context_fmha: bool
    packed_input: bool  # remove_input_padding is ModelConfig::usePackedInput
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int | None


class EngineLogits(NamedTuple):
    """The logits' dtype and the vocabulary, plain and padded to the world size."""

    logits_dtype: str
    vocab_size: int
    vocab_size_padded: int


def read_plugin(model_path: str | Path) -> EnginePlugin:
    """Paged context FMHA and tokens per block; RuntimeError when config.json is missing."""
    # runtime/gptJsonConfig.cpp: GptJsonConfig::parse(path) checks the file exists
    # (TLLM_CHECK_WITH_INFO "File does not exist"), then reads build_config.plugin_config.
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: File does not exist: {path}")
    plugin = json.loads(path.read_text())["build_config"]["plugin_config"]
    return EnginePlugin(bool(plugin["use_paged_context_fmha"]), int(plugin["tokens_per_block"]))


def read_limits(model_path: str | Path) -> EngineLimits:
    """(context FMHA, packed input, max_input_len, max_seq_len, max_num_tokens) of the engine's config.json
    (build_config and its plugin_config; gptJsonConfig.cpp: max_num_tokens optional, remove_input_padding
    is ModelConfig::usePackedInput)."""
    build = json.loads((Path(model_path) / "config.json").read_text())["build_config"]
    plugin = build["plugin_config"]
    return EngineLimits(bool(plugin["context_fmha"]), bool(plugin["remove_input_padding"]), int(build["max_input_len"]),
                        int(build["max_seq_len"]), build.get("max_num_tokens"))


def read_logits(model_path: str | Path) -> EngineLogits:
    """Logits dtype, vocabulary size and its padded size; RuntimeError for a dtype the runtime refuses."""
    # runtime/gptJsonConfig.cpp createModelConfig: pretrained_config.vocab_size (required),
    # logits_dtype (default "float32"; only float32/float16, else "Unsupported logits data type");
    # runtime/modelConfig.h getVocabSizePadded(worldSize) rounds up to the world size (tp * pp * cp).
    pretrained = json.loads((Path(model_path) / "config.json").read_text())["pretrained_config"]
    logits_dtype = pretrained.get("logits_dtype", "float32")
    if logits_dtype not in ("float32", "float16"):
        raise RuntimeError("[TensorRT-LLM][ERROR] Unsupported logits data type")
    mapping = pretrained.get("mapping", {})
    world = mapping.get("tp_size", 1) * mapping.get("pp_size", 1) * mapping.get("cp_size", 1)
    vocab = int(pretrained["vocab_size"])
    return EngineLogits(logits_dtype, vocab, (vocab + world - 1) // world * world)
