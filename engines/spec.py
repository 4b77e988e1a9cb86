"""Engine specs: one YAML per model/pool, validated by pydantic at the edge.

A spec is everything needed to build (TensorRT-LLM 1.2: ``quantize.py`` then
``trtllm-build``) and to serve (Triton model ``kvgate_llm`` around the TensorRT-LLM
executor, or the CPU reference engine) one pool's engine. The mapping from a spec to
TensorRT-LLM arguments lives in :mod:`engines.trtllm`; this module only states what a
valid spec is.

Invariants (checked here, so no renderer ever sees a bad spec):

* ``backend: tensorrt_llm`` specs carry a ``tensorrt_llm`` pin, an FP8 KV cache and a
  KV config with an explicit ``secondary_offload_min_priority`` (TensorRT-LLM's code
  default is 30, its docs say 35; kvgate never relies on either) and a non-zero
  ``event_buffer_max_size`` (per-tenant block counts come from KV events);
* each TensorRT-LLM rule below is named (``[rule …]`` in the error) with the source file it
  comes from, see :data:`RULES`: onboarding stays on, FP8 KV comes with FP8 weights, the
  container names its registry host, and the host tier is sized per rank
  (``host_cache_size_per_rank``; the old ``host_cache_size`` key is refused because its
  unit was ambiguous — see :meth:`EngineSpec.pinned_host_bytes_total`);
* ``tokens_per_block`` is a power of two > 1 (``cpp/tensorrt_llm/batch_manager/
  kvCacheManager.cpp`` and the KV cache docs require it), fixed at build time;
* ``max_input_len < max_seq_len`` and ``max_num_tokens >= tokens_per_block`` (rule ``chunk-unit-block``);
  ``max_num_tokens`` may be below ``max_input_len``: the executor runs with chunked context;
* ``model.revision`` (a commit sha or a branch/tag name of the Hugging Face repo) only comes with
  ``model.hf_id`` (rule ``revision-needs-hf-id``). Without one a spec stays valid, but its builds are not
  reproducible: :func:`spec_warnings` says so (``kvgate plan --spec``, ``kvgate build engine``) and the
  build records the commit it got in its manifest;
* the spec hash (:func:`spec_hash`) depends on content only, not on YAML layout.
"""

from __future__ import annotations

import hashlib
import json
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from retention.types import MAX_PRIORITY, MIN_PRIORITY

SLUG = r"^[a-z0-9][a-z0-9._-]{0,62}$"
# Bounds of a buildable spec, shared with ``kvgate plan`` (engines/capacity) so that a plan
# never prints spec values this module refuses.
MAX_TOKENS_PER_BLOCK = 1024
MAX_PARALLEL = 64  # tensor_parallel and pipeline_parallel, each


class SpecError(ValueError):
    """A spec file cannot be read or is invalid; the message names the file and field."""


# Rules the validator enforces (the TensorRT-LLM ones, and where the model comes from): name -> the
# source it comes from.
RULES: dict[str, str] = {
    "onboard-blocks": (
        "NVIDIA/TensorRT-LLM cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp (00825c4e): "
        'with onboarding off, TLLM_CHECK_WITH_INFO(!getPagedContextFMHA(), "KV cache blocks need to be '
        'onboarded if context FMHA.") aborts the executor; every kvgate engine is built with '
        "--use_paged_context_fmha enable, and host-tier hits are only reused by onboarding them"
    ),
    "fp8-kv-needs-fp8-weights": (
        "NVIDIA/TensorRT-LLM tensorrt_llm/builder.py (008b2b8d) build(): with FP8 KV and weights not "
        "FP8/W4A8_AWQ/NVFP4 it sets use_paged_context_fmha = False ('FP8 Paged Context FMHA is disabled "
        "because FP8 context FMHA is disabled'), and trtGptModelInflightBatching.cpp fixExecutorConfig then "
        "disables block reuse with only a warning; the same happens when the build GPU is below SM 89, which "
        "the engine build checks in the built config.json"
    ),
    "host-cache-per-rank": (
        "NVIDIA/TensorRT-LLM cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp: every rank builds "
        "its own KV cache manager from BaseKVCacheManager::calculateFreeMemBytes (kvCacheManager.cpp: "
        "freeSecondaryMemBytes = config.getHostCacheSize()), so KvCacheConfig.host_cache_size is pinned host "
        "memory per rank; a replica pins world_size times that"
    ),
    "chunk-unit-block": (
        "NVIDIA/TensorRT-LLM cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp (b35ac1b6): with "
        "chunked context (kvgate always enables it, so max_num_tokens may be below max_input_len) the chunk unit "
        "is tokens_per_block, TLLM_CHECKed to be divisible by it (\"To prevent cache fragmentation\"), and is then "
        "lowered to max_num_tokens without a second check; microBatchScheduler.cpp rounds every chunk but a "
        "prompt's last down to a multiple of the unit. There is no multiple-of rule on max_num_tokens itself"
    ),
    "container-registry-host": (
        "triton-inference-server/server docs/introduction/compatibility.md (r26.04): the -trtllm-python-py3 "
        "images are published as nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3; a name without a "
        "registry host resolves against Docker Hub, where NVIDIA does not publish it"
    ),
    "revision-needs-hf-id": (
        "huggingface_hub snapshot_download (docstring, 2.4.0): revision is 'an optional Git revision id, which can be "
        "a branch name, a tag, or a commit hash' of the Hub repository named by repo_id; a local checkpoint_path has "
        "no such history, and TensorRT-LLM's examples/quantization/quantize.py (059c97c1) takes no revision at all "
        "(the engine build downloads hf_id at the revision first)"
    ),
}


def rule_error(name: str, message: str) -> str:
    """An error message naming the rule and its source (``RULES``)."""
    return f"[rule {name}] {message} (source: {RULES[name]})"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
# git check-ref-format: no control characters, space, ~ ^ : ? * [ or backslash, no "..", "@{", "//", no component
# starting with "." or ending with ".lock", not ending with "/" or "."; and (kvgate) it starts with a letter,
# a digit or "_", so a revision can never read as a command-line flag in the build's argv.
_REF_NAME = re.compile(
    r"(?!.*(?:\.\.|@\{|//|/\.|\.lock/))"  # nowhere: "..", "@{", "//", a component starting with "." or ending ".lock"
    r"(?!.*(?:\.lock|[/.])$)"  # at the end: ".lock", "/" or "."
    r"[A-Za-z0-9_][^\x00-\x20\x7f~^:?*\[\\]{0,254}"
)


def _revision_problem(value: str) -> str | None:
    if COMMIT_SHA.fullmatch(value) or _REF_NAME.fullmatch(value):
        return None
    return (f"{value!r} must be a commit sha (40 hex digits) or a branch or tag name git accepts "
            "(no spaces, ~ ^ : ? * [ \\ or '..', at most 255 characters, not starting with '-', '.' or '/')")


class ModelSource(_Strict):
    """Where the weights come from: a Hugging Face id (at ``revision``), or a local checkpoint/GGUF path."""

    hf_id: str | None = None
    checkpoint_path: str | None = None
    # The Hub repository's commit (40 hex) or branch/tag name; None: its default branch at build time,
    # which the build records (manifest.json model.resolved_revision) but cannot reproduce.
    revision: str | None = Field(default=None, description="commit sha or branch/tag of hf_id (hf_id only)")
    tokenizer: str | None = Field(default=None, description="tokenizer id/path if it differs from the model")

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        if (self.hf_id is None) == (self.checkpoint_path is None):
            raise ValueError("model needs exactly one of hf_id or checkpoint_path")
        if self.revision is not None:
            if self.checkpoint_path is not None:
                raise ValueError(rule_error(
                    "revision-needs-hf-id",
                    f"model.revision {self.revision!r} with checkpoint_path {self.checkpoint_path!r}: a revision names "
                    "a commit of the Hugging Face repo in hf_id; pin a local checkpoint by its path (an immutable "
                    "directory per version) instead",
                ))
            problem = _revision_problem(self.revision)
            if problem:
                raise ValueError(f"model.revision: {problem}")
        return self

    @property
    def location(self) -> str:
        return self.hf_id if self.hf_id is not None else str(self.checkpoint_path)

    @property
    def pinned_commit(self) -> str | None:
        """The commit the spec pins (a 40-hex ``revision``); None for a branch, a tag or no revision."""
        return self.revision if self.revision is not None and COMMIT_SHA.fullmatch(self.revision) else None

    @property
    def tokenizer_revision(self) -> str | None:
        """The revision the tokenizer is fetched at: the model's, when the tokenizer comes from the model's repo."""
        return self.revision if self.tokenizer in (None, self.hf_id) else None


class TrtllmPin(_Strict):
    """The TensorRT-LLM release the engine is built with and served by (engines are not portable)."""

    version: Annotated[str, Field(pattern=r"^1\.2\.\d+(rc\d+)?$")]
    # The image's full public name, registry host included (NGC: nvcr.io/nvidia/tritonserver:...).
    container: Annotated[str, Field(pattern=r"^[\w./:-]+:[\w.-]+-trtllm-python-py3$")]
    # examples/ is copied to /app/examples in the -trtllm-python-py3 image (tensorrtllm_backend
    # r26.04 ce68ff5 dockerfile/Dockerfile.triton.trt_llm_backend: WORKDIR /app, COPY ... examples,
    # from the release/1.2.1 checkout it also pip-installs tensorrt_llm==1.2.1).
    examples_dir: str = "/app/examples"

    @model_validator(mode="after")
    def _registry_host(self) -> TrtllmPin:
        # Docker's rule: the first path component is a registry host when it contains "." or ":"
        # or is "localhost"; otherwise the name resolves against Docker Hub.
        first = self.container.split("/", 1)[0]
        if "/" not in self.container or not ("." in first or ":" in first or first == "localhost"):
            raise ValueError(rule_error(
                "container-registry-host",
                f"container {self.container!r} names no registry host; use the image's public name, "
                "e.g. nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3 (a mirror: its own host/path)",
            ))
        return self


class Quantization(_Strict):
    weights: Literal["none", "fp8"]
    # TensorRT-LLM FP8 KV is E4M3 with a per-tensor scale; there is no E5M2 KV option.
    kv_cache: Literal["fp8", "fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "fp32"]
    dtype: Literal["auto", "float16", "bfloat16"] = "auto"
    calib_size: Annotated[int, Field(ge=1, le=100_000)] = 512
    calib_dataset: str | None = None  # quantize.py default: cnn_dailymail (downloaded inside the builder)
    calib_batch_size: Annotated[int, Field(ge=1, le=1024)] = 1


class BuildLimits(_Strict):
    tokens_per_block: Annotated[int, Field(ge=2, le=MAX_TOKENS_PER_BLOCK)]
    max_batch_size: Annotated[int, Field(ge=1, le=4096)]
    max_input_len: Annotated[int, Field(ge=1)]
    max_seq_len: Annotated[int, Field(ge=2)]
    max_num_tokens: Annotated[int, Field(ge=1)]
    tensor_parallel: Annotated[int, Field(ge=1, le=MAX_PARALLEL)] = 1
    pipeline_parallel: Annotated[int, Field(ge=1, le=MAX_PARALLEL)] = 1
    gemm_plugin: Literal["auto", "float16", "bfloat16", "fp8", "disable"] = "auto"
    workers: Annotated[int, Field(ge=1, le=64)] = 1

    @model_validator(mode="after")
    def _consistent(self) -> BuildLimits:
        if self.tokens_per_block & (self.tokens_per_block - 1):
            raise ValueError(f"tokens_per_block must be a power of two, got {self.tokens_per_block}")
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(f"max_input_len ({self.max_input_len}) must be < max_seq_len ({self.max_seq_len})")
        if self.max_num_tokens < self.tokens_per_block:
            raise ValueError(rule_error(
                "chunk-unit-block",
                f"max_num_tokens ({self.max_num_tokens}) must be >= tokens_per_block ({self.tokens_per_block}): "
                "a smaller value makes the context chunks smaller than a KV cache block",
            ))
        if self.workers > self.tensor_parallel * self.pipeline_parallel:
            raise ValueError("workers cannot exceed the number of ranks (tensor_parallel * pipeline_parallel)")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


class KvCacheSpec(_Strict):
    """Mirrors ``executor::KvCacheConfig`` (cpp/include/tensorrt_llm/executor/executor.h).

    ``host_cache_size_per_rank`` is ``KvCacheConfig.host_cache_size``: bytes of pinned host
    memory for the secondary tier *of each rank* (rule ``host-cache-per-rank``).
    """

    enable_block_reuse: bool = True
    # (0, 1): KvCacheConfig::setFreeGpuMemoryFraction TLLM_CHECKs both bounds (executor/kvCacheConfig.cpp)
    free_gpu_memory_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.9
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    host_cache_size_per_rank: Annotated[int, Field(ge=0)] = 0
    onboard_blocks: bool = True
    secondary_offload_min_priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
    event_buffer_max_size: Annotated[int, Field(ge=0)] = 0
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True

    @model_validator(mode="before")
    @classmethod
    def _no_ambiguous_host_cache_size(cls, data: object) -> object:
        if isinstance(data, dict) and "host_cache_size" in data:
            raise ValueError(rule_error(
                "host-cache-per-rank",
                "host_cache_size is ambiguous (per rank or per replica?); write host_cache_size_per_rank "
                "(bytes each rank pins; a TP8 replica pins 8 times that)",
            ))
        return data

    @model_validator(mode="after")
    def _onboarding(self) -> KvCacheSpec:
        if not self.onboard_blocks:
            raise ValueError(rule_error(
                "onboard-blocks",
                "kv_cache.onboard_blocks: false is refused: the executor aborts at start-up with paged context "
                "FMHA, and offloaded blocks could never be reused",
            ))
        return self


class TritonSpec(_Strict):
    model_name: Annotated[str, Field(pattern=SLUG)] = "kvgate_llm"
    instance_count: Annotated[int, Field(ge=1, le=8)] = 1
    iter_stats_max_iterations: Annotated[int, Field(ge=1)] = 1000
    response_poll_ms: Annotated[int, Field(ge=1, le=1000)] = 5
    max_queue_size: Annotated[int, Field(ge=1)] | None = None
    vocab_size: Annotated[int, Field(ge=2)]
    end_id: Annotated[int, Field(ge=0)] | None = None
    # Orchestrator-mode worker binary (tensor parallel > 1): Triton server r26.04 build.py
    # (tensorrtllm_postbuild) installs trtllmExecutorWorker in backends/tensorrtllm/ of
    # /opt/tritonserver, and it is the stock C++ backend's default executor_worker_path
    # (TensorRT-LLM triton_backend/inflight_batcher_llm/src/model_state.cc). Override per image.
    executor_worker_path: str = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"


class ReferenceSpec(_Strict):
    """The CPU reference engine's sizes (engines/reference/ reads these)."""

    primary_blocks: Annotated[int, Field(ge=1)]
    secondary_blocks: Annotated[int, Field(ge=0)] = 0


class EngineSpec(_Strict):
    name: Annotated[str, Field(pattern=SLUG)]
    description: str = ""
    backend: Literal["tensorrt_llm", "reference"]
    model: ModelSource
    quantization: Quantization
    build: BuildLimits
    kv_cache: KvCacheSpec
    triton: TritonSpec
    tensorrt_llm: TrtllmPin | None = None
    reference: ReferenceSpec | None = None

    @model_validator(mode="after")
    def _backend_fields(self) -> EngineSpec:
        if self.backend == "tensorrt_llm":
            if self.tensorrt_llm is None:
                raise ValueError("backend tensorrt_llm needs a tensorrt_llm: {version, container} pin")
            if self.reference is not None:
                raise ValueError("reference: settings only apply to backend reference")
            if self.quantization.kv_cache not in ("fp8", "fp8_e4m3"):
                raise ValueError("TensorRT-LLM engines store KV in FP8 (E4M3): set quantization.kv_cache: fp8")
            if self.kv_cache.event_buffer_max_size == 0:
                raise ValueError("kv_cache.event_buffer_max_size must be > 0: per-tenant block counts come from KV events")
            if self.triton.instance_count != 1:
                # Each Python-backend instance builds its own executor, sizing its KV pool from the GPU
                # memory free when it starts (BaseKVCacheManager::calculateFreeMemBytes × the fraction):
                # a second one loads the weights again into what the first left, and requests, the
                # stats call and the per-tenant ledger would be split across separate caches.
                raise ValueError("triton.instance_count must be 1 for backend tensorrt_llm: the executor owns the "
                                 "GPUs and its KV cache; one instance per model (scale with replicas)")
            if self.build.gemm_plugin == "fp8" and self.quantization.weights != "fp8":
                raise ValueError("gemm_plugin fp8 needs quantization.weights: fp8")
            if self.quantization.weights != "fp8":
                raise ValueError(rule_error(
                    "fp8-kv-needs-fp8-weights",
                    f"quantization.weights: {self.quantization.weights} with an FP8 KV cache builds an engine without "
                    "paged context FMHA, so the pool's KV block reuse would silently be off; use weights: fp8 "
                    "(on an Ada, Hopper or Blackwell GPU: SM >= 89)",
                ))
        else:
            if self.reference is None:
                raise ValueError("backend reference needs reference: {primary_blocks, secondary_blocks}")
            if self.tensorrt_llm is not None:
                raise ValueError("tensorrt_llm: pin only applies to backend tensorrt_llm")
            if self.quantization.weights != "none":
                raise ValueError("the reference engine has no FP8 weight path; set quantization.weights: none")
        return self

    def pinned_host_bytes_per_rank(self) -> int:
        """Pinned host memory one rank's KV cache manager allocates for the secondary tier."""
        return self.kv_cache.host_cache_size_per_rank

    def pinned_host_bytes_total(self) -> int:
        """Pinned host memory of one replica: every rank pins its own tier (rule ``host-cache-per-rank``)."""
        ranks = self.build.world_size if self.backend == "tensorrt_llm" else 1
        return self.kv_cache.host_cache_size_per_rank * ranks


def reference_settings(spec: EngineSpec) -> dict[str, object]:
    """Keyword arguments for ``engines.reference.config.ReferenceEngineConfig`` from a reference spec."""
    if spec.backend != "reference" or spec.reference is None:
        raise SpecError(f"spec {spec.name!r} is not a reference-engine spec")
    kv_dtype = "fp8_e4m3" if spec.quantization.kv_cache == "fp8" else spec.quantization.kv_cache
    return {
        "kv_dtype": kv_dtype,
        "primary_blocks": spec.reference.primary_blocks,
        "secondary_blocks": spec.reference.secondary_blocks,
        "tokens_per_block": spec.build.tokens_per_block,
        "secondary_offload_min_priority": spec.kv_cache.secondary_offload_min_priority,
        "enable_block_reuse": spec.kv_cache.enable_block_reuse,
        "max_batch_size": spec.build.max_batch_size,
        "max_num_tokens": spec.build.max_num_tokens,
        "max_input_len": spec.build.max_input_len,
        "max_output_len": spec.build.max_seq_len - spec.build.max_input_len,
    }


def spec_warnings(spec: EngineSpec) -> list[str]:
    """What is valid but not reproducible in ``spec`` (the validator refuses nothing here): one sentence each."""
    model, out = spec.model, []
    if model.hf_id is not None and model.revision is None:
        out.append(
            f"model.hf_id {model.hf_id!r} has no revision: each build takes the repo's default branch as it is "
            "then, so the engine and its tokenizer are not reproducible from this spec (the build records the commit "
            "it got in manifest.json, model.resolved_revision); pin it with model.revision: <40-hex commit>"
        )
    elif model.hf_id is not None and model.pinned_commit is None:
        out.append(
            f"model.revision {model.revision!r} is a branch or tag name, which can move: a later build may get other "
            "weights; pin a 40-hex commit for a reproducible engine"
        )
    if model.hf_id is not None and model.tokenizer not in (None, model.hf_id):
        out.append(
            f"model.tokenizer {model.tokenizer!r} is fetched as named: model.revision pins only {model.hf_id!r}"
        )
    return out


def spec_hash(spec: EngineSpec) -> str:
    """SHA-256 of the spec's canonical JSON: equal content ⇒ equal hash, whatever the YAML layout."""
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _format_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def parse_spec(data: object, *, source: str = "<spec>") -> EngineSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a spec is a YAML mapping, got {type(data).__name__}")
    try:
        return EngineSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"{source}: {_format_errors(exc)}") from exc


def load_spec(path: str | Path) -> EngineSpec:
    """Read and validate one spec file; a bare name (no ``/``, no ``.yaml``) means a bundled spec."""
    path_str = str(path)
    if "/" not in path_str and not path_str.endswith((".yaml", ".yml")):
        return load_bundled_spec(path_str)
    file = Path(path_str)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{file}: cannot read spec ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"{file}: not UTF-8 (byte {exc.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{file}: not valid YAML ({exc})") from exc
    return parse_spec(data, source=str(file))


def bundled_spec_names() -> list[str]:
    folder = resources.files("engines") / "specs"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_bundled_spec(name: str) -> EngineSpec:
    file = resources.files("engines") / "specs" / f"{name}.yaml"
    if not file.is_file():
        raise SpecError(f"no bundled spec named {name!r}; bundled: {', '.join(bundled_spec_names())}")
    return parse_spec(yaml.safe_load(file.read_text(encoding="utf-8")), source=f"engines/specs/{name}.yaml")
