"""Attacks on the API with tokens for two tenants (issue 28): what an unauthenticated or
low-privilege caller can cost the server, and what one tenant can learn or take from another."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text
from werkzeug.test import TestResponse

from api import create_app
from api.auth import TokenTable, hash_token
from api.errors import ApiError
from api.schemas import MAX_JSON_DEPTH, check_json
from db.records import Dispatch, NewRun
from examples.order_refund import build as build_refund
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.sweeps import expire_approval
from tasks.celery_app import make_celery
from tests.support import drive_to_end

# name: (roles, token, tenant)
TOKENS = {
    "alice": ("read+submit+cancel", "tok-alice", "red"),
    "amy": ("submit", "tok-amy", "red"),
    "ann": ("read+approve+finance", "tok-ann", "red"),
    "bob": ("read+submit+cancel+approve+finance", "tok-bob", "blue"),
    "root": ("admin", "tok-root", "ops"),
}


def token_env(tokens: dict[str, tuple[str, str, str]] = TOKENS) -> str:
    return ",".join(
        f"{name}:{roles}:{hash_token(tok)}:{tenant}"
        for name, (roles, tok, tenant) in tokens.items()
    )


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name][1]}"}


def make_client(
    runtime: Runtime,
    settings: Settings,
    tokens: dict[str, tuple[str, str, str]] = TOKENS,
    **changes: Any,
) -> FlaskClient:
    if "order-refund" not in runtime.agents:
        runtime.tickets.seed()
        runtime.agents.register(build_refund(runtime.tickets))
    runtime.settings = replace(settings, api_tokens=token_env(tokens), **changes)
    return create_app(
        runtime=runtime, celery=make_celery(runtime.settings, register=False)
    ).test_client()


@pytest.fixture
def client(runtime: Runtime, settings: Settings) -> FlaskClient:
    return make_client(runtime, settings)


def submit(client: FlaskClient, who: str, body: Any = None, **headers: str) -> TestResponse:
    return client.post(
        "/api/runs", json=body or {"input": "Which tickets?"}, headers={**auth(who), **headers}
    )


# -- 5. the size before anything that costs time in proportion to it ----------------------


def test_an_input_over_the_limit_is_refused_for_its_size_before_its_text_is_walked(
    client: FlaskClient, runtime: Runtime
) -> None:
    limit = runtime.settings.max_input_chars
    # Over the input limit, under the body limit, and unsafe deep inside: the size decides.
    hostile = {"a": ["x"] * (limit // 4) + ["\x00"]}
    response = client.post(
        "/api/runs",
        data=json.dumps({"agent": "order-refund", "input": hostile}),
        content_type="application/json",
        headers=auth("alice"),
    )
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["field"] == "input"
    assert "DAR_MAX_INPUT_CHARS" in error["message"], error


def test_the_walk_names_the_place_of_unsafe_text_and_of_too_deep_nesting() -> None:
    with pytest.raises(ApiError) as nul:
        check_json({"input": {"a": [1, {"b": "ok"}, {"c": "x\x00"}]}})
    assert nul.value.field == "input.a[2].c"
    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    check_json({"v": deep[0]}, text=False)  # exactly the limit
    with pytest.raises(ApiError, match="nested more than"):
        check_json({"v": deep}, text=False)
    with pytest.raises(ApiError, match="nested more than"):
        check_json({"v": deep})


def test_a_list_of_runs_carries_no_input(client: FlaskClient) -> None:
    run_id = submit(client, "alice", {"input": "secret question " * 100}).get_json()["id"]
    (item,) = client.get("/api/runs", headers=auth("alice")).get_json()["items"]
    assert item["id"] == run_id
    assert "input" not in item
    one = client.get(f"/api/runs/{run_id}", headers=auth("alice")).get_json()
    assert one["input"].startswith("secret question")


# -- 4. event streams per token and per tenant -----------------------------------------------


def test_open_event_streams_are_limited_per_token_and_per_tenant(
    runtime: Runtime, settings: Settings
) -> None:
    client = make_client(runtime, settings, events_streams_per_token=2, events_streams_per_tenant=3)
    run_id = submit(client, "alice").get_json()["id"]
    path = f"/api/runs/{run_id}/events"

    def stream(who: str) -> TestResponse:
        return client.get(path, headers=auth(who), buffered=False)

    held = [stream("alice"), stream("alice")]
    assert [r.status_code for r in held] == [200, 200]
    refused = stream("alice")
    assert refused.status_code == 429
    assert refused.headers["Retry-After"].isdigit()
    assert "DAR_EVENTS_STREAMS_PER_TOKEN" in refused.get_json()["error"]["message"]

    held.append(stream("ann"))  # the tenant's third
    assert held[-1].status_code == 200
    tenant_full = stream("ann")
    assert tenant_full.status_code == 429
    assert "DAR_EVENTS_STREAMS_PER_TENANT" in tenant_full.get_json()["error"]["message"]

    # Another tenant, and the routes that are not streams, are untouched.
    bob_run = submit(client, "bob").get_json()["id"]
    other = client.get(f"/api/runs/{bob_run}/events", headers=auth("bob"), buffered=False)
    assert other.status_code == 200
    other.close()
    assert client.get("/healthz").status_code == 200
    assert submit(client, "alice").status_code == 201

    held.pop(0).close()  # a stream ends: its slot is free again
    again = stream("alice")
    assert again.status_code == 200
    for r in [*held, again]:
        r.close()


def test_the_process_keeps_connections_for_other_routes(
    runtime: Runtime, settings: Settings
) -> None:
    client = make_client(runtime, settings, events_streams_max=2)
    run_id = submit(client, "alice").get_json()["id"]
    bob_run = submit(client, "bob").get_json()["id"]
    held = [
        client.get(f"/api/runs/{run_id}/events", headers=auth("alice"), buffered=False),
        client.get(f"/api/runs/{bob_run}/events", headers=auth("bob"), buffered=False),
    ]
    refused = client.get(f"/api/runs/{bob_run}/events", headers=auth("bob"), buffered=False)
    assert refused.status_code == 429
    assert "DAR_EVENTS_STREAMS_MAX" in refused.get_json()["error"]["message"]
    for r in held:
        r.close()


# -- 3. priority is bounded per token ---------------------------------------------------------


def test_a_token_without_admin_cannot_jump_every_queue(client: FlaskClient) -> None:
    body = {"input": "Which tickets?", "concurrencyKey": "shared"}
    assert submit(client, "alice", {**body, "priority": 10}).status_code == 201
    refused = submit(client, "alice", {**body, "priority": 1000})
    assert refused.status_code == 403
    error = refused.get_json()["error"]
    assert error["field"] == "priority"
    assert "DAR_TOKEN_MAX_PRIORITY" in error["message"]
    assert submit(client, "root", {**body, "priority": 1000}).status_code == 201


# -- 7. quotas, lookups, /metrics, audit -------------------------------------------------------


def _failed_run(runtime: Runtime, submitted_by: str, tenant: str) -> str:
    run, _ = runtime.store.create_run(
        NewRun(
            agent="acme-tickets",
            input="Which tickets?",
            model="claude-sonnet-4-5",
            max_steps=10,
            token_budget=1000,
            timeout_seconds=600,
            submitted_by=submitted_by,
            tenant=tenant,
        )
    )
    with runtime.engine.begin() as conn:
        conn.execute(
            text("UPDATE run SET status = 'FAILED', finished_at = now() WHERE id = :id"),
            {"id": run.id},
        )
    return str(run.id)


def test_resuming_another_tokens_runs_counts_against_the_active_run_limit(
    runtime: Runtime, settings: Settings
) -> None:
    client = make_client(runtime, settings, token_max_active_runs=2)
    theirs = [_failed_run(runtime, "alice", "red") for _ in range(3)]
    answers = [
        client.post(f"/api/runs/{rid}/resume", headers=auth("amy")).status_code for rid in theirs
    ]
    assert answers == [202, 202, 429], "amy resumed alice's runs past her own limit"


def test_a_fork_gets_no_larger_budget_or_timeout_than_a_resume_would(
    client: FlaskClient, runtime: Runtime
) -> None:
    rid = _failed_run(runtime, "alice", "red")
    for field, value in (("tokenBudget", 1_000_000), ("timeoutSeconds", 86_400)):
        refused = client.post(
            f"/api/runs/{rid}/fork", json={"fromSeq": 1, field: value}, headers=auth("alice")
        )
        assert refused.status_code == 403, refused.get_json()
        assert refused.get_json()["error"]["field"] == field
        resumed = client.post(f"/api/runs/{rid}/resume", json={field: value}, headers=auth("alice"))
        assert resumed.status_code == 403
    within = client.post(
        f"/api/runs/{rid}/fork", json={"fromSeq": 1, "tokenBudget": 500}, headers=auth("alice")
    )
    assert within.status_code == 201, within.get_json()


def _approval(client: FlaskClient, runtime: Runtime) -> dict[str, Any]:
    created = submit(
        client,
        "alice",
        {"agent": "order-refund", "input": {"order_id": 105, "amount": 9.5, "reason": "x"}},
    )
    run = runtime.store.get_run(uuid.UUID(created.get_json()["id"]))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    (approval,) = client.get("/api/approvals", headers=auth("ann")).get_json()["items"]
    return dict(approval)


def test_another_tenants_approval_and_no_approval_answer_alike(
    client: FlaskClient, runtime: Runtime
) -> None:
    theirs = _approval(client, runtime)["id"]
    nobody = str(uuid.uuid4())
    for verb in ("get", "approve"):
        answers = []
        for aid in (theirs, nobody):
            path = f"/api/approvals/{aid}" + ("" if verb == "get" else "/approve")
            call = client.get if verb == "get" else client.post
            response = call(path, headers=auth("bob"))
            answers.append(
                (response.status_code, response.get_json()["error"]["message"].replace(aid, "X"))
            )
        assert answers[0] == answers[1] == (404, "no approval with id X")
    assert runtime.store.get_approval(uuid.UUID(theirs), tenant="blue") is None
    assert runtime.store.get_approval(uuid.UUID(theirs), tenant="red") is not None


def test_a_decision_is_audited_with_its_comment_and_payload_hash(
    client: FlaskClient, runtime: Runtime
) -> None:
    approval = _approval(client, runtime)
    decided = client.post(
        f"/api/approvals/{approval['id']}/approve",
        json={"comment": "ok, refund it"},
        headers=auth("ann"),
    )
    assert decided.status_code == 200
    (event,) = [
        e for e in runtime.store.audit_events(uuid.UUID(approval["runId"])) if e.action == "approve"
    ]
    assert event.detail["comment"] == "ok, refund it"
    assert event.detail["payloadHash"] == approval["payloadHash"]


def test_metrics_need_the_metrics_role_unless_opened(runtime: Runtime, settings: Settings) -> None:
    tokens = {**TOKENS, "prom": ("metrics", "tok-prom", "ops")}
    client = make_client(runtime, settings, tokens)
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=auth("alice")).status_code == 403
    ok = client.get("/metrics", headers={"Authorization": "Bearer tok-prom"})
    assert ok.status_code == 200
    assert "dar_runs" in ok.get_data(as_text=True)
    assert client.get("/metrics", headers=auth("root")).status_code == 200
    opened = make_client(runtime, settings, tokens, metrics_public=True)
    assert opened.get("/metrics").status_code == 200


# -- 7. tokens expire, and are revoked without a restart -------------------------------------


def test_an_expired_token_is_refused(runtime: Runtime, settings: Settings) -> None:
    past, future = int(time.time()) - 1, "2999-01-01"
    entries = ",".join(
        [
            f"old:read:{hash_token('tok-old')}:red:expires={past}",
            f"new:read:{hash_token('tok-new')}:expires={future}",
        ]
    )
    runtime.settings = replace(settings, api_tokens=entries)
    client = create_app(
        runtime=runtime, celery=make_celery(runtime.settings, register=False)
    ).test_client()
    assert client.get("/api/runs", headers={"Authorization": "Bearer tok-old"}).status_code == 401
    assert client.get("/api/runs", headers={"Authorization": "Bearer tok-new"}).status_code == 200


def test_a_token_removed_from_the_tokens_file_is_refused_without_a_restart(
    runtime: Runtime, settings: Settings, tmp_path: Path
) -> None:
    tokens_file = tmp_path / "tokens"
    keep = f"keep:read:{hash_token('tok-keep')}"
    gone = f"gone:read+submit:{hash_token('tok-gone')}"
    tokens_file.write_text(f"# the API's tokens\n{keep}\n{gone}\n")
    runtime.settings = replace(settings, api_tokens_file=str(tokens_file))
    client = create_app(
        runtime=runtime, celery=make_celery(runtime.settings, register=False)
    ).test_client()
    gone_h = {"Authorization": "Bearer tok-gone"}
    assert client.get("/api/runs", headers=gone_h).status_code == 200
    tokens_file.write_text(f"{keep}\n")
    os.utime(tokens_file, (time.time() + 5, time.time() + 5))  # a new mtime, whatever the clock
    deadline = time.monotonic() + 10
    while client.get("/api/runs", headers=gone_h).status_code != 401:
        assert time.monotonic() < deadline, "the revoked token still works"
        time.sleep(0.2)
    assert client.get("/api/runs", headers={"Authorization": "Bearer tok-keep"}).status_code == 200
    # A file that no longer parses keeps the last good tokens.
    tokens_file.write_text("not an entry\n")
    os.utime(tokens_file, (time.time() + 10, time.time() + 10))
    time.sleep(1.2)
    assert client.get("/api/runs", headers={"Authorization": "Bearer tok-keep"}).status_code == 200


def test_dar_token_new_expires(capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    assert main(["token", "new", "ci", "--roles", "read", "--expires", "2027-01-31"]) == 0
    entry = capsys.readouterr().out.strip().splitlines()[-1].strip()
    assert entry.endswith(":expires=2027-01-31")
    (_, principal), *_ = TokenTable.parse(entry).entries
    assert principal.expires_at == 1801353600.0
    assert main(["token", "new", "ci", "--roles", "read", "--expires", "soon"]) == 2


# -- 7. the audit trail: submits and timeouts --------------------------------------------------


def test_submits_and_timeout_decisions_are_audited(client: FlaskClient, runtime: Runtime) -> None:
    run_id = submit(client, "alice", **{"Idempotency-Key": "k-1"}).get_json()["id"]
    again = submit(client, "alice", **{"Idempotency-Key": "k-1"})
    assert again.status_code == 200
    events = runtime.store.audit_events(uuid.UUID(run_id))
    assert [(e.action, e.actor, e.tenant) for e in events] == [("submit", "alice", "red")], (
        "one submit, not one per retry"
    )
    assert events[0].detail["idempotencyKey"] == "k-1"

    approval = _approval(client, runtime)
    assert expire_approval(runtime.store, uuid.UUID(approval["id"]), "REJECT") is not None
    (timeout,) = [
        e for e in runtime.store.audit_events(uuid.UUID(approval["runId"])) if e.action == "timeout"
    ]
    assert (timeout.actor, timeout.tenant) == ("timeout-policy", "red")
    assert timeout.detail["policy"] == "REJECT"
    assert timeout.detail["payloadHash"] == approval["payloadHash"]


# -- 2. a fork's copied approval says whose decision it was ------------------------------------


def test_a_forks_copied_approval_is_labelled_with_the_run_that_decided_it(
    runtime: Runtime, settings: Settings
) -> None:
    tokens = {**TOKENS, "lead": ("read+submit+approve+finance", "tok-lead", "red")}
    client = make_client(runtime, settings, tokens)
    approval = _approval(client, runtime)
    run_id = approval["runId"]
    assert (
        client.post(
            f"/api/approvals/{approval['id']}/approve", json={}, headers=auth("ann")
        ).status_code
        == 200
    )
    run = runtime.store.get_run(uuid.UUID(run_id))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    steps = client.get(f"/api/runs/{run_id}/timeline", headers=auth("alice")).get_json()
    after = max(s["seq"] or 0 for s in steps) + 1
    # Only a token that may decide it keeps the decision for the steps the fork runs after it.
    made = client.post(
        f"/api/runs/{run_id}/fork",
        json={"fromSeq": after, "reuseApprovals": True},
        headers={"Authorization": "Bearer tok-lead"},
    )
    assert made.status_code == 201, made.get_json()
    fork_id = made.get_json()["id"]
    (copied,) = runtime.store.list_approvals(status=None, run_id=uuid.UUID(fork_id))
    assert copied.copied_from == uuid.UUID(run_id)
    shown = client.get(f"/api/approvals/{copied.id}", headers=auth("ann")).get_json()
    assert shown["copiedFrom"] == run_id
    # The original's own approval is its own decision.
    assert (
        client.get(f"/api/approvals/{approval['id']}", headers=auth("ann")).get_json()["copiedFrom"]
        is None
    )


def test_reusing_an_approval_in_a_fork_needs_its_role_and_an_approval_to_reuse(
    runtime: Runtime, settings: Settings
) -> None:
    tokens = {
        **TOKENS,
        "fin": ("read+submit+approve+finance", "tok-fin", "red"),
        "payer": ("read+submit+finance", "tok-payer", "red"),
    }
    client = make_client(runtime, settings, tokens)
    approval = _approval(client, runtime)
    run_id = approval["runId"]
    assert (
        client.post(
            f"/api/approvals/{approval['id']}/approve", json={}, headers=auth("ann")
        ).status_code
        == 200
    )
    run = runtime.store.get_run(uuid.UUID(run_id))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    steps = client.get(f"/api/runs/{run_id}/timeline", headers=auth("alice")).get_json()
    pay = next(s["seq"] for s in steps if s["kind"] == "APPROVAL")
    body = {"fromSeq": pay, "reuseApprovals": True}
    refused = client.post(f"/api/runs/{run_id}/fork", json=body, headers=auth("amy"))
    assert refused.status_code == 403, refused.get_json()
    assert "finance" in refused.get_json()["error"]["message"]
    # The approval's role is not enough: reusing a decision is deciding, which needs approve.
    no_approve = client.post(
        f"/api/runs/{run_id}/fork", json=body, headers={"Authorization": "Bearer tok-payer"}
    )
    assert no_approve.status_code == 403, no_approve.get_json()
    assert "'approve'" in no_approve.get_json()["error"]["message"]
    not_one = client.post(
        f"/api/runs/{run_id}/fork",
        json={"fromSeq": 1, "reuseApprovals": True},
        headers={"Authorization": "Bearer tok-fin"},
    )
    assert not_one.status_code == 409
    made = client.post(
        f"/api/runs/{run_id}/fork", json=body, headers={"Authorization": "Bearer tok-fin"}
    )
    assert made.status_code == 201, made.get_json()
    (carried,) = runtime.store.list_approvals(status=None, run_id=uuid.UUID(made.get_json()["id"]))
    assert carried.copied_from == uuid.UUID(run_id)
    # Without reuseApprovals, anyone's fork from the approval asks again.
    again = client.post(f"/api/runs/{run_id}/fork", json={"fromSeq": pay}, headers=auth("amy"))
    assert again.status_code == 201
    fork = runtime.store.get_run(uuid.UUID(again.get_json()["id"]))
    drive_to_end(runtime.driver(), Dispatch(fork.id, fork.dispatch_token))
    (asked,) = runtime.store.list_approvals(status=None, run_id=fork.id)
    assert (asked.status, asked.copied_from) == ("PENDING", None)
