"""runs and steps

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TZ = pg.TIMESTAMP(timezone=True)


def upgrade() -> None:
    op.create_table(
        "run",
        sa.Column("id", pg.UUID(as_uuid=True), primary_key=True),
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'QUEUED'")),
        sa.Column("input", pg.JSONB, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("max_steps", sa.Integer, nullable=False),
        sa.Column("token_budget", sa.BigInteger, nullable=False),
        sa.Column("tokens_used", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("input_tokens", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("output_tokens", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("cache_creation_input_tokens", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("cache_read_input_tokens", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("cost_usd", sa.Numeric(18, 8), nullable=False, server_default=sa.text("0")),
        sa.Column("deadline_at", TZ, nullable=False),
        sa.Column("run_at", TZ, nullable=False, server_default=sa.text("now()")),
        sa.Column("locked_by", sa.Text),
        sa.Column("locked_until", TZ),
        sa.Column("lease_epoch", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("dispatch_token", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("dispatched_at", TZ, nullable=False, server_default=sa.text("now()")),
        sa.Column("claims_without_progress", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("result", pg.JSONB),
        sa.Column("error", sa.Text),
        sa.Column("idempotency_key", sa.Text),
        sa.Column("request_hash", sa.Text),
        sa.Column("submitted_by", sa.Text),
        sa.Column("created_at", TZ, nullable=False, server_default=sa.text("now()")),
        sa.Column("updated_at", TZ, nullable=False, server_default=sa.text("now()")),
        sa.Column("finished_at", TZ),
        sa.CheckConstraint(
            "status IN ('QUEUED', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT', "
            "'NEEDS_ATTENTION')",
            name="run_status_ck",
        ),
    )
    op.create_index(
        "run_claim_idx", "run", ["run_at"],
        postgresql_where=sa.text("status IN ('QUEUED', 'RUNNING')"),
    )
    op.create_index(
        "run_idempotency_uk", "run", ["idempotency_key"], unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.create_index(
        "run_status_created_idx", "run",
        ["status", sa.text("created_at DESC"), sa.text("id DESC")],
    )
    op.create_index("run_created_idx", "run", [sa.text("created_at DESC"), sa.text("id DESC")])

    op.create_table(
        "run_step",
        sa.Column("run_id", pg.UUID(as_uuid=True), sa.ForeignKey("run.id", ondelete="CASCADE"), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("step_key", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("tool_name", sa.Text),
        sa.Column("tool_use_id", sa.Text),
        sa.Column("model", sa.Text),
        sa.Column("request", pg.JSONB),
        sa.Column("prompt_hash", sa.Text),
        sa.Column("response", pg.JSONB),
        sa.Column("stop_reason", sa.Text),
        sa.Column("input_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("output_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("cache_creation_input_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("cache_read_input_tokens", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("cost_usd", sa.Numeric(18, 8), nullable=False, server_default=sa.text("0")),
        sa.Column("latency_ms", sa.Integer),
        sa.Column("request_id", sa.Text),
        sa.Column("error", sa.Text),
        sa.Column("worker", sa.Text),
        sa.Column("lease_epoch", sa.BigInteger, nullable=False),
        sa.Column("started_at", TZ, nullable=False, server_default=sa.text("now()")),
        sa.Column("finished_at", TZ),
        sa.PrimaryKeyConstraint("run_id", "seq", name="run_step_pkey"),
        sa.CheckConstraint("kind IN ('MODEL', 'TOOL')", name="run_step_kind_ck"),
        sa.CheckConstraint("status IN ('STARTED', 'DONE', 'ERROR')", name="run_step_status_ck"),
    )
    op.create_index("run_step_key_uk", "run_step", ["run_id", "step_key"], unique=True)
    op.create_index(
        "step_tool_uk", "run_step", ["run_id", "tool_use_id"], unique=True,
        postgresql_where=sa.text("kind = 'TOOL'"),
    )
    # The acme demo's tickets table was created here in earlier releases; the demo sets its own
    # tables up now (db/demo.py) and 0021 drops the ones this created where unused.


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS acme_ticket")
    op.drop_table("run_step")
    op.drop_table("run")
