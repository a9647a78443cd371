"""The lean drive_run publisher writes what ``send_task`` writes; where it would differ,
``send_drive`` keeps using ``send_task``. (Real Celery workers consume its messages in every
end-to-end test: ``tests/e2e``, ``tests/chaos``.)"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis
from celery import Celery

from db.records import Dispatch, RunStatus
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.deployment import queue_name
from tasks.celery_app import DRIVE_RUN, make_celery
from tasks.dispatch import send_drive
from tasks.publish import DrivePublisher, publisher
from tests.support import submit

VARYING = ("id", "root_id")
VARYING_PROPERTIES = ("correlation_id", "delivery_tag")


def _pop(client: redis.Redis, queue: str) -> dict[str, Any]:
    raw = client.rpop(queue)
    assert isinstance(raw, bytes), "nothing was published"
    message: dict[str, Any] = json.loads(raw)
    return message


def _normalised(message: dict[str, Any]) -> dict[str, Any]:
    ids = {message["headers"][k] for k in VARYING} | {message["properties"]["correlation_id"]}
    assert len(ids) == 1, "task id, root id and correlation id are one id"
    for k in VARYING:
        message["headers"][k] = "ID"
    for k in VARYING_PROPERTIES:
        message["properties"][k] = "ID"
    return message


@pytest.fixture
def app(settings: Settings) -> Iterator[Celery]:
    app = make_celery(settings, register=False)
    yield app
    app.close()


def test_lean_message_is_the_one_send_task_writes(
    app: Celery, settings: Settings, redis_client: redis.Redis
) -> None:
    lean = publisher(app, DRIVE_RUN)
    assert lean is not None
    assert lean.queue == settings.queue
    run_id, token = str(uuid.uuid4()), str(uuid.uuid4())

    app.send_task(DRIVE_RUN, args=[run_id, token])
    celery_written = _pop(redis_client, settings.queue)
    lean.send(run_id, token)
    lean_written = _pop(redis_client, settings.queue)

    assert redis_client.llen(settings.queue) == 0
    assert _normalised(lean_written) == _normalised(celery_written)
    body = json.loads(base64.b64decode(lean_written["body"]))
    assert body[0] == [run_id, token]


def test_each_message_has_its_own_ids(app: Celery, redis_client: redis.Redis) -> None:
    lean = publisher(app, DRIVE_RUN)
    assert lean is not None
    lean.send("a", "b")
    lean.send("a", "b")
    first, second = _pop(redis_client, lean.queue), _pop(redis_client, lean.queue)
    assert first["headers"]["id"] != second["headers"]["id"]
    assert first["properties"]["delivery_tag"] != second["properties"]["delivery_tag"]


def test_a_timer_and_an_unusual_broker_go_through_send_task(
    app: Celery, settings: Settings, runtime: Runtime, redis_client: redis.Redis
) -> None:
    run, _ = submit(runtime.store)
    assert send_drive(app, runtime.store, Dispatch(run.id, run.dispatch_token, delay_seconds=30))
    timer = _pop(redis_client, queue_name(settings.queue, runtime.deployment))
    assert timer["headers"]["eta"] is not None, "a countdown's message carries its eta"

    for option in ({"global_keyprefix": "x:"}, {"queue_order_strategy": "priority"}):
        other = make_celery(settings, register=False)
        other.conf.broker_transport_options = {**other.conf.broker_transport_options, **option}
        try:
            assert publisher(other, DRIVE_RUN) is None, option
        finally:
            other.close()
    amqp = Celery("amqp", broker="amqp://guest@127.0.0.1:1//", set_as_current=False)
    assert not DrivePublisher.usable(amqp)


def test_a_dead_broker_is_reported_not_raised(runtime: Runtime, settings: Settings) -> None:
    dead = make_celery(replace(settings, redis_url="redis://127.0.0.1:1/0"), register=False)
    run, dispatch = submit(runtime.store)
    try:
        assert send_drive(dead, runtime.store, dispatch) is False
    finally:
        dead.close()
    assert runtime.store.get_run(run.id).status is RunStatus.QUEUED


def test_queued_runs_are_served_oldest_first(app: Celery, redis_client: redis.Redis) -> None:
    """The lean publisher pushes to the end Celery's ``send_task`` pushes to, the far end from
    the one workers take from: under a backlog the oldest message goes first (pushed to the
    other end, new runs would be served first and old ones starve)."""
    lean = publisher(app, DRIVE_RUN)
    assert lean is not None
    app.send_task(DRIVE_RUN, args=["run-1", "t"])
    lean.send("run-2", "t")
    lean.send("run-3", "t")
    app.send_task(DRIVE_RUN, args=["run-4", "t"])
    order = []
    for _ in range(4):  # as a worker takes them (the Redis transport pops the list's tail)
        body = json.loads(base64.b64decode(_pop(redis_client, lean.queue)["body"]))
        order.append(body[0][0])
    assert order == ["run-1", "run-2", "run-3", "run-4"]
