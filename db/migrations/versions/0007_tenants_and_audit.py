"""tenants on runs (and in the idempotency scope); an append-only audit trail

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TZ = pg.TIMESTAMP(timezone=True)

ACTIONS = "'cancel', 'resume', 'resolve', 'approve', 'reject'"


def upgrade() -> None:
    # Existing runs belong to the default tenant '' (the one an open API submits to).
    op.add_column("run", sa.Column("tenant", sa.Text, nullable=False, server_default=sa.text("''")))
    op.add_column("run", sa.Column("timeout_seconds", sa.Integer))
    op.drop_index("run_idempotency_uk", "run")
    op.create_index(
        "run_idempotency_uk", "run", ["tenant", "idempotency_key"], unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.create_index(
        "run_tenant_created_idx", "run",
        ["tenant", sa.text("created_at DESC"), sa.text("id DESC")],
    )
    op.create_table(
        "audit_event",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("at", TZ, nullable=False, server_default=sa.text("now()")),
        sa.Column("run_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("approval_id", pg.UUID(as_uuid=True)),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("detail", pg.JSONB),
        sa.CheckConstraint(f"action IN ({ACTIONS})", name="audit_event_action_ck"),
    )
    op.create_index("audit_event_run_idx", "audit_event", ["run_id", "at"])
    # Append-only: the application role cannot rewrite history by mistake (TRUNCATE, used by
    # the test suite, is a table-level statement and fires no row trigger).
    op.execute(
        """
        CREATE FUNCTION dar_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'audit_event is append-only (% refused)', TG_OP
                USING ERRCODE = 'insufficient_privilege';
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER audit_event_append_only BEFORE UPDATE OR DELETE ON audit_event "
        "FOR EACH ROW EXECUTE FUNCTION dar_audit_append_only()"
    )


def downgrade() -> None:
    op.drop_table("audit_event")
    op.execute("DROP FUNCTION dar_audit_append_only()")
    op.drop_index("run_tenant_created_idx", "run")
    op.drop_index("run_idempotency_uk", "run")
    op.create_index(
        "run_idempotency_uk", "run", ["idempotency_key"], unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.drop_column("run", "timeout_seconds")
    op.drop_column("run", "tenant")
