"""run_tenant_status_created_idx: one tenant's runs of one status, newest first

The console's runs list for a tenant filtered by status (a tenant's FAILED runs) had two
indexes to choose from, each leading to the rows of one condition only: the tenant's runs
newest first, keeping one in twenty (FAILED is ~5% of runs), or every tenant's FAILED runs,
keeping one in fifty. Either visits ~1,000 heap rows for a page of 50 on a year of history
(p99 53 ms, docs/benchmarks.md); this index leads straight to the page.

A plain CREATE INDEX (migrations run in one transaction): it blocks writes to ``run`` while
it builds (measured in docs/benchmarks.md). Build it beforehand with CREATE INDEX
CONCURRENTLY under the same name and the migration skips it.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-03
"""

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX IF NOT EXISTS run_tenant_status_created_idx "
        "ON run (tenant, status, created_at DESC, id DESC)"
    )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS run_tenant_status_created_idx")
