"""Issue 12, through the app on real PostgreSQL and Redis: tenants (3), the audit trail (4),
hostile text and what reaches the log (5), the contract (7), token roles at start (8)."""

from __future__ import annotations

import io
import logging
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from werkzeug.test import TestResponse

from api import create_app
from api.auth import hash_token
from db.records import Dispatch
from examples.order_refund import build as build_refund
from runtime.config import ConfigError, Settings
from runtime.engine.bootstrap import Runtime
from runtime.observe.logctx import configure_logging
from tasks.celery_app import make_celery
from tests.support import drive_to_end

SECRET = "PROMPT-7f3a-do-not-log"

# name: (roles, token, tenant)
TOKENS = {
    "alice": ("read+submit+cancel", "tok-alice", "red"),
    "amy": ("submit", "tok-amy", "red"),
    "ann": ("read+approve+finance", "tok-ann", "red"),
    "bob": ("read+submit+cancel+approve+finance", "tok-bob", "blue"),
    "root": ("admin", "tok-root", "ops"),
}


def _env(tokens: dict[str, tuple[str, str, str]] = TOKENS) -> str:
    return ",".join(
        f"{name}:{roles}:{hash_token(tok)}:{tenant}"
        for name, (roles, tok, tenant) in tokens.items()
    )


def _h(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name][1]}"}


@pytest.fixture
def client(runtime: Runtime, settings: Settings) -> FlaskClient:
    runtime.tickets.seed()
    runtime.agents.register(build_refund(runtime.tickets))
    runtime.settings = replace(settings, api_tokens=_env())
    return create_app(
        runtime=runtime, celery=make_celery(runtime.settings, register=False)
    ).test_client()


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buffer = io.StringIO()
    configure_logging("json", "DEBUG", stream=buffer)
    yield buffer
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def _submit(client: FlaskClient, who: str, body: Any = None, **headers: str) -> TestResponse:
    return client.post(
        "/api/runs", json=body or {"input": "Which tickets?"}, headers={**_h(who), **headers}
    )


def _fail_run(runtime: Runtime, run_id: str) -> None:
    with runtime.engine.begin() as conn:
        conn.execute(
            text("UPDATE run SET status = 'FAILED', finished_at = now() WHERE id = :id"),
            {"id": run_id},
        )


# -- 3. tenants ------------------------------------------------------------------------------


def test_idempotency_keys_are_per_tenant(client: FlaskClient) -> None:
    a = _submit(client, "alice", **{"Idempotency-Key": "k1"})
    b = _submit(client, "bob", **{"Idempotency-Key": "k1"})
    assert (a.status_code, b.status_code) == (201, 201)
    assert a.get_json()["id"] != b.get_json()["id"], "token B does not get token A's run"
    again = _submit(client, "amy", **{"Idempotency-Key": "k1"})
    assert (again.status_code, again.get_json()["id"]) == (200, a.get_json()["id"]), (
        "the same tenant's retry is the same run"
    )


def test_another_tenants_run_is_not_there(client: FlaskClient, runtime: Runtime) -> None:
    run_id = _submit(client, "alice").get_json()["id"]
    for method, path in [
        ("get", f"/api/runs/{run_id}"),
        ("get", f"/api/runs/{run_id}/timeline"),
        ("post", f"/api/runs/{run_id}/cancel"),
        ("post", f"/api/runs/{run_id}/resume"),
    ]:
        response = getattr(client, method)(path, headers=_h("bob"))
        assert response.status_code == 404, (path, response.get_json())
    assert client.get("/api/runs", headers=_h("bob")).get_json()["items"] == []
    assert [r["id"] for r in client.get("/api/runs", headers=_h("alice")).get_json()["items"]] == [
        run_id
    ]
    everyone = client.get("/api/runs", headers=_h("root")).get_json()["items"]
    assert [r["id"] for r in everyone] == [run_id], "admin sees every tenant"
    assert everyone[0]["tenant"] == "red"
    assert runtime.store.get_run(uuid.UUID(run_id)).status.value == "QUEUED", "not cancelled"


def test_another_tenants_approvals_are_not_there(client: FlaskClient, runtime: Runtime) -> None:
    created = _submit(
        client,
        "alice",
        {"agent": "order-refund", "input": {"order_id": 105, "amount": 9.5, "reason": "x"}},
    )
    run = runtime.store.get_run(uuid.UUID(created.get_json()["id"]))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    (mine,) = client.get("/api/approvals", headers=_h("ann")).get_json()["items"]
    assert client.get("/api/approvals", headers=_h("bob")).get_json()["items"] == []
    assert client.get(f"/api/approvals/{mine['id']}", headers=_h("bob")).status_code == 404
    stolen = client.post(f"/api/approvals/{mine['id']}/approve", headers=_h("bob"))
    assert stolen.status_code == 404, "bob holds finance, but not in red's tenant"


def test_resume_beyond_the_runs_own_limits_needs_admin(
    client: FlaskClient, runtime: Runtime
) -> None:
    run_id = _submit(
        client, "alice", {"input": "q", "tokenBudget": 1000, "timeoutSeconds": 600}
    ).get_json()["id"]
    _fail_run(runtime, run_id)
    path = f"/api/runs/{run_id}/resume"
    more = client.post(path, json={"tokenBudget": 100_000}, headers=_h("amy"))
    assert more.status_code == 403
    assert "admin" in more.get_json()["error"]["message"]
    longer = client.post(path, json={"timeoutSeconds": 7 * 86400}, headers=_h("amy"))
    assert longer.status_code == 403
    assert runtime.store.get_run(uuid.UUID(run_id)).token_budget == 1000, "nothing changed"
    within = client.post(
        path, json={"tokenBudget": 1000, "timeoutSeconds": 300.0}, headers=_h("amy")
    )
    assert within.status_code == 202, within.get_json()
    _fail_run(runtime, run_id)
    admin = client.post(path, json={"tokenBudget": 100_000}, headers=_h("root"))
    assert admin.status_code == 202
    assert runtime.store.get_run(uuid.UUID(run_id)).token_budget == 100_000


# -- 4. who did what -------------------------------------------------------------------------


def test_actions_are_recorded_in_an_append_only_audit_trail(
    client: FlaskClient, runtime: Runtime
) -> None:
    created = _submit(
        client,
        "alice",
        {"agent": "order-refund", "input": {"order_id": 105, "amount": 9.5, "reason": "x"}},
    )
    run_id = created.get_json()["id"]
    run = runtime.store.get_run(uuid.UUID(run_id))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    (approval,) = client.get("/api/approvals", headers=_h("ann")).get_json()["items"]
    decided = client.post(
        f"/api/approvals/{approval['id']}/reject", json={"comment": "no"}, headers=_h("ann")
    )
    assert decided.status_code == 200
    assert client.post(f"/api/runs/{run_id}/cancel", headers=_h("alice")).status_code == 202
    audit = client.get(f"/api/runs/{run_id}", headers=_h("alice")).get_json()["audit"]
    assert [(a["action"], a["actor"]) for a in audit] == [
        ("submit", "alice"),
        ("reject", "ann"),
        ("cancel", "alice"),
    ]
    assert audit[1]["approvalId"] == approval["id"]
    assert all(a["at"] for a in audit)
    timeline = client.get(f"/api/runs/{run_id}/timeline", headers=_h("alice")).get_json()
    entries = [(s["action"], s["actor"]) for s in timeline if s["kind"] == "AUDIT"]
    assert entries == [("reject", "ann"), ("cancel", "alice")], "the submit is createdAt's"
    with pytest.raises(DBAPIError, match="append-only"), runtime.engine.begin() as conn:
        conn.execute(text("UPDATE audit_event SET actor = 'mallory'"))
    with pytest.raises(DBAPIError, match="append-only"), runtime.engine.begin() as conn:
        conn.execute(text("DELETE FROM audit_event"))


def test_refused_actions_leave_no_audit_entry(client: FlaskClient, runtime: Runtime) -> None:
    run_id = _submit(client, "alice").get_json()["id"]
    _fail_run(runtime, run_id)
    assert client.post(f"/api/runs/{run_id}/cancel", headers=_h("alice")).status_code == 409
    assert [e.action for e in runtime.store.audit_events(uuid.UUID(run_id))] == ["submit"]


# -- 5. hostile text, and what the log says ----------------------------------------------------


def _raw(client: FlaskClient, path: str, raw: str, who: str = "root") -> TestResponse:
    return client.post(path, data=raw, content_type="application/json", headers=_h(who))


HOSTILE: list[tuple[str, str, str]] = [
    # (id, raw JSON body for POST /api/runs, the field the 400 names)
    ("nul-input", '{"input": "' + SECRET + '\\u0000"}', "input"),
    ("surrogate-input", '{"input": "' + SECRET + '\\ud800"}', "input"),
    ("nul-model", '{"input": "' + SECRET + '", "model": "claude\\u0000"}', "model"),
    (
        "durable-json-key",
        '{"agent": "order-refund", "input": {"a": {"' + SECRET + '\\u0000": 1}}}',
        f"input.a.{SECRET}\x00",
    ),
    (
        "durable-json-value",
        '{"agent": "order-refund", "input": {"a": ["ok", "' + SECRET + '\\udfff"]}}',
        "input.a[1]",
    ),
    ("deep", '{"input": ' + "[" * 1000 + "]" * 1000 + "}", ""),
    ("deep-100", '{"agent": "order-refund", "input": ' + "[" * 100 + "]" * 100 + "}", ""),
]


@pytest.mark.parametrize(("raw", "field"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_submissions_are_400_naming_the_field_and_never_logged(
    client: FlaskClient, runtime: Runtime, captured: io.StringIO, raw: str, field: str
) -> None:
    response = _raw(client, "/api/runs", raw)
    assert response.status_code == 400, response.get_data(as_text=True)[:300]
    error = response.get_json()["error"]
    if field:
        assert error["field"] == field
    else:
        assert "nested" in error["message"]
    with runtime.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM run")).scalar_one() == 0
    assert SECRET not in captured.getvalue()


def test_hostile_comments_reasons_and_queries_are_400(
    client: FlaskClient, runtime: Runtime, captured: io.StringIO
) -> None:
    aid = uuid.uuid4()
    rid = _submit(client, "alice").get_json()["id"]
    cases = [
        (
            _raw(client, f"/api/approvals/{aid}/approve", '{"comment": "x\\u0000"}', "ann"),
            "comment",
        ),
        (
            _raw(client, f"/api/runs/{rid}/resolve", '{"action": "fail", "reason": "\\ud83d"}'),
            "reason",
        ),
        (
            _raw(
                client,
                f"/api/runs/{rid}/resolve",
                '{"action": "supply_result", "output": {"k": "\\u0000"}}',
            ),
            "output.k",
        ),
        (client.get("/api/approvals?role=fin%00ance", headers=_h("ann")), "role"),
        (client.get("/api/runs?status=QUEUED%00", headers=_h("alice")), "status"),
        (client.get("/api/runs?cursor=%00", headers=_h("alice")), "cursor"),
        (client.get("/api/runs?sort=name", headers=_h("alice")), "sort"),
    ]
    for response, field in cases:
        body = response.get_json()
        assert response.status_code == 400, (field, body)
        assert body["error"]["field"] == field, body
    nul_key = client.post(
        "/api/runs", json={"input": "q"}, headers={**_h("alice"), "Idempotency-Key": "k\x00"}
    )
    assert nul_key.status_code == 400, nul_key.get_json()


def test_database_errors_never_log_statement_parameters(
    runtime: Runtime, settings: Settings, captured: io.StringIO
) -> None:
    """Whatever slips past validation: the engine hides parameters, and the API's error
    handler logs the error's kind, never its text (which can quote the data)."""
    app = create_app(runtime=runtime, celery=make_celery(settings, register=False))

    @app.get("/probe/<kind>")
    def probe(kind: str) -> str:
        if kind == "data":  # a value the store's statement refuses; PostgreSQL quotes it
            runtime.store.get_run(SECRET)  # type: ignore[arg-type]
        with runtime.engine.connect() as conn:  # a raised error whose message carries it
            conn.execute(text("SELECT 1 / 0 WHERE :v <> ''"), {"v": SECRET})
        return "unreachable"

    client = app.test_client()
    assert client.get("/probe/data").status_code == 400
    assert client.get("/probe/other").status_code in (400, 500)
    logged = captured.getvalue()
    assert "database" in logged, "the error is logged"
    assert SECRET not in logged
    with pytest.raises(DBAPIError) as raised, runtime.engine.connect() as conn:
        conn.execute(text("SELECT 1 / 0 WHERE :v <> ''"), {"v": SECRET})
    assert SECRET not in str(raised.value), "hide_parameters on the engine"


# -- 7. the contract ---------------------------------------------------------------------------


def test_the_document_states_every_kind_and_status_the_api_returns(client: FlaskClient) -> None:
    from db.records import StepKind, StepStatus

    step = client.get("/api/openapi.json").get_json()["components"]["schemas"]["Step"]
    assert set(step["properties"]["kind"]["enum"]) == {*map(str, StepKind), "AUDIT"}
    assert set(step["properties"]["status"]["enum"]) == set(map(str, StepStatus))
    assert "PENDING" in step["properties"]["status"]["enum"]


def test_nulls_and_whole_floats_mean_the_same_in_the_document_and_the_api(
    client: FlaskClient, runtime: Runtime
) -> None:
    doc = client.get("/api/openapi.json").get_json()["components"]["schemas"]
    assert "null" in doc["Decision"]["properties"]["payloadHash"]["type"]
    assert doc["Resume"]["properties"]["timeoutSeconds"]["type"] == ["integer", "null"]
    run_id = _submit(client, "alice").get_json()["id"]
    _fail_run(runtime, run_id)
    ok = client.post(
        f"/api/runs/{run_id}/resume", json={"timeoutSeconds": 300.0}, headers=_h("root")
    )
    assert ok.status_code == 202, "300.0 is the whole number 300, as submit says"
    bad = _raw(client, f"/api/approvals/{uuid.uuid4()}/approve", '{"payloadHash": "abc"}', "ann")
    assert bad.status_code in (400, 404)


# -- 8. roles ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("role", "hint"), [("reed", "read"), ("admn", "admin")])
def test_a_misspelt_role_fails_at_start(
    runtime: Runtime, settings: Settings, role: str, hint: str
) -> None:
    runtime.settings = replace(settings, api_tokens=f"ci:{role}:{hash_token('t')}")
    with pytest.raises(ConfigError, match=f"unknown role '{role}'.*did you mean '{hint}'"):
        create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))


def test_admin_does_not_decide_an_approval_whose_role_it_lacks(
    client: FlaskClient, runtime: Runtime
) -> None:
    created = _submit(
        client,
        "root",
        {"agent": "order-refund", "input": {"order_id": 105, "amount": 9.5, "reason": "x"}},
    )
    run = runtime.store.get_run(uuid.UUID(created.get_json()["id"]))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    (approval,) = client.get("/api/approvals", headers=_h("root")).get_json()["items"]
    refused = client.post(f"/api/approvals/{approval['id']}/approve", headers=_h("root"))
    assert refused.status_code == 403
    assert "admin does not imply approval roles" in refused.get_json()["error"]["message"]
