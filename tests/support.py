"""Helpers shared by tests: submitting runs, expiring leases, driving a run to the end."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import replace
from decimal import Decimal
from typing import Any

import redis
from flask.testing import FlaskClient
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

import api
from db.engine import make_engine
from db.errors import DatabaseUnavailable
from db.records import Dispatch, NewRun, Run
from db.store import RunStore
from runtime.agents import Agent, AgentRegistry
from runtime.client import Event, parse_sse
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Driver, Outcome
from runtime.testing.testkit import SimulatedCrash
from runtime.tools import Tool
from tasks.celery_app import make_celery
from tests.fakes.messages_api import FakeMessagesApi
from tests.netproxy import TcpProxy

__all__ = [
    "SimulatedCrash",
    "api_client",
    "drive_to_end",
    "events_over_http",
    "expire_lease",
    "fork_over_http",
    "redis_scope",
    "register_agent",
    "scratch_database",
    "submit",
]


@contextlib.contextmanager
def redis_scope(url: str, *patterns: str) -> Iterator[redis.Redis]:
    """A Redis client for a test; the keys matching ``patterns`` are deleted afterwards."""
    client = redis.Redis.from_url(url)
    try:
        yield client
    finally:
        for pattern in patterns:
            for key in client.scan_iter(pattern):
                client.delete(key)
        client.close()


def submit(
    store: RunStore,
    text_input: str = "find x",
    *,
    agent: str = "test-agent",
    token_budget: int = 10_000,
    max_steps: int = 50,
    timeout_seconds: int = 300,
    model: str = "claude-sonnet-4-5",
    cost_budget_usd: Decimal | None = None,
    tenant: str = "",
) -> tuple[Run, Dispatch]:
    run, _ = store.create_run(
        NewRun(
            agent=agent,
            input=text_input,
            model=model,
            max_steps=max_steps,
            token_budget=token_budget,
            timeout_seconds=timeout_seconds,
            cost_budget_usd=cost_budget_usd,
            tenant=tenant,
        )
    )
    return run, Dispatch(run.id, run.dispatch_token)


def expire_lease(engine: Engine, run_id: uuid.UUID) -> None:
    """What waiting out the lease would do, without the wait (test-only SQL): the lease
    lapsed a second ago, after the run's last dispatch, as it would in real time."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE run SET locked_until = now() - interval '1 second',"
                " dispatched_at = LEAST(dispatched_at, now() - interval '2 seconds')"
                " WHERE id = :id"
            ),
            {"id": run_id},
        )


def register_agent(registry: AgentRegistry, *tools: Tool, name: str = "test-agent") -> Agent:
    return registry.register(Agent(name=name, system_prompt="You are a test agent.", tools=tools))


def drive_to_end(driver: Driver, dispatch: Dispatch, max_steps: int = 100) -> list[Any]:
    """Follow the chain of dispatches, as the Celery task would, until the run ends."""
    outcomes: list[Any] = []
    current: Dispatch | None = dispatch
    for _ in range(max_steps):
        if current is None:
            return outcomes
        result = driver.drive(current.run_id, current.token)
        outcomes.append(result.outcome)
        if result.outcome is Outcome.DROPPED:
            return outcomes
        current = result.dispatch
    raise AssertionError("run did not finish")


def dropped_connection() -> DatabaseUnavailable:
    """What the store raises when its connection drops mid-statement (the driver's
    ``OperationalError`` as the cause): the blip a checkpoint is retried across."""
    return DatabaseUnavailable.from_error(
        OperationalError("COMMIT", {}, Exception("server closed the connection"))
    )


def pointed_at(settings: Settings, fake: FakeMessagesApi, **overrides: Any) -> Settings:
    """``settings`` with the production model client pointed at the fake Messages API and
    quick retries (10-50 ms); ``overrides`` set the rest."""
    return replace(
        settings,
        **{
            "anthropic_api_key": "test-key",
            "anthropic_base_url": fake.url,
            "retry_base_seconds": 0.01,
            "retry_cap_seconds": 0.05,
            **overrides,
        },
    )


@contextlib.contextmanager
def api_client(rt: Runtime, settings: Settings) -> Iterator[FlaskClient]:
    """A test client of the REST API over ``rt``, its Celery app (no tasks registered)
    publishing to ``settings``' broker; the Celery app is closed after."""
    celery = make_celery(settings, register=False)
    try:
        yield api.create_app(runtime=rt, celery=celery).test_client()
    finally:
        celery.close()


def events_over_http(rt: Runtime, run_id: uuid.UUID) -> list[Event]:
    """The run's events as ``GET /api/runs/{id}/events`` streams them (answered 200)."""
    app = api.create_app(runtime=rt)
    app.config["TESTING"] = True
    resp = app.test_client().get(f"/api/runs/{run_id}/events")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return list(parse_sse(resp.get_data(as_text=True).splitlines()))


def fork_over_http(client: FlaskClient, run_id: uuid.UUID, from_seq: int) -> uuid.UUID:
    """The id of the fork ``POST /api/runs/{id}/fork`` makes from ``from_seq`` (answered 201)."""
    response = client.post(f"/api/runs/{run_id}/fork", json={"fromSeq": from_seq})
    assert response.status_code == 201, response.get_data(as_text=True)
    return uuid.UUID(response.get_json()["id"])


@contextlib.contextmanager
def scratch_database(admin_url: str, name: str) -> Iterator[str]:
    """The URL of an empty database ``name`` made afresh (one left by an earlier run is
    dropped first), dropped again after."""
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextlib.contextmanager
def proxied_engine(database_url: str, **engine_options: Any) -> Iterator[tuple[Engine, TcpProxy]]:
    """An engine on ``database_url`` through a TCP proxy the test can cut (a partition, a
    restart seen from the client), and the proxy; both closed after."""
    url = make_url(database_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    engine = make_engine(
        url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False),
        **engine_options,
    )
    try:
        yield engine, proxy
    finally:
        engine.dispose()
        proxy.close()


# -- drive_run queues (one per version: runtime.engine.deployment) -------------------------


def drive_queues(client: redis.Redis, base: str) -> list[str]:
    """The queues of drive_run messages under ``base`` (DAR_QUEUE): ``base`` itself and
    each version's ``base.<version>``."""
    found = {
        key.decode()
        for key in client.scan_iter(match=f"{base}*")
        if key.decode() == base or key.decode().startswith(f"{base}.")
    }
    return sorted(q for q in found if client.type(q) == b"list")


def queued_raw(client: redis.Redis, base: str) -> list[bytes]:
    """Every message waiting in the queues under ``base``."""
    out: list[bytes] = []
    for queue in drive_queues(client, base):
        out.extend(client.lrange(queue, 0, -1))  # type: ignore[arg-type]
    return out


def queued_count(client: redis.Redis, base: str) -> int:
    return sum(int(client.llen(q)) for q in drive_queues(client, base))  # type: ignore[arg-type]


def clear_queued(client: redis.Redis, base: str) -> None:
    for queue in drive_queues(client, base):
        client.delete(queue)


# -- a stack of real processes whose model is a fake over HTTP ------------------------------


@contextlib.contextmanager
def stack_against(
    api_url: str,
    *,
    database_url: str,
    redis_url: str,
    settings: Settings,
    tmp_path: Any,
    workers: int,
    env: dict[str, str] | None = None,
    tail: int = 8000,
) -> Iterator[Any]:
    """``dar dev``'s supervisor (web, ``workers`` workers, beat) as the Procfile ships it (its
    pool, concurrency and leases), on the test's database and Redis, its model client pointed
    at the fake at ``api_url``; no DAR_* or ANTHROPIC_* setting of this process leaks in
    (``env`` adds some). Its log's last ``tail`` characters are printed when it stops. (The
    e2e tests' :func:`tests.e2e.stack.running_stack`, with the shipped settings.)"""
    from tests.e2e.stack import running_stack

    with running_stack(
        tmp_path,
        database_url,
        redis_url,
        settings,
        workers=workers,
        concurrency=None,
        log_tail=tail,
        leases={},
        own_settings_only=True,
        **{"ANTHROPIC_API_KEY": "test-key", "ANTHROPIC_BASE_URL": api_url, **(env or {})},
    ) as s:
        yield s
