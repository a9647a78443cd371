"""A body sent with ``Transfer-Encoding: chunked`` (what streaming clients send) arrives whole
on every endpoint that takes one, through the app as served (``BufferChunked`` in front), and a
decision whose body cannot be read is a 400, never an approval without its pin."""

from __future__ import annotations

import io
import json
import uuid
from dataclasses import replace
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import text
from werkzeug.test import TestResponse

from api import create_app
from api.auth import hash_token
from api.errors import ApiError
from api.validation import optional_json_body
from db.records import Dispatch
from examples.order_refund import build as build_refund
from runtime.config import Settings
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from tasks.celery_app import make_celery
from tests.support import drive_to_end

TOKENS = {
    "ann": ("read+approve+finance", "tok-ann"),
    "ci": ("read+submit+cancel", "tok-ci"),
    "root": ("admin", "tok-root"),
}


def _h(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name][1]}"}


@durable_agent("chunk-waiter")
def chunk_waiter(_: Any, steps: Steps) -> Any:
    return steps.wait_for("go")


@pytest.fixture
def app(runtime: Runtime, settings: Settings) -> Flask:
    runtime.tickets.seed()
    runtime.agents.register(build_refund(runtime.tickets))
    runtime.agents.register(chunk_waiter)
    env = ",".join(f"{n}:{r}:{hash_token(t)}:acme" for n, (r, t) in TOKENS.items())
    runtime.settings = replace(settings, api_tokens=env)
    return create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def _chunked(client: FlaskClient, path: str, body: Any, who: str = "ci") -> TestResponse:
    """POST ``body`` as a stream without a Content-Length, as a chunked request arrives."""
    return client.post(
        path,
        input_stream=io.BytesIO(json.dumps(body).encode()),
        headers={
            **_h(who),
            "Content-Type": "application/json",
            "Transfer-Encoding": "chunked",
        },
    )


def _run(client: FlaskClient, runtime: Runtime, agent: str, value: Any) -> uuid.UUID:
    created = client.post("/api/runs", json={"agent": agent, "input": value}, headers=_h("ci"))
    assert created.status_code == 201, created.get_json()
    run = runtime.store.get_run(uuid.UUID(created.get_json()["id"]))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    return run.id


def _approval(client: FlaskClient, runtime: Runtime) -> dict[str, Any]:
    run_id = _run(client, runtime, "order-refund", {"order_id": 105, "amount": 9.5, "reason": "x"})
    listed = client.get(f"/api/approvals?runId={run_id}", headers=_h("ann")).get_json()["items"]
    (approval,) = listed
    return dict(approval)


# Every verb that takes a body: sent chunked with a field the endpoint does not know, it is
# refused naming that field; a body lost on the way would be read as empty (or as no body)
# and answered otherwise.
VERBS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "submit": ("/api/runs", "ci", {"input": "Which tickets?"}),
    "schedule": ("/api/schedules", "ci", {"input": "Which tickets?", "cron": "0 9 * * *"}),
    "fork": ("/api/runs/{run}/fork", "ci", {"fromSeq": 1}),
    "resume": ("/api/runs/{run}/resume", "ci", {}),
    "resolve": ("/api/runs/{run}/resolve", "root", {"action": "fail"}),
    "message": ("/api/runs/{run}/messages", "ci", {"text": "hi"}),
    "signal": ("/api/runs/{run}/signals/go", "ci", {}),
    "approve": ("/api/approvals/{approval}/approve", "ann", {}),
    "reject": ("/api/approvals/{approval}/reject", "ann", {}),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_body_sent_chunked_arrives_whole(
    verb: str, client: FlaskClient, runtime: Runtime
) -> None:
    approval = _approval(client, runtime)
    path, who, needed = VERBS[verb]
    path = path.format(run=approval["runId"], approval=approval["id"])
    answer = _chunked(client, path, {**needed, "zzUnknown": 1}, who)
    error = answer.get_json()["error"]
    assert (answer.status_code, error["code"], error.get("field")) == (
        400,
        "unknown_field",
        "zzUnknown",
    ), f"{verb}: {error}"


def test_a_chunked_submit_starts_a_run(client: FlaskClient) -> None:
    answer = _chunked(client, "/api/runs", {"input": "Which tickets?"})
    assert answer.status_code == 201, answer.get_json()


def test_a_chunked_approval_with_a_wrong_pin_is_refused(
    client: FlaskClient, runtime: Runtime
) -> None:
    approval = _approval(client, runtime)
    answer = _chunked(
        client, f"/api/approvals/{approval['id']}/approve", {"payloadHash": "0" * 64}, "ann"
    )
    assert answer.status_code == 409, answer.get_json()
    assert answer.get_json()["error"]["code"] == "payload_changed"
    assert client.get(f"/api/approvals/{approval['id']}", headers=_h("ann")).get_json()[
        "status"
    ] == ("PENDING")


def test_a_chunked_signal_keeps_its_payload(client: FlaskClient, runtime: Runtime) -> None:
    run_id = _run(client, runtime, "chunk-waiter", "x")
    payload = {"refund": 12.5, "note": "chunked"}
    answer = _chunked(client, f"/api/runs/{run_id}/signals/go", {"payload": payload})
    assert answer.status_code == 202, answer.get_json()
    with runtime.engine.connect() as conn:
        stored = conn.execute(
            text("SELECT payload FROM run_signal WHERE run_id = :id"), {"id": run_id}
        ).scalar_one()
    assert stored == payload


def test_a_body_announced_but_unread_is_a_400_not_no_body(app: Flask) -> None:
    """Behind a server that does not buffer chunked bodies, a decision whose body cannot be
    read is refused rather than taken for a decision without a pin."""
    with app.test_request_context(
        "/api/approvals/x/approve",
        method="POST",
        input_stream=io.BytesIO(b'{"payloadHash": "00"}'),
        headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
    ):
        from flask import request

        with pytest.raises(ApiError) as refused:
            optional_json_body(request)
    assert refused.value.status == 400
    assert "Content-Length" in str(refused.value)
