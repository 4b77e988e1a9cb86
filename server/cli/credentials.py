"""`kvgate admin credentials` commands: admin credentials with roles (platform-admin, operator,
tenant-admin, viewer), over the same service functions and schemas as
``/admin/v1/credentials`` (same rules, same error codes). The shell user acts as a
platform admin (audit actor ``cli:<os user>``); a secret is printed once, at create or rotate.
"""

from __future__ import annotations

from typing import Annotated

import typer

from server.cli.options import Lazy, Limit, Offset, cli_actor, fail, print_json, registry_session, utc_now, validate_body


def register(admin: typer.Typer) -> None:
    api = Lazy("server.admin.credentials")
    svc = Lazy("tenants.admin_credentials")
    settings_module = Lazy("server.settings")
    group = typer.Typer(no_args_is_help=True, help="Admin credentials: roles and tenant scopes.")
    admin.add_typer(group, name="credentials")

    def pepper() -> str:
        value = settings_module.Settings().effective_key_pepper()
        if not value:
            fail(1, "no_pepper", "set KVGATE_KEY_PEPPER (or KVGATE_DEV=1 for the dev pepper)", "pepper")
        return value

    @group.command()
    def create(
        name: str,
        role: Annotated[str, typer.Option(help="platform-admin | operator | tenant-admin | viewer")],
        tenant: Annotated[list[str] | None, typer.Option(help="a tenant in the scope (repeat); tenant-admin needs one")] = None,
        expires_at: Annotated[str | None, typer.Option(help="ISO 8601 with offset")] = None,
    ) -> None:
        """Create a credential; the secret is printed once and cannot be shown again."""
        key_pepper = pepper()
        with registry_session() as s:
            body = validate_body(api.CredentialCreate, name=name, role=role, tenants=tenant or None,
                                 expires_at=expires_at)
            row, scope, secret = svc.create_credential(
                s, actor=cli_actor(), now=utc_now(), name=body.name, role=body.role, tenants=body.tenants,
                expires_at=body.expires_at, pepper=key_pepper)
            print_json({**api.credential_public(s, row, scope).model_dump(mode="json"), "secret": secret})

    @group.command("list")
    def list_(limit: Limit = 50, offset: Offset = 0) -> None:
        with registry_session() as s:
            page = svc.list_credentials(s, limit=limit, offset=offset)
            print_json({"items": [api.credential_public(s, r).model_dump(mode="json") for r in page.items],
                        "total": page.total, "limit": page.limit, "offset": page.offset})

    @group.command()
    def show(credential_id: int) -> None:
        with registry_session() as s:
            print_json(api.credential_public(s, svc.get_credential(s, credential_id=credential_id))
                       .model_dump(mode="json"))

    @group.command()
    def revoke(credential_id: int) -> None:
        """Revoke at once (every gateway reads credentials from the registry per request)."""
        with registry_session() as s:
            row = svc.revoke_credential(s, actor=cli_actor(), now=utc_now(), credential_id=credential_id)
            print_json(api.credential_public(s, row).model_dump(mode="json"))

    @group.command()
    def rotate(
        credential_id: int,
        overlap_seconds: Annotated[int, typer.Option(help="how long the current secret stays valid")] = 0,
    ) -> None:
        """Issue a new secret (printed once); the current one is accepted OVERLAP_SECONDS more."""
        key_pepper = pepper()
        with registry_session() as s:
            body = validate_body(api.CredentialRotate, overlap_seconds=overlap_seconds)
            row, secret = svc.rotate_credential(s, actor=cli_actor(), now=utc_now(), credential_id=credential_id,
                                                overlap_seconds=body.overlap_seconds, pepper=key_pepper)
            print_json({**api.credential_public(s, row).model_dump(mode="json"), "secret": secret})
