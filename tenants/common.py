"""Plumbing shared by the service modules: transactions, pages, references, snapshots.

Invariant: a service mutation is one transaction that either commits its change *and*
its audit event, or rolls back both (``mutation``). Integrity errors raised by the
database (a lost race on a unique name, a reference deleted meanwhile) become registry
errors, never raw driver exceptions.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tenants.errors import Conflict, Duplicate, InvalidField, NotFound, StaleVersion
from tenants.validation import NAME_RE

T = TypeVar("T")
MAX_PAGE = 500
# Ids are INTEGER columns (INT32 on PostgreSQL): a number outside [1, MAX_ID] names no row.
MAX_ID = 2**31 - 1
_ID_DIGITS = len(str(MAX_ID))  # no id is written with more significant digits


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: Sequence[T]
    total: int
    limit: int
    offset: int


def paginate(session: Session, stmt: Select[Any], *, limit: int, offset: int, rows: bool = False) -> Page[Any]:
    """Run ``stmt`` (already ordered) for one page; ``total`` counts the unpaged rows. The page holds
    the first column's objects, or with ``rows`` whole rows (an entity with a joined name)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise InvalidField(f"limit must be an integer in [1, {MAX_PAGE}]", field="limit")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= 2**31 - 1:
        raise InvalidField("offset must be an integer in [0, 2147483647]", field="offset")
    total = session.scalar(select(func.count()).select_from(stmt.order_by(None).subquery())) or 0
    page = stmt.limit(limit).offset(offset)
    items = session.execute(page).all() if rows else session.scalars(page).all()
    return Page(items=items, total=int(total), limit=limit, offset=offset)


def integrity_kind(exc: IntegrityError) -> str:
    """'unique', 'foreign_key', 'check', 'not_null' or 'other', from the driver's error."""
    sqlstate = getattr(exc.orig, "sqlstate", None)  # psycopg 3
    by_state = {"23505": "unique", "23503": "foreign_key", "23514": "check", "23502": "not_null"}
    if sqlstate in by_state:
        return by_state[sqlstate]
    text = str(exc.orig).upper()
    for needle, kind in (
        ("UNIQUE", "unique"),
        ("FOREIGN KEY", "foreign_key"),
        ("CHECK", "check"),
        ("NOT NULL", "not_null"),
    ):
        if needle in text:
            return kind
    return "other"


_BATCH = "kvgate.batch"


@contextmanager
def batch(session: Session) -> Iterator[None]:
    """Run several service mutations as ONE transaction: all commit at the end, or none.

    Inside, ``mutation`` flushes instead of committing (each service call still writes its
    change and its audit event); any error rolls back everything done in the block.
    """
    if session.info.get(_BATCH):
        raise RuntimeError("batches do not nest")
    session.info[_BATCH] = True
    try:
        yield
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.info.pop(_BATCH, None)


@contextmanager
def mutation(session: Session, *, unique_field: str | None = None, entity: str = "entity") -> Iterator[None]:
    """Commit the block's writes (change + audit) at once, or roll all of them back.

    Inside ``batch`` the writes are only flushed; the batch commits or rolls back.
    """
    try:
        yield
        if session.info.get(_BATCH):
            session.flush()
        else:
            session.commit()
    except IntegrityError as exc:
        session.rollback()
        kind = integrity_kind(exc)
        if kind == "unique":
            raise Duplicate(
                f"a {entity} with this {unique_field or 'name'} already exists", field=unique_field
            ) from None
        if kind == "foreign_key":
            raise Conflict(f"the {entity} references a row that no longer exists, or is still referenced") from None
        raise InvalidField(f"the {entity} breaks a registry constraint ({kind})") from None
    except BaseException:
        session.rollback()
        raise


def storable_id(value: object) -> bool:
    """True for an int any row's id can be; anything else names no row, and is not asked for
    (PostgreSQL refuses a parameter outside INT32, SQLite one outside INT64)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_ID


def is_id(ref: int | str) -> bool:
    """True for a numeric reference (an int, or a string of ASCII digits), whatever its size;
    ``id_value`` says which row, if any, it names."""
    # isascii: str.isdigit() is also true for "¹" or "٣", which int() then rejects.
    return (isinstance(ref, int) and not isinstance(ref, bool)) or (
        isinstance(ref, str) and ref.isascii() and ref.isdigit()
    )


def id_value(ref: int | str) -> int | None:
    """The id a numeric reference names (``"01"`` is 1), or None when it can name no row: not
    numeric, or outside [1, MAX_ID].

    A digit string with more significant digits than MAX_ID is out of range before any
    ``int()``: Python refuses to convert more than 4300 digits (ValueError), and a path or a
    body may carry any number of them.
    """
    if not is_id(ref):
        return None
    if isinstance(ref, str):
        digits = ref.lstrip("0")
        if len(digits) > _ID_DIGITS:
            return None
        ref = int(digits or "0")
    return ref if 1 <= ref <= MAX_ID else None


def get_by_ref(
    session: Session, model: type[T], ref: int | str, *, name_attr: str, what: str, field: str | None = None,
    within: Collection[int] | None = None,
) -> T:
    """Load ``model`` by numeric id or by its unique name.

    Not found raises ``NotFound`` for a path reference (``field is None``), or
    ``InvalidField(field)`` when the reference came from a request body (422). A row whose
    id is not in ``within`` (when given: a caller's scope) is not found, by the same path
    and error, so an answer never tells a foreign row from a missing one.
    """
    row: T | None
    if is_id(ref):  # a number names a row by id only (no name is all digits)
        number = id_value(ref)
        row = session.get(model, number) if number is not None else None
    elif isinstance(ref, str) and NAME_RE.match(ref):
        row = session.scalars(select(model).where(getattr(model, name_attr) == ref)).one_or_none()
    else:
        row = None
    if row is not None and within is not None and row.id not in within:  # type: ignore[attr-defined]
        row = None
    if row is None:
        message = f"{what} {str(ref)[:80]!r} does not exist"
        if field is not None:
            raise InvalidField(message, field=field, code=f"unknown_{what.replace(' ', '_')}")
        raise NotFound(message, code=f"{what.replace(' ', '_')}_not_found")
    return row


def snapshot(row: Any, *, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """JSON-able dict of a row's columns (for audit before/after), minus ``exclude``."""
    out: dict[str, Any] = {}
    for column in row.__table__.columns:
        if column.key in exclude:
            continue
        value = getattr(row, column.key)
        out[column.key] = value.isoformat() if isinstance(value, datetime) else value
    return out


def versioned_update(
    session: Session, row: Any, *, expected_version: int, values: dict[str, Any], now: datetime
) -> None:
    """``UPDATE ... SET values, version = version + 1 WHERE id = ? AND version = ?``.

    Exactly one of several concurrent callers holding the same ``expected_version``
    wins; the others match no row and get ``StaleVersion``. ``row`` is refreshed.
    """
    model = type(row)
    result = session.execute(
        update(model)
        .where(model.id == row.id, model.version == expected_version)
        .values(**values, version=model.version + 1, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise StaleVersion(f"version {expected_version} is not the current version; reload and retry", field="version")
    session.refresh(row)


def check_version(row: Any, expected_version: Any) -> int:
    """Fail fast on an obviously stale version (the UPDATE re-checks it atomically)."""
    if isinstance(expected_version, bool) or not isinstance(expected_version, int):
        raise InvalidField("version must be an integer", field="version")
    if row.version != expected_version:
        raise StaleVersion(
            f"version {expected_version} is not the current version ({row.version}); reload and retry",
            field="version",
        )
    return expected_version
