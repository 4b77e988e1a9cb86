"""Model shapes: the facts of a Hugging Face ``config.json`` that KV and weight sizing need.

One parser for both inputs: a user's ``config.json`` path and the bundled shapes in
``engines/capacity/data/models/*.json`` (subsets of the published ``config.json`` files, each
with its source under ``_kvgate``). Field names are Hugging Face's, per architecture:

* dense GQA/MHA (``llama``, ``qwen2``, ``qwen3``, ``mistral``): ``num_key_value_heads``
  (absent ⇒ equal to ``num_attention_heads``, as ``transformers`` does: MHA), ``head_dim``
  (absent ⇒ ``hidden_size // num_attention_heads``);
* MLA (``deepseek_v2``/``deepseek_v3``): ``kv_lora_rank``, ``qk_rope_head_dim``,
  ``qk_nope_head_dim``, ``v_head_dim``, ``q_lora_rank`` (null ⇒ a plain q projection);
* MoE: Mixtral ``num_local_experts`` (expert width ``intermediate_size``), Qwen-MoE
  ``num_experts`` + ``moe_intermediate_size`` (+ ``decoder_sparse_step``,
  ``mlp_only_layers``, Qwen2-MoE ``shared_expert_intermediate_size``), DeepSeek
  ``n_routed_experts`` + ``n_shared_experts`` + ``moe_intermediate_size`` +
  ``first_k_dense_replace`` (+ ``moe_layer_freq``).

Invariant: a shape is complete or it is not built — a missing field raises
:class:`ShapeError` naming it (the CLI turns that into exit code 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

Attention = Literal["mha", "gqa", "mla"]


class ShapeError(ValueError):
    """A config cannot be read or lacks a field the arithmetic needs; the message names it."""


@dataclass(frozen=True, slots=True)
class MlaDims:
    """DeepSeek multi-head latent attention. The cache holds one latent of
    ``kv_lora_rank + qk_rope_head_dim`` values per token and layer, shared by all heads."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None


@dataclass(frozen=True, slots=True)
class MoeDims:
    """Routed experts (all resident in memory, whatever ``experts_per_token``)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # per shared expert
    dense_layers: tuple[int, ...] = ()  # layer indices with a dense MLP instead of experts


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int | None  # dense MLP width (None: every layer is MoE)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over q and k heads (head_dim weights each)
    mla: MlaDims | None = None
    moe: MoeDims | None = None
    source: str = ""

    @property
    def attention(self) -> Attention:
        if self.mla is not None:
            return "mla"
        return "mha" if self.num_kv_heads == self.num_attention_heads else "gqa"

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers


def _get(config: dict[str, Any], field: str, where: str, *, kind: type = int, optional: bool = False,
         default: Any = None) -> Any:
    if field not in config or config[field] is None:
        if optional:
            return default
        raise ShapeError(f"{where}: config.json lacks {field!r}, needed for the KV/weight arithmetic")
    value = config[field]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ShapeError(f"{where}: {field!r} must be a non-negative integer, got {value!r}")
    elif kind is bool and not isinstance(value, bool):
        raise ShapeError(f"{where}: {field!r} must be true or false, got {value!r}")
    return value


def _positive(config: dict[str, Any], field: str, where: str) -> int:
    value = _get(config, field, where)
    if value < 1:
        raise ShapeError(f"{where}: {field!r} must be >= 1, got {value}")
    return value


def shape_from_config(config: dict[str, Any], *, name: str, where: str | None = None) -> ModelShape:
    """Build a :class:`ModelShape` from a parsed ``config.json``; :class:`ShapeError` names what is missing."""
    where = where or name
    if not isinstance(config, dict):
        raise ShapeError(f"{where}: config.json must be a JSON object")
    if isinstance(config.get("text_config"), dict) and "hidden_size" not in config:
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type", config.get("model_type"))}
    model_type = str(config.get("model_type") or "unknown")
    hidden = _positive(config, "hidden_size", where)
    layers = _positive(config, "num_hidden_layers", where)
    heads = _positive(config, "num_attention_heads", where)
    vocab = _positive(config, "vocab_size", where)
    kv_heads = _get(config, "num_key_value_heads", where, optional=True, default=heads)
    if kv_heads < 1 or heads % kv_heads:
        raise ShapeError(f"{where}: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
    head_dim = _get(config, "head_dim", where, optional=True, default=hidden // heads)

    mla = None
    if "kv_lora_rank" in config:
        mla = MlaDims(
            kv_lora_rank=_positive(config, "kv_lora_rank", where),
            qk_rope_head_dim=_positive(config, "qk_rope_head_dim", where),
            qk_nope_head_dim=_positive(config, "qk_nope_head_dim", where),
            v_head_dim=_positive(config, "v_head_dim", where),
            q_lora_rank=_get(config, "q_lora_rank", where, optional=True),
        )

    moe = None
    intermediate: int | None
    if "n_routed_experts" in config:  # DeepSeek V2/V3
        first_dense = _get(config, "first_k_dense_replace", where)
        freq = _get(config, "moe_layer_freq", where, optional=True, default=1) or 1
        dense = tuple(i for i in range(layers) if i < first_dense or i % freq)
        expert = _positive(config, "moe_intermediate_size", where)
        shared = _get(config, "n_shared_experts", where, optional=True, default=0)
        moe = MoeDims(_positive(config, "n_routed_experts", where), _positive(config, "num_experts_per_tok", where),
                      expert, shared, expert, dense)
        intermediate = _positive(config, "intermediate_size", where) if dense else None
    elif "num_local_experts" in config:  # Mixtral: every layer is MoE, experts as wide as intermediate_size
        width = _positive(config, "intermediate_size", where)
        moe = MoeDims(_positive(config, "num_local_experts", where), _positive(config, "num_experts_per_tok", where), width)
        intermediate = None
    elif "num_experts" in config and config.get("num_experts"):  # Qwen2-MoE / Qwen3-MoE
        step = _get(config, "decoder_sparse_step", where, optional=True, default=1) or 1
        only_mlp = set(config.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step)
        shared_width = _get(config, "shared_expert_intermediate_size", where, optional=True, default=0)
        moe = MoeDims(_positive(config, "num_experts", where), _positive(config, "num_experts_per_tok", where),
                      _positive(config, "moe_intermediate_size", where), 1 if shared_width else 0, shared_width, dense)
        intermediate = _positive(config, "intermediate_size", where) if dense else None
    else:
        intermediate = _positive(config, "intermediate_size", where)

    # Qwen2 / Qwen2-MoE hard-code q/k/v biases (transformers Qwen2Attention: bias=True);
    # elsewhere ``attention_bias`` says so.
    qkv_bias = model_type in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False))
    source = ""
    meta = config.get("_kvgate")
    if isinstance(meta, dict):
        source = str(meta.get("source", ""))
    return ModelShape(
        name=name, model_type=model_type, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, intermediate_size=intermediate,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"), mla=mla, moe=moe, source=source,
    )


def _models_dir():
    return resources.files("engines") / "capacity" / "data" / "models"


def bundled_shape_names() -> list[str]:
    return sorted(p.name[: -len(".json")] for p in _models_dir().iterdir() if p.name.endswith(".json"))


def bundled_shape_for_hf_id(hf_id: str) -> str | None:
    """The bundled shape whose source is this Hugging Face model id (``_kvgate.hf_id``), if any."""
    for name in bundled_shape_names():
        meta = json.loads((_models_dir() / f"{name}.json").read_text(encoding="utf-8")).get("_kvgate", {})
        if str(meta.get("hf_id", "")).lower() == hf_id.lower():
            return name
    return None


def load_shape(ref: str | Path) -> ModelShape:
    """A bundled shape by name (``llama-3.1-70b``) or a ``config.json`` path."""
    text_ref = str(ref)
    if "/" not in text_ref and not text_ref.endswith(".json"):
        file = _models_dir() / f"{text_ref}.json"
        if not file.is_file():
            raise ShapeError(f"no bundled model shape {text_ref!r}; bundled: {', '.join(bundled_shape_names())} "
                             "(or pass a path to a config.json)")
        return shape_from_config(json.loads(file.read_text(encoding="utf-8")), name=text_ref)
    path = Path(text_ref)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ShapeError(f"{path}: cannot read config.json ({exc.strerror})") from None
    except UnicodeDecodeError as exc:  # before JSONDecodeError: both are ValueErrors
        raise ShapeError(f"{path}: not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ShapeError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return shape_from_config(data, name=name, where=str(path))
