"""run.status_changes: how many times the run's status has changed, kept by the status trigger

A worker keeps a copy of the step log of the runs it worked on (db/steplog.py). When a run
comes back to it after steps on other workers, the copy catches up by reading only the rows
written under its last lease epoch or later, instead of every row. That is exact only if
nothing but workers wrote the run's steps meanwhile, and every other writer of step rows (an
approval decision, an operator's resolution, a resume) changes the run's status in the same
transaction: a copy is caught up only while this counter has not moved since it was made.

The counter is bumped by the BEFORE UPDATE OF status trigger of migration 0010, which
already rewrites the new row: no extra write.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

ON_RUN = """
CREATE OR REPLACE FUNCTION dar_run_event_on_run() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO run_event (run_id, n, kind, status) VALUES (NEW.id, 1, 'run.status', NEW.status);
        RETURN NULL;
    END IF;
    IF NEW.status IS DISTINCT FROM OLD.status THEN
        NEW.event_seq := NEW.event_seq + 1;
        {bump}
        INSERT INTO run_event (run_id, n, kind, status)
        VALUES (NEW.id, NEW.event_seq, 'run.status', NEW.status);
    END IF;
    RETURN NEW;
END $$;
"""


def upgrade() -> None:
    op.execute("ALTER TABLE run ADD COLUMN status_changes bigint NOT NULL DEFAULT 0")
    op.execute(ON_RUN.replace("{bump}", "NEW.status_changes := NEW.status_changes + 1;"))


def downgrade() -> None:
    op.execute(ON_RUN.replace("{bump}", ""))
    op.execute("ALTER TABLE run DROP COLUMN status_changes")
