"""Metrics after runs with known usage: the worker's own endpoint and the API's /metrics."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import replace

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry
from sqlalchemy import text

from api import create_app
from cli.embedded import free_port
from db.records import ReadyRuns, RunStatus
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.observe.metrics import Metrics
from runtime.tools import tool
from tasks.celery_app import DRIVE_RUN, make_celery
from tasks.drive import stop_worker_state
from tests.support import drive_to_end, expire_lease, register_agent, submit

PRICES = {"claude-test": {"input": 3, "output": 15, "cache_write": 3.75, "cache_read": 0.3}}


@tool(idempotent=True)
def noop() -> str:
    """Nothing."""
    return "ok"


def test_driver_records_tokens_cost_latency_and_duration(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    registry = CollectorRegistry()
    llm.model = "claude-test-model"
    llm.then_tool_use("toolu_1", "noop", {}, 1000, 200).then_text("done", 2000, 100)
    register_agent(runtime.agents, noop)
    runtime.pricing = type(runtime.pricing).from_json(json.dumps(PRICES))
    run, dispatch = submit(runtime.store)
    drive_to_end(runtime.driver(metrics=Metrics(registry)), dispatch)
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    model = "claude-test-model"
    assert value("dar_tokens_total", model=model, direction="input") == 3000
    assert value("dar_tokens_total", model=model, direction="output") == 300
    # 3000 * 3 / 1e6 + 300 * 15 / 1e6
    assert value("dar_cost_usd_total", model=model) == pytest.approx(0.0135)
    assert value("dar_step_latency_seconds_count", kind="MODEL", outcome="ok") == 2
    assert value("dar_step_latency_seconds_count", kind="TOOL", outcome="ok") == 1
    assert value("dar_run_duration_seconds_count", status="SUCCEEDED") == 1


@pytest.fixture
def worker_app(settings: Settings, llm: ScriptedLlm) -> Iterator[tuple[Celery, int]]:
    port = free_port()
    local = replace(settings, metrics_port=port)
    rt = Runtime.build(local, llm=llm)
    app = make_celery(local)
    app.dar_runtime = rt
    try:
        yield app, port
    finally:
        stop_worker_state(app)
        rt.close()


def test_the_worker_serves_its_metrics(worker_app: tuple[Celery, int], llm: ScriptedLlm) -> None:
    app, port = worker_app
    rt: Runtime = app.dar_runtime
    llm.then_text("hi", 40, 2)
    register_agent(rt.agents)
    run, dispatch = submit(rt.store)
    assert app.tasks[DRIVE_RUN].run(str(run.id), str(dispatch.token)) == "FINISHED"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    assert 'dar_tokens_total{direction="input",model="scripted"} 40.0' in body
    assert 'dar_step_latency_seconds_count{kind="MODEL",outcome="ok"} 1.0' in body


def test_api_metrics_show_fleet_gauges_and_http(runtime: Runtime, llm: ScriptedLlm) -> None:
    register_agent(runtime.agents)
    for _ in range(3):
        submit(runtime.store)
    run, _ = submit(runtime.store)
    runtime.store.cancel(run.id)
    client = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    c = client.test_client()
    assert c.get("/healthz").status_code == 200
    body = c.get("/metrics").get_data(as_text=True)
    assert 'dar_runs{status="QUEUED"} 3.0' in body
    assert 'dar_runs{status="CANCELLED"} 1.0' in body
    assert "dar_stale_leases 0.0" in body
    assert "dar_http_request_duration_seconds" in body


def test_ready_runs_gauges_count_the_backlog_more_workers_would_shrink(
    runtime: Runtime,
) -> None:
    """dar_runs_ready counts runs a worker could take now and none holds; a timer (or a key
    slot, a rate limit) is not ready; a run in a step is in_step until its lease lapses."""
    store, engine = runtime.store, runtime.engine
    assert store.count_ready_runs() == ReadyRuns(0, 0.0, 0)
    old, _ = submit(store)
    timer, _ = submit(store)
    held, held_dispatch = submit(store)
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE run SET run_at = now() + interval '1 hour' WHERE id = :id"),
            {"id": timer.id},
        )
        conn.execute(
            text(
                "UPDATE run SET run_at = now() - interval '20 seconds',"
                " updated_at = now() - interval '12 seconds' WHERE id = :id"
            ),
            {"id": old.id},
        )
    assert store.claim(held.id, held_dispatch.token, "worker-A", 30) is not None
    ready = store.count_ready_runs()
    assert (ready.ready, ready.in_step) == (1, 1)
    assert 12 <= ready.oldest_seconds < 60, "the wait counts from the last write, not run_at"

    expire_lease(engine, held.id)  # its worker died: ready again, nobody in a step
    ready = store.count_ready_runs()
    assert (ready.ready, ready.in_step) == (2, 0)

    client = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    body = client.test_client().get("/metrics").get_data(as_text=True)
    assert "dar_runs_ready 2.0" in body
    assert "dar_runs_in_step 0.0" in body
    assert re.search(r"^dar_runs_ready_oldest_seconds 1\d\.\d+", body, re.MULTILINE), body
