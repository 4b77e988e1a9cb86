"""`kvgate admin` commands: the registry from the shell, over the same service functions
and schemas as the admin REST API (so the same rules and error codes apply).

Output is JSON on stdout; errors are the admin error shape on stderr with exit code 1
(registry rule) or 2 (invalid input). ``apply --exit-code`` exits 3 when its plan has
changes (a drift check). Audit events name the actor ``cli:<os user>`` (``apply --actor NAME``:
``cli:NAME``; the CLI writes in no other actor namespace).
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any

import typer

from server.cli import credentials, slo  # their own modules: admin credentials, the SLO guard's budget
from server.cli.options import (
    Lazy,
    Limit,
    Offset,
    OptVersion,
    PoolArg,
    ReplicaName,
    Sets,
    cli_actor,
    fail,
    load_settings,
    page_of,
    parse_sets,
    print_json,
    registry_session,
    utc_now,
    validate_body,
)

# `kvgate admin apply --exit-code`: the plan had changes (not an error: 1 and 2 are).
CHANGES_PLANNED = 3
ACTOR_NAME_MAX = 128 - len("cli:")  # audit_events.actor is 128 characters


def _apply_actor(name: str) -> str:
    """``cli:<name>`` for ``apply --actor``: a CLI change never passes for an API caller's
    (``admin:...``, an OIDC subject, ...), and a name with a control or formatting character (a
    newline forging a second line in a log, a bidi override) is refused, as credential names are."""
    from tenants.validation import first_unprintable

    if not name.strip() or len(name) > ACTOR_NAME_MAX:
        fail(2, "invalid_value", f"--actor must be 1-{ACTOR_NAME_MAX} characters", "--actor")
    bad = first_unprintable(name)
    if bad is not None:
        fail(2, "invalid_value", f"--actor must not contain control or formatting characters (found U+{ord(bad):04X})",
             "--actor")
    return f"cli:{name}"


def _crud(
    parent: typer.Typer,
    *,
    name: str,
    help_text: str,
    service: str,
    schema: str,
    create_fn: str,
    get_fn: str,
    list_fn: str,
    update_fn: str,
    delete_fn: str,
    required: dict[str, str],
) -> typer.Typer:
    """list/show/create/update/delete for pools and retention classes.

    ``service`` is a module path and ``schema`` a schema family prefix (``Pool`` ->
    ``PoolCreate``/``PoolUpdate``/``PoolPublic``), resolved when a command runs so that
    ``kvgate --help`` does not import SQLAlchemy or FastAPI.
    """
    group = typer.Typer(no_args_is_help=True, help=help_text)
    parent.add_typer(group, name=name)

    def svc(fn: str) -> Any:
        return getattr(importlib.import_module(service), fn)

    def sc(kind: str) -> Any:
        return getattr(importlib.import_module("server.admin.schemas"), f"{schema}{kind}")

    @group.command("list")
    def list_(limit: Limit = 50, offset: Offset = 0) -> None:
        with registry_session() as s:
            print_json(page_of(sc("Public"), svc(list_fn)(s, limit=limit, offset=offset)))

    @group.command()
    def show(ref: str) -> None:
        with registry_session() as s:
            print_json(sc("Public").model_validate(svc(get_fn)(s, ref=ref)).model_dump(mode="json"))

    @group.command(help=f"Create; required --set fields: {', '.join(required) or 'none'} (plus NAME).")
    def create(name_: Annotated[str, typer.Argument(metavar="NAME")], set_: Sets = None) -> None:
        with registry_session() as s:
            body = validate_body(sc("Create"), name=name_, **parse_sets(set_))
            row = svc(create_fn)(s, actor=cli_actor(), now=utc_now(), **body.model_dump())
            print_json(sc("Public").model_validate(row).model_dump(mode="json"))

    @group.command()
    def update(ref: str, version: Annotated[int, typer.Option(help="current version")], set_: Sets = None) -> None:
        with registry_session() as s:
            body = validate_body(sc("Update"), version=version, **parse_sets(set_))
            row = svc(update_fn)(
                s,
                actor=cli_actor(),
                now=utc_now(),
                ref=ref,
                version=version,
                changes=body.model_dump(exclude_unset=True, exclude={"version"}),
            )
            print_json(sc("Public").model_validate(row).model_dump(mode="json"))

    @group.command()
    def delete(ref: str) -> None:
        with registry_session() as s:
            svc(delete_fn)(s, actor=cli_actor(), now=utc_now(), ref=ref)
            print_json({"deleted": ref})

    return group


def register(app: typer.Typer) -> None:
    """Attach ``kvgate admin pools|replicas|classes|tenants|keys|audit|apply`` to the root CLI."""
    admin = typer.Typer(no_args_is_help=True, help="Manage the tenant registry (pools, classes, tenants, keys).")
    app.add_typer(admin, name="admin")

    _crud(
        admin,
        name="pools",
        help_text="Engine pools.",
        service="tenants.pools",
        schema="Pool",
        create_fn="create_pool",
        get_fn="get_pool",
        list_fn="list_pools",
        update_fn="update_pool",
        delete_fn="delete_pool",
        required={"model_name": "", "replicas (JSON list) or the legacy triton_url": "", "primary_blocks": ""},
    )
    _crud(
        admin,
        name="classes",
        help_text="Retention classes.",
        service="tenants.retention_classes",
        schema="RetentionClass",
        create_fn="create_class",
        get_fn="get_class",
        list_fn="list_classes",
        update_fn="update_class",
        delete_fn="delete_class",
        required={},
    )
    _register_replicas(admin)
    _register_tenants(admin)
    _register_keys(admin)

    slo.register(admin)
    credentials.register(admin)

    @admin.command("apply")
    def apply_(
        file: Annotated[str, typer.Option("--file", "-f", help="registry YAML file ('-' = stdin)")],
        dry_run: Annotated[bool, typer.Option("--dry-run", help="print the diff, write nothing")] = False,
        prune: Annotated[
            bool, typer.Option("--prune", help="also delete what the file's lists do not name (a pruned tenant's "
                               "keys, usage history and stored responses too, counted in the plan; refused while "
                               "it would leave an unrevoked tenant-admin credential with no tenant)")
        ] = False,
        actor: Annotated[str | None, typer.Option(help=f"audit actor NAME, recorded as cli:NAME (1-{ACTOR_NAME_MAX} "
                                                  "printable characters; default: the OS user)")] = None,
        exit_code: Annotated[
            bool, typer.Option("--exit-code", help=f"exit {CHANGES_PLANNED} when the plan has changes, 0 when the "
                               "registry matches (with --dry-run: a drift check for CI)")
        ] = False,
    ) -> None:
        """Make the registry match a declarative file: pools with replicas, classes, tenants.

        Idempotent: a second apply of the same file changes nothing and writes no audit
        event. Prints each change (field: old → new); all changes commit in one
        transaction, one audit event each, or none do. A bad file exits 2, writing nothing.
        Exit 0 whether or not there were changes, unless --exit-code: then 3 when the plan
        has changes (with --dry-run: the registry differs from the file; without: they were
        applied), so exit 1 and 2 stay errors.
        """
        import sys
        from pathlib import Path

        from tenants.declarative import apply_registry, load_registry
        from tenants.errors import InvalidField

        who = cli_actor() if actor is None else _apply_actor(actor)
        try:
            text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            fail(2, "invalid_file", f"cannot read {file}: {exc}", "--file")
        if _no_document(text):  # an empty file would plan "no changes" (or, with --prune, delete everything)
            fail(2, "invalid_file", f"{file} holds no registry (empty, only comments, or null); nothing to apply "
                 "(a file that means an empty registry says so: pools: [], retention_classes: [], tenants: [])", "--file")
        try:
            doc = load_registry(text, source=file)
        except InvalidField as exc:
            fail(2, exc.code, exc.message, exc.field)
        _require_current_schema()
        with registry_session() as s:
            try:
                plan = apply_registry(s, doc, actor=who, now=utc_now(), prune=prune, dry_run=dry_run)
            except InvalidField as exc:
                fail(2, exc.code, exc.message, exc.field)
            typer.echo(plan.render())
            if dry_run:
                typer.echo("dry run: nothing written")
            elif not plan.empty:
                typer.echo(f"applied as {who}")
        if exit_code and not plan.empty:
            raise typer.Exit(CHANGES_PLANNED)

    @admin.command()
    def audit(
        limit: Limit = 50,
        offset: Offset = 0,
        entity_type: Annotated[str | None, typer.Option()] = None,
        entity_id: Annotated[str | None, typer.Option()] = None,
        action: Annotated[str | None, typer.Option()] = None,
    ) -> None:
        """List audit events, newest first."""
        from server.admin import schemas as sc
        from tenants import audit as audit_log

        with registry_session() as s:
            print_json(
                page_of(
                    sc.AuditEventPublic,
                    audit_log.list_events(
                        s, limit=limit, offset=offset, entity_type=entity_type, entity_id=entity_id, action=action
                    ),
                )
            )


def _register_replicas(admin: typer.Typer) -> None:
    sc = Lazy("server.admin.schemas")
    svc = Lazy("tenants.replicas")

    group = typer.Typer(no_args_is_help=True, help="A pool's engine replicas (endpoints).")
    admin.add_typer(group, name="replicas")

    def out(row: Any) -> None:
        print_json(sc.ReplicaPublic.model_validate(row).model_dump(mode="json"))

    @group.command("list")
    def list_(pool: PoolArg) -> None:
        with registry_session() as s:
            print_json([sc.ReplicaPublic.model_validate(r).model_dump(mode="json") for r in svc.list_replicas(s, pool=pool)])

    @group.command()
    def show(pool: PoolArg, name: ReplicaName) -> None:
        with registry_session() as s:
            out(svc.get_replica(s, pool=pool, name=name))

    @group.command()
    def add(
        pool: PoolArg,
        name: ReplicaName,
        endpoint: Annotated[str, typer.Option(help="engine gRPC host:port")],
        weight: Annotated[int, typer.Option(help="relative share, >= 1")] = 1,
        state: Annotated[str, typer.Option(help="active|draining|disabled")] = "active",
    ) -> None:
        """Add a replica to POOL."""
        with registry_session() as s:
            body = validate_body(sc.ReplicaCreate, name=name, endpoint=endpoint, weight=weight, state=state)
            out(svc.add_replica(s, actor=cli_actor(), now=utc_now(), pool=pool, **body.model_dump()))

    @group.command(help="Change endpoint, weight and/or state: --set endpoint=h:p --set weight=2.")
    def update(
        pool: PoolArg, name: ReplicaName, version: Annotated[int, typer.Option(help="current version")], set_: Sets = None
    ) -> None:
        with registry_session() as s:
            body = validate_body(sc.ReplicaUpdate, version=version, **parse_sets(set_))
            changes = body.model_dump(exclude_unset=True, exclude={"version"})
            out(svc.update_replica(s, actor=cli_actor(), now=utc_now(), pool=pool, name=name, version=version,
                                   changes=changes))

    def state_command(command: str, state: str, doc: str) -> None:
        def change(pool: PoolArg, name: ReplicaName, version: OptVersion = None) -> None:
            with registry_session() as s:
                out(svc.set_state(s, actor=cli_actor(), now=utc_now(), pool=pool, name=name, state=state, version=version))

        change.__doc__ = doc
        group.command(command)(change)

    state_command("drain", "draining", "Drain: no new requests; in-flight ones finish.")
    state_command("disable", "disabled", "Disable: out of rotation.")
    state_command("activate", "active", "Activate: back into rotation.")

    @group.command()
    def remove(pool: PoolArg, name: ReplicaName) -> None:
        """Remove a replica (a pool's last replica cannot be removed)."""
        with registry_session() as s:
            svc.remove_replica(s, actor=cli_actor(), now=utc_now(), pool=pool, name=name)
            print_json({"removed": name, "pool": pool})


def _no_document(text: str) -> bool:
    """Whether ``text`` holds no registry: an empty stream (blank, only comments) or one null
    document (``---``, ``null``). Malformed YAML is not judged here: ``load_registry`` names it."""
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return False
    return node is None or (isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null")


def _require_current_schema() -> None:
    """Exit 1 with a clear message unless the database is migrated to this code's head."""
    from sqlalchemy.exc import SQLAlchemyError

    from tenants import migrate

    url = load_settings().database_url  # an invalid KVGATE_* variable: one line, exit 2
    try:
        current, head = migrate.current(url=url), migrate.head()
    except SQLAlchemyError as exc:
        fail(1, "database_unavailable", f"database error: {type(exc).__name__}: {exc}")
    if current != head:
        fail(1, "schema_not_current", f"the registry schema is at {current or 'base'}, this kvgate needs {head}: "
              "run `kvgate db upgrade` first")


def _tenant_json(session: Any, tenant: Any) -> dict[str, Any]:
    from server.admin.tenants import tenant_detail

    return tenant_detail(session, tenant).model_dump(mode="json")


def _register_tenants(admin: typer.Typer) -> None:
    sc = Lazy("server.admin.schemas")
    svc = Lazy("tenants.tenant")

    group = typer.Typer(no_args_is_help=True, help="Tenants.")
    admin.add_typer(group, name="tenants")

    @group.command("list")
    def list_(
        limit: Limit = 50,
        offset: Offset = 0,
        status: Annotated[str | None, typer.Option(help="active|suspended")] = None,
    ) -> None:
        from server.admin.tenants import tenant_publics

        with registry_session() as s:
            result = svc.list_tenants(s, limit=limit, offset=offset, status=status)
            items = [p.model_dump(mode="json") for p in tenant_publics(s, list(result.items))]
            print_json({"items": items, "total": result.total, "limit": result.limit, "offset": result.offset})

    @group.command()
    def show(ref: str) -> None:
        """A tenant with its computed retention view (host vs dropped per segment)."""
        with registry_session() as s:
            print_json(_tenant_json(s, svc.get_tenant(s, ref=ref)))

    @group.command(help="Create a tenant; other fields (isolation, limits, kv_quota_fraction) via --set.")
    def create(
        slug: str,
        pool: Annotated[str, typer.Option(help="pool id or name")],
        retention_class: Annotated[str, typer.Option("--class", help="retention class id or name")],
        display_name: Annotated[str | None, typer.Option()] = None,
        set_: Sets = None,
    ) -> None:
        with registry_session() as s:
            body = validate_body(
                sc.TenantCreate,
                slug=slug,
                display_name=display_name or slug,
                pool=pool,
                retention_class=retention_class,
                **parse_sets(set_),
            )
            print_json(_tenant_json(s, svc.create_tenant(s, actor=cli_actor(), now=utc_now(), **body.model_dump())))

    @group.command()
    def update(ref: str, version: Annotated[int, typer.Option(help="current version")], set_: Sets = None) -> None:
        with registry_session() as s:
            body = validate_body(sc.TenantUpdate, version=version, **parse_sets(set_))
            tenant = svc.update_tenant(
                s,
                actor=cli_actor(),
                now=utc_now(),
                ref=ref,
                version=version,
                changes=body.model_dump(exclude_unset=True, exclude={"version"}),
            )
            print_json(_tenant_json(s, tenant))

    @group.command()
    def suspend(ref: str) -> None:
        with registry_session() as s:
            print_json(_tenant_json(s, svc.suspend_tenant(s, actor=cli_actor(), now=utc_now(), ref=ref)))

    @group.command()
    def resume(ref: str) -> None:
        with registry_session() as s:
            print_json(_tenant_json(s, svc.resume_tenant(s, actor=cli_actor(), now=utc_now(), ref=ref)))

    @group.command()
    def delete(ref: str) -> None:
        with registry_session() as s:
            svc.delete_tenant(s, actor=cli_actor(), now=utc_now(), ref=ref)
            print_json({"deleted": ref})


def _register_keys(admin: typer.Typer) -> None:
    sc = Lazy("server.admin.schemas")
    svc = Lazy("tenants.keys")
    settings_module = Lazy("server.settings")

    group = typer.Typer(no_args_is_help=True, help="A tenant's API keys.")
    admin.add_typer(group, name="keys")

    @group.command()
    def create(
        tenant: str,
        name: Annotated[str, typer.Option()] = "",
        expires_at: Annotated[str | None, typer.Option(help="ISO 8601 with offset")] = None,
    ) -> None:
        """Create a key; the plaintext is printed once and cannot be shown again."""
        settings = settings_module.Settings()
        pepper = settings.effective_key_pepper()
        if not pepper:
            fail(1, "no_pepper", "set KVGATE_KEY_PEPPER (or KVGATE_DEV=1 for the dev pepper)", "pepper")
        with registry_session() as s:
            body = validate_body(sc.ApiKeyCreate, name=name, expires_at=expires_at)
            row, plaintext = svc.create_key(
                s, actor=cli_actor(), now=utc_now(), tenant=tenant, name=body.name, expires_at=body.expires_at, pepper=pepper
            )
            print_json({**sc.ApiKeyPublic.model_validate(row).model_dump(mode="json"), "key": plaintext})

    @group.command("list")
    def list_(tenant: str, limit: Limit = 50, offset: Offset = 0) -> None:
        with registry_session() as s:
            print_json(page_of(sc.ApiKeyPublic, svc.list_keys(s, tenant=tenant, limit=limit, offset=offset)))

    @group.command()
    def revoke(tenant: str, key_id: int) -> None:
        with registry_session() as s:
            row = svc.revoke_key(s, actor=cli_actor(), now=utc_now(), tenant=tenant, key_id=key_id)
            print_json(sc.ApiKeyPublic.model_validate(row).model_dump(mode="json"))
