"""a per-run event log for the live stream: run.event_seq and run_event, written by triggers

Every durable change a client of ``GET /api/runs/{id}/events`` sees (a status change, a step
row appearing or finishing, an approval requested or decided) gets the run's next event
number in the same transaction that makes the change. The counter lives on the run row, so
numbers are handed out in commit order (the row lock is held to commit): a reader that saw
event n never later finds an event below n, and ``Last-Event-ID`` resumes exactly.

Triggers rather than store code: every writer (worker, API, reaper, forks, retention) gets
events without each write path having to remember them.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

FUNCTIONS = """
CREATE FUNCTION dar_run_event_next(rid uuid) RETURNS bigint LANGUAGE sql AS $$
    UPDATE run SET event_seq = event_seq + 1 WHERE id = rid RETURNING event_seq
$$;

CREATE FUNCTION dar_run_event_on_run() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO run_event (run_id, n, kind, status) VALUES (NEW.id, 1, 'run.status', NEW.status);
        RETURN NULL;
    END IF;
    IF NEW.status IS DISTINCT FROM OLD.status THEN
        NEW.event_seq := NEW.event_seq + 1;
        INSERT INTO run_event (run_id, n, kind, status)
        VALUES (NEW.id, NEW.event_seq, 'run.status', NEW.status);
    END IF;
    RETURN NEW;
END $$;

CREATE FUNCTION dar_run_event_on_step() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO run_event (run_id, n, kind, step_seq, status)
        VALUES (NEW.run_id, dar_run_event_next(NEW.run_id), 'step.started', NEW.seq, 'STARTED');
        IF NEW.status <> 'STARTED' THEN
            INSERT INTO run_event (run_id, n, kind, step_seq, status)
            VALUES (NEW.run_id, dar_run_event_next(NEW.run_id), 'step.finished', NEW.seq,
                    NEW.status);
        END IF;
    ELSIF NEW.status IS DISTINCT FROM OLD.status AND NEW.status <> 'STARTED' THEN
        INSERT INTO run_event (run_id, n, kind, step_seq, status)
        VALUES (NEW.run_id, dar_run_event_next(NEW.run_id), 'step.finished', NEW.seq, NEW.status);
    END IF;
    RETURN NULL;
END $$;

CREATE FUNCTION dar_run_event_on_approval() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO run_event (run_id, n, kind, approval_id, status)
        VALUES (NEW.run_id, dar_run_event_next(NEW.run_id), 'approval.requested', NEW.id,
                NEW.status);
    ELSIF NEW.status IS DISTINCT FROM OLD.status THEN
        INSERT INTO run_event (run_id, n, kind, approval_id, status)
        VALUES (NEW.run_id, dar_run_event_next(NEW.run_id), 'approval.decided', NEW.id,
                NEW.status);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER run_event_run_insert BEFORE INSERT ON run
    FOR EACH ROW EXECUTE FUNCTION dar_run_event_first();
CREATE TRIGGER run_event_run_inserted AFTER INSERT ON run
    FOR EACH ROW EXECUTE FUNCTION dar_run_event_on_run();
CREATE TRIGGER run_event_run_status BEFORE UPDATE OF status ON run
    FOR EACH ROW EXECUTE FUNCTION dar_run_event_on_run();
CREATE TRIGGER run_event_step AFTER INSERT OR UPDATE OF status ON run_step
    FOR EACH ROW EXECUTE FUNCTION dar_run_event_on_step();
CREATE TRIGGER run_event_approval AFTER INSERT OR UPDATE OF status ON approval
    FOR EACH ROW EXECUTE FUNCTION dar_run_event_on_approval();
"""

FIRST = """
CREATE FUNCTION dar_run_event_first() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.event_seq := 1;
    RETURN NEW;
END $$;
"""


def upgrade() -> None:
    op.execute("ALTER TABLE run ADD COLUMN event_seq bigint NOT NULL DEFAULT 0")
    op.execute(
        """
        CREATE TABLE run_event (
            run_id uuid NOT NULL REFERENCES run (id) ON DELETE CASCADE,
            n bigint NOT NULL,
            kind text NOT NULL,
            step_seq integer,
            approval_id uuid,
            status text,
            at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT run_event_pkey PRIMARY KEY (run_id, n),
            CONSTRAINT run_event_kind_ck CHECK (kind IN ('run.status', 'step.started',
                'step.finished', 'approval.requested', 'approval.decided'))
        )
        """
    )
    # Runs that exist already start their log at their current status.
    op.execute("UPDATE run SET event_seq = 1")
    op.execute(
        "INSERT INTO run_event (run_id, n, kind, status) SELECT id, 1, 'run.status', status FROM run"
    )
    op.execute(FIRST)
    op.execute(FUNCTIONS)


def downgrade() -> None:
    for trigger, table in (
        ("run_event_run_insert", "run"),
        ("run_event_run_inserted", "run"),
        ("run_event_run_status", "run"),
        ("run_event_step", "run_step"),
        ("run_event_approval", "approval"),
    ):
        op.execute(f"DROP TRIGGER {trigger} ON {table}")
    for fn in ("on_approval", "on_step", "on_run", "first", "next"):
        op.execute(f"DROP FUNCTION dar_run_event_{fn}")
    op.execute("DROP TABLE run_event")
    op.execute("ALTER TABLE run DROP COLUMN event_seq")
