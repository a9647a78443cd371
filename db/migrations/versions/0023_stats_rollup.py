"""stats_rollup: the console's overview per closed hour, so a 7-day window reads 168 rows

``GET /api/stats`` aggregated every step of the window: ~380,000 rows for 7 days of a
year-old database (1.3 s p50, docs/benchmarks.md). The beat now keeps, per closed UTC hour,
what those queries return for that hour (runs ended by status, recorded cost by model, step
latency p50/p95/count by kind), for every tenant together and per tenant (percentiles do
not add up, so each view keeps its own). The stats read the hours held here and aggregate
the rest of the window (the current hour, the last one or two before the beat's grace, the
window's first partial hour) from the step and run rows as before: the same answer as the
raw query, row for row.

Exact also when history changes after its hour was rolled up (a resumed run loses its
finished_at, a fork copies old steps, a step of an old attempt is recorded again,
retention shorter than the window deletes): the triggers below mark the hours such a write
touches (``stats_hour_dirty``), and those hours are read raw until the beat rolls them up
again. The triggers' WHEN clauses compare the row's time with the start of the current
hour: a step or run finished now never matches, so the write path does not run them.

- ``stats_hour``: the hours rolled up (an hour with no activity has no ``stats_rollup`` row).
- ``stats_hour_dirty``: one row per late write's hour (duplicates allowed: a row of a
  concurrent writer must survive the roller's delete, which it cannot see).
- The triggers look 8 days back, the roll-up keeps 7 days and 2 hours (the longest window).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-03
"""

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

LATE = (
    "{row}.finished_at < date_trunc('hour', now(), 'UTC') "
    "AND {row}.finished_at >= now() - interval '8 days'"
)

FUNCTION = f"""
CREATE OR REPLACE FUNCTION dar_stats_late_write() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    old_hour timestamptz;
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') AND {LATE.format(row="OLD")} THEN
        old_hour := date_trunc('hour', OLD.finished_at, 'UTC');
        INSERT INTO stats_hour_dirty (bucket) VALUES (old_hour);
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') AND {LATE.format(row="NEW")}
       AND date_trunc('hour', NEW.finished_at, 'UTC') IS DISTINCT FROM old_hour THEN
        INSERT INTO stats_hour_dirty (bucket)
        VALUES (date_trunc('hour', NEW.finished_at, 'UTC'));
    END IF;
    RETURN NULL;
END $$;
"""

# What the stats read of a row: a run's end and final status; a step's end, start, kind,
# model, cost and latency.
TRIGGERS = {
    "run_stats_late_update": ("run", "UPDATE OF finished_at, status"),
    "run_stats_late_delete": ("run", "DELETE"),
    "run_step_stats_late_insert": ("run_step", "INSERT"),
    "run_step_stats_late_update": (
        "run_step",
        "UPDATE OF finished_at, started_at, kind, model, cost_usd, latency_ms",
    ),
    "run_step_stats_late_delete": ("run_step", "DELETE"),
}


def _when(event: str) -> str:
    if event == "INSERT":
        return LATE.format(row="NEW")
    if event == "DELETE":
        return LATE.format(row="OLD")
    return f"({LATE.format(row='OLD')}) OR ({LATE.format(row='NEW')})"


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE stats_hour (
            bucket timestamptz PRIMARY KEY,
            rolled_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        """
        CREATE TABLE stats_hour_dirty (
            id bigserial PRIMARY KEY,
            bucket timestamptz NOT NULL,
            at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute("CREATE INDEX stats_hour_dirty_bucket_idx ON stats_hour_dirty (bucket)")
    op.execute(
        """
        CREATE TABLE stats_rollup (
            every_tenant boolean NOT NULL,
            tenant text NOT NULL,
            bucket timestamptz NOT NULL,
            section text NOT NULL,
            key text NOT NULL,
            n bigint,
            usd numeric,
            p50 double precision,
            p95 double precision,
            CONSTRAINT stats_rollup_pkey PRIMARY KEY (every_tenant, tenant, bucket, section, key),
            CONSTRAINT stats_rollup_section_ck CHECK (section IN ('finished', 'cost', 'latency'))
        )
        """
    )
    op.execute("CREATE INDEX stats_rollup_bucket_idx ON stats_rollup (bucket)")
    op.execute(FUNCTION)
    for name, (table, event) in TRIGGERS.items():
        op.execute(
            f"CREATE TRIGGER {name} AFTER {event} ON {table} FOR EACH ROW "
            f"WHEN ({_when(event.split()[0])}) EXECUTE FUNCTION dar_stats_late_write()"
        )


def downgrade() -> None:
    for name, (table, _) in TRIGGERS.items():
        op.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
    op.execute("DROP FUNCTION IF EXISTS dar_stats_late_write()")
    op.execute("DROP TABLE stats_rollup")
    op.execute("DROP TABLE stats_hour_dirty")
    op.execute("DROP TABLE stats_hour")
