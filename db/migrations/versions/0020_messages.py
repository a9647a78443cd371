"""Messages into an agent-loop run: run.messages_pending, and the MESSAGE step kind

A message is kept as a run_signal row (name '$message', which no signal name can be) and
counted in run.messages_pending, which every claim reads with the run: the worker delivers
it at the next step boundary as a MESSAGE step, consuming the row and the count in the
transaction that records the step. A run that would end SUCCEEDED with a message pending
goes on instead (finish_run), and a SUCCEEDED run that gets one is queued again.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

BEFORE = (
    "'MODEL', 'TOOL', 'STEP', 'LLM', 'SIDE_EFFECT', 'APPROVAL', 'COMPENSATION', 'VERSION', "
    "'TOOLSET', 'WAIT', 'SEND', 'CHILD'"
)


def upgrade() -> None:
    op.drop_constraint("run_step_kind_ck", "run_step")
    op.create_check_constraint("run_step_kind_ck", "run_step", f"kind IN ({BEFORE}, 'MESSAGE')")
    op.execute("ALTER TABLE run ADD COLUMN messages_pending integer NOT NULL DEFAULT 0")


def downgrade() -> None:
    op.execute("ALTER TABLE run DROP COLUMN messages_pending")
    op.drop_constraint("run_step_kind_ck", "run_step")
    op.create_check_constraint("run_step_kind_ck", "run_step", f"kind IN ({BEFORE})")
