"""Migrations produce exactly the schema the code declares, and are safe to run at once."""

from __future__ import annotations

import threading

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from db.demo import DEMO_TABLES
from db.engine import make_engine
from db.migrate import VERSION_TABLE, check_current, current_revision, head_revision, upgrade
from db.schema import metadata
from tests.support import scratch_database


def test_migrated_schema_matches_the_tables(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "compare_type": True,
                    "version_table": VERSION_TABLE,
                    # the demo's own tables, which the test database also holds (conftest)
                    "include_name": lambda name, kind, _: (
                        kind != "table" or name not in DEMO_TABLES
                    ),
                },
            )
            assert compare_metadata(ctx, metadata) == []
        assert current_revision(engine) == head_revision()
        check_current(engine)
    finally:
        engine.dispose()


def test_two_processes_migrating_at_once_is_safe(pg_admin_url: str) -> None:
    with scratch_database(pg_admin_url, "dar_concurrent_migrate") as url:
        engines = [make_engine(url) for _ in range(4)]
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(engines))

        def migrate(i: int) -> None:
            barrier.wait()
            try:
                upgrade(engines[i])
            except BaseException as e:
                errors.append(e)

        try:
            threads = [threading.Thread(target=migrate, args=(i,)) for i in range(len(engines))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert errors == []
            assert current_revision(engines[0]) == head_revision()
            with engines[0].connect() as conn:
                versions = conn.execute(text(f"SELECT count(*) FROM {VERSION_TABLE}")).scalar_one()
            assert versions == 1
        finally:
            for e in engines:
                e.dispose()


def test_an_invalid_prebuilt_children_index_is_built_again(pg_admin_url: str) -> None:
    """Migration 0025's index may be built beforehand with CREATE INDEX CONCURRENTLY; one
    that failed half way is left invalid under the name, and the migration must not take it
    for the index (it drops the old one after)."""
    with scratch_database(pg_admin_url, "dar_invalid_index_migrate") as url:
        engine = make_engine(url)
        try:
            upgrade(engine, "0024")
            with engine.begin() as conn:
                conn.execute(text("CREATE INDEX run_parent_created_idx ON run (parent_run_id)"))
                # what a failed concurrent build leaves (the test user is a superuser)
                conn.execute(
                    text(
                        "UPDATE pg_index SET indisvalid = false "
                        "WHERE indexrelid = 'run_parent_created_idx'::regclass"
                    )
                )
            upgrade(engine)
            with engine.connect() as conn:
                valid, definition = conn.execute(
                    text(
                        "SELECT i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i "
                        "WHERE i.indexrelid = 'run_parent_created_idx'::regclass"
                    )
                ).one()
            assert valid
            assert "created_at" in definition
        finally:
            engine.dispose()
