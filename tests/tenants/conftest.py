from tests.tenants.fixtures import _postgres_db, _sqlite_db, db, session  # noqa: F401
