"""Per-token quotas on submit, atomic under concurrency: submits per minute (resumes count),
runs in flight; an accepted idempotent submit retried gets its run, never a 429."""

from __future__ import annotations

import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from flask.testing import FlaskClient
from sqlalchemy import text

from api import create_app
from api.auth import hash_token
from db.records import NewRun
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from tasks.celery_app import make_celery

TOKEN = "dar_quota_token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def _client(runtime: Runtime, settings: Settings, **limits: int) -> FlaskClient:
    runtime.settings = replace(
        settings, api_tokens=f"quota-user:submit+read:{hash_token(TOKEN)}:team", **limits
    )
    app = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    return app.test_client()


def test_thirty_concurrent_submits_with_a_limit_of_five_admit_five(
    runtime: Runtime, settings: Settings
) -> None:
    c = _client(runtime, settings, submit_rate_per_minute=5)

    def post(_: int) -> int:
        return c.post("/api/runs", json={"input": "x"}, headers=HEADERS).status_code

    with ThreadPoolExecutor(30) as pool:
        codes = Counter(pool.map(post, range(30)))
    assert codes == {201: 5, 429: 25}


def test_a_retried_idempotent_submit_gets_its_run_not_429(
    runtime: Runtime, settings: Settings
) -> None:
    c = _client(runtime, settings, submit_rate_per_minute=1)
    first = c.post("/api/runs", json={"input": "x"}, headers={**HEADERS, "Idempotency-Key": "k1"})
    assert first.status_code == 201
    again = c.post("/api/runs", json={"input": "x"}, headers={**HEADERS, "Idempotency-Key": "k1"})
    assert again.status_code == 200
    assert again.get_json()["id"] == first.get_json()["id"]
    other = c.post("/api/runs", json={"input": "x"}, headers={**HEADERS, "Idempotency-Key": "k2"})
    assert other.status_code == 429


def test_resume_counts_against_the_submit_rate(runtime: Runtime, settings: Settings) -> None:
    c = _client(runtime, settings, submit_rate_per_minute=1)
    run, _ = runtime.store.create_run(
        NewRun(
            agent="acme-tickets",
            input="x",
            model="claude-sonnet-4-5",
            max_steps=5,
            token_budget=1000,
            timeout_seconds=60,
            submitted_by="quota-user",
            tenant="team",
        )
    )
    _fail(runtime, run.id)
    # the failed run's own submit (just now) used the minute's allowance
    limited = c.post(f"/api/runs/{run.id}/resume", headers=HEADERS)
    assert limited.status_code == 429
    assert "DAR_SUBMIT_RATE_PER_MINUTE" in limited.get_json()["error"]["message"]
    # a resume is a submit: with room for two, the resume takes the second place
    c = _client(runtime, settings, submit_rate_per_minute=2)
    assert c.post(f"/api/runs/{run.id}/resume", headers=HEADERS).status_code == 202
    assert c.post("/api/runs", json={"input": "x"}, headers=HEADERS).status_code == 429


def test_runs_in_flight_per_token(runtime: Runtime, settings: Settings) -> None:
    c = _client(runtime, settings, token_max_active_runs=2)
    ids = [
        c.post("/api/runs", json={"input": "x"}, headers=HEADERS).get_json()["id"] for _ in range(2)
    ]
    refused = c.post("/api/runs", json={"input": "x"}, headers=HEADERS)
    assert refused.status_code == 429
    assert "DAR_TOKEN_MAX_ACTIVE_RUNS" in refused.get_json()["error"]["message"]
    _fail(runtime, uuid.UUID(ids[0]))
    assert c.post("/api/runs", json={"input": "x"}, headers=HEADERS).status_code == 201


def _fail(runtime: Runtime, run_id: uuid.UUID) -> None:
    """Test-only SQL: the run ended FAILED."""
    with runtime.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE run SET status = 'FAILED', finished_at = now(), error = 'boom',"
                " locked_by = NULL, locked_until = NULL WHERE id = :id"
            ),
            {"id": run_id},
        )


def test_a_fork_counts_as_a_submit(runtime: Runtime, settings: Settings) -> None:
    from tests.support import drive_to_end

    c = _client(runtime, settings, submit_rate_per_minute=1)
    created = c.post("/api/runs", json={"input": "x"}, headers=HEADERS)
    assert created.status_code == 201
    run = runtime.store.get_run(uuid.UUID(created.get_json()["id"]))
    runtime.llm.then_text("done")  # type: ignore[attr-defined]
    from db.records import Dispatch

    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    fork = c.post(f"/api/runs/{run.id}/fork", json={"fromSeq": 1}, headers=HEADERS)
    assert fork.status_code == 429, fork.get_json()
    assert "DAR_SUBMIT_RATE_PER_MINUTE" in fork.get_json()["error"]["message"]
