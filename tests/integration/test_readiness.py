"""/readyz follows PostgreSQL: a real server stopped and started again."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from api import create_app
from cli.embedded import EmbeddedPostgres
from db.engine import make_engine
from db.migrate import upgrade
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import make_celery
from tests.support import scratch_database


@pytest.mark.slow  # stops and restarts PostgreSQL: `pytest --all`
def test_readyz_turns_503_when_postgres_stops_and_200_when_it_returns(settings: Settings) -> None:
    server = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="dar-ready-")))
    url = server.start()
    engine = make_engine(url, pool_size=1)
    upgrade(engine)
    engine.dispose()
    rt = Runtime.build(replace(settings, database_url=url), llm=ScriptedLlm(), pool_size=2)
    try:
        client = create_app(
            runtime=rt, celery=make_celery(rt.settings, register=False)
        ).test_client()
        assert client.get("/readyz").status_code == 200

        server.stop()
        down = client.get("/readyz")
        assert down.status_code == 503
        assert "postgres" in down.get_json()["problems"]
        listed = client.get("/api/runs")
        assert listed.status_code == 503
        assert listed.get_json()["error"]["code"] == "database_unavailable"
        assert client.get("/healthz").status_code == 200, "the process itself is alive"

        server.start()
        assert client.get("/readyz").status_code == 200
    finally:
        rt.close()
        server.stop()


def test_readyz_reports_pending_migrations(settings: Settings, pg_admin_url: str) -> None:
    with scratch_database(pg_admin_url, "dar_unmigrated") as url:
        rt = Runtime.build(replace(settings, database_url=url), llm=ScriptedLlm(), pool_size=1)
        try:
            client = create_app(
                runtime=rt, celery=make_celery(rt.settings, register=False)
            ).test_client()
            resp = client.get("/readyz")
            assert resp.status_code == 503
            assert "dar migrate" in resp.get_json()["problems"]["migrations"]
        finally:
            rt.close()
