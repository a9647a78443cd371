"""Runs keep their version: a run records the version of the process that stored it (a
child its parent's), its messages go to its version's queue, and a worker of another version
runs nothing of it: the message goes on to the run's own queue, nothing lost."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis
from celery import Celery

from db.records import Dispatch, NewRun, RunStatus
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.deployment import queue_name
from runtime.engine.driver import Outcome
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import DRIVE_RUN, REAP, make_celery
from tasks.dispatch import send_drive
from tasks.drive import stop_worker_state
from tests.support import register_agent, submit


def _messages(client: redis.Redis, queue: str) -> list[tuple[str, str]]:
    out = []
    for raw in client.lrange(queue, 0, -1):
        body = json.loads(base64.b64decode(json.loads(raw)["body"]))
        out.append((body[0][0], body[0][1]))
    return out


@pytest.fixture
def versions(settings: Settings, llm: ScriptedLlm) -> Iterator[tuple[Runtime, Runtime]]:
    """Two processes of one deployment's database: the code of v1, the code of v2."""
    built = [
        Runtime.build(replace(settings, deployment=v), llm=llm, pool_size=2) for v in ("v1", "v2")
    ]
    for rt in built:
        register_agent(rt.agents)
    try:
        yield built[0], built[1]
    finally:
        for rt in built:
            rt.close()


def _worker(settings: Settings, runtime: Runtime) -> Celery:
    app = make_celery(settings)
    app.dar_runtime = runtime
    return app


def test_a_run_starts_on_the_version_that_stored_it_and_a_child_on_its_parent_s(
    versions: tuple[Runtime, Runtime],
) -> None:
    v1, v2 = versions
    run, _ = submit(v1.store)
    assert run.deployment == "v1"
    assert v1.store.get_run(run.id).deployment == "v1"
    child, _ = v2.store.create_run(
        NewRun(
            agent="test-agent",
            input="sub-task",
            model="m",
            max_steps=5,
            token_budget=100,
            timeout_seconds=60,
            parent_run_id=run.id,
        )
    )
    assert child.deployment == "v1", "a child is part of its parent's work"
    assert submit(v2.store)[0].deployment == "v2"


def test_messages_go_to_the_queue_of_the_run_s_version(
    versions: tuple[Runtime, Runtime], settings: Settings, redis_client: redis.Redis
) -> None:
    v1, v2 = versions
    app = _worker(settings, v2)
    try:
        run, dispatch = submit(v1.store)
        assert send_drive(app, v2.store, dispatch)  # read from the row, whoever sends it
        assert _messages(redis_client, queue_name(settings.queue, "v1")) == [
            (str(run.id), str(dispatch.token))
        ]
        assert redis_client.llen(settings.queue) == 0
        assert redis_client.llen(queue_name(settings.queue, "v2")) == 0
    finally:
        app.close()


def test_a_worker_of_another_version_runs_nothing_and_sends_the_run_to_its_own_queue(
    versions: tuple[Runtime, Runtime],
    settings: Settings,
    llm: ScriptedLlm,
    redis_client: redis.Redis,
) -> None:
    v1, v2 = versions
    llm.then_text("done")
    run, dispatch = submit(v1.store)
    wrong, right = _worker(settings, v2), _worker(settings, v1)
    try:
        # The message reached v2's worker (sent before an upgrade, or to DAR_QUEUE).
        assert wrong.tasks[DRIVE_RUN].run(str(run.id), str(dispatch.token)) == "REROUTED"
        assert v1.store.steps(run.id) == [], "no step driven by the wrong version"
        assert llm.requests == [], "no model call"
        after = v1.store.get_run(run.id)
        assert after.status is RunStatus.QUEUED
        assert after.locked_by is None
        v1_queue = queue_name(settings.queue, "v1")
        assert _messages(redis_client, v1_queue) == [(str(run.id), str(dispatch.token))]
        redis_client.delete(v1_queue)

        assert right.tasks[DRIVE_RUN].run(str(run.id), str(dispatch.token)) == "FINISHED"
        assert v1.store.get_run(run.id).status is RunStatus.SUCCEEDED
        assert len(llm.requests) == 1
    finally:
        for app in (wrong, right):
            stop_worker_state(app)
            app.close()


def test_a_stale_message_of_another_version_is_dropped_not_rerouted(
    versions: tuple[Runtime, Runtime], settings: Settings, redis_client: redis.Redis
) -> None:
    v1, v2 = versions
    run, dispatch = submit(v1.store)
    v1.store.mark_undispatched(dispatch)
    wrong = _worker(settings, v2)
    try:
        stale = "00000000-0000-0000-0000-000000000001"
        assert wrong.tasks[DRIVE_RUN].run(str(run.id), stale) == "DROPPED"
        assert redis_client.llen(queue_name(settings.queue, "v1")) == 0, "no second chain"
    finally:
        stop_worker_state(wrong)
        wrong.close()


def test_a_run_with_no_version_is_driven_by_any_worker(
    versions: tuple[Runtime, Runtime], llm: ScriptedLlm
) -> None:
    v1, v2 = versions
    llm.then_text("done")
    run, dispatch = submit(v1.store)
    with v1.engine.begin() as conn:  # stored before versions existed
        conn.exec_driver_sql("UPDATE run SET deployment = NULL WHERE id = %s", (run.id,))
    result = v2.driver().drive(dispatch.run_id, dispatch.token)
    assert result.outcome is Outcome.FINISHED
    assert v2.store.get_run(run.id).status is RunStatus.SUCCEEDED


def test_the_reaper_sends_no_message_to_a_version_no_worker_serves(
    versions: tuple[Runtime, Runtime], settings: Settings, redis_client: redis.Redis
) -> None:
    v1, v2 = versions
    run, dispatch = submit(v1.store)
    v1.store.mark_undispatched(dispatch)  # its message presumed lost
    reaper = _worker(settings, v2)  # a v2 worker's beat task: v2 is live, v1 is not
    v1_queue = queue_name(settings.queue, "v1")
    try:
        assert reaper.tasks[REAP].run() == 1
        assert redis_client.llen(v1_queue) == 0, "nothing piles up in a queue nobody reads"
        assert v1.store.get_run(run.id).status is RunStatus.QUEUED

        v1.deployments.worker_seen("a-v1-worker", "v1")  # a worker of v1 starts
        v1.store.mark_undispatched(Dispatch(run.id, v1.store.get_run(run.id).dispatch_token))
        assert reaper.tasks[REAP].run() == 1
        assert _messages(redis_client, v1_queue) == [
            (str(run.id), str(v1.store.get_run(run.id).dispatch_token))
        ]
    finally:
        stop_worker_state(reaper)
        reaper.close()
