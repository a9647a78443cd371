"""one executor: persisted model attempts, paused steps, recorded compensations

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Model attempts made for the step in flight, kept across durable timers so a model that
    # answers 429 forever ends the run after DAR_RETRY_MAX_ATTEMPTS, not at its deadline.
    op.add_column(
        "run", sa.Column("model_attempts", sa.Integer, nullable=False, server_default=sa.text("0"))
    )
    # PAUSED: a step whose body was interrupted cleanly (a durable timer inside it); it is
    # entered again with the same attempt, without being in doubt.
    op.drop_constraint("run_step_status_ck", "run_step")
    op.create_check_constraint(
        "run_step_status_ck",
        "run_step",
        "status IN ('STARTED', 'DONE', 'ERROR', 'RETRYING', 'PENDING', 'APPROVED', 'REJECTED', "
        "'PAUSED')",
    )
    # Where a completed step's compensation can be found again in any process.
    op.add_column("run_step", sa.Column("compensation", sa.Text))


def downgrade() -> None:
    op.drop_column("run_step", "compensation")
    op.drop_constraint("run_step_status_ck", "run_step")
    op.create_check_constraint(
        "run_step_status_ck",
        "run_step",
        "status IN ('STARTED', 'DONE', 'ERROR', 'RETRYING', 'PENDING', 'APPROVED', 'REJECTED')",
    )
    op.drop_column("run", "model_attempts")
