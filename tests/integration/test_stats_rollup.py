"""The stats roll-up (migration 0023): GET /api/stats reads closed hours from it and gives the
same answer as aggregating every row of the window, also after history changed under
rolled-up hours (a resume, a fork of an old run, a delete, a step recorded again) and while
a late write is in flight during a roll-up."""

from __future__ import annotations

import random
import threading
import uuid
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

import pytest
from sqlalchemy import text

from db.records import NewFork, NewRun, Stats
from db.store import RunStore
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from tasks.celery_app import STATS_ROLLUP, make_celery
from tasks.drive import stop_worker_state

TENANTS = ("", "acme", "globex")
MODELS = ("claude-sonnet-4-5", "claude-haiku-4-5")
WEEK = 7 * 86400


@pytest.fixture
def store(runtime: Runtime) -> RunStore:
    return runtime.store


def _history(store: RunStore, runs: int = 160, seed: int = 27) -> list[uuid.UUID]:
    """Finished runs spread over the last 7 days and 3 hours (the current hour included),
    each with model and tool steps of varied latency, cost and model (some model steps
    without their model: the cost is the run's model's)."""
    rng = random.Random(seed)
    ids = []
    ended: list[dict[str, object]] = []
    steps: list[dict[str, object]] = []
    for i in range(runs):
        run, _ = store.create_run(
            NewRun(
                agent="stats-agent",
                input=f"run {i}",
                model=MODELS[i % 2],
                max_steps=50,
                token_budget=100_000,
                timeout_seconds=600,
                tenant=TENANTS[i % 3],
            )
        )
        ids.append(run.id)
        # The newest runs end within the current hour (the part the roll-up never holds).
        age = rng.uniform(0, 3600) if i < 12 else rng.uniform(0, WEEK + 3 * 3600)
        status = rng.choice(("SUCCEEDED", "SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT"))
        ended.append({"status": status, "age": age, "id": run.id})
        for seq in range(1, rng.randrange(2, 7)):
            model_step = seq % 2 == 1
            steps.append(
                {
                    "id": run.id,
                    "seq": seq,
                    "key": f"s:{seq}",
                    "kind": "MODEL" if model_step else "TOOL",
                    "model": (None if seq == 3 else MODELS[seq % 2]) if model_step else None,
                    "cost": Decimal(rng.randrange(1, 9000)) / 10**6 if model_step else 0,
                    "latency": rng.randrange(200, 5000) if model_step else None,
                    "age": age,
                    "took": rng.uniform(0.01, 30),
                }
            )
    # The ends and the step rows in two batches (one statement each, pipelined), not a round
    # trip per row: ~700 of them per history took most of this file's time.
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE run SET status = :status,"
                " finished_at = now() - make_interval(secs => :age) WHERE id = :id"
            ),
            ended,
        )
        conn.execute(
            text(
                "INSERT INTO run_step (run_id, seq, step_key, kind, status, model,"
                " cost_usd, latency_ms, lease_epoch, started_at, finished_at)"
                " VALUES (:id, :seq, :key, :kind, 'DONE', :model, :cost, :latency, 1,"
                " now() - make_interval(secs => :age + :took),"
                " now() - make_interval(secs => :age - :seq))"
            ),
            steps,
        )
    return ids


def _same(store: RunStore, label: str) -> None:
    """The rolled-up answer equals the raw one, row for row, for every window and view."""
    for window in (86400, WEEK):
        for tenant in (None, *TENANTS):
            rolled = store.stats(window_seconds=window, tenant=tenant)
            raw = store.stats(window_seconds=window, tenant=tenant, rolled=False)
            assert rolled == raw, f"{label}: window {window}, tenant {tenant!r}"


def _dirty(store: RunStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM stats_hour_dirty")).scalar_one())


def _rolled_hours(store: RunStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM stats_hour")).scalar_one())


def _everything_rolled(store: RunStore) -> None:
    """Every closed hour of the window rolled up (no grace: the test writes nothing meanwhile)."""
    store.roll_up_stats(grace_seconds=0)
    assert _dirty(store) == 0


def _total(stats: Stats) -> int:
    return sum(c.n for c in stats.finished)


def test_rolled_up_hours_answer_as_the_raw_rows(store: RunStore) -> None:
    _history(store)
    raw = store.stats(window_seconds=WEEK, rolled=False)
    assert _total(raw) > 100, "history over many hours"
    assert len(raw.latency) > 100

    assert store.roll_up_stats(grace_seconds=0) >= 7 * 24
    # Rolled up: the hours from the window's second to the last closed one.
    assert _rolled_hours(store) >= 7 * 24
    _same(store, "rolled up")
    assert store.roll_up_stats(grace_seconds=0) == 0, "nothing left to roll up"

    # The answer really comes from the roll-up: a changed roll-up row shows.
    with store.engine.begin() as conn:
        changed = conn.execute(
            text(
                "UPDATE stats_rollup SET n = n + 1000 WHERE every_tenant AND section = 'finished'"
                " AND bucket = (SELECT max(bucket) FROM stats_rollup WHERE section = 'finished')"
                " RETURNING key"
            )
        ).all()
    assert changed
    assert _total(store.stats(window_seconds=WEEK)) == _total(raw) + 1000 * len(changed)
    assert _total(store.stats(window_seconds=WEEK, rolled=False)) == _total(raw)


def test_history_changed_under_rolled_up_hours(store: RunStore, runtime: Runtime) -> None:
    ids = _history(store)
    _everything_rolled(store)
    _same(store, "rolled up")

    with store.engine.connect() as conn:
        old = conn.execute(
            text(
                "SELECT id, status FROM run WHERE finished_at < now() - interval '2 days'"
                " AND id = ANY(:ids) ORDER BY finished_at DESC"
            ),
            {"ids": ids},
        ).all()
    failed = next(r.id for r in old if r.status == "FAILED")
    forked = next(r.id for r in old if r.id != failed)
    deleted = next(r.id for r in old if r.id not in (failed, forked))
    moved = next(r.id for r in old if r.id not in (failed, forked, deleted))

    # A resume takes a FAILED run out of its hour's count.
    store.resume_failed(failed)
    _same(store, "after a resume")
    assert _dirty(store) > 0

    # A fork copies the old run's steps, with their times, into a new run.
    store.fork_run(
        NewFork(
            source=forked,
            from_seq=3,
            input="again",
            model=MODELS[0],
            token_budget=100_000,
            timeout_seconds=600,
        ),
        lambda run, steps: [],
    )
    _same(store, "after a fork")

    # A run deleted (retention shorter than the window) takes its steps with it.
    with store.engine.begin() as conn:
        conn.execute(text("DELETE FROM run WHERE id = :id"), {"id": deleted})
        # A step of an old run recorded again now: it leaves its old hour for this one.
        conn.execute(
            text(
                "UPDATE run_step SET finished_at = now(), cost_usd = cost_usd + 0.5"
                " WHERE run_id = :id AND seq = 1"
            ),
            {"id": moved},
        )
    _same(store, "after a delete and a step recorded again")

    # Rolled up again: the touched hours are clean and still the same answer.
    assert store.roll_up_stats(grace_seconds=0) >= 1
    assert _dirty(store) == 0
    _same(store, "rolled up again")


def test_a_late_write_in_flight_during_the_roll_up_is_not_lost(store: RunStore) -> None:
    """A write to a rolled-up hour, uncommitted while that hour is rolled up again: the
    roller cannot see it, and its mark survives the roller's cleaning, so the hour is read
    raw until the next roll-up."""
    ids = _history(store)
    _everything_rolled(store)
    with store.engine.connect() as conn:
        victim, hour = conn.execute(
            text(
                "SELECT id, date_trunc('hour', finished_at, 'UTC') FROM run"
                " WHERE id = ANY(:ids) AND status = 'SUCCEEDED'"
                " AND finished_at < now() - interval '1 day' LIMIT 1"
            ),
            {"ids": ids},
        ).one()
    # Another write dirtied the same hour before: the roller will clean that mark.
    with store.engine.begin() as conn:
        conn.execute(
            text("UPDATE run SET finished_at = finished_at WHERE id = :id"), {"id": victim}
        )
    assert _dirty(store) == 1

    writer = store.engine.connect()
    try:
        writer.execute(text("UPDATE run SET status = 'FAILED' WHERE id = :id"), {"id": victim})
        rolled = store.roll_up_stats(grace_seconds=0)  # runs meanwhile, in other transactions
        assert rolled >= 1
        writer.commit()
    finally:
        writer.close()

    with store.engine.connect() as conn:
        marks = conn.execute(
            text("SELECT count(*) FROM stats_hour_dirty WHERE bucket = :h"), {"h": hour}
        ).scalar_one()
    assert marks == 1, "the in-flight write's mark survived the roll-up"
    _same(store, "after the in-flight write committed")
    _everything_rolled(store)
    _same(store, "rolled up again")


def test_two_rollers_at_once(store: RunStore) -> None:
    _history(store, runs=60)
    errors: list[BaseException] = []

    def roll() -> None:
        try:
            store.roll_up_stats(grace_seconds=0)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=roll) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    store.roll_up_stats(grace_seconds=0)  # what a lock holder left, if any
    assert store.roll_up_stats(grace_seconds=0) == 0
    _same(store, "three rollers")


def test_the_beat_task_rolls_up_and_prunes(settings: Settings, runtime: Runtime) -> None:
    store = runtime.store
    _history(store, runs=40)
    app = make_celery(replace(settings))
    app.dar_runtime = runtime
    # Hours past the horizon: pruned.
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO stats_hour (bucket) VALUES"
                " (date_trunc('hour', now() - interval '9 days', 'UTC'))"
            )
        )
    try:
        rolled = app.tasks[STATS_ROLLUP].run()
        # The default grace: the last hour is not closed yet, nor perhaps the one before.
        assert 7 * 24 - 1 <= rolled <= 7 * 24 + 2
        with store.engine.connect() as conn:
            oldest = conn.execute(text("SELECT min(bucket) FROM stats_hour")).scalar_one()
            now = conn.execute(text("SELECT now()")).scalar_one()
        assert oldest > now - timedelta(days=7, hours=3)
        assert app.tasks[STATS_ROLLUP].run() == 0
    finally:  # the task built this process's worker state: its heartbeat stops with the test
        stop_worker_state(app)
    _same(store, "the beat's roll-up")
