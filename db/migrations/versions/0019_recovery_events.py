"""recovery you can see: the reaper's re-dispatch of a run whose lease lapsed and a worker's
resume are audit events (``recovery.redispatched``, ``recovery.resumed``), and each is a
``run.recovery`` event of the run's live stream, written by a trigger on ``audit_event``

Before, a crash and its recovery left an unexplained gap in the timeline and the console:
what happened was only in the worker and beat logs.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

OLD_ACTIONS = "'cancel', 'resume', 'resolve', 'approve', 'reject', 'fork', 'submit', 'timeout'"
NEW_ACTIONS = OLD_ACTIONS + ", 'recovery.redispatched', 'recovery.resumed'"
OLD_KINDS = "'run.status', 'step.started', 'step.finished', 'approval.requested', 'approval.decided'"
NEW_KINDS = OLD_KINDS + ", 'run.recovery'"

ON_AUDIT = """
CREATE FUNCTION dar_run_event_on_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.action LIKE 'recovery.%' AND EXISTS (SELECT 1 FROM run WHERE id = NEW.run_id) THEN
        INSERT INTO run_event (run_id, n, kind, audit_id, status)
        VALUES (NEW.run_id, dar_run_event_next(NEW.run_id), 'run.recovery', NEW.id,
                substr(NEW.action, 10));
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER run_event_audit AFTER INSERT ON audit_event
    FOR EACH ROW EXECUTE FUNCTION dar_run_event_on_audit();
"""


def upgrade() -> None:
    op.add_column("run_event", sa.Column("audit_id", sa.BigInteger))
    op.drop_constraint("run_event_kind_ck", "run_event", type_="check")
    op.create_check_constraint("run_event_kind_ck", "run_event", f"kind IN ({NEW_KINDS})")
    op.drop_constraint("audit_event_action_ck", "audit_event", type_="check")
    op.create_check_constraint("audit_event_action_ck", "audit_event", f"action IN ({NEW_ACTIONS})")
    op.execute(ON_AUDIT)


def downgrade() -> None:
    op.execute("DROP TRIGGER run_event_audit ON audit_event")
    op.execute("DROP FUNCTION dar_run_event_on_audit()")
    op.execute("DELETE FROM run_event WHERE kind = 'run.recovery'")
    op.drop_constraint("run_event_kind_ck", "run_event", type_="check")
    op.create_check_constraint("run_event_kind_ck", "run_event", f"kind IN ({OLD_KINDS})")
    # The trail is append-only: recovery rows stay, and only new rows are checked.
    op.drop_constraint("audit_event_action_ck", "audit_event", type_="check")
    op.execute(
        "ALTER TABLE audit_event ADD CONSTRAINT audit_event_action_ck "
        f"CHECK (action IN ({OLD_ACTIONS})) NOT VALID"
    )
    op.drop_column("run_event", "audit_id")
