"""indexes for a database of a year of runs (bench/bigdb.py, docs/benchmarks.md)

- ``run_step_finished_idx``: the console's stats (cost by model, step latency, per hour)
  read the steps that finished in the last 24 h or 7 d. Without it, each was a scan of every
  step ever recorded (20 million rows: seconds); with it, a range of the index, which carries
  the columns those queries read (an index-only scan, no heap access).
- ``run_agent_created_idx``: the run list filtered by agent, newest first, pages on it
  instead of walking every run until 50 of a rare agent turn up.

Built with a plain CREATE INDEX (migrations run in one transaction): on a year of history
it blocks writes to ``run_step`` while it builds; measured in docs/benchmarks.md. Build them
beforehand with CREATE INDEX CONCURRENTLY under the same names to avoid that: the migration
then finds them and skips.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX IF NOT EXISTS run_step_finished_idx ON run_step (finished_at) "
        "INCLUDE (kind, model, cost_usd, latency_ms, started_at, run_id) "
        "WHERE finished_at IS NOT NULL"
    )
    op.execute(
        "CREATE INDEX IF NOT EXISTS run_agent_created_idx "
        "ON run (agent, created_at DESC, id DESC)"
    )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS run_agent_created_idx")
    op.execute("DROP INDEX IF EXISTS run_step_finished_idx")
