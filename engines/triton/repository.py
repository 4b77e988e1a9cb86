"""Render a Triton model repository: one ``kvgate_llm``-style model per pool.

Layout (what ``tritonserver --model-repository DIR`` expects)::

    DIR/
      <model_name>/
        config.pbtxt        rendered from engines/templates/config.pbtxt.tmpl
        1/model.py          engines/triton/model.py, byte for byte

The repository holds exactly the rendered models: each model folder carries a marker file
(:data:`RENDERED_MARKER`), and a render removes the marked folders it no longer renders — a
model left from an earlier render would make Triton start a second executor on the same GPUs.
Folders without the marker were not written by kvgate and are never touched.

Templates are typed: :class:`ConfigValues` lists every placeholder, and
:func:`render_template` refuses a template whose placeholders differ from the values'
fields (``string.Template.substitute`` alone would catch a missing value but not an
unused one). Triton's own ``fill_template.py`` silently leaves ``${var}`` in place; this
renderer never does.
"""

from __future__ import annotations

import json
import shutil
import string
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path

from engines import contract, response_tensors
from engines.spec import EngineSpec, load_spec
from engines.triton.params import ServingParams

RENDERED_MARKER = "kvgate-rendered.json"  # in each model folder kvgate writes (Triton ignores the file)
TOKENIZER_MARKER = "kvgate-tokenizer.json"  # in each tokenizer folder the engine builder saves
TRITON_DATATYPES = {"INT32": "TYPE_INT32", "UINT64": "TYPE_UINT64", "FP32": "TYPE_FP32", "BOOL": "TYPE_BOOL", "BYTES": "TYPE_STRING"}


class TemplateError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ConfigValues:
    model_name: str
    spec_name: str
    spec_hash: str
    instance_count: int
    inputs: str
    outputs: str
    parameters: str


def render_template(template_text: str, values: object) -> str:
    """``string.Template.substitute`` with an exact placeholder ↔ field check."""
    template = string.Template(template_text)
    if not template.is_valid():
        raise TemplateError("template has an invalid placeholder")
    wanted = set(template.get_identifiers())
    given = {f.name for f in fields(values)}  # type: ignore[arg-type]
    if wanted != given:
        raise TemplateError(
            f"template placeholders and values differ: unfilled {sorted(wanted - given)}, unused {sorted(given - wanted)}"
        )
    return template.substitute(asdict(values))  # type: ignore[call-overload]


def _q(text: str) -> str:
    return json.dumps(text)  # protobuf text format accepts JSON-style double-quoted strings


def _tensor_block(kind: str, specs: tuple[contract.TensorSpec, ...], *, optional: bool) -> str:
    entries = []
    for spec in specs:
        lines = [
            f"    name: {_q(spec.name)}",
            f"    data_type: {TRITON_DATATYPES[spec.datatype]}",
            f"    dims: [ {', '.join(str(d) for d in spec.shape)} ]",
        ]
        if optional:
            # Every input is optional to Triton: the stats call sends only kv_stats;
            # engines.contract.parse_request enforces input_ids / request_output_len.
            lines.append("    optional: true")
        entries.append("  {\n" + "\n".join(lines) + "\n  }")
    return f"{kind} [\n" + ",\n".join(entries) + "\n]"


def _parameters_block(params: dict[str, str]) -> str:
    return "\n".join(
        f"parameters {{\n  key: {_q(k)}\n  value: {{\n    string_value: {_q(v)}\n  }}\n}}" for k, v in params.items()
    )


def config_template() -> str:
    return (resources.files("engines") / "templates" / "config.pbtxt.tmpl").read_text(encoding="utf-8")


def tokenizer_dir_for(spec: EngineSpec, engines_root: str) -> str:
    """Where the engine builder leaves a spec's tokenizer (build/engine_builder.sh, Helm's builder job:
    ``/engines/tokenizers/<spec name>``; the gateway reads the same folder through KVGATE_TOKENIZER_ROOT)."""
    return f"{engines_root.rstrip('/')}/tokenizers/{spec.name}"


def save_spec_tokenizer(spec_ref: str, engines_root: str, *, load: Callable[..., object] | None = None) -> str:
    """Save the tokenizer of ``spec_ref`` (YAML path or bundled name) to :func:`tokenizer_dir_for`; say what was done.

    ``load`` is ``transformers.AutoTokenizer.from_pretrained`` unless given. A tokenizer from the model's
    repo is fetched at the commit the engine was built from (``model.resolved_revision`` in the manifest
    under ``engines_root``, which the builder writes first), else at ``model.revision``, passed as
    ``revision=``; a separate ``model.tokenizer`` source is fetched as named. Skipped when the folder's
    :data:`TOKENIZER_MARKER` names the same source and revision. The tokenizer is saved beside the folder
    and swapped in, marker included, so an interrupted download never looks saved.
    """
    from engines.trtllm.engine_build import recorded_model_revision

    spec = load_spec(spec_ref)
    source = spec.model.tokenizer or spec.model.location
    revision = spec.model.tokenizer_revision
    if spec.model.hf_id is not None and spec.model.tokenizer in (None, spec.model.hf_id):  # the model's own repo
        revision = recorded_model_revision(spec, engines_root) or revision
    target = Path(tokenizer_dir_for(spec, engines_root))
    try:
        saved = json.loads((target / TOKENIZER_MARKER).read_text(encoding="utf-8"))
        saved_from = (saved.get("source"), saved.get("revision"))
    except (OSError, ValueError, AttributeError):
        saved_from = None
    at = f"{source}@{revision}" if revision else source
    if saved_from == (source, revision):
        return f"{spec.name}: tokenizer from {at} already in {target}"
    if load is None:
        from transformers import AutoTokenizer  # the Triton image has it; the gateway never calls this

        load = AutoTokenizer.from_pretrained
    # Spec names start with [a-z0-9], so these hidden siblings never shadow a spec's folder.
    staging, previous = target.with_name(f".{target.name}.new"), target.with_name(f".{target.name}.old")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(previous, ignore_errors=True)
    tokenizer = load(source, revision=revision) if revision else load(source)
    tokenizer.save_pretrained(str(staging))  # type: ignore[attr-defined]
    marker = json.dumps({"source": source, "revision": revision, "spec_name": spec.name}) + "\n"
    (staging / TOKENIZER_MARKER).write_text(marker, encoding="utf-8")
    if target.exists():
        target.rename(previous)
    staging.rename(target)
    shutil.rmtree(previous, ignore_errors=True)
    return f"{spec.name}: tokenizer from {at} saved to {target}"


def render_config(spec: EngineSpec, *, engine_dir: str, tokenizer_dir: str | None = None) -> str:
    params = ServingParams.from_spec(spec, engine_dir=engine_dir, tokenizer_dir=tokenizer_dir)
    values = ConfigValues(
        model_name=spec.triton.model_name,
        spec_name=spec.name,
        spec_hash=params.spec_hash,
        instance_count=spec.triton.instance_count,
        inputs=_tensor_block("input", contract.INPUTS, optional=True),
        outputs=_tensor_block("output", response_tensors.OUTPUTS, optional=False),
        parameters=_parameters_block(params.to_parameters()),
    )
    return render_template(config_template(), values)


def model_source() -> bytes:
    return (resources.files("engines") / "triton" / "model.py").read_bytes()


@dataclass(frozen=True, slots=True)
class RenderedModel:
    model_name: str
    config_path: Path
    model_path: Path


def render_repository(specs: list[EngineSpec], output: Path, *, engines_root: str) -> list[RenderedModel]:
    """Write one model per spec under ``output``; ``engines_root`` is where engines live *in the Triton container*.

    Two specs may not share a model name (Triton would load only one of them). Every config is
    rendered before anything is written, so a refused spec leaves the repository as it was; then
    the folders kvgate rendered earlier (marked with :data:`RENDERED_MARKER`) that no spec renders
    now are removed.
    """
    names = [s.triton.model_name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TemplateError(f"two specs render the same Triton model name: {', '.join(duplicates)}")
    # The tokenizer makes guided decoding possible (GuidedDecodingConfig in model.py).
    texts = [
        render_config(spec, engine_dir=f"{engines_root.rstrip('/')}/{spec.name}/engine",
                      tokenizer_dir=tokenizer_dir_for(spec, engines_root))
        for spec in specs
    ]
    output.mkdir(parents=True, exist_ok=True)
    for stale in sorted(output.iterdir()):
        if stale.name not in names and not stale.is_symlink() and (stale / RENDERED_MARKER).is_file():
            shutil.rmtree(stale)
    rendered = []
    for spec, text in zip(specs, texts, strict=True):
        model_dir = output / spec.triton.model_name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        marker = {"rendered_by": "kvgate", "spec_name": spec.name}
        (model_dir / RENDERED_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
        config_path = model_dir / "config.pbtxt"
        config_path.write_text(text, encoding="utf-8")
        model_path = model_dir / "1" / "model.py"
        model_path.write_bytes(model_source())
        rendered.append(RenderedModel(spec.triton.model_name, config_path, model_path))
    return rendered
