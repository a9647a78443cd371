"""Shared fixtures: real PostgreSQL and Redis, a fresh database per test.

PostgreSQL: ``TEST_DATABASE_URL`` or ``DATABASE_URL`` when set, otherwise an embedded server
(pgserver) started for the session. Redis: ``TEST_REDIS_URL`` or ``REDIS_URL``, otherwise an
embedded redis-server. One database is migrated once as a template; every test gets its own
copy (``CREATE DATABASE ... TEMPLATE``), so tests are isolated and fast.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from api.embedded import EmbeddedPostgres, EmbeddedRedis
from db.engine import make_engine, normalize_url
from db.migrate import upgrade
from runtime.bootstrap import Runtime
from runtime.config import Settings
from runtime.llm.scripted import ScriptedLlm

TEMPLATE = f"dar_template_{os.getpid()}"


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    url = os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if url:
        yield normalize_url(url)
        return
    server = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="dar-test-pg-")))
    try:
        yield normalize_url(server.start())
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("TEST_REDIS_URL") or os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    server = EmbeddedRedis()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def _admin_engine(url: str):  # type: ignore[no-untyped-def]
    return create_engine(url, isolation_level="AUTOCOMMIT", poolclass=None)


@pytest.fixture(scope="session")
def template_db(pg_admin_url: str) -> Iterator[str]:
    admin = _admin_engine(pg_admin_url)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{TEMPLATE}"'))
        conn.execute(text(f'CREATE DATABASE "{TEMPLATE}"'))
    url = make_url(pg_admin_url).set(database=TEMPLATE).render_as_string(hide_password=False)
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    try:
        yield TEMPLATE
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def database_url(pg_admin_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for this test."""
    name = f"dar_t_{uuid.uuid4().hex[:12]}"
    admin = _admin_engine(pg_admin_url)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"'))
    try:
        yield make_url(pg_admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def settings(database_url: str, redis_url: str) -> Settings:
    """Settings for one test: its own database, its own queue, short leases."""
    return replace(
        Settings(),
        database_url=database_url,
        redis_url=redis_url,
        queue=f"dar-test-{uuid.uuid4().hex[:10]}",
        lease_seconds=5.0,
        heartbeat_seconds=1.0,
        demo_latency_ms=0,
        worker_name="worker-A",
    )


@pytest.fixture
def llm() -> ScriptedLlm:
    return ScriptedLlm()


@pytest.fixture
def runtime(settings: Settings, llm: ScriptedLlm) -> Iterator[Runtime]:
    rt = Runtime.build(settings, llm=llm, pool_size=5)
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture
def redis_client(redis_url: str, settings: Settings) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.delete(settings.queue)
        client.close()
