"""run_parent_created_idx: a run's children in the order they were started

``GET /api/runs/{id}/tree`` walks a tree of child runs taking at most a few hundred children
of each run, oldest first; on ``run (parent_run_id)`` alone PostgreSQL reads and sorts every
child of a run to take the first ones (a parent with 100,000 children: 100,000 rows per
request). With ``created_at, id`` in the index the children come in order and the walk reads
only what it shows. It replaces run_parent_idx, which served the same lookups (a parent's
children for ``GET /api/runs/{id}`` and the cancel cascade).

A plain CREATE INDEX (migrations run in one transaction): it blocks writes to ``run`` while
it builds, a partial index over child runs only. Build it beforehand with CREATE INDEX
CONCURRENTLY under the same name and the migration skips it (an invalid one, left by a
failed concurrent build, is dropped and built again).

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-03
"""

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A CREATE INDEX CONCURRENTLY that failed leaves an invalid index of that name, which
    # IF NOT EXISTS would take for the index: drop it and build it here instead.
    op.execute(
        "DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_index "
        "WHERE indexrelid = to_regclass('run_parent_created_idx') AND NOT indisvalid) "
        "THEN DROP INDEX run_parent_created_idx; END IF; END $$"
    )
    op.execute(
        "CREATE INDEX IF NOT EXISTS run_parent_created_idx "
        "ON run (parent_run_id, created_at, id) WHERE parent_run_id IS NOT NULL"
    )
    op.execute("DROP INDEX IF EXISTS run_parent_idx")


def downgrade() -> None:
    op.execute(
        "CREATE INDEX IF NOT EXISTS run_parent_idx "
        "ON run (parent_run_id) WHERE parent_run_id IS NOT NULL"
    )
    op.execute("DROP INDEX IF EXISTS run_parent_created_idx")
