"""Schedules on real PostgreSQL: the REST calls, and one run per tick whoever claims it."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import text

import api
from db.records import Dispatch, RunStatus, Schedule
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.schedules import tick_schedules
from tasks.celery_app import make_celery


@pytest.fixture
def celery(settings: Settings) -> Iterator[Celery]:
    app = make_celery(settings, register=False)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def app(runtime: Runtime, celery: Celery) -> Flask:
    return api.create_app(runtime=runtime, celery=celery)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def create(client: FlaskClient, **fields: object) -> dict[str, object]:
    body = {"input": "Which acme tickets are overdue?", "cron": "* * * * *", **fields}
    response = client.post("/api/schedules", json=body)
    assert response.status_code == 201, response.get_data(as_text=True)
    return dict(response.get_json())


def make_due(runtime: Runtime, schedule_id: object, seconds_ago: float = 0.5) -> None:
    """Move the schedule's next tick into the past (instead of waiting for the clock)."""
    with runtime.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE schedule SET next_tick_at = now() - make_interval(secs => :s) "
                "WHERE id = :id"
            ),
            {"id": schedule_id, "s": seconds_ago},
        )


def runs_of(runtime: Runtime, schedule_id: object) -> list[tuple[uuid.UUID, str]]:
    with runtime.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status FROM run WHERE schedule_id = :id ORDER BY created_at"),
            {"id": schedule_id},
        )
        return [(r.id, r.status) for r in rows]


def ticks_of(runtime: Runtime, schedule_id: object) -> list[tuple[str, uuid.UUID | None]]:
    with runtime.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT status, run_id FROM schedule_tick WHERE schedule_id = :id ORDER BY tick_at"
            ),
            {"id": schedule_id},
        )
        return [(r.status, r.run_id) for r in rows]


def finish_runs(runtime: Runtime, schedule_id: object) -> None:
    with runtime.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE run SET status = 'SUCCEEDED', finished_at = now() WHERE schedule_id = :id"
            ),
            {"id": schedule_id},
        )


def test_a_schedule_is_created_listed_shown_and_deleted(client: FlaskClient) -> None:
    made = create(client, cron="0 9 * * 1-5", timezone="Europe/Paris", overlap="queue")
    assert made["cron"] == "0 9 * * 1-5"
    assert made["timezone"] == "Europe/Paris"
    assert (made["overlap"], made["catchUp"]) == ("queue", "none")
    assert made["agent"] == "acme-tickets"
    listed = client.get("/api/schedules").get_json()["items"]
    assert [s["id"] for s in listed] == [made["id"]]
    shown = client.get(f"/api/schedules/{made['id']}").get_json()
    assert shown["nextTickAt"] == made["nextTickAt"]
    assert shown["recentTicks"] == []
    deleted = client.delete(f"/api/schedules/{made['id']}")
    assert deleted.status_code == 200
    assert client.get(f"/api/schedules/{made['id']}").status_code == 404
    assert client.delete(f"/api/schedules/{made['id']}").status_code == 404


@pytest.mark.parametrize(
    ("fields", "status", "field", "words"),
    [
        ({"cron": "every minute"}, 400, "cron", "5 fields"),
        ({"cron": "99 * * * *"}, 422, "cron", "ever fires"),
        ({"timezone": "Moon/Base"}, 422, "timezone", "IANA"),
        ({"timezone": "../etc"}, 400, "timezone", "IANA"),
        ({"overlap": "sometimes"}, 400, "overlap", "skip"),
        ({"catchUp": "maybe"}, 400, "catchUp", "latest"),
        ({"agent": "nobody"}, 400, "agent", "registered agent"),
        ({"every": 5}, 400, "every", "allowed fields"),
    ],
)
def test_a_bad_schedule_names_the_field_and_the_fix(
    client: FlaskClient, fields: dict[str, object], status: int, field: str, words: str
) -> None:
    body = {"input": "hello", "cron": "* * * * *", **fields}
    response = client.post("/api/schedules", json=body)
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["field"] == field
    assert words in error["message"]


BASE = datetime(2026, 1, 1, tzinfo=UTC)


def claim(runtime: Runtime, schedule_id: object, *ticks: int) -> list[Dispatch]:
    """One beat's pass over the schedule, claiming the ticks ``BASE + n minutes`` (the
    store's part; which ticks are due is runtime.engine.schedules', tested on its own)."""
    make_due(runtime, schedule_id)

    def plan(_: Schedule, now: datetime) -> tuple[list[datetime], datetime]:
        return [BASE + timedelta(minutes=n) for n in ticks], now + timedelta(hours=1)

    return runtime.store.claim_schedule_ticks(uuid.UUID(str(schedule_id)), plan)


def test_a_tick_starts_one_run_however_many_beats_claim_it_at_once(
    client: FlaskClient, runtime: Runtime
) -> None:
    made = create(client, overlap="allow")
    barrier = threading.Barrier(6)
    started: list[Dispatch] = []

    def beat() -> None:
        barrier.wait()
        started.extend(claim(runtime, made["id"], 1))

    threads = [threading.Thread(target=beat) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runs = runs_of(runtime, made["id"])
    assert len(runs) == 1
    assert [d.run_id for d in started] == [runs[0][0]]
    assert ticks_of(runtime, made["id"]) == [("STARTED", runs[0][0])]
    # The same tick again (a beat that read the schedule before it moved on, a restart): nothing.
    assert claim(runtime, made["id"], 1) == []
    assert len(runs_of(runtime, made["id"])) == 1
    shown = client.get(f"/api/schedules/{made['id']}").get_json()
    assert shown["recentTicks"][0]["runId"] == str(runs[0][0])
    run = client.get(f"/api/runs/{runs[0][0]}").get_json()
    assert run["scheduleId"] == made["id"]
    assert run["status"] == str(RunStatus.QUEUED)


def test_overlap_allow_starts_every_tick(client: FlaskClient, runtime: Runtime) -> None:
    made = create(client, overlap="allow")
    assert len(claim(runtime, made["id"], 1, 2)) == 2
    assert len(claim(runtime, made["id"], 3)) == 1


def test_overlap_skip_starts_nothing_while_the_last_run_is_live(
    client: FlaskClient, runtime: Runtime
) -> None:
    made = create(client)  # skip is the default
    assert len(claim(runtime, made["id"], 1)) == 1
    assert claim(runtime, made["id"], 2) == []
    assert [s for s, _ in ticks_of(runtime, made["id"])] == ["STARTED", "SKIPPED"]
    finish_runs(runtime, made["id"])
    assert len(claim(runtime, made["id"], 3)) == 1


def test_overlap_queue_starts_the_tick_when_the_last_run_ends(
    client: FlaskClient, runtime: Runtime
) -> None:
    made = create(client, overlap="queue")
    first = claim(runtime, made["id"], 1)
    assert claim(runtime, made["id"], 2) == []
    assert [s for s, _ in ticks_of(runtime, made["id"])] == ["STARTED", "QUEUED"]
    assert tick_schedules(runtime.store) == [], "still live: the queued tick waits"
    finish_runs(runtime, made["id"])
    second = tick_schedules(runtime.store)  # not due, but a queued tick can start now
    assert len(first) == len(second) == 1
    assert ticks_of(runtime, made["id"])[1] == ("STARTED", second[0].run_id)


def test_catch_up_all_starts_each_missed_tick_and_none_only_the_recent(
    client: FlaskClient, runtime: Runtime
) -> None:
    every = create(client, overlap="allow", catchUp="all")
    recent = create(client, overlap="allow")
    for made in (every, recent):
        make_due(runtime, made["id"], seconds_ago=5 * 60 + 1)  # five minutes down
    tick_schedules(runtime.store)
    assert len(runs_of(runtime, every["id"])) in (5, 6)
    assert len(runs_of(runtime, recent["id"])) in (0, 1), "only a tick inside the grace"
    with runtime.engine.connect() as conn:
        nxt = conn.execute(
            text("SELECT next_tick_at - now() FROM schedule WHERE id = :id"), {"id": every["id"]}
        ).scalar_one()
    assert timedelta(0) < nxt <= timedelta(minutes=1)
