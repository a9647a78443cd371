"""Signals and durable waits: run_signal, and the WAIT and SEND step kinds

A signal is a row of run_signal for one run, kept until a step of that run consumes it (in
the transaction that records the step): delivered once, and a signal sent before the run
waits for it is kept for the wait. ``steps.send`` inserts its signal in the transaction that
records its own step, under the step's idempotency key: exactly once across crashes.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

BEFORE = (
    "'MODEL', 'TOOL', 'STEP', 'LLM', 'SIDE_EFFECT', 'APPROVAL', 'COMPENSATION', 'VERSION', "
    "'TOOLSET'"
)


def upgrade() -> None:
    op.drop_constraint("run_step_kind_ck", "run_step")
    op.create_check_constraint("run_step_kind_ck", "run_step", f"kind IN ({BEFORE}, 'WAIT', 'SEND')")
    op.execute(
        """
        CREATE TABLE run_signal (
            id bigserial PRIMARY KEY,
            run_id uuid NOT NULL REFERENCES run (id) ON DELETE CASCADE,
            name text NOT NULL,
            payload jsonb,
            idempotency_key text,
            sent_by text,
            created_at timestamptz NOT NULL DEFAULT now(),
            consumed_by text,
            consumed_at timestamptz
        )
        """
    )
    op.execute(
        "CREATE UNIQUE INDEX run_signal_idempotency_uk ON run_signal (run_id, idempotency_key) "
        "WHERE idempotency_key IS NOT NULL"
    )
    op.execute(
        "CREATE INDEX run_signal_pending_idx ON run_signal (run_id, name, id) "
        "WHERE consumed_by IS NULL"
    )


def downgrade() -> None:
    op.execute("DROP TABLE run_signal")
    op.drop_constraint("run_step_kind_ck", "run_step")
    op.create_check_constraint("run_step_kind_ck", "run_step", f"kind IN ({BEFORE})")
