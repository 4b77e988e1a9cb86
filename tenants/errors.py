"""Registry errors: each carries a stable ``code`` and, where one field is to blame, its name.

The admin API maps them to HTTP statuses (``server/errors.py``); the CLI prints them.
Nothing here knows HTTP: ``kind`` is the category the edge translates.
"""

from __future__ import annotations


class RegistryError(Exception):
    """Base class. ``kind`` is one of: invalid, not_found, forbidden, conflict, stale, in_use, unavailable."""

    kind = "invalid"
    default_code = "invalid"

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code or self.default_code


class InvalidField(RegistryError):
    """A value breaks a registry rule (range, unknown reference, forbidden combination)."""

    kind = "invalid"
    default_code = "invalid_value"


class NotFound(RegistryError):
    kind = "not_found"
    default_code = "not_found"


class Forbidden(RegistryError):
    """The caller's role or scope does not allow this change (e.g. a limit above its cap)."""

    kind = "forbidden"
    default_code = "forbidden"


class Duplicate(RegistryError):
    """A unique name/slug is already taken."""

    kind = "conflict"
    default_code = "duplicate"


class Conflict(RegistryError):
    """The request conflicts with the current state (e.g. a dedicated pool is taken)."""

    kind = "conflict"
    default_code = "conflict"


class StaleVersion(RegistryError):
    """Optimistic concurrency: the caller's ``version`` is not the stored one."""

    kind = "conflict"
    default_code = "stale_version"


class InUse(RegistryError):
    """A pool or retention class still referenced by tenants cannot be deleted."""

    kind = "conflict"
    default_code = "in_use"
