"""drive_run and reap through Celery's real task code and real Redis.

Messages are published to this test's own queue; the queue's length in Redis is the number
of drive_run chains alive for the run.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis
from celery import Celery

from api import create_app
from cli.embedded import EmbeddedRedis
from db.records import RunStatus
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import tool
from tasks.celery_app import DRIVE_RUN, REAP, make_celery
from tasks.drive import stop_worker_state
from tests.support import (
    clear_queued,
    expire_lease,
    queued_count,
    queued_raw,
    register_agent,
    submit,
)


def _queued(client: redis.Redis, queue: str) -> list[tuple[str, str]]:
    """(run_id, token) of every drive_run message waiting in the queue."""
    out = []
    for raw in queued_raw(client, queue):
        msg = json.loads(raw)
        assert msg["headers"]["task"] == DRIVE_RUN
        body = json.loads(__import__("base64").b64decode(msg["body"]))
        args = body[0]
        out.append((args[0], args[1]))
    return out


def _celery(settings: Settings, runtime: Runtime) -> Iterator[Celery]:
    app = make_celery(settings)
    app.dar_runtime = runtime
    try:
        yield app
    finally:
        stop_worker_state(app)


@pytest.fixture
def celery_app(settings: Settings, runtime: Runtime) -> Iterator[Celery]:
    yield from _celery(settings, runtime)


def test_duplicated_message_adds_no_step_and_no_second_chain(
    celery_app: Celery, runtime: Runtime, llm: ScriptedLlm, redis_client: redis.Redis
) -> None:
    llm.then_tool_use("toolu_1", "noop").then_text("done")
    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store)
    drive_run = celery_app.tasks[DRIVE_RUN]

    assert drive_run.run(str(run.id), str(dispatch.token)) == "CONTINUE"
    assert drive_run.run(str(run.id), str(dispatch.token)) == "DROPPED", "redelivery"
    assert len(runtime.store.steps(run.id)) == 1
    assert len(llm.requests) == 1
    queued = _queued(redis_client, runtime.settings.queue)
    assert queued == [(str(run.id), str(runtime.store.get_run(run.id).dispatch_token))]


def test_duplicate_delivered_while_the_step_runs_is_dropped(
    celery_app: Celery, runtime: Runtime, llm: ScriptedLlm, redis_client: redis.Redis
) -> None:
    in_tool = threading.Event()
    release = threading.Event()
    outcomes: list[str] = []

    @tool(idempotent=True)
    def slow() -> str:
        """Slow."""
        in_tool.set()
        release.wait(10)
        return "ok"

    llm.then_tool_use("toolu_1", "slow").then_text("done")
    register_agent(runtime.agents, slow)
    run, dispatch = submit(runtime.store)
    drive_run = celery_app.tasks[DRIVE_RUN]
    assert drive_run.run(str(run.id), str(dispatch.token)) == "CONTINUE"
    clear_queued(redis_client, runtime.settings.queue)
    token = str(runtime.store.get_run(run.id).dispatch_token)

    first = threading.Thread(target=lambda: outcomes.append(drive_run.run(str(run.id), token)))
    first.start()
    assert in_tool.wait(10)
    outcomes.append(drive_run.run(str(run.id), token))  # the duplicate, mid-step
    release.set()
    first.join(10)
    assert sorted(outcomes) == ["CONTINUE", "DROPPED"]
    assert [s.step_key for s in runtime.store.steps(run.id)] == ["model:1", "tool:toolu_1"]
    assert len(_queued(redis_client, runtime.settings.queue)) == 1, "one chain"


def test_stale_message_after_redispatch_is_dropped(
    celery_app: Celery, runtime: Runtime, llm: ScriptedLlm, redis_client: redis.Redis
) -> None:
    llm.then_text("done")
    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store)
    runtime.store.mark_undispatched(dispatch)  # as if the message was lost
    assert celery_app.tasks[REAP].run() == 1
    (queued,) = _queued(redis_client, runtime.settings.queue)
    assert queued[1] != str(dispatch.token)
    # The "lost" message turns up after all: stale, it runs nothing.
    assert celery_app.tasks[DRIVE_RUN].run(str(run.id), str(dispatch.token)) == "DROPPED"
    assert celery_app.tasks[DRIVE_RUN].run(*queued) == "FINISHED"  # its answer ended it
    assert llm.requests
    assert len(llm.requests) == 1


def test_reaper_redispatches_a_run_whose_worker_died(
    celery_app: Celery, runtime: Runtime, llm: ScriptedLlm, redis_client: redis.Redis
) -> None:
    llm.then_text("done")
    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store)
    assert runtime.store.claim(run.id, dispatch.token, "dead-worker", 30) is not None
    assert celery_app.tasks[REAP].run() == 0, "lease is live"
    expire_lease(runtime.engine, run.id)
    assert celery_app.tasks[REAP].run() == 1
    assert celery_app.tasks[REAP].run() == 0, "only once"
    (queued,) = _queued(redis_client, runtime.settings.queue)
    assert celery_app.tasks[DRIVE_RUN].run(*queued) == "FINISHED"  # its answer ended it
    assert runtime.store.steps(run.id)[0].worker == runtime.settings.worker_name


def test_submit_while_redis_is_down_then_the_reaper_dispatches(
    settings: Settings, runtime: Runtime, llm: ScriptedLlm
) -> None:
    private = EmbeddedRedis()
    private.start()
    try:
        local = replace(settings, redis_url=private.url)
        api_celery = make_celery(local, register=False)
        client = create_app(runtime=runtime, celery=api_celery).test_client()
        private.stop()  # Redis dies

        resp = client.post("/api/runs", json={"input": "Which acme tickets are overdue?"})
        assert resp.status_code == 201, resp.json
        run_id = uuid.UUID(resp.json["id"])
        assert runtime.store.get_run(run_id).status is RunStatus.QUEUED

        private.start()  # Redis is back, empty: the message never reached it
        worker_celery = make_celery(local)
        worker_celery.dar_runtime = runtime
        try:
            assert worker_celery.tasks[REAP].run() == 1
            back = redis.Redis.from_url(private.url)
            (queued,) = _queued(back, local.queue)
            assert queued[0] == str(run_id)
            assert queued[1] == str(runtime.store.get_run(run_id).dispatch_token)
            back.close()
        finally:
            stop_worker_state(worker_celery)
    finally:
        private.stop()


def test_a_fenced_out_task_ends_cleanly_and_sends_nothing(
    celery_app: Celery, runtime: Runtime, llm: ScriptedLlm, redis_client: redis.Redis
) -> None:
    llm.then_text("late")
    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store)

    class TakenOverMidCall:
        def send(self, request: object) -> object:
            expire_lease(runtime.engine, run.id)  # this worker stalls past its lease...
            (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
            assert runtime.store.claim(run.id, redispatch.token, "other", 30) is not None
            return llm.send(request)  # type: ignore[arg-type]

    runtime.llm = TakenOverMidCall()  # type: ignore[assignment]
    assert celery_app.tasks[DRIVE_RUN].run(str(run.id), str(dispatch.token)) == "LEASE_LOST"
    assert runtime.store.steps(run.id) == []
    assert queued_count(redis_client, runtime.settings.queue) == 0, "no message: it was fenced"
    assert runtime.store.get_run(run.id).locked_by == "other"
