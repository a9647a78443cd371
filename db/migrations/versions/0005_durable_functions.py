"""durable functions: more step kinds and statuses, attempts, approvals, WAITING runs

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

TZ = pg.TIMESTAMP(timezone=True)


def upgrade() -> None:
    op.drop_constraint("run_status_ck", "run")
    op.create_check_constraint(
        "run_status_ck",
        "run",
        "status IN ('QUEUED', 'RUNNING', 'WAITING', 'SUCCEEDED', 'FAILED', 'CANCELLED', "
        "'TIMED_OUT', 'NEEDS_ATTENTION')",
    )
    op.drop_constraint("run_step_kind_ck", "run_step")
    op.create_check_constraint(
        "run_step_kind_ck",
        "run_step",
        "kind IN ('MODEL', 'TOOL', 'STEP', 'LLM', 'SIDE_EFFECT', 'APPROVAL', 'COMPENSATION', "
        "'VERSION')",
    )
    op.drop_constraint("run_step_status_ck", "run_step")
    op.create_check_constraint(
        "run_step_status_ck",
        "run_step",
        "status IN ('STARTED', 'DONE', 'ERROR', 'RETRYING', 'PENDING', 'APPROVED', 'REJECTED')",
    )
    op.add_column(
        "run_step", sa.Column("attempt", sa.Integer, nullable=False, server_default=sa.text("0"))
    )
    op.add_column("run_step", sa.Column("input_hash", sa.Text))
    op.create_table(
        "approval",
        sa.Column("id", pg.UUID(as_uuid=True), primary_key=True),
        sa.Column(
            "run_id", pg.UUID(as_uuid=True), sa.ForeignKey("run.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("step_key", sa.Text, nullable=False),
        sa.Column("role", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'PENDING'")),
        sa.Column("payload", pg.JSONB, nullable=False),
        sa.Column("payload_hash", sa.Text, nullable=False),
        sa.Column("timeout_policy", sa.Text, nullable=False),
        sa.Column("requested_at", TZ, nullable=False, server_default=sa.text("now()")),
        sa.Column("expires_at", TZ, nullable=False),
        sa.Column("decided_by", sa.Text),
        sa.Column("decided_at", TZ),
        sa.Column("comment", sa.Text),
        sa.CheckConstraint(
            "status IN ('PENDING', 'APPROVED', 'REJECTED', 'EXPIRED', 'CANCELLED')",
            name="approval_status_ck",
        ),
        sa.CheckConstraint(
            "timeout_policy IN ('FAIL', 'REJECT', 'APPROVE')", name="approval_policy_ck"
        ),
        sa.UniqueConstraint("run_id", "step_key", name="approval_run_step_uk"),
    )
    op.create_index(
        "approval_pending_idx", "approval", ["role", "requested_at"],
        postgresql_where=sa.text("status = 'PENDING'"),
    )
    op.create_index(
        "approval_expiry_idx", "approval", ["expires_at"],
        postgresql_where=sa.text("status = 'PENDING'"),
    )


def downgrade() -> None:
    op.drop_table("approval")
    op.drop_column("run_step", "input_hash")
    op.drop_column("run_step", "attempt")
