"""`kvgate simulate --replicas N --router ...`: the trace over N replica pools behind routers.

Parsing of the routing options (exit code 2 on bad input, through ``simulate``'s error
handling) and the report: per GPU capacity and policy, one row per router — hit rate by
tier, share of the reference (one pool with N× the capacity: not a ceiling, a router that keeps
each prefix on one replica can beat it), load imbalance (max / mean
prefill tokens computed per replica), requests per replica. The replay itself is
``retention/simulation/cluster_sim.py`` (pure), whose ``kv-aware`` runs the gateway's router code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence

import typer

from retention.simulation.cluster_sim import ClusterConfig, ClusterReport, compare_routers
from retention.routing import ROUTER_NAMES, CostModel, RoutingError
from retention.simulation.simulator import SimConfig
from retention.trace import TraceRequest
from server.cli.options import CliError


MAX_REPLICAS = 1024
"""More replica pools than this are refused: each is a whole pool, and the run would exhaust memory."""


def cluster_configs(
    replicas: int | None,
    routers: Sequence[str] | None,
    *,
    index: str,
    ttl: float | None,
    cost: str,
    temperature: float,
    seed: int,
    gateways: int = 1,
    sync_delay: float | None = None,
) -> list[ClusterConfig]:
    """The validated configurations (empty without ``--replicas``: the classic single pool).

    ``gateways``: gateway replicas behind a round-robin balancer, each with its own router;
    ``sync_delay``: they run routing sync, each applying its peers' notices that many seconds late
    (None: each routes on its own dispatches alone)."""
    if replicas is None:
        if routers:
            raise CliError("--router needs --replicas N")
        if gateways != 1 or sync_delay is not None:
            raise CliError("--gateways and --sync-delay need --replicas N")
        return []
    if gateways < 1:
        raise CliError("--gateways must be >= 1")
    if sync_delay is not None and not (math.isfinite(sync_delay) and sync_delay >= 0):
        raise CliError("--sync-delay must be a number of seconds >= 0")
    if sync_delay is not None and gateways < 2:
        raise CliError("--sync-delay needs --gateways 2 or more (one gateway has no peers)")
    if replicas < 1:
        raise CliError("--replicas must be >= 1")
    if replicas > MAX_REPLICAS:
        raise CliError(f"--replicas must be <= {MAX_REPLICAS}")
    names = list(routers or ROUTER_NAMES)
    for name in names:
        if name not in ROUTER_NAMES:
            raise CliError(f"--router {name!r} is not one of {', '.join(ROUTER_NAMES)}")
    if len(set(names)) != len(names):
        raise CliError("--router names must not repeat")
    if index not in ("precise", "approximate"):
        raise CliError("--index must be 'precise' or 'approximate'")
    if ttl is not None and not (math.isfinite(ttl) and ttl > 0):
        raise CliError("--ttl must be a number of seconds > 0")
    if ttl is not None and index != "approximate":
        raise CliError("--ttl applies to --index approximate only")
    if cost not in ("kvgate", "dynamo"):
        raise CliError("--cost must be 'kvgate' or 'dynamo'")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise CliError("--temperature must be >= 0")
    try:
        model = CostModel.dynamo(temperature=temperature) if cost == "dynamo" else CostModel(temperature=temperature)
    except RoutingError as exc:
        raise CliError(str(exc)) from None
    return [
        ClusterConfig(replicas, name, cost=model, index=index, ttl_s=ttl, seed=seed,  # type: ignore[arg-type]
                      gateways=gateways, sync=sync_delay is not None, sync_delay_s=sync_delay or 0.0)
        for name in names
    ]


def run_replicas(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    clusters: Sequence[ClusterConfig],
    capacities: Sequence[int],
    *,
    host_blocks: Callable[[int], int],
    config: SimConfig,
    mapping,  # noqa: ANN001 - ClassMapping | None
    block_size: int,
    as_json: bool,
    progress: bool,
    trace: str,
    distinct: int,
) -> None:
    """Replay, then print tables or JSON (``progress``: draw the bar on stderr, also with ``as_json``)."""
    from retention.simulation.sim_policies import make_policy

    reports: list[tuple[int, str, ClusterReport]] = []
    steps = len(capacities) * len(policies) * (len(clusters) + 1) * len(requests)

    def run(advance: Callable[[int], None] | None) -> None:
        for capacity in capacities:
            for name in policies:
                report = compare_routers(
                    requests, lambda n=name: make_policy(n, mapping=mapping, block_size=block_size), clusters,
                    primary_blocks=capacity, secondary_blocks=host_blocks(capacity), config=config, progress=advance,
                )
                reports.append((capacity, name, report))

    if progress:  # on stderr: --json's stdout stays clean
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True,
                      console=Console(stderr=True)) as bar:
            task = bar.add_task("replay", total=steps)
            run(lambda n: bar.advance(task, n))
    else:
        run(None)
    if as_json:
        typer.echo(json.dumps({
            "trace": trace, "requests": len(requests), "distinct_blocks": distinct, "hold": config.hold,
            "tokens_per_block": config.tokens_per_block, "replicas": clusters[0].replicas,
            "index": clusters[0].index, "gateways": clusters[0].gateways,
            "sync_delay_s": clusters[0].sync_delay_s if clusters[0].sync else None, "runs": [
                {"primary_blocks": cap, "policy": name, **_report_dict(report)} for cap, name, report in reports
            ],
        }, indent=2))
        return
    _print(reports, distinct, len(requests), config.hold, clusters[0])


def _report_dict(report: ClusterReport) -> dict:
    """The report's JSON with ``reference`` / ``share_of_reference`` beside the older ``ceiling`` /
    ``share_of_ceiling`` (kept, same values): the one pool of N× capacity is no bound on a router."""
    data = report.to_dict()
    data["reference"] = data["ceiling"]
    for row in data["routers"].values():
        row["share_of_reference"] = row["share_of_ceiling"]
    return data


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _print(reports, distinct: int, num_requests: int, hold: str, cluster: ClusterConfig) -> None:  # noqa: ANN001
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    console.print(
        f"{num_requests} requests, {distinct} distinct blocks, --hold {hold}, {cluster.replicas} replicas, "
        f"kv-aware index {cluster.index}"
        + ("" if cluster.gateways == 1 else f", {cluster.gateways} gateways "
           + (f"synced ({cluster.sync_delay_s:g} s late)" if cluster.sync else "each on its own dispatches"))
    )
    for capacity, policy, report in reports:
        table = Table(
            title=f"policy {policy}: {report.replicas} × GPU {capacity} blocks ({_pct(capacity / distinct)} of distinct), "
            f"host {report.secondary_blocks} blocks each"
        )
        for column in ("router", "hit rate", "GPU", "host", "of reference", "load imbalance", "requests per replica",
                       "delayed", "rejected"):
            table.add_column(column, justify="left" if column == "router" else "right", no_wrap=column == "router")
        for name, result in report.results.items():
            t = result.total
            table.add_row(
                name, _pct(t.hit_rate), _pct(t.gpu_hit_rate), _pct(t.host_hit_rate), _pct(report.share_of_ceiling(name)),
                f"{result.load_imbalance:.2f}", " / ".join(str(r.requests) for r in result.replicas),
                str(t.delayed_requests), str(t.rejected),
            )
        c = report.ceiling
        table.add_row(
            f"reference (one pool × {report.replicas} capacity)", _pct(c.hit_rate), _pct(c.gpu_hit_rate), _pct(c.host_hit_rate),
            "100.00%", "", "", str(c.delayed_requests), str(c.rejected),
        )
        console.print(table)
