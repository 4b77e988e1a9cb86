"""`kvgate build` commands: TensorRT-LLM 1.2 engines and the Triton model repository.

* ``kvgate build engine SPEC [--output DIR] [--dry-run] [--force]`` — quantize.py then
  trtllm-build inside the TensorRT-LLM container, with a manifest (spec hash, versions,
  artifact checksums) so an unchanged spec is not rebuilt; ``--dry-run`` prints the exact
  commands, whether a build would run, and the pinned host memory the served engine takes
  (per rank and per replica: every rank pins its own host tier).
* ``kvgate build repo SPEC... --output DIR [--engines-root PATH]`` — one Triton model per
  spec (config.pbtxt + model.py).
* ``kvgate build download --hf-id ID [--revision REV] --output DIR`` — the engine build's first
  step for a ``model.hf_id`` spec (``build engine`` runs it): the repo at the revision's commit into
  the Hugging Face cache, linked at ``DIR/<ID>``, the commit recorded in ``DIR/source.json``.

``build engine`` prints what the spec leaves unreproducible (``engines.spec.spec_warnings``: an
``hf_id`` without a pinned commit) and, when not a dry run, re-resolves such a revision on the Hub so
that an engine whose branch moved is rebuilt (offline it is kept, and the reason says so).

SPEC is a YAML path or the name of a bundled spec (``engines/specs/<name>.yaml``).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer


def _check_output(output: Path, *, write: bool = True) -> None:
    """Refuse an ``--output`` that is a file or (when ``write``) not creatable, before any work: exit 2."""
    from server.cli.options import output_dir_problem

    if write:
        problem = output_dir_problem(output)
    else:  # a dry run writes nothing: only a file in the directory's place is wrong
        problem = "exists and is not a directory" if output.exists() and not output.is_dir() else None
    if problem:
        typer.echo(f"error: --output {output} {problem}", err=True)
        raise typer.Exit(2)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root CLI."""
    build_app = typer.Typer(no_args_is_help=True, help="Build TensorRT-LLM engines and the Triton model repository.")

    @build_app.command("engine")
    def engine(
        spec: Annotated[str, typer.Argument(help="spec YAML path or bundled spec name")],
        output: Annotated[Path, typer.Option("--output", "-o", help="engines root (one folder per spec)")] = Path("/engines"),
        dry_run: Annotated[bool, typer.Option("--dry-run", help="print the exact commands, run nothing")] = False,
        force: Annotated[bool, typer.Option("--force", help="rebuild even when the manifest matches")] = False,
    ) -> None:
        """Download (at the spec's revision), quantize (FP8 KV) and build one spec's engines."""
        from engines.spec import SpecError, load_spec, spec_warnings
        from engines.trtllm.build_plan import BuildPlanError, build_plan
        from engines.trtllm.engine_build import (
            EngineBuildError,
            build_engine,
            host_memory_summary,
            installed_trtllm_version,
            up_to_date,
        )
        from engines.trtllm.model_download import hub_commit

        _check_output(output, write=not dry_run)
        try:
            loaded = load_spec(spec)
            plan = build_plan(loaded, output_dir=str(output))
        except (SpecError, BuildPlanError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        if dry_run:  # nothing is asked of the Hub: a moved branch shows as "not checked upstream"
            fresh, why = up_to_date(loaded, plan, output / loaded.name / "manifest.json")
            typer.echo(f"# {loaded.name}: {'up to date, would not rebuild' if fresh else 'would build'} ({why})")
            typer.echo(f"# {host_memory_summary(loaded)}")
            for warning in spec_warnings(loaded):
                typer.echo(f"# warning: {warning}")
            for command in plan.commands:
                typer.echo(shlex.join(command.argv))
            return
        for warning in spec_warnings(loaded):
            typer.echo(f"warning: {warning}", err=True)
        try:
            outcome = build_engine(
                loaded, output, progress=typer.echo, force=force, trtllm_version=installed_trtllm_version(),
                resolve_revision=hub_commit,
            )
        except EngineBuildError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        typer.echo(str(outcome.manifest_path))

    @build_app.command("download")
    def download(
        hf_id: Annotated[str, typer.Option("--hf-id", help="Hugging Face model id (the spec's model.hf_id)")],
        output: Annotated[Path, typer.Option("--output", "-o", help="where the snapshot is linked and recorded")],
        revision: Annotated[str | None, typer.Option("--revision", help="commit sha, branch or tag \\[default branch]")] = None,
    ) -> None:
        """Download a Hub model at one commit (the engine build's first step); print id@commit and its link."""
        from engines.trtllm.model_download import DownloadError, download_hf_model

        _check_output(output)
        try:
            record = download_hf_model(hf_id, revision, output)
        except (DownloadError, OSError, ValueError, ImportError) as exc:  # huggingface_hub: OSError/ValueError kinds
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        typer.echo(f"{hf_id}@{record['resolved_revision']} -> {output / hf_id}")

    @build_app.command("repo")
    def repo(
        specs: Annotated[list[str], typer.Argument(help="spec YAML paths or bundled spec names")],
        output: Annotated[Path, typer.Option("--output", "-o", help="model repository directory")],
        engines_root: Annotated[str, typer.Option(help="where the engines are mounted inside the Triton container")] = "/engines",
    ) -> None:
        """Render the Triton model repository (one kvgate_llm model per spec)."""
        from engines.spec import SpecError, load_spec
        from engines.triton.params import ParamsError
        from engines.triton.repository import TemplateError, render_repository

        _check_output(output)
        try:
            rendered = render_repository([load_spec(s) for s in specs], output, engines_root=engines_root)
        except (SpecError, ParamsError, TemplateError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        for model in rendered:
            typer.echo(f"{model.model_name}: {model.config_path} {model.model_path}")

    app.add_typer(build_app, name="build")
