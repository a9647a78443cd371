"""Alembic environment. Run through ``db.migrate``, which passes a connection that already
holds the migration advisory lock inside its transaction."""

from __future__ import annotations

from alembic import context

from db.migrate import VERSION_TABLE
from db.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - alembic CLI use is not supported
    raise RuntimeError("run migrations with `dar migrate` (db.migrate.upgrade)")

context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
