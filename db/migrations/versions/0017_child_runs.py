"""Child runs: run.parent_run_id, and the CHILD step kind

A durable function's ``steps.child(agent, input)`` inserts the child run in the transaction
that records its ``PENDING`` step, so a parent crash never starts the same child twice; the
parent waits parked (no lease), and is woken when the child ends.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

BEFORE = (
    "'MODEL', 'TOOL', 'STEP', 'LLM', 'SIDE_EFFECT', 'APPROVAL', 'COMPENSATION', 'VERSION', "
    "'TOOLSET', 'WAIT', 'SEND'"
)


def upgrade() -> None:
    op.drop_constraint("run_step_kind_ck", "run_step")
    op.create_check_constraint("run_step_kind_ck", "run_step", f"kind IN ({BEFORE}, 'CHILD')")
    op.execute("ALTER TABLE run ADD COLUMN parent_run_id uuid")
    op.execute(
        "CREATE INDEX run_parent_idx ON run (parent_run_id) WHERE parent_run_id IS NOT NULL"
    )


def downgrade() -> None:
    op.execute("DROP INDEX run_parent_idx")
    op.execute("ALTER TABLE run DROP COLUMN parent_run_id")
    op.drop_constraint("run_step_kind_ck", "run_step")
    op.create_check_constraint("run_step_kind_ck", "run_step", f"kind IN ({BEFORE})")
