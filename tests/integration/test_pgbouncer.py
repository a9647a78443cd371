"""Through a real PgBouncer in transaction mode (Debian's 1.18: no ``max_prepared_statements``):
psycopg's automatic prepared statements break there, ``DAR_DB_PREPARE=auto`` detects the
pooler and turns them off, and the API and the driver work through it."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from celery import Celery
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

import api
from db.engine import behind_a_pooler, make_engine
from db.records import Dispatch, RunStatus
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import make_celery
from tests.pgbouncer import PgBouncer
from tests.support import drive_to_end


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _two_server_connections(url: str) -> None:
    """Make the pooler open a second server connection (two transactions at once), so that
    round-robin hands a client's next transactions to different ones."""
    a = psycopg.connect(_libpq(url))
    b = psycopg.connect(_libpq(url))
    try:
        a.execute("SELECT 1")
        b.execute("SELECT 1")
        a.commit()
        b.commit()
    finally:
        a.close()
        b.close()


def _repeat(engine: Engine, times: int = 12) -> None:
    # Each iteration is its own transaction; after five, psycopg prepares the statement.
    for i in range(times):
        with engine.begin() as conn:
            assert conn.execute(text("SELECT CAST(:i AS int) + 1"), {"i": i}).scalar_one() == i + 1


@pytest.fixture
def engines(pooled_database_url: str) -> Iterator[dict[str, Engine]]:
    made = {
        mode: make_engine(pooled_database_url, pool_size=1, prepare=mode)
        for mode in ("on", "auto", "off")
    }  # type: ignore[arg-type]
    try:
        yield made
    finally:
        for engine in made.values():
            engine.dispose()


def test_prepared_statements_fail_through_transaction_pooling(
    engines: dict[str, Engine], pooled_database_url: str
) -> None:
    """What a user of PgBouncer 1.18 met: the statement prepared on one server connection
    does not exist on the next one. Shows that the test set-up does pool per transaction."""
    _two_server_connections(pooled_database_url)
    with pytest.raises(DBAPIError) as caught:
        _repeat(engines["on"])
    assert isinstance(
        caught.value.orig,
        psycopg.errors.InvalidSqlStatementName | psycopg.errors.DuplicatePreparedStatement,
    )


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_auto_and_off_prepare_nothing_through_the_pooler(
    engines: dict[str, Engine], pooled_database_url: str, mode: str
) -> None:
    _two_server_connections(pooled_database_url)
    _repeat(engines[mode], times=30)
    with engines[mode].connect() as conn:
        assert conn.connection.driver_connection.prepare_threshold is None  # type: ignore[union-attr]


def test_the_pooler_is_detected_and_a_direct_connection_keeps_prepared_statements(
    database_url: str, pooled_database_url: str
) -> None:
    for url, pooled in ((database_url, False), (pooled_database_url, True)):
        with psycopg.connect(_libpq(url)) as conn:
            assert behind_a_pooler(conn) is pooled
            assert not conn.info.transaction_status  # left idle, no transaction open
    direct = make_engine(database_url, pool_size=1)
    try:
        with direct.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold == 5  # type: ignore[union-attr]
    finally:
        direct.dispose()


def test_a_bad_prepare_mode_is_refused_with_the_choices(database_url: str) -> None:
    with pytest.raises(ValueError, match="auto, on, off"):
        make_engine(database_url, prepare="sometimes")  # type: ignore[arg-type]


def test_submit_and_drive_runs_through_the_pooler(
    settings: Settings, pooled_database_url: str, pgbouncer: PgBouncer
) -> None:
    """The API's submit (the first ``POST /api/runs`` answered 500 on PgBouncer 1.18) and
    the driver's claim, checkpoints and hand-over, many times over, all through the pooler."""
    _two_server_connections(pooled_database_url)
    pooled = dataclasses.replace(settings, database_url=pooled_database_url)
    llm = ScriptedLlm()
    runtime = Runtime.build(pooled, llm=llm, pool_size=2)
    celery: Celery = make_celery(pooled, register=False)
    try:
        runtime.tickets.seed()
        client = api.create_app(runtime=runtime, celery=celery).test_client()
        ids = []
        for i in range(8):
            response = client.post("/api/runs", json={"input": f"overdue tickets? {i}"})
            assert response.status_code == 201, response.get_data(as_text=True)
            ids.append(uuid.UUID(response.get_json()["id"]))
        driver = runtime.driver()
        for run_id in ids:
            llm.then_tool_use(f"toolu_{run_id.hex[:8]}", "list_tickets", {"overdue": True})
            llm.then_text("done")
            run = runtime.store.get_run(run_id)
            outcomes = drive_to_end(driver, Dispatch(run.id, run.dispatch_token))
            assert outcomes[-1] is Outcome.FINISHED
            assert runtime.store.get_run(run_id).status is RunStatus.SUCCEEDED
            assert client.get(f"/api/runs/{run_id}/timeline").status_code == 200
        listed = client.get("/api/runs?limit=50").get_json()
        assert len(listed["items"]) == 8
    finally:
        celery.close()
        runtime.close()
    assert "prepared statement" not in pgbouncer.log_text()
