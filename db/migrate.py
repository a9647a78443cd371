"""Schema migrations with Alembic, in a version table of our own.

``upgrade`` runs in one transaction holding a transaction-level advisory lock, so two
processes migrating at once (two releases, a worker and the API starting together) are
serialised: the second waits, then finds the schema current and does nothing.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

from db.errors import MigrationsPending

VERSION_TABLE = "dar_alembic_version"
# An arbitrary 64-bit key that names "dar schema migration" among advisory locks.
_LOCK_KEY = 0x64_61_72_5F_6D_69_67


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
    return cfg


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    cfg = _config()
    with engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_KEY})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def check_current(engine: Engine) -> None:
    """Raise :class:`MigrationsPending` unless the database is at the head revision (for
    processes that must not run DDL themselves)."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise MigrationsPending(
            f"database schema is at {current or 'nothing'}, code expects {head}: "
            "run `dar migrate` (the Procfile's release process)"
        )
