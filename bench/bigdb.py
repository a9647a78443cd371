"""A year of history in PostgreSQL, and the API and console reads measured on it.

``python -m bench.bigdb generate [--runs 1000000]`` fills the database ``DAR_BIGDB_DB``
(default ``dar_bigdb``) on the server of ``DAR_BIGDB_ADMIN_URL`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``) with ``--runs`` runs created over 365 days,
~20 steps each on average (a model turn and a tool call, alternately; realistic response
sizes), five runs of 5,000 steps, the events the triggers would have written (two per step,
three status changes per run), approvals on 1% of the runs, and a few thousand live runs
(queued, running, waiting) at the end of the year. Everything is made by ``generate_series``
in SQL, batch by batch, with the triggers off (``session_replication_role = replica``; the
event rows are written explicitly instead). ``--runs 100000`` makes a tenth of it.

``python -m bench.bigdb bench [--samples 200]`` measures, on that database, with the store and
the Flask app as the API runs them: list (each filter, deep keyset paging), get, timeline,
events from the start and from an id, approvals, the console's counts and stats (overview),
the id-prefix search; the claim's and reaper's plans (``EXPLAIN``); claim + checkpoint on
the big database against an empty one on the same server, in the same run; retention's
batched deletes and what they do to a concurrent claim. Prints a table, writes
``bench/results/bigdb-<time>.json`` and the plot ``docs/bench-bigdb.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from db.engine import make_engine, normalize_url
from db.migrate import upgrade
from db.records import NewRun, Usage
from db.store import RunStore

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DAYS = 365
LONG_RUNS = 5
LONG_STEPS = 5000
LIVE_RUNS = 3000
"""The newest runs are live: queued, running (lease held) or waiting for an approval."""
BATCH = 10_000


def admin_url() -> str:
    return normalize_url(
        os.environ.get("DAR_BIGDB_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )


def db_url(name: str | None = None) -> str:
    name = name or os.environ.get("DAR_BIGDB_DB", "dar_bigdb")
    return make_url(admin_url()).set(database=name).render_as_string(hide_password=False)


def _recreate(name: str) -> str:
    admin = create_engine(admin_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = db_url(name)
    engine = make_engine(url, pool_size=1)
    upgrade(engine)
    engine.dispose()
    return url


# -- the generator ----------------------------------------------------------------------------

# Per run number g (1..N, oldest first): a deterministic pseudo-random h(g, salt) decides its
# shape. The SQL below is run once per batch [lo, hi].
HELPERS = """
CREATE OR REPLACE FUNCTION pg_temp.h(g bigint, salt int) RETURNS bigint
    LANGUAGE sql IMMUTABLE AS $$ SELECT abs(hashint8(g * 1009 + salt)::bigint) $$;
CREATE OR REPLACE FUNCTION pg_temp.rid(g bigint) RETURNS uuid
    LANGUAGE sql IMMUTABLE AS $$ SELECT md5('dar-bigdb-' || g)::uuid $$;
CREATE OR REPLACE FUNCTION pg_temp.nsteps(g bigint, n bigint) RETURNS int
    LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN g % (n / 5) = n / 10 THEN 5000 ELSE 2 + (pg_temp.h(g, 1) % 37)::int END $$;
CREATE OR REPLACE FUNCTION pg_temp.status(g bigint, n bigint, live int) RETURNS text
    LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN g > n - live THEN (ARRAY['QUEUED', 'RUNNING', 'RUNNING', 'WAITING'])[1 + g % 4]
        ELSE (CASE WHEN pg_temp.h(g, 2) % 1000 < 900 THEN 'SUCCEEDED'
                   WHEN pg_temp.h(g, 2) % 1000 < 950 THEN 'FAILED'
                   WHEN pg_temp.h(g, 2) % 1000 < 970 THEN 'CANCELLED'
                   WHEN pg_temp.h(g, 2) % 1000 < 985 THEN 'TIMED_OUT'
                   WHEN pg_temp.h(g, 2) % 1000 < 990 THEN 'NEEDS_ATTENTION'
                   ELSE 'SUCCEEDED' END)
    END $$;
CREATE OR REPLACE FUNCTION pg_temp.created(g bigint, n bigint) RETURNS timestamptz
    LANGUAGE sql STABLE AS $$
    SELECT now() - make_interval(days => 365) * (1 - g::float8 / n)
           - make_interval(secs => 600 + (pg_temp.h(g, 3) % 600)::int) $$;
"""

RUNS_SQL = """
INSERT INTO run (id, agent, status, input, model, max_steps, token_budget, tokens_used,
                 input_tokens, output_tokens, cost_usd, deadline_at, run_at, locked_by,
                 locked_until, lease_epoch, dispatch_token, dispatched_at, result, error,
                 submitted_by, created_at, updated_at, finished_at, tenant, timeout_seconds,
                 event_seq, status_changes, concurrency_key, priority)
SELECT pg_temp.rid(g),
       CASE WHEN pg_temp.h(g, 4) % 1000 = 0 THEN 'rare-agent'
            ELSE 'agent-' || (pg_temp.h(g, 4) % 10) END,
       st,
       to_jsonb('Which tickets of customer ' || (g % 5000) || ' are overdue, and why? '
                || repeat('Context line. ', (pg_temp.h(g, 5) % 12)::int)),
       (ARRAY['claude-sonnet-4-5', 'claude-haiku-4-5', 'claude-opus-4-1'])[1 + g % 3],
       6000, 1000000, ns * 900, ns * 850, ns * 50, ns * 0.0045,
       c + interval '1 hour', c + make_interval(secs => ns * 3),
       CASE WHEN st = 'RUNNING' THEN 'worker-' || (g % 8) END,
       CASE WHEN st = 'RUNNING' THEN now() + interval '1 hour' END,
       ns, gen_random_uuid(), c + make_interval(secs => ns * 3),
       CASE WHEN st = 'SUCCEEDED'
            THEN to_jsonb(repeat('Tickets 101, 102 and 103 are overdue. ', 8)) END,
       CASE WHEN st IN ('FAILED', 'TIMED_OUT', 'NEEDS_ATTENTION')
            THEN 'model error: overloaded (529) after 5 attempts' END,
       'token-' || (pg_temp.h(g, 6) % 200),
       c, c + make_interval(secs => ns * 3),
       CASE WHEN st IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT')
            THEN c + make_interval(secs => ns * 3) END,
       'tenant-' || (pg_temp.h(g, 7) % 50), 3600,
       2 * ns + 3, 2,
       CASE WHEN pg_temp.h(g, 8) % 10 = 0 THEN 'customer-' || (g % 5000) END,
       0
FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) g
CROSS JOIN LATERAL (SELECT pg_temp.nsteps(g, :n) AS ns, pg_temp.status(g, :n, :live) AS st,
                           pg_temp.created(g, :n) AS c) x
"""

STEPS_SQL = """
INSERT INTO run_step (run_id, seq, step_key, kind, status, tool_name, tool_use_id, model,
                      prompt_hash, response, stop_reason, input_tokens, output_tokens,
                      cost_usd, latency_ms, request_id, error, attempt, worker, lease_epoch,
                      started_at, finished_at)
SELECT pg_temp.rid(g), s,
       CASE WHEN s % 2 = 1 THEN 'model:' || ((s + 1) / 2)
            ELSE 'tool:toolu_' || left(md5(g || '-' || s), 24) END,
       CASE WHEN s % 2 = 1 THEN 'MODEL' ELSE 'TOOL' END,
       CASE WHEN s = ns AND st IN ('FAILED', 'NEEDS_ATTENTION') THEN 'ERROR'
            WHEN s = ns AND st = 'RUNNING' THEN 'STARTED' ELSE 'DONE' END,
       CASE WHEN s % 2 = 0 THEN (ARRAY['list_tickets', 'add_comment', 'get_ticket'])[1 + s % 3] END,
       CASE WHEN s % 2 = 0 THEN 'toolu_' || left(md5(g || '-' || s), 24) END,
       CASE WHEN s % 2 = 1 THEN 'claude-sonnet-4-5' END,
       CASE WHEN s % 2 = 1 THEN md5(g || ':' || s) END,
       CASE WHEN s % 2 = 1 THEN jsonb_build_object(
                'content', jsonb_build_array(
                    jsonb_build_object('type', 'text', 'text',
                        repeat('I will look at the overdue tickets of this customer first. ',
                               (2 + pg_temp.h(g * 7 + s, 9) % 14)::int)),
                    jsonb_build_object('type', 'tool_use', 'id',
                        'toolu_' || left(md5(g || '-' || (s + 1)), 24),
                        'name', 'list_tickets', 'input',
                        jsonb_build_object('overdue', true, 'customer', g % 5000))),
                'stop_reason', 'tool_use', 'model', 'claude-sonnet-4-5',
                'usage', jsonb_build_object('input_tokens', 850, 'output_tokens', 50))
            ELSE jsonb_build_object('result',
                repeat('ticket 1042 (printer on fire, due 2026-03-01, owner sam); ',
                       (1 + pg_temp.h(g * 7 + s, 10) % 8)::int)) END,
       CASE WHEN s % 2 = 1 THEN 'tool_use' END,
       CASE WHEN s % 2 = 1 THEN 1700 ELSE 0 END,
       CASE WHEN s % 2 = 1 THEN 100 ELSE 0 END,
       CASE WHEN s % 2 = 1 THEN 0.009 ELSE 0 END,
       CASE WHEN s % 2 = 1 THEN 800 + (pg_temp.h(g * 7 + s, 11) % 4000)::int END,
       CASE WHEN s % 2 = 1 THEN 'req_' || left(md5(g || 'r' || s), 20) END,
       CASE WHEN s = ns AND st IN ('FAILED', 'NEEDS_ATTENTION')
            THEN 'tool raised: connection reset' END,
       1, 'worker-' || ((g + s) % 8), s,
       c + make_interval(secs => (s - 1) * 3),
       CASE WHEN s = ns AND st = 'RUNNING' THEN NULL
            ELSE c + make_interval(secs => s * 3 - 1) END
FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) g
CROSS JOIN LATERAL (SELECT pg_temp.nsteps(g, :n) AS ns, pg_temp.status(g, :n, :live) AS st,
                           pg_temp.created(g, :n) AS c) x
CROSS JOIN LATERAL generate_series(1, x.ns) s
"""

EVENTS_SQL = """
INSERT INTO run_event (run_id, n, kind, step_seq, status, at)
SELECT pg_temp.rid(g), e.n, e.kind, e.step_seq, e.status, e.at
FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) g
CROSS JOIN LATERAL (SELECT pg_temp.nsteps(g, :n) AS ns, pg_temp.status(g, :n, :live) AS st,
                           pg_temp.created(g, :n) AS c) x
CROSS JOIN LATERAL (
    SELECT 1::bigint AS n, 'run.status' AS kind, NULL::int AS step_seq, 'QUEUED' AS status,
           x.c AS at
    UNION ALL SELECT 2, 'run.status', NULL, 'RUNNING', x.c
    UNION ALL
    SELECT 3 + 2 * (s - 1) + k, CASE k WHEN 0 THEN 'step.started' ELSE 'step.finished' END, s,
           CASE k WHEN 0 THEN 'STARTED' ELSE 'DONE' END,
           x.c + make_interval(secs => (s - 1) * 3 + k * 2)
    FROM generate_series(1, x.ns) s, generate_series(0, 1) k
    UNION ALL SELECT 2 * x.ns + 3, 'run.status', NULL, x.st, x.c + make_interval(secs => x.ns * 3)
    WHERE x.st NOT IN ('QUEUED', 'RUNNING')
) e
"""

APPROVALS_SQL = """
INSERT INTO approval (id, run_id, step_key, role, status, payload, payload_hash,
                      timeout_policy, requested_at, expires_at, decided_by, decided_at)
SELECT md5('approval-' || g)::uuid, pg_temp.rid(g), 'refund:1',
       (ARRAY['finance', 'support', 'ops'])[1 + g % 3],
       CASE WHEN st = 'WAITING' THEN 'PENDING'
            WHEN pg_temp.h(g, 12) % 5 = 0 THEN 'REJECTED' ELSE 'APPROVED' END,
       jsonb_build_object('amount', g % 500, 'customer', g % 5000), md5('p' || g), 'FAIL',
       x.c + interval '5 seconds', x.c + interval '7 days',
       CASE WHEN st <> 'WAITING' THEN 'alice' END,
       CASE WHEN st <> 'WAITING' THEN x.c + interval '5 minutes' END
FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) g
CROSS JOIN LATERAL (SELECT pg_temp.status(g, :n, :live) AS st,
                           pg_temp.created(g, :n) AS c) x
WHERE g % 100 = 0 OR st = 'WAITING'
"""


def generate(runs: int) -> dict[str, Any]:
    url = _recreate(os.environ.get("DAR_BIGDB_DB", "dar_bigdb"))
    engine = create_engine(url, pool_size=1)
    live = min(LIVE_RUNS, runs // 10)
    params = {"n": runs, "live": live}
    began = time.monotonic()
    with engine.connect() as conn:
        conn.execute(text("SET session_replication_role = replica"))  # no triggers, no FK checks
        conn.execute(text("SET synchronous_commit = off"))
        conn.connection.driver_connection.execute(HELPERS)  # type: ignore[union-attr]
        conn.commit()
        for lo in range(1, runs + 1, BATCH):
            hi = min(runs, lo + BATCH - 1)
            for sql in (RUNS_SQL, STEPS_SQL, EVENTS_SQL, APPROVALS_SQL):
                conn.execute(text(sql), {**params, "lo": lo, "hi": hi})
            conn.commit()
            done = hi / runs
            spent = time.monotonic() - began
            print(
                f"bigdb: {hi:,} runs ({done:.0%}) in {spent:.0f}s, "
                f"~{spent / done - spent:.0f}s to go",
                flush=True,
            )
    loaded = time.monotonic() - began
    raw = engine.raw_connection()
    try:
        raw.driver_connection.autocommit = True  # type: ignore[union-attr]
        raw.driver_connection.execute("VACUUM (ANALYZE)")  # type: ignore[union-attr]
    finally:
        raw.close()
    sizes = _sizes(engine)
    engine.dispose()
    out = {"runs": runs, "load_s": loaded, "total_s": time.monotonic() - began, **sizes}
    print(f"bigdb: generated {json.dumps(out)}", flush=True)
    return out


def _sizes(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        counts = {
            t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one())
            for t in ("run", "run_step", "run_event", "approval")
        }
        size = conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
    return {"rows": counts, "database_bytes": int(size)}


def rollup() -> int:
    """Migrate the database to the head (timing each revision's upgrade), then roll up the
    stats of its last 7 days as the beat's first pass would (timed)."""
    from alembic.script import ScriptDirectory

    from db.migrate import _config, current_revision

    engine = make_engine(db_url(), pool_size=2)
    out: dict[str, Any] = {"from": current_revision(engine)}
    script = ScriptDirectory.from_config(_config())
    pending = sorted(  # the revisions are numbered 0001, 0002, ...
        rev.revision
        for rev in script.walk_revisions("base", "heads")
        if out["from"] is None or rev.revision > out["from"]
    )
    for revision in pending:
        t0 = time.monotonic()
        upgrade(engine, revision)
        out[f"upgrade {revision} s"] = time.monotonic() - t0
        print(f"bigdb: upgrade to {revision}: {out[f'upgrade {revision} s']:.1f}s", flush=True)
    store = RunStore(engine)
    t0 = time.monotonic()
    hours = store.roll_up_stats()
    out["rollup_hours"] = hours
    out["rollup_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    out["rollup_again_hours"] = store.roll_up_stats()
    out["rollup_again_s"] = time.monotonic() - t0
    out["load_average"] = os.getloadavg()
    print(f"bigdb: rollup {json.dumps(out)}", flush=True)
    engine.dispose()
    return 0


# -- the benchmark ----------------------------------------------------------------------------


def _percentiles(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"n": len(ms), "p50": statistics.median(ms), "p99": p99, "max": ordered[-1]}


def _time(fn: Callable[[], Any], samples: int, warmup: int = 3) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1000)
    return _percentiles(ms)


class Sample:
    """Run ids and cursors to read, picked at random over the whole year."""

    def __init__(self, engine: Engine, rng: random.Random) -> None:
        self.rng = rng
        with engine.connect() as conn:
            self.ids = [
                r[0]
                for r in conn.execute(text("SELECT id FROM run TABLESAMPLE SYSTEM (1) LIMIT 5000"))
            ]
            self.long = [
                r[0]
                for r in conn.execute(
                    text("SELECT id FROM run WHERE lease_epoch >= 5000 ORDER BY created_at")
                )
            ]
            self.cursors = [
                (r[0], r[1])
                for r in conn.execute(
                    text("SELECT created_at, id FROM run TABLESAMPLE SYSTEM (1) LIMIT 5000")
                )
            ]
            self.events = {
                r[0]: int(r[1])
                for r in conn.execute(
                    text("SELECT id, event_seq FROM run WHERE id = ANY(:ids)"),
                    {"ids": self.ids[:500]},
                )
            }

    def run_id(self) -> uuid.UUID:
        return self.rng.choice(self.ids)  # type: ignore[no-any-return]

    def cursor(self) -> tuple[Any, uuid.UUID]:
        return self.rng.choice(self.cursors)  # type: ignore[no-any-return]


def _explain(engine: Engine, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) inside a transaction that is rolled back (writes undone)."""
    with engine.connect() as conn:
        rows = conn.execute(text("EXPLAIN (ANALYZE, BUFFERS) " + sql), params).scalars().all()
        conn.rollback()
    plan = "\n".join(rows)
    took = next((r for r in rows if r.startswith("Execution Time")), "")
    return {"plan": plan, "execution": took}


def _claim_checkpoint(store: RunStore, n: int) -> list[float]:
    """n runs created, each claimed and checkpointed (one model step, handed over): the ms
    of claim + checkpoint, the two statements of a model step."""
    from decimal import Decimal

    from db.records import ModelCheckpoint

    out = []
    for i in range(n):
        run, _ = store.create_run(
            NewRun(
                agent="bench",
                input="x",
                model="claude-sonnet-4-5",
                max_steps=50,
                token_budget=100000,
                timeout_seconds=600,
            )
        )
        t0 = time.perf_counter()
        claim = store.claim(run.id, run.dispatch_token, "bench-worker", 30)
        assert claim is not None
        store.checkpoint_model(
            claim,
            ModelCheckpoint(
                seq=1,
                step_key="model:1",
                model="claude-sonnet-4-5",
                prompt_hash=f"h{i}",
                request=None,
                response={"content": [{"type": "text", "text": "ok " * 100}]},
                stop_reason="end_turn",
                usage=Usage(1700, 100),
                cost_usd=Decimal("0.009"),
                latency_ms=900,
                request_id=None,
            ),
        )
        out.append((time.perf_counter() - t0) * 1000)
    return out


def bench(samples: int, only: list[str] | None = None) -> int:
    """Every figure, or those whose name contains one of ``only`` (``claim``, ``retention``
    and ``plans`` name the write sections and the plans)."""
    import api
    from runtime.config import Settings
    from runtime.engine.bootstrap import Runtime
    from tasks.celery_app import make_celery

    url = db_url()
    rng = random.Random(27)
    settings = replace(
        Settings.from_env({}),
        database_url=url,
        redis_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/11"),
    )
    runtime = Runtime.build(settings, pool_size=4)
    celery = make_celery(settings, register=False)
    client = api.create_app(runtime=runtime, celery=celery).test_client()
    store, engine = runtime.store, runtime.engine
    sizes = _sizes(engine)
    print(f"bigdb: {json.dumps(sizes)}", flush=True)
    sample = Sample(engine, rng)

    def api_get(make: Callable[[], str]) -> Callable[[], Any]:
        def call() -> Any:
            response = client.get(make())
            assert response.status_code == 200, response.get_data(as_text=True)[:300]

        return call

    results: dict[str, Any] = {"sizes": sizes, "samples": samples}
    reads: dict[str, dict[str, float]] = {}

    def want(name: str) -> bool:
        return not only or any(o in name for o in only)

    def measure(name: str, fn: Callable[[], Any], n: int = samples) -> None:
        if not want(name):
            return
        reads[name] = _time(fn, n)
        r = reads[name]
        print(f"bigdb: {name:<44} p50 {r['p50']:7.1f} ms  p99 {r['p99']:7.1f} ms", flush=True)

    measure("list: newest page", api_get(lambda: "/api/runs?limit=50"))
    measure("list: status=FAILED", api_get(lambda: "/api/runs?limit=50&status=FAILED"))
    measure("list: status=RUNNING", api_get(lambda: "/api/runs?limit=50&status=RUNNING"))
    measure(
        "list: agent (common)",
        api_get(lambda: f"/api/runs?limit=50&agent=agent-{rng.randrange(10)}"),
    )
    measure("list: agent (rare, 0.1%)", api_get(lambda: "/api/runs?limit=50&agent=rare-agent"))
    measure(
        "list: tenant",
        lambda: store.list_runs(limit=51, tenant=f"tenant-{rng.randrange(50)}"),
    )
    measure(
        "list: tenant + status=FAILED",
        lambda: store.list_runs(limit=51, tenant=f"tenant-{rng.randrange(50)}", status="FAILED"),
    )
    measure(
        "list: deep page (random cursor)", lambda: store.list_runs(limit=51, before=sample.cursor())
    )
    measure(
        "list: deep page, status=FAILED",
        lambda: store.list_runs(limit=51, before=sample.cursor(), status="FAILED"),
    )
    measure(
        "list: deep page, tenant + agent",
        lambda: store.list_runs(
            limit=51,
            before=sample.cursor(),
            tenant=f"tenant-{rng.randrange(50)}",
            agent=f"agent-{rng.randrange(10)}",
        ),
    )
    measure(
        "id prefix: 4 hex digits", api_get(lambda: f"/api/runs?idPrefix={sample.run_id().hex[:4]}")
    )
    measure(
        "id prefix: 8 hex digits", api_get(lambda: f"/api/runs?idPrefix={sample.run_id().hex[:8]}")
    )
    measure("get run", api_get(lambda: f"/api/runs/{sample.run_id()}"))
    measure("timeline (~20 steps)", api_get(lambda: f"/api/runs/{sample.run_id()}/timeline"))
    if sample.long:
        measure(
            "timeline (5,000 steps)",
            api_get(lambda: f"/api/runs/{rng.choice(sample.long)}/timeline"),
            n=max(10, samples // 10),
        )
    measure("events from the start", lambda: store.run_events_after(sample.run_id(), 0))

    def from_an_id() -> None:
        rid = rng.choice(list(sample.events))
        store.run_events_after(rid, rng.randrange(max(1, sample.events[rid])))

    measure("events from an id", from_an_id)
    if sample.long:
        measure(
            "events of a 5,000-step run from an id",
            lambda: store.run_events_after(rng.choice(sample.long), rng.randrange(9000)),
        )
    measure("approvals pending", api_get(lambda: "/api/approvals"))
    overview_n = max(5, samples // 20)
    measure("counts (console)", api_get(lambda: "/api/runs/counts"), n=overview_n)
    measure("stats 24h (overview)", api_get(lambda: "/api/stats?window=24h"), n=overview_n)
    measure("stats 7d (overview)", api_get(lambda: "/api/stats?window=7d"), n=overview_n)

    def overview() -> None:
        for path in ("/api/runs/counts", "/api/stats?window=24h", "/api/approvals"):
            assert client.get(path).status_code == 200

    measure("overview page (counts + stats 24h + approvals)", overview, n=overview_n)
    results["reads"] = reads

    # The same reads without what this pass added, in the same run: the stats of the whole
    # window from the rows (no roll-up), and a tenant's FAILED runs without their index.
    measure(
        "stats 7d from the rows (no roll-up)",
        lambda: store.stats(window_seconds=7 * 86400, rolled=False),
        n=overview_n,
    )
    measure(
        "stats 7d from the roll-up (store)",
        lambda: store.stats(window_seconds=7 * 86400),
        n=overview_n,
    )
    if want("without its index"):
        reads["list: tenant + status=FAILED, without its index"] = _without_index(
            engine, "run_tenant_status_created_idx", rng, samples
        )
        r = reads["list: tenant + status=FAILED, without its index"]
        print(
            f"bigdb: {'list: tenant + FAILED, without its index':<44} p50 {r['p50']:7.1f} ms"
            f"  p99 {r['p99']:7.1f} ms",
            flush=True,
        )
    results["load_average"] = os.getloadavg()
    if not any(want(section) for section in ("plans", "claim", "retention")):
        return _finish(results, runtime, celery, only)
    # The claim's and the reaper's plans.
    with engine.connect() as conn:
        live = conn.execute(
            text("SELECT id, dispatch_token FROM run WHERE status = 'QUEUED' LIMIT 1")
        ).one()
    from db.queries import QUERIES as Q

    plans = {
        "claim_run": _explain(
            engine,
            Q["claim_run"].text,
            {"id": live[0], "token": live[1], "worker": "x", "lease_seconds": 30},
        ),
        "claim_next_run": _explain(
            engine, Q["claim_next_run"].text, {"worker": "x", "lease_seconds": 30}
        ),
        "redispatch_due": _explain(
            engine, Q["redispatch_due"].text, {"redispatch_after": 30, "limit": 500}
        ),
        "count_ready_runs": _explain(engine, Q["count_ready_runs"].text, {}),
        "delete_finished_runs": _explain(
            engine,
            Q["delete_finished_runs"].text,
            {"older_than_seconds": 300 * 86400, "batch": 500},
        ),
    }
    for name, plan in plans.items():
        print(f"bigdb: plan {name}: {plan['execution']}", flush=True)
    results["plans"] = plans

    if want("claim"):
        results["claim_checkpoint"] = _claim_rounds(engine, samples)
    if want("retention"):
        results["retention"] = _retention(store, samples)
    return _finish(results, runtime, celery, only)


def _finish(results: dict[str, Any], runtime: Any, celery: Any, only: list[str] | None) -> int:
    celery.close()
    runtime.close()
    results["load_average_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"bigdb-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"bigdb: wrote {out}", flush=True)
    if not only:
        _plot(results)
    return 0


def _without_index(
    engine: Engine, index: str, rng: random.Random, samples: int
) -> dict[str, float]:
    """A tenant's FAILED runs (the list's own statement) with ``index`` dropped in a
    transaction that is rolled back: the plan the list had before the index, same run."""
    from db.queries import QUERIES as Q

    params = {
        "status": "FAILED",
        "agent": None,
        "id_low": None,
        "id_high": None,
        "before_created": None,
        "before_id": None,
        "limit": 51,
    }
    with engine.connect() as conn:
        conn.execute(text(f"DROP INDEX {index}"))
        out = _time(
            lambda: conn.execute(
                Q["list_runs"], {**params, "tenant": f"tenant-{rng.randrange(50)}"}
            ).all(),
            samples,
        )
        conn.rollback()
    return out


def _claim_rounds(engine: Engine, samples: int) -> dict[str, Any]:
    """Claim + checkpoint on the big database and on an empty one on the same server, with
    random (version 4) and time-ordered (version 7) run ids, interleaved round by round so
    all four see the same machine; with the WAL each one writes."""
    from db.ids import uuid7

    empty_url = _recreate("dar_bigdb_empty")
    empty_engine = make_engine(empty_url, pool_size=2)
    stores = {
        "big, uuid4": RunStore(engine, run_ids=uuid.uuid4),
        "big, uuid7": RunStore(engine, run_ids=uuid7),
        "empty, uuid4": RunStore(empty_engine, run_ids=uuid.uuid4),
        "empty, uuid7": RunStore(empty_engine, run_ids=uuid7),
    }
    ms: dict[str, list[float]] = {name: [] for name in stores}
    wal: dict[str, int] = dict.fromkeys(stores, 0)
    per_round = max(5, samples // 10)

    def lsn() -> int:
        with engine.connect() as conn:
            return int(
                conn.execute(text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one()
            )

    for _ in range(10):
        for name, store in stores.items():
            before = lsn()
            ms[name] += _claim_checkpoint(store, per_round)
            wal[name] += lsn() - before
    out: dict[str, Any] = {}
    for name in stores:
        out[name] = {**_percentiles(ms[name]), "wal_bytes_per_run": wal[name] / len(ms[name])}
        print(
            f"bigdb: claim + checkpoint, {name:<13} p50 {out[name]['p50']:.2f} ms"
            f"  p99 {out[name]['p99']:.2f} ms  WAL {out[name]['wal_bytes_per_run']:,.0f} B/run"
            " (create + claim + checkpoint)",
            flush=True,
        )
    for ids in ("uuid4", "uuid7"):
        ratio = out[f"big, {ids}"]["p50"] / out[f"empty, {ids}"]["p50"]
        out[f"ratio_p50_{ids}"] = ratio
        print(f"bigdb: claim + checkpoint, big / empty, {ids}: {ratio:.2f}", flush=True)
    empty_engine.dispose()
    return out


def _retention(store: RunStore, samples: int) -> dict[str, Any]:
    """Batched deletes of the oldest finished runs (500 per batch, as the beat's sweep does
    by default), and what a claim + checkpoint costs meanwhile against before."""
    before = _claim_checkpoint(store, max(20, samples // 4))
    stop = threading.Event()
    during: list[float] = []

    def load() -> None:
        while not stop.is_set():
            during.extend(_claim_checkpoint(store, 5))

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    batches: list[float] = []
    deleted = 0
    began = time.monotonic()
    for _ in range(20):
        t0 = time.perf_counter()
        n = store.delete_finished_runs(older_than_seconds=300 * 86400, batch=500)
        batches.append((time.perf_counter() - t0) * 1000)
        deleted += n
        if n == 0:
            break
    spent = time.monotonic() - began
    stop.set()
    worker.join(30)
    out = {
        "batch": 500,
        "batches": _percentiles(batches),
        "runs_deleted": deleted,
        "runs_per_second": deleted / spent if spent else 0.0,
        "claim_checkpoint_before": _percentiles(before),
        "claim_checkpoint_during": _percentiles(during) if during else None,
    }
    print(
        f"bigdb: retention: {deleted} runs in batches of 500, p50 {out['batches']['p50']:.0f} ms "
        f"per batch ({out['runs_per_second']:.0f} runs/s); claim + checkpoint p99 "
        f"{out['claim_checkpoint_before']['p99']:.1f} ms before, "
        f"{(out['claim_checkpoint_during'] or {}).get('p99', float('nan')):.1f} ms during",
        flush=True,
    )
    return out


def _plot(results: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bigdb: matplotlib not installed: no plot", flush=True)
        return
    reads = results["reads"]
    names = list(reads)
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(names) + 1.2))
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], [reads[n]["p50"] for n in names], height=0.4, label="p50")
    ax.barh([i - 0.2 for i in y], [reads[n]["p99"] for n in names], height=0.4, label="p99")
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(50, color="grey", linestyle="--", linewidth=0.8)
    ax.axvline(500, color="grey", linestyle=":", linewidth=0.8)
    rows = results["sizes"]["rows"]
    ax.set_xlabel("ms (log); dashed: 50 ms run-level goal, dotted: 500 ms overview goal")
    ax.set_title(
        f"API reads on {rows['run']:,} runs / {rows['run_step']:,} steps / "
        f"{rows['run_event']:,} events",
        fontsize=10,
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = ROOT / "docs" / "bench-bigdb.png"
    fig.savefig(out, dpi=110)
    print(f"bigdb: plot {out}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bigdb", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="fill the database (drops it first)")
    gen.add_argument("--runs", type=int, default=1_000_000)
    b = sub.add_parser("bench", help="measure the reads on it")
    b.add_argument("--samples", type=int, default=200)
    b.add_argument(
        "--only", action="append", help="only the figures whose name contains this (repeatable)"
    )
    sub.add_parser("rollup", help="migrate to the head and roll up the stats, timed")
    args = ap.parse_args(argv)
    if args.command == "generate":
        generate(args.runs)
        return 0
    if args.command == "rollup":
        return rollup()
    return bench(args.samples, args.only)


if __name__ == "__main__":
    sys.exit(main())
