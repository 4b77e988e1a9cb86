"""`kvgate admin slo` commands: a pool's SLO budget (the gateway's SLO guard settings).

Same service functions and schema as ``PUT/GET/DELETE /admin/v1/pools/{ref}/slo``. The
guard's live state and the restore action belong to a running gateway: use the admin
API (``GET /admin/v1/pools/{ref}/slo/state``, ``POST .../slo/restore``).
"""

from __future__ import annotations

from typing import Any

import typer

from server.cli.admin import OptVersion, PoolArg, Sets, _actor, _body, _Lazy, _now, _parse_sets, _print, _session


def register(admin: typer.Typer) -> None:
    api = _Lazy("server.admin.slo")
    svc = _Lazy("tenants.slo")
    group = typer.Typer(no_args_is_help=True, help="A pool's SLO budget (p99 TTFT / inter-token latency guard).")
    admin.add_typer(group, name="slo")

    def out(row: Any) -> None:
        _print(api.SloBudgetPublic.model_validate(row).model_dump(mode="json"))

    @group.command()
    def show(pool: PoolArg) -> None:
        """Show POOL's budget."""
        with _session() as s:
            out(svc.get_budget(s, pool=pool))

    @group.command("set", help=(
        "Set POOL's whole budget (fields not given take their defaults): --set ttft_p99_ms=800 "
        "--set itl_p99_ms=60 --set window_seconds=60 --set min_requests=20 --set cooldown_seconds=300 "
        "--set hysteresis=0.2 --set enabled=true --set pilot_fraction=1.0"))
    def set_(pool: PoolArg, set_: Sets = None, version: OptVersion = None) -> None:
        with _session() as s:
            body = _body(api.SloBudgetSet, **_parse_sets(set_), version=version)
            out(svc.set_budget(s, actor=_actor(), now=_now(), pool=pool, values=body.model_dump(exclude={"version"}),
                               version=body.version))

    @group.command()
    def delete(pool: PoolArg) -> None:
        """Remove POOL's budget (the guard is off; a tripped guard restores the tier)."""
        with _session() as s:
            svc.delete_budget(s, actor=_actor(), now=_now(), pool=pool)
            _print({"deleted": "slo", "pool": pool})
