"""OIDC bearer tokens for the admin API: a signed JWT from an identity provider -> a role and scope.

Verification is PyJWT's (``jwt.decode``): the signature with a key from the configured JWKS
(file, or URL fetched and cached by ``jwt.PyJWKClient``), only RS256/ES256 (never ``none``
or an HMAC algorithm a public key could be abused for), ``iss`` and ``aud`` equal to the
settings, ``exp`` required and in the future. Claims map to a role through
``oidc_role_map``; when several values map, the most powerful role wins.

Scope invariants: platform-admin and operator are never scoped. A tenant-admin or viewer is
*always* scoped: to the slugs of the tenants claim, or, when the claim is absent, to no
tenant at all (a token the provider issued without a scope reads nothing, never every
tenant; an unscoped viewer is an admin credential made so on purpose). A tenant-admin with
no tenants is refused. A tenants claim we cannot read (JSON null, a number, an object) is
refused, never read as "no scope". The name claim must fit the audit actor whole
(``MAX_NAME``): two long names are never truncated into one actor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jwt

from server.settings import Settings
from tenants.models import ADMIN_ROLES
from tenants.validation import first_unprintable

log = logging.getLogger("kvgate.admin.oidc")
ALGORITHMS = ["RS256", "ES256"]
ACTOR_PREFIX = "oidc:"
MAX_NAME = 128 - len(ACTOR_PREFIX)  # audit_events.actor is 128 chars
_ABSENT = object()


@dataclass(frozen=True, slots=True)
class OidcClaims:
    """What a verified token says: ``tenants`` are slugs as the provider sent them (None = unscoped:
    platform-admin and operator only)."""

    name: str
    role: str
    tenants: tuple[str, ...] | None


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token.startswith("eyJ")


class OidcVerifier:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._client = jwt.PyJWKClient(settings.oidc_jwks_url, lifespan=300) if settings.oidc_jwks_url else None
        self._keys = (jwt.PyJWKSet.from_json(settings.oidc_jwks_file.read_text())
                      if settings.oidc_jwks_file is not None and self._client is None else None)

    def _key(self, token: str) -> jwt.PyJWK:
        """The signing key as a ``PyJWK``, not its raw key: PyJWT then checks the token's ``alg``
        against the key's own (a header naming RS256 over an EC key is refused, not a crash)."""
        if self._client is not None:
            return self._client.get_signing_key_from_jwt(token)
        assert self._keys is not None
        kid = jwt.get_unverified_header(token).get("kid")
        if kid is None and len(self._keys.keys) == 1:
            return self._keys.keys[0]
        return self._keys[kid]

    def verify(self, token: str) -> OidcClaims | None:
        """The mapped claims of a valid token, or None (bad signature, wrong issuer/audience, expired,
        no mapped role, a name too long for the actor, an unreadable tenants claim, a tenant-admin
        without tenants)."""
        s = self._settings
        try:
            claims = jwt.decode(token, self._key(token), algorithms=ALGORITHMS, audience=s.oidc_audience,
                                issuer=s.oidc_issuer, options={"require": ["exp", "iss", "aud"]})
        except (jwt.PyJWTError, KeyError, TypeError, ValueError) as exc:  # a forged token never answers 500
            log.info("OIDC token refused: %s", type(exc).__name__)
            return None
        values = claims.get(s.oidc_roles_claim)
        values = [values] if isinstance(values, str) else values if isinstance(values, list) else []
        mapped = {s.oidc_role_map[v] for v in values if isinstance(v, str) and v in s.oidc_role_map}
        role = next((r for r in ADMIN_ROLES if r in mapped), None)
        name = claims.get(s.oidc_name_claim)
        if role is None or not isinstance(name, str) or not name:
            return None
        if len(name) > MAX_NAME:
            log.info("OIDC token refused: its %s claim is over %d characters", s.oidc_name_claim, MAX_NAME)
            return None
        bad = first_unprintable(name)
        if bad is not None:  # as for credential names: the actor is shown in logs, the audit log, the console
            log.info("OIDC token refused: its %s claim holds U+%04X (a control or format character)",
                     s.oidc_name_claim, ord(bad))
            return None
        raw = claims.get(s.oidc_tenants_claim, _ABSENT)
        if raw is _ABSENT:  # no scope sent: scoped to nothing (platform-admin/operator are unscoped below)
            tenants: tuple[str, ...] | None = ()
        elif isinstance(raw, str):  # one value sent bare, as the roles claim may be
            tenants = (raw,)
        elif isinstance(raw, list):
            tenants = tuple(t for t in raw if isinstance(t, str))
        else:  # null or another shape: a scope we cannot read is refused, never read as no scope at all
            return None
        if role in ("platform-admin", "operator"):
            tenants = None
        if role == "tenant-admin" and not tenants:
            return None
        return OidcClaims(name=f"{ACTOR_PREFIX}{name}", role=role, tenants=tenants)
