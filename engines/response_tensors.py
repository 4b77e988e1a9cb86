"""The response side of the engine-model contract (``engines/contract.py``): the output tensors.

Every answer of either engine but an error is made of these tensors, whatever the transport:
a generation response from :func:`encode_response` (the Triton model and the reference engine
both build it with this function), the stats call's answer in ``kv_cache_stats``. The gateway's
engine client reads them back by name (``server/gateway/replicas/engine_client.py``), and both
engines' model configurations list :data:`OUTPUTS`. What the values mean (a streamed response's
``output_ids`` is a delta, ``sequence_length`` is cumulative, the per-request KV figures, the log
probabilities of the processed distribution) is the contract's, stated in its docstring; the
values themselves, :class:`engines.contract.KvMetrics` and :class:`engines.contract.TokenLogProbs`,
are defined there too, since schedulers and the gateway pass them around without any tensor.

Invariant: :func:`decode_log_probs` inverts the log-probability part of :func:`encode_response`
(a row with fewer than ``num_top`` alternatives is padded with -inf, which decoding drops).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from engines.contract import KvMetrics, TensorSpec, TokenLogProbs

# Outputs --------------------------------------------------------------------------------
OUTPUT_IDS = TensorSpec("output_ids", "INT32", (-1,))
SEQUENCE_LENGTH = TensorSpec("sequence_length", "INT32", (1,))
KV_REUSED = TensorSpec("kv_cache_reused_blocks", "INT32", (1,))
KV_NEW = TensorSpec("kv_cache_alloc_new_blocks", "INT32", (1,))
KV_TOTAL = TensorSpec("kv_cache_alloc_total_blocks", "INT32", (1,))
KV_ONBOARDED = TensorSpec("kv_cache_onboarded_blocks", "INT32", (1,))
KV_CACHE_STATS = TensorSpec("kv_cache_stats", "BYTES", (1,))
# Present only when the request set return_log_probs; one row per token of output_ids.
OUTPUT_LOG_PROBS = TensorSpec("output_log_probs", "FP32", (-1,))
TOP_LOG_PROBS = TensorSpec("top_log_probs", "FP32", (-1, -1))  # kvgate: [tokens, num_top_log_probs]
TOP_LOG_PROBS_IDS = TensorSpec("top_log_probs_token_ids", "INT32", (-1, -1))  # kvgate

OUTPUTS: tuple[TensorSpec, ...] = (
    OUTPUT_IDS, SEQUENCE_LENGTH, KV_REUSED, KV_NEW, KV_TOTAL, KV_ONBOARDED, KV_CACHE_STATS,
    OUTPUT_LOG_PROBS, TOP_LOG_PROBS, TOP_LOG_PROBS_IDS,
)


def encode_response(output_ids: list[int] | tuple[int, ...], sequence_length: int, kv: KvMetrics,
                    log_probs: Sequence[TokenLogProbs] | None = None, num_top: int = 0) -> dict[str, np.ndarray]:
    """Output tensors; ``log_probs`` (one per output id) adds ``output_log_probs`` and, with
    ``num_top`` > 0, ``top_log_probs``/``top_log_probs_token_ids`` of shape ``[len(output_ids), num_top]``."""
    out = {
        OUTPUT_IDS.name: np.array(output_ids, np.int32),
        SEQUENCE_LENGTH.name: np.array([sequence_length], np.int32),
        KV_REUSED.name: np.array([kv.reused_blocks], np.int32),
        KV_NEW.name: np.array([kv.new_blocks], np.int32),
        KV_TOTAL.name: np.array([kv.total_blocks], np.int32),
        KV_ONBOARDED.name: np.array([kv.onboarded_blocks], np.int32),
    }
    if log_probs is not None:
        out[OUTPUT_LOG_PROBS.name] = np.array([lp.logprob for lp in log_probs], np.float32)
        if num_top:
            ids = np.zeros((len(log_probs), num_top), np.int32)
            values = np.full((len(log_probs), num_top), -np.inf, np.float32)
            for row, lp in enumerate(log_probs):
                for col, (token, value) in enumerate(lp.top[:num_top]):
                    ids[row, col], values[row, col] = token, value
            out[TOP_LOG_PROBS.name] = values
            out[TOP_LOG_PROBS_IDS.name] = ids
    return out


def decode_log_probs(tensors: Mapping[str, np.ndarray]) -> tuple[TokenLogProbs, ...] | None:
    """Inverse of the log-probability part of :func:`encode_response` (None when absent)."""
    if OUTPUT_LOG_PROBS.name not in tensors:
        return None
    chosen = np.asarray(tensors[OUTPUT_LOG_PROBS.name], np.float32).reshape(-1)
    top_values = tensors.get(TOP_LOG_PROBS.name)
    top_ids = tensors.get(TOP_LOG_PROBS_IDS.name)
    out = []
    for row, value in enumerate(chosen.tolist()):
        top: tuple[tuple[int, float], ...] = ()
        if top_values is not None and top_ids is not None and np.size(top_values):
            vals = np.asarray(top_values).reshape(len(chosen), -1)[row]
            ids = np.asarray(top_ids).reshape(len(chosen), -1)[row]
            top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist()) if np.isfinite(v))
        out.append(TokenLogProbs(float(value), top))
    return tuple(out)

