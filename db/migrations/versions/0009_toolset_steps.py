"""a run's recorded MCP tool set: step kind TOOLSET

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

BEFORE = "'MODEL', 'TOOL', 'STEP', 'LLM', 'SIDE_EFFECT', 'APPROVAL', 'COMPENSATION', 'VERSION'"


def upgrade() -> None:
    op.drop_constraint("run_step_kind_ck", "run_step")
    op.create_check_constraint("run_step_kind_ck", "run_step", f"kind IN ({BEFORE}, 'TOOLSET')")


def downgrade() -> None:
    op.execute("DELETE FROM run_step WHERE kind = 'TOOLSET'")
    op.drop_constraint("run_step_kind_ck", "run_step")
    op.create_check_constraint("run_step_kind_ck", "run_step", f"kind IN ({BEFORE})")
