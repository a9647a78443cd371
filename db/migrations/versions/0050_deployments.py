"""deployments: each run records the version of the code it started on (run.deployment);
workers say which version they serve (deployment_worker, a heartbeat); each version's agent
definitions are recorded once (deployment_agent: what an upgrade compares); upgrades are audited

A run is driven only by workers of its version until an operator upgrades it after a clean
replay check (runtime.engine.deployment, runtime.engine.replaycheck). Runs stored before
this migration have no version (NULL) and are driven by any worker, as before.

Revision ID: 0050
Revises: 0040
Create Date: 2026-12-07
"""

import re

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0050"
down_revision = "0040"
branch_labels = None
depends_on = None

UPGRADE = "upgrade"
LIVE = "status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION')"


def upgrade() -> None:
    op.add_column("run", sa.Column("deployment", sa.Text))
    op.create_index(
        "run_deployment_live_idx", "run", ["deployment"], postgresql_where=sa.text(LIVE)
    )
    op.create_table(
        "deployment_worker",
        sa.Column("worker", sa.Text, nullable=False),
        sa.Column("deployment", sa.Text, nullable=False),
        sa.Column(
            "started_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.Column(
            "last_seen", sa.TIMESTAMP(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.PrimaryKeyConstraint("worker", "deployment", name="deployment_worker_pkey"),
    )
    op.create_table(
        "deployment_agent",
        sa.Column("deployment", sa.Text, nullable=False),
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("definition", postgresql.JSONB, nullable=False),
        sa.Column(
            "recorded_at",
            sa.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.PrimaryKeyConstraint("deployment", "agent", name="deployment_agent_pkey"),
    )
    actions = _audit_actions()
    _set_audit_actions([*actions, UPGRADE] if UPGRADE not in actions else actions, valid=True)


def downgrade() -> None:
    # The trail is append-only: upgrade rows stay, and only new rows are checked.
    _set_audit_actions([a for a in _audit_actions() if a != UPGRADE], valid=False)
    op.drop_table("deployment_agent")
    op.drop_table("deployment_worker")
    op.drop_index("run_deployment_live_idx", table_name="run")
    op.drop_column("run", "deployment")


def _audit_actions() -> list[str]:
    """The actions the audit trail's check allows now, read from the database: this
    migration adds one to whatever the migrations before it allowed."""
    definition = (
        op.get_bind()
        .execute(
            sa.text(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
                "WHERE conname = 'audit_event_action_ck'"
            )
        )
        .scalar_one()
    )
    return re.findall(r"'([^']+)'", definition)


def _set_audit_actions(actions: list[str], *, valid: bool) -> None:
    listed = ", ".join(f"'{a}'" for a in actions)
    op.drop_constraint("audit_event_action_ck", "audit_event", type_="check")
    op.execute(
        "ALTER TABLE audit_event ADD CONSTRAINT audit_event_action_ck "
        f"CHECK (action IN ({listed})){'' if valid else ' NOT VALID'}"
    )
