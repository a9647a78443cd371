"""budget_hold: a run tree's budget is shared, model calls in flight held against it

A child run's model call may start when the tree's spend, the worst cases of the tree's
other calls in flight and its own worst case fit the root's budget, or when no other call
of the tree is in flight: only a call started alone can cross the budget, so the tree
passes it by at most one step (``runtime.pipeline.modelcall.share_tree_budget``). A row is
a call in flight: written at its admission under an advisory lock on the root, deleted
once its tokens are counted on its run. Runs with no parent never write here.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-03
"""

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE budget_hold (
            run_id uuid NOT NULL REFERENCES run (id) ON DELETE CASCADE,
            lease_epoch bigint NOT NULL,
            root_run_id uuid NOT NULL,
            step_key text NOT NULL,
            tokens bigint NOT NULL,
            cost_usd numeric(18, 8) NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT budget_hold_pkey PRIMARY KEY (run_id, lease_epoch)
        )
        """
    )
    op.execute("CREATE INDEX budget_hold_root_idx ON budget_hold (root_run_id)")


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS budget_hold")
