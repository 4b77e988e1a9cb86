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
        quant = data.get("pretrained_config", {}).get("quantization", {}) or {}
        return EngineFacts(
            path=str(path),
            context_fmha=bool(plugin["context_fmha"]),
            paged_context_fmha=bool(plugin["use_paged_context_fmha"]),
            tokens_per_block=int(plugin["tokens_per_block"]),
            quant_algo=quant.get("quant_algo"),
            kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
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
