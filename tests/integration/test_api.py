"""The REST API through Flask's test client, on real PostgreSQL and real Redis.

Messages go to the per-test queue ``settings.queue`` in Redis; nothing consumes them, so the
tests count and read them there.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import redis
from celery import Celery
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import text
from werkzeug.test import TestResponse

import api
from api.validation import SUBMIT_FIELDS
from db.records import Dispatch, RunStatus
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome, StepResult
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import DRIVE_RUN, make_celery
from tests.support import drive_to_end, queued_count, queued_raw

QUESTION = "Which acme tickets are overdue?"


# -- fixtures and helpers ------------------------------------------------------------------

# fixed, not uuid4() at collection: test ids must be equal in every pytest-xdist worker
UNKNOWN_RUN = "5b0e3c1e-0000-4000-8000-00000000dead"


@pytest.fixture
def celery(settings: Settings) -> Iterator[Celery]:
    app = make_celery(settings, register=False)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def app(runtime: Runtime, celery: Celery) -> Flask:
    assert "acme-tickets" in runtime.agents, "the runs use the built-in default agent"
    assert runtime.settings.default_agent == "acme-tickets"
    return api.create_app(runtime=runtime, celery=celery)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def post_run(client: FlaskClient, body: Any = None, **headers: str) -> TestResponse:
    return client.post(
        "/api/runs", json={"input": QUESTION} if body is None else body, headers=headers
    )


def created_id(response: TestResponse) -> str:
    assert response.status_code == 201, response.get_data(as_text=True)
    run_id: str = response.get_json()["id"]
    return run_id


def assert_error(
    response: TestResponse, status: int, *, code: str | None = None, field: str | None = None
) -> dict[str, Any]:
    """Every error is JSON ``{"error": {"code", "message", "field"?}}`` with its status."""
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    body = response.get_json()
    assert isinstance(body, dict)
    assert set(body) == {"error"}
    error = body["error"]
    assert isinstance(error["code"], str)
    assert error["code"]
    assert isinstance(error["message"], str)
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    if field is not None:
        assert error["field"] == field
        assert field in error["message"], "the message names the field"
    return dict(error)


def queued(redis_client: redis.Redis, settings: Settings) -> list[dict[str, Any]]:
    """The drive_run messages waiting in the test's queue: task name and arguments."""
    out = []
    for raw in queued_raw(redis_client, settings.queue):
        message = json.loads(raw)
        body = json.loads(base64.b64decode(message["body"]))
        out.append({"task": message["headers"]["task"], "args": body[0]})
    return out


def run_count(runtime: Runtime) -> int:
    with runtime.engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM run")).scalar_one())


def dispatch_of(runtime: Runtime, run_id: str) -> Dispatch:
    run = runtime.store.get_run(uuid.UUID(run_id))
    return Dispatch(run.id, run.dispatch_token)


def drive(runtime: Runtime, run_id: str) -> StepResult:
    """Handle the run's current drive_run message, as a worker would."""
    dispatch = dispatch_of(runtime, run_id)
    return runtime.driver().drive(dispatch.run_id, dispatch.token)


# -- submitting ----------------------------------------------------------------------------


def test_submit_returns_201_queued_with_location_and_sends_one_message(
    client: FlaskClient, runtime: Runtime, redis_client: redis.Redis, settings: Settings
) -> None:
    response = post_run(client, {"input": QUESTION, "tokenBudget": 50000, "timeoutSeconds": 300})
    run_id = created_id(response)
    assert response.get_json() == {"id": run_id, "status": "QUEUED"}
    uuid.UUID(run_id)
    assert response.headers["Location"].endswith(f"/api/runs/{run_id}")
    assert client.get(response.headers["Location"]).status_code == 200

    assert queued_count(redis_client, settings.queue) == 1
    run = runtime.store.get_run(uuid.UUID(run_id))
    assert queued(redis_client, settings) == [
        {"task": DRIVE_RUN, "args": [run_id, str(run.dispatch_token)]}
    ]
    assert run.status is RunStatus.QUEUED
    assert run.agent == "acme-tickets"
    assert run.input == QUESTION
    assert run.token_budget == 50000
    assert run.model == settings.model_default
    assert run.max_steps == settings.default_max_steps
    assert 299 <= (run.deadline_at - run.created_at).total_seconds() <= 301


def test_submit_applies_defaults_and_accepts_every_field(
    client: FlaskClient, runtime: Runtime, settings: Settings
) -> None:
    default_id = created_id(post_run(client, {"input": QUESTION}))
    run = runtime.store.get_run(uuid.UUID(default_id))
    assert run.token_budget == settings.default_token_budget
    assert (
        0
        <= (run.deadline_at - run.created_at).total_seconds() - settings.default_timeout_seconds
        <= 1
    )

    full = {
        "input": QUESTION,
        "tokenBudget": settings.max_token_budget,
        "timeoutSeconds": settings.max_timeout_seconds,
        "maxSteps": 10_000,
        "model": "claude-haiku-4-5",
        "agent": "acme-tickets",
        "costBudgetUsd": 2.5,
    }
    run = runtime.store.get_run(uuid.UUID(created_id(post_run(client, full))))
    assert run.token_budget == settings.max_token_budget
    assert run.cost_budget_usd == Decimal("2.5")
    assert run.max_steps == 10_000
    assert run.model == "claude-haiku-4-5"


def _too_long(settings: Settings) -> str:
    return "x" * (settings.max_input_chars + 1)


BAD_FIELDS: list[tuple[str, Any, str, str]] = [
    # (id, body or a function of settings giving it, field, a phrase of the message)
    ("missing-input", {}, "input", "required"),
    ("input-null", {"input": None}, "input", "non-empty string"),
    ("empty-input", {"input": ""}, "input", "non-empty string"),
    ("blank-input", {"input": "   \n"}, "input", "non-empty string"),
    ("input-not-a-string", {"input": ["a"]}, "input", "non-empty string"),
    (
        "input-too-long",
        lambda s: {"input": _too_long(s)},
        "input",
        "DAR_MAX_INPUT_CHARS",
    ),
    ("budget-string", {"input": "q", "tokenBudget": "5000"}, "tokenBudget", "whole number"),
    ("budget-float", {"input": "q", "tokenBudget": 1.5}, "tokenBudget", "whole number"),
    ("budget-bool", {"input": "q", "tokenBudget": True}, "tokenBudget", "whole number"),
    ("budget-zero", {"input": "q", "tokenBudget": 0}, "tokenBudget", "between"),
    ("budget-negative", {"input": "q", "tokenBudget": -1}, "tokenBudget", "between"),
    (
        "budget-above-max",
        lambda s: {"input": "q", "tokenBudget": s.max_token_budget + 1},
        "tokenBudget",
        "DAR_MAX_TOKEN_BUDGET",
    ),
    ("timeout-zero", {"input": "q", "timeoutSeconds": 0}, "timeoutSeconds", "between"),
    (
        "timeout-above-max",
        lambda s: {"input": "q", "timeoutSeconds": s.max_timeout_seconds + 1},
        "timeoutSeconds",
        "DAR_MAX_TIMEOUT_SECONDS",
    ),
    ("timeout-string", {"input": "q", "timeoutSeconds": "60"}, "timeoutSeconds", "whole"),
    ("timeout-bool", {"input": "q", "timeoutSeconds": False}, "timeoutSeconds", "whole"),
    ("max-steps-zero", {"input": "q", "maxSteps": 0}, "maxSteps", "between"),
    ("max-steps-above", {"input": "q", "maxSteps": 10_001}, "maxSteps", "between"),
    ("max-steps-float", {"input": "q", "maxSteps": 2.5}, "maxSteps", "whole"),
    ("cost-zero", {"input": "q", "costBudgetUsd": 0}, "costBudgetUsd", "from 0.0001"),
    ("cost-negative", {"input": "q", "costBudgetUsd": -0.5}, "costBudgetUsd", "from 0.0001"),
    ("cost-string", {"input": "q", "costBudgetUsd": "5"}, "costBudgetUsd", "US dollars"),
    ("cost-bool", {"input": "q", "costBudgetUsd": True}, "costBudgetUsd", "US dollars"),
    ("cost-above-max", {"input": "q", "costBudgetUsd": 100_001}, "costBudgetUsd", "100000"),
    ("model-not-a-string", {"input": "q", "model": 42}, "model", "model name"),
    ("agent-unknown", {"input": "q", "agent": "nope"}, "agent", "known agents: acme-tickets"),
    ("agent-not-a-string", {"input": "q", "agent": 7}, "agent", "acme-tickets"),
]


@pytest.mark.parametrize(
    ("body", "field", "phrase"), [b[1:] for b in BAD_FIELDS], ids=[b[0] for b in BAD_FIELDS]
)
def test_a_bad_field_is_400_naming_it(
    client: FlaskClient,
    runtime: Runtime,
    redis_client: redis.Redis,
    settings: Settings,
    body: Any,
    field: str,
    phrase: str,
) -> None:
    payload = body(settings) if callable(body) else body
    error = assert_error(post_run(client, payload), 400, code="invalid_field", field=field)
    assert phrase in error["message"]
    assert run_count(runtime) == 0, "nothing is stored"
    assert queued_count(redis_client, settings.queue) == 0, "nothing is sent"


def test_input_at_the_limit_is_accepted(
    runtime: Runtime, celery: Celery, settings: Settings
) -> None:
    small = dataclasses.replace(runtime, settings=dataclasses.replace(settings, max_input_chars=10))
    c = api.create_app(runtime=small, celery=celery).test_client()
    assert c.post("/api/runs", json={"input": "x" * 10}).status_code == 201
    error = assert_error(c.post("/api/runs", json={"input": "x" * 11}), 400, field="input")
    assert "11 characters" in error["message"]
    assert "limit is 10" in error["message"]


def test_a_cost_budget_too_small_to_store_is_not_silently_zero(client: FlaskClient) -> None:
    response = post_run(client, {"input": QUESTION, "costBudgetUsd": 1e-9})
    if response.status_code == 201:
        stored = client.get(response.headers["Location"]).get_json()["costBudgetUsd"]
        assert stored > 0, f"accepted as above 0 but stored as {stored}"
    else:
        assert_error(response, 400, field="costBudgetUsd")


def test_an_unknown_field_is_400_naming_it_and_listing_the_allowed_ones(
    client: FlaskClient, runtime: Runtime, redis_client: redis.Redis, settings: Settings
) -> None:
    error = assert_error(
        post_run(client, {"input": QUESTION, "token_budget": 5}),
        400,
        code="unknown_field",
        field="token_budget",
    )
    assert "tokenBudget" in error["message"], "lists the allowed fields"
    assert run_count(runtime) == 0
    assert queued_count(redis_client, settings.queue) == 0


@pytest.mark.parametrize(
    ("content_type", "data"),
    [
        ("text/plain", json.dumps({"input": QUESTION})),
        ("application/x-www-form-urlencoded", "input=hello"),
        (None, json.dumps({"input": QUESTION})),
    ],
)
def test_a_body_that_is_not_json_is_415(
    client: FlaskClient, runtime: Runtime, content_type: str | None, data: str
) -> None:
    response = client.post("/api/runs", data=data, content_type=content_type)
    error = assert_error(response, 415, code="unsupported_media_type")
    assert "application/json" in error["message"]
    assert run_count(runtime) == 0


@pytest.mark.parametrize(
    ("data", "phrase"),
    [
        ('{"input": "q"', "not valid JSON"),
        ("{'input': 'q'}", "not valid JSON"),
        ("", "JSON object"),
        ('["input", "q"]', "JSON object"),
        ('"just a string"', "JSON object"),
        (b"\xff\xfe{", "not valid JSON"),
    ],
)
def test_malformed_json_is_400(
    client: FlaskClient, runtime: Runtime, data: str | bytes, phrase: str
) -> None:
    response = client.post("/api/runs", data=data, content_type="application/json")
    error = assert_error(response, 400, code="invalid_json")
    assert phrase in error["message"]
    assert run_count(runtime) == 0


def test_a_body_above_the_limit_is_413(
    runtime: Runtime, celery: Celery, settings: Settings, redis_client: redis.Redis
) -> None:
    small = dataclasses.replace(settings, max_body_bytes=1024)
    app = api.create_app(small, runtime=runtime, celery=celery)
    assert app.config["MAX_CONTENT_LENGTH"] == 1024
    client = app.test_client()
    error = assert_error(
        client.post("/api/runs", json={"input": "x" * 2000}), 413, code="body_too_large"
    )
    assert "1024" in error["message"]
    assert run_count(runtime) == 0
    assert queued_count(redis_client, settings.queue) == 0
    # Just under the limit is fine.
    assert client.post("/api/runs", json={"input": "x" * 900}).status_code == 201


# -- idempotency ---------------------------------------------------------------------------


def test_same_idempotency_key_and_body_returns_the_same_run_without_a_second_message(
    client: FlaskClient, runtime: Runtime, redis_client: redis.Redis, settings: Settings
) -> None:
    body = {"input": QUESTION, "tokenBudget": 50000}
    first = post_run(client, body, **{"Idempotency-Key": "order-42"})
    run_id = created_id(first)
    again = post_run(client, body, **{"Idempotency-Key": "order-42"})
    assert again.status_code == 200
    assert again.get_json() == {"id": run_id, "status": "QUEUED"}
    assert again.headers["Location"] == first.headers["Location"]
    # The same JSON with its keys in another order is the same request.
    reordered = post_run(
        client, {"tokenBudget": 50000, "input": QUESTION}, **{"Idempotency-Key": "order-42"}
    )
    assert reordered.status_code == 200
    assert reordered.get_json()["id"] == run_id
    assert run_count(runtime) == 1
    assert queued_count(redis_client, settings.queue) == 1, "no second message"
    # A different key is a different run.
    assert created_id(post_run(client, body, **{"Idempotency-Key": "order-43"})) != run_id
    assert queued_count(redis_client, settings.queue) == 2


def test_the_replay_reports_the_runs_current_status(client: FlaskClient) -> None:
    run_id = created_id(post_run(client, None, **{"Idempotency-Key": "k-cancel"}))
    assert client.post(f"/api/runs/{run_id}/cancel").status_code == 202
    again = post_run(client, None, **{"Idempotency-Key": "k-cancel"})
    assert again.status_code == 200
    assert again.get_json() == {"id": run_id, "status": "CANCELLED"}


def test_same_idempotency_key_with_a_different_body_is_422(
    client: FlaskClient, runtime: Runtime, redis_client: redis.Redis, settings: Settings
) -> None:
    run_id = created_id(post_run(client, {"input": QUESTION}, **{"Idempotency-Key": "k1"}))
    response = post_run(client, {"input": "something else"}, **{"Idempotency-Key": "k1"})
    error = assert_error(response, 422, code="idempotency_key_reused")
    assert "k1" in error["message"]
    assert run_id in error["message"]
    assert run_count(runtime) == 1
    assert queued_count(redis_client, settings.queue) == 1


@pytest.mark.parametrize("key", ["", "k" * 201])
def test_a_bad_idempotency_key_is_400(client: FlaskClient, runtime: Runtime, key: str) -> None:
    assert_error(post_run(client, None, **{"Idempotency-Key": key}), 400, field="Idempotency-Key")
    assert run_count(runtime) == 0


# -- listing -------------------------------------------------------------------------------


def test_list_filters_by_status_and_paginates_without_duplicates_or_gaps(
    client: FlaskClient,
) -> None:
    ids = [created_id(post_run(client, {"input": f"question {i}"})) for i in range(5)]
    for cancelled in (ids[1], ids[3]):
        assert client.post(f"/api/runs/{cancelled}/cancel").status_code == 202
    newest_first = list(reversed(ids))

    everything = client.get("/api/runs").get_json()
    assert [r["id"] for r in everything["items"]] == newest_first
    assert everything["nextCursor"] is None

    seen: list[str] = []
    sizes: list[int] = []
    cursor: str | None = None
    for _ in range(10):
        query = {"limit": "2"} | ({"cursor": cursor} if cursor else {})
        page = client.get("/api/runs", query_string=query)
        assert page.status_code == 200
        body = page.get_json()
        sizes.append(len(body["items"]))
        seen.extend(r["id"] for r in body["items"])
        cursor = body["nextCursor"]
        if cursor is None:
            break
    assert sizes == [2, 2, 1]
    assert seen == newest_first, "every run once, in order: no duplicates, no gaps"

    cancelled = client.get("/api/runs", query_string={"status": "CANCELLED"}).get_json()
    assert [r["id"] for r in cancelled["items"]] == [ids[3], ids[1]]
    assert {r["status"] for r in cancelled["items"]} == {"CANCELLED"}
    queued_runs = client.get("/api/runs", query_string={"status": "QUEUED", "limit": 2})
    body = queued_runs.get_json()
    assert [r["id"] for r in body["items"]] == [ids[4], ids[2]]
    rest = client.get(
        "/api/runs", query_string={"status": "QUEUED", "limit": 2, "cursor": body["nextCursor"]}
    ).get_json()
    assert [r["id"] for r in rest["items"]] == [ids[0]]
    assert rest["nextCursor"] is None
    succeeded = client.get("/api/runs", query_string={"status": "SUCCEEDED"}).get_json()
    assert succeeded == {"items": [], "nextCursor": None}


def test_a_page_that_ends_exactly_at_the_last_run_has_no_next_cursor(
    client: FlaskClient,
) -> None:
    for i in range(4):
        created_id(post_run(client, {"input": f"q{i}"}))
    first = client.get("/api/runs", query_string={"limit": 2}).get_json()
    second = client.get(
        "/api/runs", query_string={"limit": 2, "cursor": first["nextCursor"]}
    ).get_json()
    assert len(second["items"]) == 2
    assert second["nextCursor"] is None


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"status": "queued"}, "status"),
        ({"status": "DONE"}, "status"),
        ({"status": ""}, "status"),
        ({"limit": "0"}, "limit"),
        ({"limit": "201"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"limit": "2.5"}, "limit"),
        ({"limit": ""}, "limit"),
        ({"cursor": "not-a-cursor"}, "cursor"),
        ({"cursor": base64.urlsafe_b64encode(b"yesterday|nobody").decode()}, "cursor"),
        ({"cursor": base64.urlsafe_b64encode(b"\xff\xfe").decode()}, "cursor"),
        ({"cursor": "%%%"}, "cursor"),
    ],
)
def test_bad_list_parameters_are_400_naming_them(
    client: FlaskClient, query: dict[str, str], field: str
) -> None:
    assert_error(client.get("/api/runs", query_string=query), 400, field=field)


def test_a_unicode_digit_limit_is_400(client: FlaskClient) -> None:
    assert_error(client.get("/api/runs", query_string={"limit": "²"}), 400, field="limit")


# -- one run -------------------------------------------------------------------------------


def test_get_a_run(client: FlaskClient) -> None:
    run_id = created_id(post_run(client, {"input": QUESTION, "tokenBudget": 1234}))
    response = client.get(f"/api/runs/{run_id}")
    assert response.status_code == 200
    run = response.get_json()
    assert run["id"] == run_id
    assert run["status"] == "QUEUED"
    assert run["agent"] == "acme-tickets"
    assert run["input"] == QUESTION
    assert run["tokenBudget"] == 1234
    assert run["tokensUsed"] == 0
    assert run["cancelRequested"] is False
    assert run["finishedAt"] is None


@pytest.mark.parametrize(
    "path",
    [
        f"/api/runs/{UNKNOWN_RUN}",
        "/api/runs/not-a-uuid",
        "/api/runs/123",
        f"/api/runs/{UNKNOWN_RUN}/timeline",
        "/api/runs/not-a-uuid/timeline",
    ],
)
def test_an_unknown_run_is_404(client: FlaskClient, path: str) -> None:
    assert_error(client.get(path), 404, code="not_found")


# -- timeline ------------------------------------------------------------------------------


def test_timeline_after_driving_the_run(runtime: Runtime, celery: Celery, llm: ScriptedLlm) -> None:
    # Store the full requests, so the test shows the timeline leaves them out.
    rt = dataclasses.replace(
        runtime, settings=dataclasses.replace(runtime.settings, store_requests=True)
    )
    client = api.create_app(runtime=rt, celery=celery).test_client()
    rt.tickets.seed()
    answer = "Tickets 101, 102 and 103 are overdue."
    llm.then_tool_use("toolu_01Ab", "list_tickets", {"overdue": True}, 812, 64).then_text(
        answer, 1210, 140
    )
    run_id = created_id(post_run(client, {"input": QUESTION, "tokenBudget": 50000}))
    outcomes = drive_to_end(rt.driver(), dispatch_of(rt, run_id))
    # the last answer ended the conversation: its task ended the run too
    assert outcomes == [Outcome.CONTINUE, Outcome.CONTINUE, Outcome.FINISHED]

    run = client.get(f"/api/runs/{run_id}").get_json()
    assert run["status"] == "SUCCEEDED"
    assert run["result"] == answer
    assert run["tokensUsed"] == 812 + 64 + 1210 + 140

    response = client.get(f"/api/runs/{run_id}/timeline")
    assert response.status_code == 200
    steps = response.get_json()
    assert [(s["seq"], s["kind"], s["status"], s["toolName"]) for s in steps] == [
        (1, "MODEL", "DONE", None),
        (2, "TOOL", "DONE", "list_tickets"),
        (3, "MODEL", "DONE", None),
    ]
    for s in steps:
        assert isinstance(s["latencyMs"], int)
        assert s["latencyMs"] >= 0
    assert [s["stepKey"] for s in steps] == ["model:1", "tool:toolu_01Ab", "model:2"]
    assert steps[1]["toolUseId"] == "toolu_01Ab"
    assert [s["stopReason"] for s in steps] == ["tool_use", None, "end_turn"]
    assert [(s["inputTokens"], s["outputTokens"]) for s in steps] == [
        (812, 64),
        (0, 0),
        (1210, 140),
    ]

    # No request or response bodies: not as keys, not as content.
    for s in steps:
        assert not {"request", "response", "body", "messages", "content"} & set(s)
    raw = response.get_data(as_text=True)
    assert QUESTION not in raw, "the request (the user's input) is not in the timeline"
    assert "support operations assistant" not in raw, "nor the system prompt"
    assert "Invoice PDF shows wrong VAT rate" not in raw, "nor the tool's output"
    assert answer not in raw, "nor the model's response"
    assert '"overdue"' not in raw, "nor the tool_use input"
    # ...although the database holds them.
    with rt.engine.connect() as conn:
        stored = conn.execute(
            text("SELECT request::text, response::text FROM run_step WHERE seq = 1")
        ).one()
    assert QUESTION in stored[0]
    assert "toolu_01Ab" in stored[1]


def test_timeline_of_a_queued_run_is_empty(client: FlaskClient) -> None:
    run_id = created_id(post_run(client))
    response = client.get(f"/api/runs/{run_id}/timeline")
    assert response.status_code == 200
    assert response.get_json() == []


# -- cancel --------------------------------------------------------------------------------


def test_cancel_a_queued_run_ends_it_at_once(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    run_id = created_id(post_run(client))
    response = client.post(f"/api/runs/{run_id}/cancel")
    assert response.status_code == 202
    assert response.get_json() == {"id": run_id, "status": "CANCELLED", "cancelRequested": True}
    run = client.get(f"/api/runs/{run_id}").get_json()
    assert run["status"] == "CANCELLED"
    assert run["cancelRequested"] is True
    assert run["finishedAt"] is not None
    assert run["error"] == "cancelled by request"
    # Its drive_run message, still in the queue, runs nothing.
    result = drive(runtime, run_id)
    assert result.outcome is Outcome.DROPPED
    assert llm.requests == []


def test_cancel_a_run_whose_lease_is_live_ends_it_at_the_next_drive(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm, settings: Settings
) -> None:
    llm.then_tool_use("toolu_1", "list_tickets", {})
    run_id = created_id(post_run(client))
    # A worker has claimed the run and is inside its model call.
    claim = runtime.store.claim(
        uuid.UUID(run_id), dispatch_of(runtime, run_id).token, "worker-A", 30
    )
    assert claim is not None

    response = client.post(f"/api/runs/{run_id}/cancel")
    assert response.status_code == 202
    assert response.get_json() == {"id": run_id, "status": "RUNNING", "cancelRequested": True}
    run = client.get(f"/api/runs/{run_id}").get_json()
    assert run["status"] == "RUNNING", "a running step is not interrupted"
    assert run["cancelRequested"] is True
    assert run["lockedBy"] == "worker-A"

    # The holder finishes the step it was in and hands the run on; the next drive stops it.
    worker = runtime.driver(worker="worker-A")
    step = worker.execute(claim)
    assert step.outcome is Outcome.CONTINUE
    assert step.dispatch is not None
    final = worker.drive(step.dispatch.run_id, step.dispatch.token)
    assert final.outcome is Outcome.FINISHED
    assert final.status is RunStatus.CANCELLED
    run = client.get(f"/api/runs/{run_id}").get_json()
    assert run["status"] == "CANCELLED"
    assert run["error"] == "cancelled by request"
    assert len(llm.requests) == 1, "no model call after the cancel was noticed"
    timeline = client.get(f"/api/runs/{run_id}/timeline").get_json()
    steps = [s["kind"] for s in timeline if s["kind"] != "AUDIT"]
    assert steps == ["MODEL"], "the pending tool never ran"
    assert [s["action"] for s in timeline if s["kind"] == "AUDIT"] == ["cancel"]


def test_cancel_a_run_between_steps_ends_it_at_once(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    llm.then_tool_use("toolu_1", "list_tickets", {})
    run_id = created_id(post_run(client))
    step = drive(runtime, run_id)
    assert step.outcome is Outcome.CONTINUE
    assert client.get(f"/api/runs/{run_id}").get_json()["status"] == "RUNNING"
    response = client.post(f"/api/runs/{run_id}/cancel")
    assert response.status_code == 202
    assert response.get_json()["status"] == "CANCELLED"
    assert step.dispatch is not None
    dropped = runtime.driver().drive(step.dispatch.run_id, step.dispatch.token)
    assert dropped.outcome is Outcome.DROPPED


def test_cancel_a_finished_run_is_409(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    llm.then_text("All done.")
    succeeded = created_id(post_run(client))
    drive_to_end(runtime.driver(), dispatch_of(runtime, succeeded))
    assert client.get(f"/api/runs/{succeeded}").get_json()["status"] == "SUCCEEDED"
    error = assert_error(client.post(f"/api/runs/{succeeded}/cancel"), 409, code="already_finished")
    assert "SUCCEEDED" in error["message"]
    assert client.get(f"/api/runs/{succeeded}").get_json()["cancelRequested"] is False

    cancelled = created_id(post_run(client))
    assert client.post(f"/api/runs/{cancelled}/cancel").status_code == 202
    error = assert_error(client.post(f"/api/runs/{cancelled}/cancel"), 409, code="already_finished")
    assert "CANCELLED" in error["message"]


@pytest.mark.parametrize("run_id", [UNKNOWN_RUN, "not-a-uuid"])
def test_cancel_an_unknown_run_is_404(client: FlaskClient, run_id: str) -> None:
    assert_error(client.post(f"/api/runs/{run_id}/cancel"), 404, code="not_found")


# -- errors in general ---------------------------------------------------------------------


def test_unknown_routes_and_methods_are_json_errors(client: FlaskClient) -> None:
    assert_error(client.get("/api/nothing-here"), 404)
    assert_error(client.delete("/api/runs"), 405)
    assert_error(client.put(f"/api/runs/{uuid.uuid4()}/cancel"), 405)


def test_405_names_the_allowed_methods(client: FlaskClient) -> None:
    response = client.delete("/api/runs")
    assert response.status_code == 405
    assert {"GET", "POST"} <= set(response.allow)


# -- OpenAPI and health --------------------------------------------------------------------


def _documented(document: dict[str, Any]) -> set[tuple[str, str]]:
    methods = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
    return {
        (path, method.upper())
        for path, item in document["paths"].items()
        for method in item
        if method in methods
    }


def _registered(app: Flask) -> set[tuple[str, str]]:
    out = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        for method in rule.methods or ():
            if method not in {"HEAD", "OPTIONS"}:
                out.add((path, method))
    return out


def test_openapi_documents_every_route(client: FlaskClient, app: Flask) -> None:
    response = client.get("/api/openapi.json")
    assert response.status_code == 200
    document = response.get_json()
    registered = _registered(app)
    served = {
        (p, m) for p, m in registered if p.startswith("/api/") or p in {"/healthz", "/readyz"}
    }
    assert ("/healthz", "GET") in served
    assert ("/readyz", "GET") in served
    assert ("/api/runs", "POST") in served
    documented = _documented(document)
    assert served - documented == set(), "registered routes missing from the OpenAPI document"
    assert documented - registered == set(), "documented routes the app does not serve"
    # Path parameters are declared for every templated path.
    for path, item in document["paths"].items():
        for name in re.findall(r"{([^}]+)}", path):
            for method, operation in item.items():
                params = operation.get("parameters", []) + item.get("parameters", [])
                assert any(p.get("in") == "path" and p["name"] == name for p in params), (
                    f"{method.upper()} {path} does not declare its path parameter {name}"
                )


def test_openapi_document_is_valid() -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    from api.openapi import openapi_document

    validator.validate(openapi_document())


def test_openapi_matches_the_error_shape_and_submission_fields(client: FlaskClient) -> None:
    document = client.get("/api/openapi.json").get_json()
    schemas = document["components"]["schemas"]
    assert set(schemas["RunSubmission"]["properties"]) == set(SUBMIT_FIELDS)
    assert schemas["RunSubmission"]["required"] == ["input"]
    assert schemas["RunSubmission"]["additionalProperties"] is False
    assert schemas["Error"]["properties"]["error"]["required"] == ["code", "message"]
    # Every documented property of a run and a step is one the API returns.
    run_id = created_id(post_run(client))
    run = client.get(f"/api/runs/{run_id}").get_json()
    assert set(schemas["Run"]["properties"]) == set(run)


def test_healthz(client: FlaskClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.get_json() == {"status": "ok"}


def test_readyz_when_everything_is_up(client: FlaskClient) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.get_json() == {"status": "ready"}


def test_readyz_is_503_when_redis_does_not_answer(runtime: Runtime, settings: Settings) -> None:
    dead = make_celery(
        dataclasses.replace(settings, redis_url="redis://127.0.0.1:1/0"), register=False
    )
    try:
        client = api.create_app(runtime=runtime, celery=dead).test_client()
        response = client.get("/readyz")
    finally:
        dead.close()
    assert response.status_code == 503
    body = response.get_json()
    assert body["status"] == "unavailable"
    assert set(body["problems"]) == {"redis"}
