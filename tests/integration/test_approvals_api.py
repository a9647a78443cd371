"""Approvals through REST: roles, the payload hash, idempotent and race-safe decisions,
starting durable functions with JSON input, resume, and the pending-approvals gauge."""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis
from flask.testing import FlaskClient

from api import create_app
from api.auth import hash_token
from db.records import Dispatch
from examples.order_refund import build as build_refund
from runtime.config import ConfigError, Settings
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from tasks.celery_app import make_celery
from tests.support import clear_queued, drive_to_end, queued_count

TOKENS = {
    "ann": ("read+approve+finance", "tok-ann"),
    "sam": ("read+approve", "tok-sam"),
    "ci": ("read+submit+cancel", "tok-ci"),
    "prom": ("metrics", "tok-prom"),
}


def _env() -> str:
    # One tenant: the approvers see the runs the ci token submits.
    return ",".join(f"{n}:{roles}:{hash_token(t)}:acme" for n, (roles, t) in TOKENS.items())


def _h(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name][1]}"}


@pytest.fixture
def client(runtime: Runtime, settings: Settings) -> FlaskClient:
    runtime.tickets.seed()
    runtime.agents.register(build_refund(runtime.tickets))
    runtime.settings = replace(settings, api_tokens=_env())
    app = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    return app.test_client()


def _waiting_refund(client: FlaskClient, runtime: Runtime) -> tuple[str, dict[str, object]]:
    created = client.post(
        "/api/runs",
        json={"agent": "order-refund", "input": {"order_id": 105, "amount": 9.5, "reason": "x"}},
        headers=_h("ci"),
    )
    assert created.status_code == 201, created.get_json()
    run_id = created.get_json()["id"]
    run = runtime.store.get_run(__import__("uuid").UUID(run_id))
    drive_to_end(
        runtime.driver(),
        __import__("db.records", fromlist=["Dispatch"]).Dispatch(run.id, run.dispatch_token),
    )
    listed = client.get("/api/approvals?role=finance", headers=_h("ann")).get_json()["items"]
    (approval,) = [a for a in listed if a["runId"] == run_id]
    return run_id, approval


def test_list_filter_and_decide_with_the_right_role(
    client: FlaskClient, runtime: Runtime, redis_client: redis.Redis
) -> None:
    run_id, approval = _waiting_refund(client, runtime)
    assert approval["status"] == "PENDING"
    assert approval["payload"]["stepKey"] == "pay:0"
    assert client.get("/api/approvals?role=support_lead", headers=_h("sam")).get_json() == {
        "items": []
    }
    path = f"/api/approvals/{approval['id']}/approve"
    assert client.post(path, headers=_h("sam")).status_code == 403, "wrong approval role"
    assert client.post(path, headers=_h("ci")).status_code == 403, "no approve role"
    assert client.post(path).status_code == 401
    clear_queued(redis_client, runtime.settings.queue)
    ok = client.post(
        path, json={"comment": "fine", "payloadHash": approval["payloadHash"]}, headers=_h("ann")
    )
    assert ok.status_code == 200, ok.get_json()
    body = ok.get_json()
    assert (body["status"], body["decidedBy"], body["comment"]) == ("APPROVED", "ann", "fine")
    assert queued_count(redis_client, runtime.settings.queue) == 1, "the decision woke the run"
    again = client.post(path, headers=_h("ann"))
    assert again.status_code == 200, "the same decision twice is harmless"
    assert queued_count(redis_client, runtime.settings.queue) == 1, "and wakes nothing twice"
    other = client.post(f"/api/approvals/{approval['id']}/reject", headers=_h("ann"))
    assert other.status_code == 409
    run = client.get(f"/api/runs/{run_id}", headers=_h("ci")).get_json()
    assert run["status"] == "RUNNING"


def test_a_stale_payload_hash_is_refused(client: FlaskClient, runtime: Runtime) -> None:
    _, approval = _waiting_refund(client, runtime)
    stale = client.post(
        f"/api/approvals/{approval['id']}/approve",
        json={"payloadHash": "0" * 64},
        headers=_h("ann"),
    )
    assert stale.status_code == 409
    assert stale.get_json()["error"]["code"] == "payload_changed"


def test_approve_after_cancel_is_refused(client: FlaskClient, runtime: Runtime) -> None:
    run_id, approval = _waiting_refund(client, runtime)
    cancelled = client.post(f"/api/runs/{run_id}/cancel", headers=_h("ci"))
    body = cancelled.get_json()
    # The run has a completed reservation to undo: a worker compensates it, then it ends.
    assert (body["status"], body["cancelRequested"]) == ("RUNNING", True)
    late = client.post(f"/api/approvals/{approval['id']}/approve", headers=_h("ann"))
    assert late.status_code == 409
    after = client.get(f"/api/approvals/{approval['id']}", headers=_h("ann")).get_json()
    assert after["status"] == "CANCELLED"
    (due,) = runtime.store.redispatch_due(redispatch_after=3600)
    drive_to_end(runtime.driver(), due)
    run = client.get(f"/api/runs/{run_id}", headers=_h("ci")).get_json()
    assert run["status"] == "CANCELLED"
    assert "compensated: reserve" in run["error"]
    assert runtime.tickets.count_comments(105) == 2, "reserved once, released once"


def test_pending_approvals_gauge(client: FlaskClient, runtime: Runtime) -> None:
    _waiting_refund(client, runtime)
    metrics = client.get("/metrics", headers=_h("prom")).get_data(as_text=True)
    assert 'dar_approvals_pending{role="finance"} 1.0' in metrics


def test_resume_a_failed_durable_run(client: FlaskClient, runtime: Runtime) -> None:
    calls: list[int] = []

    @durable_agent("fragile")
    def fragile(_: object, steps: Steps) -> str:
        def once_broken() -> str:
            calls.append(1)
            if len(calls) == 1:
                raise TimeoutError("upstream down")
            return "ok"

        return steps.run("call", once_broken, type=str)

    runtime.agents.register(fragile)
    created = client.post("/api/runs", json={"agent": "fragile", "input": {}}, headers=_h("ci"))
    run_id = created.get_json()["id"]

    run = runtime.store.get_run(__import__("uuid").UUID(run_id))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    assert client.get(f"/api/runs/{run_id}", headers=_h("ci")).get_json()["status"] == "FAILED"
    resumed = client.post(f"/api/runs/{run_id}/resume", json={}, headers=_h("ci"))
    assert resumed.status_code == 202, resumed.get_json()
    run = runtime.store.get_run(run.id)
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    final = client.get(f"/api/runs/{run_id}", headers=_h("ci")).get_json()
    assert (final["status"], final["result"]) == ("SUCCEEDED", "ok")
    step = client.get(f"/api/runs/{run_id}/timeline", headers=_h("ci")).get_json()[0]
    assert step["status"] == "DONE"
    assert client.post(f"/api/runs/{run_id}/resume", headers=_h("ci")).status_code == 409


def test_an_approval_role_no_token_holds_fails_at_startup(
    runtime: Runtime, settings: Settings
) -> None:
    @durable_agent("audited", approval_roles=["auditor"])
    def audited(_: object, steps: Steps) -> None:
        return None

    runtime.agents.register(audited)
    runtime.agents.register(build_refund(runtime.tickets))  # declares the tokens' finance
    runtime.settings = replace(settings, api_tokens=_env())
    with pytest.raises(ConfigError, match="approval role 'auditor' is declared"):
        create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))


def test_the_event_stream_shows_the_approval_asked_and_decided(
    client: FlaskClient, runtime: Runtime
) -> None:
    from runtime.client import parse_sse

    run_id, approval = _waiting_refund(client, runtime)
    ok = client.post(
        f"/api/approvals/{approval['id']}/approve", json={"comment": "ok"}, headers=_h("ann")
    )
    assert ok.status_code == 200
    run = runtime.store.get_run(__import__("uuid").UUID(run_id))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    resp = client.get(f"/api/runs/{run_id}/events", headers=_h("ann"))
    events = list(parse_sse(resp.get_data(as_text=True).splitlines()))
    names = [e.name for e in events]
    asked = names.index("approval.requested")
    decided = names.index("approval.decided")
    statuses = [(i, e.data["status"]) for i, e in enumerate(events) if e.name == "run.status"]
    assert (asked - 1, "WAITING") in statuses, "parked for the decision, then asked"
    assert (decided + 1, "RUNNING") in statuses, "decided, then running again"
    assert events[asked].data["role"] == "finance"
    assert events[asked].data["status"] == "PENDING"
    assert (events[decided].data["status"], events[decided].data["decidedBy"]) == (
        "APPROVED",
        "ann",
    )
    assert events[-1].name == "run.finished"
