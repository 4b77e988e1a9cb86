"""Spec → the exact engine-build commands (run inside the TensorRT-LLM 1.2 container).

Up to three steps, each an argv list (never a shell string, so nothing is re-quoted):

0. ``kvgate build download`` (``model.hf_id`` specs only): resolves ``model.revision`` (the repo's
   default branch when unset) to a commit, downloads exactly that commit into the Hugging Face cache
   and links it at ``<output>/<spec>/source/<hf_id>``, recording the commit in ``source/source.json``
   (:func:`engines.trtllm.model_download.download_hf_model`). quantize.py cannot do this itself:
   ``examples/quantization/quantize.py`` (059c97c1) has no revision option and
   ``tensorrt_llm/quantization/quantize_by_modelopt.py`` (042c510d) loads ``--model_dir`` with
   ``from_pretrained(ckpt_path, ...)`` and no revision, i.e. a hub id at its main branch.
1. ``examples/quantization/quantize.py`` writes a TensorRT-LLM checkpoint with FP8 KV
   (``--kv_cache_dtype fp8`` ⇒ ``kv_cache_quant_algo=FP8`` in its config.json) and FP8
   weights (``--qformat fp8``: the only format kvgate emits, see :func:`_qformat`); tensor
   and pipeline parallelism are fixed here (``--tp_size`` / ``--pp_size``): the checkpoint
   holds one shard per rank.
2. ``trtllm-build`` (``tensorrt_llm/commands/build.py``) compiles one engine per rank.
   It has no ``--tp_size``: the mapping comes from the checkpoint. KV reuse needs
   ``--use_paged_context_fmha enable``; ``--tokens_per_block`` is fixed here for the
   engine's lifetime (both are plugin options, ``tensorrt_llm/plugin/plugin.py``).

Invariant: :func:`build_plan` is a pure function of the spec and the two directories.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from engines.spec import EngineSpec


class BuildPlanError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Command:
    step: str
    argv: tuple[str, ...]

    def flag(self, name: str) -> str | None:
        """The value following ``name`` in argv (None when absent)."""
        for i, token in enumerate(self.argv[:-1]):
            if token == name:
                return self.argv[i + 1]
        return None

    def flags(self) -> dict[str, str]:
        """Every ``--flag value`` pair (the contract tests compare this dict exactly)."""
        out: dict[str, str] = {}
        tokens = self.argv
        i = 0
        while i < len(tokens):
            if tokens[i].startswith("--"):
                if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                    raise BuildPlanError(f"{tokens[i]} has no value in {self.step}")
                out[tokens[i]] = tokens[i + 1]
                i += 2
            else:
                i += 1
        return out


@dataclass(frozen=True, slots=True)
class BuildPlan:
    spec_name: str
    checkpoint_dir: str
    engine_dir: str
    commands: tuple[Command, ...]
    expected_artifacts: tuple[str, ...]  # relative to engine_dir
    model_dir: str = ""  # what quantize.py reads: the downloaded snapshot's link, or the spec's checkpoint_path
    model_record: str | None = None  # the download step's record (None: nothing is downloaded)


SOURCE_DIR = "source"  # under <output>/<spec>/: the downloaded model's link and its record
SOURCE_RECORD = "source.json"


def _qformat(spec: EngineSpec) -> str:
    # examples/quantization/quantize.py --qformat choices: nvfp4, fp8, int8_sq, int4_awq,
    # w4a8_awq, int8_wo, int4_wo, full_prec (default). Only fp8 reaches here: full_prec weights
    # with an FP8 KV cache lose paged context FMHA (spec rule fp8-kv-needs-fp8-weights).
    return {"fp8": "fp8"}[spec.quantization.weights]


def build_plan(spec: EngineSpec, *, output_dir: str) -> BuildPlan:
    """The commands that turn ``spec`` into engines under ``output_dir/<spec name>/``."""
    if spec.backend != "tensorrt_llm" or spec.tensorrt_llm is None:
        raise BuildPlanError(f"spec {spec.name!r} uses backend {spec.backend!r}: it has no TensorRT-LLM engine to build")
    root = PurePosixPath(output_dir) / spec.name
    checkpoint_dir = str(root / "checkpoint")
    engine_dir = str(root / "engine")
    q = spec.quantization
    b = spec.build
    commands: list[Command] = []
    model_dir, record = spec.model.location, None
    if spec.model.hf_id is not None:
        # Downloaded first, at the revision (quantize.py would read the hub's main branch); gated models
        # need HF_TOKEN in the builder's environment. The link keeps the hub id in the path quantize.py
        # sees, as when it was given the id itself (quantize_by_modelopt.py matches model names in it).
        source = root / SOURCE_DIR
        download = ["kvgate", "build", "download", "--hf-id", spec.model.hf_id]
        if spec.model.revision is not None:
            download += ["--revision", spec.model.revision]
        download += ["--output", str(source)]
        commands.append(Command("download", tuple(download)))
        model_dir, record = str(source / spec.model.hf_id), str(source / SOURCE_RECORD)
    quantize = [
        "python3", str(PurePosixPath(spec.tensorrt_llm.examples_dir) / "quantization" / "quantize.py"),
        "--model_dir", model_dir,
        "--dtype", q.dtype,
        "--qformat", _qformat(spec),
        "--kv_cache_dtype", "fp8",
        "--calib_size", str(q.calib_size),
        "--batch_size", str(q.calib_batch_size),
        "--tp_size", str(b.tensor_parallel),
        "--pp_size", str(b.pipeline_parallel),
        "--output_dir", checkpoint_dir,
    ]
    if q.calib_dataset is not None:
        quantize[-2:-2] = ["--calib_dataset", q.calib_dataset]
    trtllm_build = [
        "trtllm-build",
        "--checkpoint_dir", checkpoint_dir,
        "--output_dir", engine_dir,
        "--gemm_plugin", b.gemm_plugin,
        "--kv_cache_type", "paged",
        "--use_paged_context_fmha", "enable",
        "--tokens_per_block", str(b.tokens_per_block),
        "--max_batch_size", str(b.max_batch_size),
        "--max_input_len", str(b.max_input_len),
        "--max_seq_len", str(b.max_seq_len),
        "--max_num_tokens", str(b.max_num_tokens),
        "--max_beam_width", "1",
        "--workers", str(b.workers),
    ]
    artifacts = ("config.json",) + tuple(f"rank{r}.engine" for r in range(b.world_size))
    commands += [Command("quantize", tuple(quantize)), Command("trtllm-build", tuple(trtllm_build))]
    return BuildPlan(
        spec_name=spec.name,
        checkpoint_dir=checkpoint_dir,
        engine_dir=engine_dir,
        commands=tuple(commands),
        expected_artifacts=artifacts,
        model_dir=model_dir,
        model_record=record,
    )
