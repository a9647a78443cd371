"""A schedule is a standing submit by its creator: created within the creator's priority cap,
frequency cap, quota and number of schedules; each tick's run counted against the creator's
quota (skipped, with the reason, while over it) and only while its token is still valid;
create and delete audited; tick rows kept like runs; ticks claimed fairly across tenants; and
the overlap policy holds within one pass and for runs waiting on an operator."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from flask.testing import FlaskClient
from sqlalchemy import text

import api
from api.auth import hash_token
from db.records import Dispatch, NewSchedule, Schedule
from db.store import SubmitQuota
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.schedules import tick_schedules
from runtime.engine.sweeps import delete_expired
from runtime.engine.tokens import TokenSource
from tasks.celery_app import make_celery

TOKENS = {
    "amy": ("read+submit", "tok-amy", "red"),
    "sue": ("read+submit", "tok-sue", "red"),
    "boss": ("admin", "tok-boss", "red"),
}


def _h(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name][1]}"}


def _env() -> str:
    return ",".join(f"{n}:{r}:{hash_token(t)}:{tn}" for n, (r, t, tn) in TOKENS.items())


@pytest.fixture
def celery(settings: Settings) -> Iterator[Celery]:
    app = make_celery(settings, register=False)
    try:
        yield app
    finally:
        app.close()


def _client(runtime: Runtime, celery: Celery, **changes: Any) -> FlaskClient:
    runtime.settings = replace(runtime.settings, api_tokens=_env(), **changes)
    return api.create_app(runtime=runtime, celery=celery).test_client()


@pytest.fixture
def client(runtime: Runtime, celery: Celery) -> FlaskClient:
    return _client(runtime, celery, token_max_active_runs=2, token_max_schedules=3)


def create(client: FlaskClient, who: str = "amy", **fields: object) -> Any:
    body = {"input": "Which acme tickets are overdue?", "cron": "* * * * *", **fields}
    return client.post("/api/schedules", json=body, headers=_h(who))


BASE = datetime(2026, 1, 1, tzinfo=UTC)


def claim(runtime: Runtime, schedule_id: object, *ticks: int, **kwargs: Any) -> list[Dispatch]:
    with runtime.engine.begin() as conn:
        conn.execute(
            text("UPDATE schedule SET next_tick_at = now() - interval '1 second' WHERE id = :id"),
            {"id": schedule_id},
        )

    def plan(_: Schedule, now: datetime) -> tuple[list[datetime], datetime]:
        return [BASE + timedelta(minutes=n) for n in ticks], now + timedelta(hours=1)

    return runtime.store.claim_schedule_ticks(uuid.UUID(str(schedule_id)), plan, **kwargs)


def ticks_of(runtime: Runtime, schedule_id: object) -> list[tuple[str, str | None]]:
    with runtime.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT status, reason FROM schedule_tick WHERE schedule_id = :id ORDER BY tick_at"
            ),
            {"id": schedule_id},
        )
        return [(r.status, r.reason) for r in rows]


def runs_of(runtime: Runtime, schedule_id: object) -> list[uuid.UUID]:
    with runtime.engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT id FROM run WHERE schedule_id = :id ORDER BY created_at"),
                {"id": schedule_id},
            ).scalars()
        )


# -- at create ---------------------------------------------------------------------------------


def test_a_schedule_above_the_priority_cap_is_refused_as_a_submit_is(
    client: FlaskClient,
) -> None:
    refused = create(client, priority=1000)
    assert refused.status_code == 403, refused.get_json()
    assert refused.get_json()["error"]["field"] == "priority"
    assert create(client, "boss", priority=1000).status_code == 201


def test_a_schedule_ticking_more_often_than_the_minimum_is_refused(client: FlaskClient) -> None:
    refused = create(client, cron="* * * * * *")
    assert refused.status_code == 400, refused.get_json()
    error = refused.get_json()["error"]
    assert error["field"] == "cron"
    assert "DAR_SCHEDULE_MIN_INTERVAL_SECONDS" in error["message"]
    assert create(client, cron="*/10 * * * * *").status_code == 201, "every 10 s is allowed"


def test_a_token_has_at_most_so_many_schedules(client: FlaskClient) -> None:
    for _ in range(3):
        assert create(client).status_code == 201
    refused = create(client)
    assert refused.status_code == 429, refused.get_json()
    assert "DAR_TOKEN_MAX_SCHEDULES" in refused.get_json()["error"]["message"]
    assert create(client, "sue").status_code == 201, "a cap per token"


def test_a_schedule_is_not_created_while_its_creator_is_over_its_in_flight_cap(
    client: FlaskClient,
) -> None:
    for _ in range(2):
        assert client.post("/api/runs", json={"input": "q"}, headers=_h("amy")).status_code == 201
    refused = create(client)
    assert refused.status_code == 429, refused.get_json()
    assert "DAR_TOKEN_MAX_ACTIVE_RUNS" in refused.get_json()["error"]["message"]


def test_create_and_delete_are_audited_and_delete_needs_what_create_needed(
    client: FlaskClient, runtime: Runtime
) -> None:
    made = create(client, "boss", priority=50).get_json()
    shown = client.get(f"/api/schedules/{made['id']}", headers=_h("amy")).get_json()
    assert [(e["actor"], e["action"]) for e in shown["audit"]] == [("boss", "schedule.create")]
    refused = client.delete(f"/api/schedules/{made['id']}", headers=_h("amy"))
    assert refused.status_code == 403, (
        "a priority above the cap: only admin made it, and deletes it"
    )
    own = create(client).get_json()
    assert client.delete(f"/api/schedules/{own['id']}", headers=_h("sue")).status_code == 200
    trail = runtime.store.schedule_audit_events(uuid.UUID(own["id"]))
    assert [(e.actor, e.action, e.tenant) for e in trail] == [
        ("amy", "schedule.create", "red"),
        ("sue", "schedule.delete", "red"),
    ]


# -- at each tick ------------------------------------------------------------------------------

QUOTA = SubmitQuota(per_minute=0, max_active=2)


def test_scheduled_runs_count_against_the_creators_cap_and_are_skipped_visibly(
    client: FlaskClient, runtime: Runtime
) -> None:
    made = create(client, overlap="allow").get_json()
    started = claim(runtime, made["id"], 1, 2, 3, 4, 5, quota=QUOTA)
    assert len(started) == 2, "the creator's in-flight cap is 2"
    ticks = ticks_of(runtime, made["id"])
    assert [s for s, _ in ticks] == ["STARTED", "STARTED", "SKIPPED", "SKIPPED", "SKIPPED"]
    assert all("DAR_TOKEN_MAX_ACTIVE_RUNS" in (r or "") for _, r in ticks[2:])
    shown = client.get(f"/api/schedules/{made['id']}", headers=_h("amy")).get_json()
    assert "DAR_TOKEN_MAX_ACTIVE_RUNS" in shown["recentTicks"][0]["reason"]
    # The creator's own submits see the scheduled runs in flight.
    over = client.post("/api/runs", json={"input": "q"}, headers=_h("amy"))
    assert over.status_code == 429
    # Each run a tick started is audited as a submit by the schedule's creator.
    for run_id in runs_of(runtime, made["id"]):
        (entry,) = runtime.store.audit_events(run_id)
        assert (entry.actor, entry.action) == ("amy", "submit")
        assert entry.detail["schedule"] == made["id"]


def test_a_revoked_or_expired_tokens_schedules_start_nothing(
    client: FlaskClient, runtime: Runtime, tmp_path: Path
) -> None:
    made = create(client, overlap="allow").get_json()
    tokens = tmp_path / "tokens"
    amy = f"amy:read+submit:{hash_token('tok-amy')}:red"
    tokens.write_text(amy + "\n")
    source = TokenSource(None, str(tokens))
    assert len(claim(runtime, made["id"], 1, creator_ok=source.may_act_for)) == 1
    tokens.write_text(f"{amy}:expires=2020-01-01\n")  # expired
    source._looked = 0
    assert claim(runtime, made["id"], 2, creator_ok=source.may_act_for) == []
    tokens.write_text(f"sue:read+submit:{hash_token('tok-sue')}:red\n")  # amy revoked
    source._looked = 0
    assert claim(runtime, made["id"], 3, creator_ok=source.may_act_for) == []
    ticks = ticks_of(runtime, made["id"])
    assert [s for s, _ in ticks] == ["STARTED", "SKIPPED", "SKIPPED"]
    assert all("revoked or expired" in (r or "") for _, r in ticks[1:])


def test_overlap_skip_starts_one_run_for_the_ticks_of_one_pass(
    client: FlaskClient, runtime: Runtime
) -> None:
    made = create(client).get_json()  # overlap skip
    assert len(claim(runtime, made["id"], 1, 2, 3)) == 1
    assert [s for s, _ in ticks_of(runtime, made["id"])] == ["STARTED", "SKIPPED", "SKIPPED"]
    queued = create(client, overlap="queue").get_json()
    assert len(claim(runtime, queued["id"], 1, 2, 3)) == 1
    assert [s for s, _ in ticks_of(runtime, queued["id"])] == ["STARTED", "QUEUED", "QUEUED"]


def test_a_run_waiting_for_an_operator_is_live_for_the_overlap_policy(
    client: FlaskClient, runtime: Runtime
) -> None:
    made = create(client).get_json()
    (first,) = claim(runtime, made["id"], 1)
    with runtime.engine.begin() as conn:
        conn.execute(
            text("UPDATE run SET status = 'NEEDS_ATTENTION' WHERE id = :id"),
            {"id": first.run_id},
        )
    assert claim(runtime, made["id"], 2) == []
    assert [s for s, _ in ticks_of(runtime, made["id"])] == ["STARTED", "SKIPPED"]


# -- retention and fairness --------------------------------------------------------------------


def test_tick_rows_are_deleted_with_old_runs(client: FlaskClient, runtime: Runtime) -> None:
    made = create(client, overlap="allow").get_json()
    claim(runtime, made["id"], 1, 2)
    with runtime.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE schedule_tick SET created_at = now() - interval '40 days' "
                "WHERE tick_at = :t"
            ),
            {"t": BASE + timedelta(minutes=1)},
        )
    delete_expired(runtime.store, replace(runtime.settings, retention_days=30))
    assert [s for s, _ in ticks_of(runtime, made["id"])] == ["STARTED"], "the old tick went"


def test_one_tenants_due_schedules_do_not_crowd_out_another_tenants(runtime: Runtime) -> None:
    past = datetime.now(UTC) - timedelta(minutes=5)

    def new(tenant: str, due: datetime) -> Schedule:
        return runtime.store.create_schedule(
            NewSchedule(
                agent="acme-tickets",
                input="q",
                model="m",
                max_steps=5,
                token_budget=1000,
                timeout_seconds=60,
                cron="* * * * *",
                timezone="UTC",
                overlap="allow",
                catch_up="none",
                first_tick_at=due,
                tenant=tenant,
            )
        )

    for _ in range(30):
        new("noisy", past - timedelta(minutes=1))  # all more overdue than the quiet one
    quiet = new("quiet", past)
    assert quiet.id in runtime.store.due_schedules(limit=10)
    started = tick_schedules(runtime.store, limit=10)
    with runtime.engine.connect() as conn:
        tenants = {
            r.tenant
            for r in conn.execute(
                text("SELECT tenant FROM run WHERE id = ANY(:ids)"),
                {"ids": [d.run_id for d in started]},
            )
        }
    assert tenants == {"noisy", "quiet"}


def test_the_beats_schedule_loop_applies_the_quota_and_the_tokens_of_its_settings(
    runtime: Runtime, celery: Celery
) -> None:
    from tasks.beat import start_schedule_loop

    settings = replace(
        runtime.settings, api_tokens=_env(), token_max_active_runs=3, submit_rate_per_minute=10
    )
    loop = start_schedule_loop(celery, replace(settings, schedule_poll_seconds=3600))
    try:
        assert loop.quota == SubmitQuota(per_minute=10, max_active=3)
        assert loop.creator_ok is not None
        assert loop.creator_ok("amy")
        assert not loop.creator_ok("mallory"), "a token no longer configured starts nothing"
    finally:
        loop.stop()
        loop.store.engine.dispose()
