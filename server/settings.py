"""kvgate settings: one pydantic-settings class, environment prefix ``KVGATE_``.

Invariant: ``check_serving_secrets`` refuses empty or placeholder admin tokens and key
pepper unless ``dev`` is set; ``create_app`` calls it, so a production server never
starts with guessable secrets. Lists such as ``KVGATE_ADMIN_TOKENS`` are comma-separated;
an entry ``name:token`` names the audit actor, a bare token is ``admin:token-<position>``.
"""

from __future__ import annotations

import ipaddress
import secrets
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tenants.db import DEFAULT_DATABASE_URL

PLACEHOLDERS = frozenset(
    {
        "",
        "changeme",
        "change-me",
        "change_me",
        "changethis",
        "secret",
        "password",
        "admin",
        "token",
        "test",
        "dev",
        "kvgate",
        "xxx",
        "todo",
        "placeholder",
    }
)
MIN_SECRET_LEN = 16
# Dev mode only: a fixed pepper keeps dev keys valid across restarts. Never for production.
DEV_KEY_PEPPER = "kvgate-dev-pepper-NOT-FOR-PRODUCTION"
DEV_TOKEN_FILE = ".kvgate-dev-admin-token"


def settings_errors(exc: ValidationError) -> str:
    """One line per invalid setting, named by its environment variable (``KVGATE_<FIELD>``)."""
    parts = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error.get("loc", ()) if part != "__root__")
        name = f"KVGATE_{field.upper()}" if field else "settings"
        parts.append(f"{name}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


class SettingsError(ValueError):
    """The configuration cannot be served (e.g. placeholder secrets outside dev mode)."""


def _is_placeholder(value: str) -> bool:
    return value.strip().lower() in PLACEHOLDERS or len(value.strip()) < MIN_SECRET_LEN


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", env_file=None, extra="ignore")

    database_url: str = DEFAULT_DATABASE_URL
    admin_tokens: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)
    key_pepper: str = Field(default="", repr=False)
    dev: bool = False
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    # Proxies whose X-Forwarded-Proto / X-Forwarded-For uvicorn believes (its forwarded_allow_ips):
    # comma-separated addresses or networks, or "*" (anyone: only when nothing but the proxy can
    # reach the server, since the console's Secure cookie and its per-address sign-in throttle
    # follow these headers). Unset: uvicorn's default, this host only (FORWARDED_ALLOW_IPS, else
    # 127.0.0.1 and ::1).
    forwarded_allow_ips: str | None = None
    redis_url: str | None = None
    # Prefix of every Redis key and channel kvgate uses (admission, routing sync): deployments
    # sharing one Redis keep apart by it (pub/sub channels ignore the database number).
    redis_namespace: str = Field(default="kvgate", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    # Redis admission (server/gateway/admission.py): a concurrency lease lapses this long after
    # its gateway's last heartbeat (renewed every third of it while the request is live), so a
    # SIGKILLed gateway's slots are free again within this bound.
    admission_lease_ttl_s: float = Field(default=30.0, gt=0.0)
    # When set, /metrics requires "Authorization: Bearer <token>" (it names every tenant).
    metrics_token: str | None = Field(default=None, repr=False)
    # Online miss-ratio curves (server/gateway/observe/miss_ratio.py): the share of the block-hash
    # space each pool's shadow pools sample; 0 turns them off.
    mrc_sample_rate: float = Field(default=0.01, ge=0.0, le=1.0)
    log_level: str = "info"
    # Live trace captures (admin API /pools/{ref}/captures) write here: <trace_dir>/<pool>/capture-*.jsonl
    trace_dir: Path = Path("kvgate-traces")
    # Usage journal (server/gateway/usage_journal.py): every answered request's usage is fsynced
    # here before the answer ends and replayed into the registry by the next start, so a
    # SIGKILL loses no billing. Gateways may share the directory (segments are flock-owned);
    # keep it on a volume that outlives the process. Off: a crash loses up to one flush interval.
    usage_journal: bool = True
    usage_journal_dir: Path = Path("kvgate-usage-journal")
    # "fsync": each group of lines is fsynced before its answers end (survives a power loss).
    # "write": written before the answer, never fsynced (survives SIGKILL, not a power loss or
    # kernel crash: the lines the kernel had not yet written back are lost; module docstring).
    usage_journal_sync: Literal["fsync", "write"] = "fsync"
    # Replica routing (server/gateway/replicas/routing.py, retention/routing/cost.py).
    router: Literal["kv-aware", "kv-adaptive", "round-robin", "session", "random"] = "kv-aware"
    router_overlap_weight: float = Field(default=1.0, ge=0.0)
    router_temperature: float = Field(default=0.0, ge=0.0)
    # Routing sync (server/gateway/replicas/peer_sync.py): gateway replicas behind one balancer
    # publish their dispatches, first tokens and completions through Redis (KVGATE_REDIS_URL) and
    # apply one another's, so each routes on the whole fleet's load and in-flight prefixes. A
    # peer silent for routing_sync_lease_s (heartbeats every third of it) is forgotten.
    routing_sync: bool = False
    routing_sync_lease_s: float = Field(default=15.0, gt=0.0)
    # First-token deadline per attempt (server/gateway/replicas/routing.py, RoutingConfig): a replica
    # that accepted a request but sent no token within this many seconds has its call cancelled
    # (the engine frees the request), counts a failure in its circuit breaker, and the request
    # is retried once on another replica; with none left the client gets a 504
    # ``engine_timeout``. 0 = no deadline. Non-streamed answers without stop strings come from
    # the engine in one message, so their deadline is the whole answer's:
    # first_token_timeout_s + max_tokens * answer_timeout_per_token_s.
    first_token_timeout_s: float = Field(default=30.0, ge=0.0)
    answer_timeout_per_token_s: float = Field(default=0.5, ge=0.0)
    # Inter-token deadline (KVGATE_INTER_TOKEN_TIMEOUT_S, RoutingConfig.inter_token_timeout_s): a
    # replica that sent an answer's first token and then nothing for this many seconds has its
    # call cancelled and counts a timeout in its circuit breaker; a stream ends with the
    # dialect's error event, a non-streamed answer is run again on another replica (nothing
    # reached the client) or answered 504 ``engine_timeout``. Unset: first_token_timeout_s
    # (a request paused mid-answer waits to be scheduled again as a new one waits for its
    # first token). 0 = no deadline.
    inter_token_timeout_s: float | None = Field(default=None, ge=0.0)
    # Circuit breaker (server/gateway/replicas/breaker.py): a failed or timed-out replica is out
    # of rotation for breaker_open_s, doubling on each further failure up to breaker_max_open_s.
    breaker_open_s: float = Field(default=0.5, gt=0.0)
    breaker_max_open_s: float = Field(default=10.0, gt=0.0)
    # Stored responses of the Responses API (/v1/responses, tenants/responses.py): how long one
    # is kept (OpenAI keeps them 30 days) and how many bytes one tenant may hold.
    responses_ttl_s: float = Field(default=30 * 24 * 3600.0, gt=0.0)
    responses_max_bytes: int = Field(default=64 * 2**20, ge=1)
    # Optional OIDC for the admin API (server/admin/oidc.py): signed JWTs (RS256/ES256) from an
    # identity provider, keys from a JWKS file or URL; issuer and audience must match. The
    # roles claim's values map to kvgate roles through oidc_role_map (JSON object, e.g.
    # {"kvgate-ops": "operator"}); the tenants claim lists the slugs a tenant-admin or viewer
    # is scoped to. Off unless an issuer and a JWKS source are set.
    oidc_issuer: str | None = None
    oidc_audience: str | None = None
    oidc_jwks_file: Path | None = None
    oidc_jwks_url: str | None = None
    oidc_roles_claim: str = "roles"
    oidc_role_map: dict[str, Literal["platform-admin", "operator", "tenant-admin", "viewer"]] = Field(
        default_factory=dict)
    oidc_tenants_claim: str = "kvgate_tenants"
    oidc_name_claim: str = "sub"

    @model_validator(mode="after")
    def _breaker_bounds(self) -> "Settings":
        if self.breaker_max_open_s < self.breaker_open_s:
            raise ValueError(f"breaker_max_open_s ({self.breaker_max_open_s}) must be >= breaker_open_s "
                             f"({self.breaker_open_s})")
        return self

    @model_validator(mode="after")
    def _sync_needs_redis(self) -> "Settings":
        if self.routing_sync and not self.redis_url:
            raise ValueError("routing_sync needs redis_url: gateways share their dispatches through Redis")
        return self

    @model_validator(mode="after")
    def _oidc_complete(self) -> "Settings":
        if self.oidc_issuer and not (self.oidc_jwks_file or self.oidc_jwks_url):
            raise ValueError("oidc_issuer needs oidc_jwks_file or oidc_jwks_url")
        if self.oidc_issuer and not self.oidc_audience:
            raise ValueError("oidc_issuer needs oidc_audience")
        return self

    @property
    def oidc_enabled(self) -> bool:
        return bool(self.oidc_issuer)

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _proxy_addresses(cls, value: str | None) -> str | None:
        # uvicorn would take what it cannot parse as a literal that never matches a client address,
        # so a typo silently trusts no one: refuse it here. "*" works alone only; a network's host
        # bits must be zero (uvicorn parses networks strictly).
        if value is None or not value.strip():
            return None
        if value.strip() == "*":
            return "*"
        for entry in (part.strip() for part in value.split(",")):
            try:
                ipaddress.ip_network(entry, strict=True)
            except ValueError:
                raise ValueError(f"{entry!r} is not an IP address or network ('*' only on its own)") from None
        return value

    @field_validator("admin_tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("admin_tokens")
    @classmethod
    def _distinct_actors(cls, value: list[str]) -> list[str]:
        # Two entries recorded as one actor (two "ops:" names, or a name "token-2" beside a bare second
        # token) would make the audit log unable to tell their changes apart.
        seen: set[str] = set()
        for position, entry in enumerate(value, start=1):
            actor = _credential(entry, position)[0]
            if actor in seen:
                raise ValueError(f"entry {position} records as the audit actor {actor!r}, as an earlier entry "
                                 "does: give each token its own name (name:token)")
            seen.add(actor)
        return value

    def admin_credentials(self) -> list[tuple[str, str]]:
        """(actor id, token) pairs. The actor id is what audit events record, never the token.

        ``name:token`` is ``admin:<name>``; a bare token is ``admin:token-<n>``, ``n`` its 1-based
        position in the list: the same list gives the same actors at every start, and the actor
        says nothing about the token. (Not a digest of it: every role that reads the audit log
        sees actors, and an unsalted hash there lets a dictionary recover a passphrase token.)
        Reordering the list renumbers bare tokens; name them for an actor that survives edits.
        """
        out = [_credential(entry, position) for position, entry in enumerate(self.admin_tokens, start=1)]
        return out

    def effective_key_pepper(self) -> str:
        if self.key_pepper:
            return self.key_pepper
        return DEV_KEY_PEPPER if self.dev else ""

    def check_serving_secrets(self) -> None:
        """Raise ``SettingsError`` unless the secrets are real (or ``dev`` is set)."""
        if self.dev:
            return
        creds = self.admin_credentials()
        if not creds or any(_is_placeholder(token) for _, token in creds):
            raise SettingsError(
                "KVGATE_ADMIN_TOKENS is empty or holds a placeholder/short token "
                f"(< {MIN_SECRET_LEN} chars); set real tokens or start in dev mode (--dev)"
            )
        if _is_placeholder(self.key_pepper):
            raise SettingsError(
                f"KVGATE_KEY_PEPPER is empty or a placeholder (< {MIN_SECRET_LEN} chars); "
                "set a long random value or start in dev mode (--dev)"
            )



def _credential(entry: str, position: int) -> tuple[str, str]:
    """(actor id, token) of the ``position``-th (1-based) ``KVGATE_ADMIN_TOKENS`` entry."""
    name, sep, token = entry.partition(":")
    if sep and name and token:
        return f"admin:{name}", token
    return f"admin:token-{position}", entry

def with_dev_admin_token(settings: Settings, *, token_file: Path = Path(DEV_TOKEN_FILE)) -> tuple[Settings, str | None]:
    """In dev mode without tokens: load (or create) a random token kept in ``token_file``.

    Returns the settings to use and the token if one was supplied this way (for printing).
    """
    if not settings.dev or settings.admin_tokens:
        return settings, None
    token = token_file.read_text().strip() if token_file.exists() else ""
    if not token:
        token = "kvgdev_" + secrets.token_urlsafe(24)
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
    return settings.model_copy(update={"admin_tokens": [f"dev:{token}"]}), token
