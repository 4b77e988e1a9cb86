"""`kvgate admin slo` commands: a pool's SLO budget (the gateway's SLO guard settings).

Same service functions and schema as ``PUT/GET/DELETE /admin/v1/pools/{ref}/slo``. The
guard's live state and the restore action belong to a running gateway: use the admin
API (``GET /admin/v1/pools/{ref}/slo/state``, ``POST .../slo/restore``).
"""

from __future__ import annotations

from typing import Any

import typer

from server.cli.options import (
    Lazy, OptVersion, PoolArg, Sets, cli_actor, fail, parse_sets, print_json, registry_session, utc_now, validate_body,
)


def register(admin: typer.Typer) -> None:
    api = Lazy("server.admin.slo")
    svc = Lazy("tenants.slo")
    group = typer.Typer(no_args_is_help=True, help="A pool's SLO budget (p99 TTFT / inter-token latency guard).")
    admin.add_typer(group, name="slo")

    def out(row: Any) -> None:
        print_json(api.SloBudgetPublic.model_validate(row).model_dump(mode="json"))

    @group.command()
    def show(pool: PoolArg) -> None:
        """Show POOL's budget."""
        with registry_session() as s:
            out(svc.get_budget(s, pool=pool))

    @group.command("set", help=(
        "Set POOL's whole budget. At least one threshold, which has no default: --set ttft_p99_ms=800 "
        "and/or --set itl_p99_ms=60 (p99 milliseconds). Fields not given take these defaults: "
        "--set window_seconds=60 --set min_requests=20 --set cooldown_seconds=300 "
        "--set hysteresis=0.2 --set enabled=true --set pilot_fraction=1.0"))
    def set_(pool: PoolArg, set_: Sets = None, version: OptVersion = None) -> None:
        with registry_session() as s:
            body = validate_body(api.SloBudgetSet, **parse_sets(set_), version=version)
            if body.ttft_p99_ms is None and body.itl_p99_ms is None:  # such a budget never trips: it guards nothing
                fail(2, "invalid_value", "a budget needs ttft_p99_ms or itl_p99_ms (e.g. --set ttft_p99_ms=800): "
                     "with neither it guards nothing", "ttft_p99_ms")
            out(svc.set_budget(s, actor=cli_actor(), now=utc_now(), pool=pool, values=body.model_dump(exclude={"version"}),
                               version=body.version))

    @group.command()
    def delete(pool: PoolArg) -> None:
        """Remove POOL's budget (the guard is off; a tripped guard restores the tier)."""
        with registry_session() as s:
            svc.delete_budget(s, actor=cli_actor(), now=utc_now(), pool=pool)
            print_json({"deleted": "slo", "pool": pool})
