"""`kvgate simulate TRACE.jsonl`: replay a Mooncake trace through the pool and planner.

Examples::

    kvgate simulate ../shared/traces/mooncake_synthetic_trace.jsonl -c 1% -c 2% -c 5% --host 4x
    kvgate simulate trace.jsonl -p lru -p class --classes classes.yaml --hold tokens --json
    kvgate simulate trace.jsonl -c 1% -c 2% -c 5% -c 10% --plot hit_rate.png
    kvgate simulate trace.jsonl -p adaptive -p oracle-reuse -p oracle-reuse-within-30s --host 0
    kvgate simulate trace.jsonl --replicas 4 --router round-robin --router kv-aware -p trtllm-default --hold tokens

Capacities are GPU blocks (``439``) or a percentage of the trace's distinct blocks
(``1%``); ``--host`` is host blocks (``1756``), a multiple of the GPU capacity (``4x``)
or ``0``. The simulation itself lives in ``retention/simulation/simulator.py`` (pure); this module
only reads files, draws tables, the progress bar and the plot. With ``--replicas N`` the
trace is replayed over N pools (each of the given capacity) behind each ``--router``
(``retention/simulation/cluster_sim.py``, ``server/cli/simulate_replicas.py``), next to the reference
of one pool with N× the capacity (not a ceiling: a router can beat it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from retention.simulation.capacity import check_blocks, distinct_pool_blocks, parse_capacity, parse_host
from server.cli.options import CliError, writable_dir


def register(app: typer.Typer) -> None:
    """Attach ``kvgate simulate`` to the root CLI."""

    @app.command("simulate")
    def simulate(
        trace: Annotated[Path, typer.Argument(help="Mooncake-format JSONL trace (or gzip of one)")],
        policy: Annotated[
            list[str] | None,
            typer.Option("--policy", "-p", help="lru | trtllm-default | class | adaptive (with selection) | adaptive-bands | protect, or the offline ceilings oracle-reuse | "
                 "oracle-reuse-within-<S>s | oracle-next-use | oracle-popularity-<S>s; any policy as <name>+hints replays the "
                 "trace's cache hints on top, as <name>+conv holds conversations and tool loops for their measured gaps while its duel says it pays, "
                 "<name>+conv+demote and <name>+conv+end add demote requests on delete and at a run's end, <name>+end the run's-end "
                 "demote alone, without the hold (repeat; default lru + trtllm-default, + class with --classes)"),
        ] = None,
        capacity: Annotated[
            list[str] | None, typer.Option("--capacity", "-c", help="GPU capacity: blocks or % of distinct blocks (repeat)")
        ] = None,
        host: Annotated[str, typer.Option("--host", help="host tier: blocks, a multiple of GPU like 4x, or 0")] = "4x",
        block_size: Annotated[int | None, typer.Option("--block-size", help="tokens per trace hash id (default: the "
                              "lines' block_size field, as a kvgate capture writes it, else 512 as Mooncake)")] = None,
        tokens_per_block: Annotated[int | None, typer.Option("--tokens-per-block", help="pool block size (default: --block-size)")] = None,
        hold: Annotated[str, typer.Option("--hold", help="none: release at admission; tokens: hold for modelled prefill+decode")] = "none",
        prefill_tps: Annotated[float, typer.Option("--prefill-tps", help="prefill tokens/s (--hold tokens)")] = 8000.0,
        decode_tps: Annotated[float, typer.Option("--decode-tps", help="decode tokens/s per request (--hold tokens)")] = 40.0,
        classes: Annotated[Path | None, typer.Option("--classes", help="YAML mapping of tenants/prefix groups to retention classes")] = None,
        salted: Annotated[bool, typer.Option("--salted", help="salt each request with its tenant (no cross-tenant reuse)")] = False,
        limit: Annotated[int | None, typer.Option("--limit", help="replay only the first N requests")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="print the full report as JSON")] = False,
        plot: Annotated[Path | None, typer.Option("--plot", help="write hit rate vs capacity per policy (PNG)")] = None,
        progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="progress bar on stderr "
                            "(default: on, off with --json; an explicit --progress keeps it with --json)")] = None,
        replicas: Annotated[int | None, typer.Option("--replicas", help="replay over N replica pools, each of the given capacity, behind --router")] = None,
        router: Annotated[
            list[str] | None,
            typer.Option("--router", help="random | round-robin | session | kv-aware | kv-adaptive (repeat; default all five; needs --replicas)"),
        ] = None,
        index: Annotated[str, typer.Option("--index", help="kv-aware's index: precise (pool KV events) | approximate (its own decisions)")] = "precise",
        ttl: Annotated[float | None, typer.Option("--ttl", help="approximate index: also forget blocks not routed for S seconds")] = None,
        cost: Annotated[str, typer.Option("--cost", help="kv-aware cost: kvgate (balance band) | dynamo (Dynamo's cost)")] = "kvgate",
        temperature: Annotated[float, typer.Option("--temperature", help="kv-aware softmax temperature (0 = lowest cost)")] = 0.0,
        seed: Annotated[int, typer.Option("--seed", help="random source of the random router and of softmax sampling")] = 0,
        gateways: Annotated[int, typer.Option("--gateways", help="gateway replicas behind a round-robin balancer, each with its own router (needs --replicas)")] = 1,
        sync_delay: Annotated[float | None, typer.Option("--sync-delay", help="the gateways run routing sync, applying each other's dispatches S seconds late (needs --gateways 2+)")] = None,
    ) -> None:
        """Replay a trace through the block pool and planner; compare policies against Belady."""
        from retention.simulation.oracle import is_oracle_name, oracle_factories, parse_oracle_name
        from retention.simulation.sim_policies import ClassMapping, ClassMappingError, make_policy
        from retention.simulation.simulator import SimConfig, run_simulation
        from retention.trace import TraceError, parse_trace_events, trace_block_size
        from server.analysis.trace_file import trace_lines
        from server.cli.simulate_replicas import cluster_configs, run_replicas  # heavy: kept out of --help

        try:
            if not trace.is_file():
                raise CliError(f"trace file not found: {trace}")
            if hold not in ("none", "tokens"):
                raise CliError("--hold must be 'none' or 'tokens'")
            if limit is not None and limit < 1:
                raise CliError("--limit must be >= 1")
            if plot is not None:
                if replicas is not None:
                    raise CliError("--plot draws the single-pool replay; it cannot run with --replicas")
                plot = _plot_path(plot)
            clusters = cluster_configs(
                replicas, router, index=index, ttl=ttl, cost=cost, temperature=temperature, seed=seed,
                gateways=gateways, sync_delay=sync_delay,
            )
            mapping = None
            if classes is not None:
                import yaml

                try:
                    mapping = ClassMapping.from_dict(yaml.safe_load(classes.read_text()))
                except (OSError, yaml.YAMLError) as exc:
                    raise CliError(f"cannot read {classes}: {exc}") from None
            names = list(policy or (["lru", "trtllm-default"] + (["class"] if mapping else [])))
            for i, name in enumerate(names):  # a repeat would replay twice and print its rows twice
                if name in names[:i]:
                    raise CliError(f"-p {name!r} is given twice; name each policy once")
            registry = None  # plug-in policies beyond the built-ins would be passed here
            for name in names:  # fail fast on unknown names / missing mapping
                if is_oracle_name(name):
                    if clusters:
                        raise CliError("oracle policies read the whole trace; they cannot run with --replicas")
                    parse_oracle_name(name)
                else:
                    make_policy(name, mapping=mapping, block_size=block_size or 512, registry=registry)
            with trace_lines(trace) as lines:  # plain or gzip; a line that is not UTF-8 is named
                requests, deletions = parse_trace_events(lines, block_size=block_size)
            block_size = block_size or trace_block_size(requests)
            pool_block = block_size if tokens_per_block is None else tokens_per_block
            config = SimConfig(
                tokens_per_block=pool_block, trace_block_size=block_size, hold=hold,  # type: ignore[arg-type]
                prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps, salted=salted,
            )
            if limit is not None:
                requests = requests[:limit]
            if not requests:
                raise CliError("the trace holds no requests")
            distinct = distinct_pool_blocks(requests, block_size, pool_block)  # at the pool's block size
            texts = capacity or ["2%"]
            gpu_caps = [parse_capacity(c, distinct) for c in texts]
            for i, cap in enumerate(gpu_caps):  # e.g. -c 2% -c 100 on 5,000 distinct blocks: one pool, twice
                if cap in gpu_caps[:i]:
                    first = texts[gpu_caps.index(cap)]
                    same = "is given twice" if first == texts[i] else f"is the same {cap} blocks as -c {first!r}"
                    raise CliError(f"-c {texts[i]!r} {same}; give each capacity once")
            host_blocks = parse_host(host)
            for gpu_cap in gpu_caps:
                check_blocks(host_blocks(gpu_cap), distinct, f"--host {host!r} at GPU {gpu_cap} blocks")
        except (CliError, TraceError, ClassMappingError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None

        # The bar is drawn on stderr, so it never mixes into --json's stdout: only the default follows --json.
        progress = (not as_json) if progress is None else progress
        if clusters:
            run_replicas(
                requests, names, clusters, gpu_caps, host_blocks=host_blocks, config=config, mapping=mapping,
                block_size=block_size, as_json=as_json, progress=progress, trace=str(trace), distinct=distinct,
            )
            return

        # Oracles read the whole (possibly --limit-ed) request list: they know the future.
        oracles = oracle_factories(names, requests, config)
        factories = [
            oracles.get(name) or (lambda n=name: make_policy(n, mapping=mapping, block_size=block_size, registry=registry))
            for name in names
        ]
        total = len(requests) * len(names) * len(gpu_caps)
        if progress:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            with Progress(
                TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True,
                console=Console(stderr=True),
            ) as bar:
                task = bar.add_task("replay", total=total)
                reports = run_simulation(
                    requests, factories, gpu_caps, host_blocks=host_blocks, config=config,
                    progress=lambda n: bar.advance(task, n), deletions=deletions,
                )
        else:
            reports = run_simulation(requests, factories, gpu_caps, host_blocks=host_blocks, config=config,
                                     deletions=deletions)

        document = {
            "trace": str(trace),
            "requests": len(requests),
            "distinct_blocks": distinct,
            "tokens_per_block": pool_block,
            "hold": hold,
            "capacities": [_capacity_dict(r) for r in reports],
        }
        if plot is not None:
            _plot(reports, distinct, plot)
        if as_json:
            typer.echo(json.dumps(document, indent=2))
        else:
            _print_tables(reports, distinct, len(requests), hold)
            if plot is not None:
                typer.echo(f"plot written to {plot}")


def _capacity_dict(report) -> dict:  # noqa: ANN001
    """One capacity's JSON: the report's keys, plus ``age_estimate_gpu``, the name the table uses for
    ``age_ceiling_gpu`` (kept): on a recorded trace the age-based figure is an estimate, not a bound."""
    data = report.to_dict()
    data["age_estimate_gpu"] = data["age_ceiling_gpu"]
    return data


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _print_tables(reports, distinct: int, num_requests: int, hold: str) -> None:  # noqa: ANN001
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # pipes and CI logs: do not squeeze the tables to 80 columns
    console.print(f"{num_requests} requests, {distinct} distinct blocks, --hold {hold}")
    for report in reports:
        table = Table(
            title=f"GPU {report.primary_blocks} blocks ({_pct(report.primary_blocks / distinct)} of distinct), "
            f"host {report.secondary_blocks} blocks"
        )
        for column in ("policy", "hit rate", "GPU", "host", "recomputed tokens", "offloaded",
                       "onboarded", "evicted", "rejected", "delayed", "of Belady"):
            if column == "policy":
                table.add_column(column, justify="left", no_wrap=True, min_width=24)
            else:
                table.add_column(column, justify="right")
        for name, r in report.results.items():
            ceiling = report.belady_total if r.secondary_blocks and report.belady_total else report.belady_gpu
            share = r.hit_rate / ceiling.hit_rate if ceiling.hit_rate else 0.0
            table.add_row(
                name, _pct(r.hit_rate), _pct(r.gpu_hit_rate), _pct(r.host_hit_rate), f"{r.recomputed_prefill_tokens:,}",
                f"{r.offloaded_blocks:,}", f"{r.onboarded_blocks:,}",
                f"{r.evicted_primary_blocks + r.evicted_secondary_blocks:,}", str(r.rejected), str(r.delayed_requests),
                _pct(share),
            )
        table.add_row("age-based estimate (GPU only)", _pct(report.age_ceiling_gpu), "", "", "", "", "", "", "", "", "")
        table.add_row("Belady (GPU only)", _pct(report.belady_gpu.hit_rate), "", "", "", "", "", "", "", "", "")
        if report.belady_total is not None:
            table.add_row("Belady (GPU + host)", _pct(report.belady_total.hit_rate), "", "", "", "", "", "", "", "", "")
        console.print(table)
        tenants = sorted({t for r in report.results.values() for t in r.tenants})
        if tenants != ["-"]:
            per = Table(title="per tenant: hit rate (requests)")
            per.add_column("tenant")
            for name in report.results:
                per.add_column(name, justify="right")
            for tenant in tenants:
                cells = []
                for r in report.results.values():
                    t = r.tenants.get(tenant)
                    cells.append("" if t is None else f"{_pct(t.hit_rate)} ({t.requests})")
                per.add_row(tenant, *cells)
            console.print(per)


def _plot_path(path: Path) -> Path:
    """The path ``--plot`` will write (``.png`` added to a bare name), checked before the replay."""
    from matplotlib.backend_bases import FigureCanvasBase

    if path.is_dir():
        raise CliError(f"--plot {path} is a directory")
    if not path.suffix:
        path = path.with_suffix(".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise CliError(f"--plot {path}: cannot write {path.suffix!r}; use one of "
                       f"{', '.join('.' + f for f in sorted(formats))}")
    parent = path.parent
    if not parent.is_dir():
        raise CliError(f"--plot {path}: directory {parent} does not exist")
    if path.is_dir():  # a bare name whose .png is a directory
        raise CliError(f"--plot {path} is a directory")
    if not writable_dir(parent):
        raise CliError(f"--plot {path}: directory {parent} is not writable")
    return path


def _plot(reports, distinct: int, path: Path) -> None:  # noqa: ANN001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [100 * r.primary_blocks / distinct for r in reports]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in reports[0].results:
        ax.plot(xs, [100 * r.results[name].hit_rate for r in reports], marker="o", label=name)
    ax.plot(xs, [100 * r.belady_gpu.hit_rate for r in reports], "k--", label="Belady (GPU only)")
    if all(r.belady_total is not None for r in reports):
        ax.plot(xs, [100 * r.belady_total.hit_rate for r in reports], "k:", label="Belady (GPU + host)")
    ax.set_xlabel("GPU capacity (% of distinct blocks)")
    ax.set_ylabel("prompt-token hit rate (%)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
