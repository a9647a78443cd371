"""Tools against real PostgreSQL: timeouts, bad input, unknown tools, errors, output limits,
re-execution after a crash, reconcile hooks, NEEDS_ATTENTION and the operator's actions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

import pytest
from celery import Celery
from flask.testing import FlaskClient

from api import create_app
from db.records import Dispatch, Run, RunStatus, Step, StepStatus
from runtime.agentloop.acme import add_comment_tool
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import Reconciled, Tool, ToolContext, tool
from tasks.celery_app import make_celery
from tests.support import SimulatedCrash, drive_to_end, expire_lease, register_agent, submit


def _result_seen_by_model(llm: ScriptedLlm, n: int = 1) -> dict[str, object]:
    """The tool_result block the model received in its n-th request (0-based)."""
    block: dict[str, object] = llm.requests[n].messages[2]["content"][0]
    return block


def _run_one_tool(
    runtime: Runtime, llm: ScriptedLlm, t: Tool, tool_input: dict[str, object]
) -> tuple[Run, list[Step]]:
    llm.then_tool_use("toolu_1", t.name, tool_input).then_text("ok")
    register_agent(runtime.agents, t)
    run, dispatch = submit(runtime.store)
    drive_to_end(runtime.driver(), dispatch)
    return runtime.store.get_run(run.id), runtime.store.steps(run.id)


def test_timeout_becomes_an_error_result_and_the_run_goes_on(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    @tool(timeout_seconds=0.2)
    def slow(ctx: ToolContext) -> str:
        """Slow, but stops when its context is cancelled."""
        if ctx.cancelled.wait(2):
            raise TimeoutError("cancelled: nothing sent")
        return "late"

    run, steps = _run_one_tool(runtime, llm, slow, {})
    assert run.status is RunStatus.SUCCEEDED
    assert steps[1].status is StepStatus.ERROR
    assert steps[1].latency_ms is not None
    assert steps[1].latency_ms < 1500
    seen = _result_seen_by_model(llm)
    assert seen["is_error"] is True
    assert "timed out after 0.2s" in str(seen["content"])


def test_a_timed_out_tool_that_finishes_anyway_records_what_it_did(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    """Scenario: the model must never see "timed out" for a call whose effect happened
    (it would ask again and the email would go out twice)."""
    sent: list[str] = []

    @tool(timeout_seconds=0.2)
    def send_email() -> str:
        """Ignores its cancellation, finishes within the grace period."""
        time.sleep(0.6)
        sent.append("email")
        return "sent"

    run, steps = _run_one_tool(runtime, llm, send_email, {})
    assert run.status is RunStatus.SUCCEEDED
    assert sent == ["email"]
    assert steps[1].status is StepStatus.DONE
    assert _result_seen_by_model(llm)["content"] == "sent"


def test_a_timed_out_tool_still_running_stays_in_doubt(
    runtime: Runtime, llm: ScriptedLlm, settings: object
) -> None:
    runtime.settings = replace(runtime.settings, cancel_grace_seconds=0.1)
    sent: list[str] = []

    @tool(timeout_seconds=0.2)
    def send_email() -> str:
        """Ignores its cancellation for longer than the grace period."""
        time.sleep(1.0)
        sent.append("email")
        return "sent"

    llm.then_tool_use("toolu_1", send_email.name, {}).then_text("ok")
    register_agent(runtime.agents, send_email)
    run, dispatch = submit(runtime.store)
    driver = runtime.driver()
    current: Dispatch | None = dispatch
    while current is not None:
        time.sleep(current.delay_seconds)  # the durable timer, if any
        current = driver.drive(current.run_id, current.token).dispatch
    after = runtime.store.get_run(run.id)
    tool_row = runtime.store.steps(run.id)[1]
    assert tool_row.status is StepStatus.STARTED, "not recorded as failed while it may finish"
    assert after.status is RunStatus.NEEDS_ATTENTION, after.error
    assert "not declared idempotent" in (after.error or "")
    time.sleep(1.2)
    assert sent == ["email"], "it did finish: an operator now supplies the result"
    assert len(llm.requests) == 1, "the model never saw a timeout to retry"


def test_schema_error_says_what_was_wrong(runtime: Runtime, llm: ScriptedLlm) -> None:
    calls: list[int] = []

    @tool
    def square(n: int) -> int:
        """Square n."""
        calls.append(n)
        return n * n

    run, _steps = _run_one_tool(runtime, llm, square, {"n": "seven"})
    assert run.status is RunStatus.SUCCEEDED
    assert calls == [], "the tool never saw invalid input"
    seen = _result_seen_by_model(llm)
    assert seen["is_error"] is True
    assert "invalid input for tool 'square'" in str(seen["content"])
    assert "n: 'seven' is not of type 'integer'" in str(seen["content"])


def test_missing_required_field_is_an_error_result(runtime: Runtime, llm: ScriptedLlm) -> None:
    @tool
    def square(n: int) -> int:
        """Square n."""
        return n * n

    _run, steps = _run_one_tool(runtime, llm, square, {})
    assert steps[1].status is StepStatus.ERROR
    assert "'n' is a required property" in str(_result_seen_by_model(llm)["content"])


def test_unknown_tool_lists_the_known_ones(runtime: Runtime, llm: ScriptedLlm) -> None:
    @tool
    def known() -> str:
        """Known."""
        return "x"

    llm.then_tool_use("toolu_1", "imaginary").then_text("ok")
    register_agent(runtime.agents, known)
    run, dispatch = submit(runtime.store)
    drive_to_end(runtime.driver(), dispatch)
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    content = str(_result_seen_by_model(llm)["content"])
    assert "unknown tool 'imaginary'" in content
    assert "known tools: known" in content


def test_exception_is_information_for_the_model(runtime: Runtime, llm: ScriptedLlm) -> None:
    @tool
    def flaky() -> str:
        """Fails."""
        raise ConnectionError("upstream said no")

    run, steps = _run_one_tool(runtime, llm, flaky, {})
    assert run.status is RunStatus.SUCCEEDED
    assert steps[1].status is StepStatus.ERROR
    assert _result_seen_by_model(llm) == {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": "error: ConnectionError: upstream said no",
        "is_error": True,
    }


def test_large_output_is_truncated_with_a_marker(runtime: Runtime, llm: ScriptedLlm) -> None:
    runtime.settings = replace(runtime.settings, max_tool_output_chars=100)

    @tool
    def big() -> str:
        """Big."""
        return "x" * 5000

    _run_one_tool(runtime, llm, big, {})
    content = str(_result_seen_by_model(llm)["content"])
    assert content.startswith("x" * 100 + "\n[output truncated: 5000 characters")
    assert len(content) < 200


def _crash_mid_tool(runtime: Runtime, llm: ScriptedLlm, t: Tool) -> tuple[Run, Dispatch]:
    """Model asks for the tool; the tool step crashes the worker; the lease lapses and the
    reaper re-dispatches. Returns (run, redispatch)."""
    llm.then_tool_use("toolu_1", t.name, {}).then_text("ok")
    register_agent(runtime.agents, t)
    run, dispatch = submit(runtime.store)
    first = runtime.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
    assert first.dispatch is not None
    with pytest.raises(SimulatedCrash):
        runtime.driver(worker="worker-A").drive(run.id, first.dispatch.token)
    expire_lease(runtime.engine, run.id)
    (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
    return run, redispatch


def test_crash_after_the_side_effect_reexecutes_once_and_the_effect_appears_once(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    runtime.tickets.seed()
    real = add_comment_tool(runtime.tickets)
    keys: list[str] = []

    def add_comment_then_die(ticket_id: int, text: str, ctx: ToolContext) -> object:
        """Add a comment."""
        keys.append(ctx.idempotency_key)
        result = real.fn(ticket_id=ticket_id, text=text, ctx=ctx)
        if len(keys) == 1:
            raise SimulatedCrash  # after the INSERT committed, before the step is recorded
        return result

    crashing = replace(real, fn=add_comment_then_die)
    llm.then_tool_use("toolu_c", "add_comment", {"ticket_id": 101, "text": "ping"})
    llm.then_text("commented")
    register_agent(runtime.agents, crashing)
    run, dispatch = submit(runtime.store)
    first = runtime.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
    assert first.dispatch is not None
    with pytest.raises(SimulatedCrash):
        runtime.driver(worker="worker-A").drive(run.id, first.dispatch.token)
    assert runtime.tickets.count_comments(101) == 1, "the effect happened before the crash"
    expire_lease(runtime.engine, run.id)
    (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
    drive_to_end(runtime.driver(worker="worker-B"), redispatch)

    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    assert keys == [f"{run.id}/toolu_c"] * 2, "re-executed once, with the same key"
    assert runtime.tickets.count_comments(101) == 1, "and the effect appears once"
    assert '"created": false' in str(_result_seen_by_model(llm)["content"])


def test_reconcile_saying_done_takes_its_result(runtime: Runtime, llm: ScriptedLlm) -> None:
    effects: list[str] = []

    def already(ctx: ToolContext) -> Reconciled | None:
        return Reconciled({"charged": True, "key": ctx.idempotency_key})

    @tool(reconcile=already)
    def charge(ctx: ToolContext) -> str:
        """Charge the card (not idempotent)."""
        effects.append(ctx.idempotency_key)
        raise SimulatedCrash

    run, redispatch = _crash_mid_tool(runtime, llm, charge)
    drive_to_end(runtime.driver(worker="worker-B"), redispatch)
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    assert effects == [f"{run.id}/toolu_1"], "not charged twice"
    assert _result_seen_by_model(llm)["content"] == json.dumps(
        {"charged": True, "key": f"{run.id}/toolu_1"}
    )


def test_reconcile_saying_not_done_runs_the_tool(runtime: Runtime, llm: ScriptedLlm) -> None:
    effects: list[str] = []

    @tool(reconcile=lambda ctx: None)
    def charge(ctx: ToolContext) -> str:
        """Charge the card (not idempotent)."""
        effects.append(ctx.idempotency_key)
        if len(effects) == 1:
            raise SimulatedCrash  # died before the charge went out
        return "charged"

    run, redispatch = _crash_mid_tool(runtime, llm, charge)
    drive_to_end(runtime.driver(worker="worker-B"), redispatch)
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    assert effects == [f"{run.id}/toolu_1"] * 2
    assert _result_seen_by_model(llm)["content"] == "charged"


# -- NEEDS_ATTENTION and the operator ---------------------------------------------------


@pytest.fixture
def api_celery(runtime: Runtime) -> Celery:
    return make_celery(runtime.settings, register=False)


@pytest.fixture
def client(runtime: Runtime, api_celery: Celery) -> FlaskClient:
    return create_app(runtime=runtime, celery=api_celery).test_client()


def _park(runtime: Runtime, llm: ScriptedLlm, effects: list[str]) -> tuple[Run, Dispatch]:
    @tool
    def charge(ctx: ToolContext) -> str:
        """Charge the card (not idempotent, no reconcile hook)."""
        effects.append(ctx.idempotency_key)
        if len(effects) == 1:
            raise SimulatedCrash
        return "charged"

    run, redispatch = _crash_mid_tool(runtime, llm, charge)
    result = runtime.driver(worker="worker-B").drive(redispatch.run_id, redispatch.token)
    assert result.status is RunStatus.NEEDS_ATTENTION
    return run, redispatch


def _next_message(runtime: Runtime, run_id: uuid.UUID) -> Dispatch:
    run = runtime.store.get_run(run_id)
    return Dispatch(run.id, run.dispatch_token)


def test_non_idempotent_started_tool_needs_attention(
    runtime: Runtime, llm: ScriptedLlm, client: FlaskClient
) -> None:
    effects: list[str] = []
    run, _ = _park(runtime, llm, effects)
    body = client.get(f"/api/runs/{run.id}").get_json()
    assert body["status"] == "NEEDS_ATTENTION"
    assert "not declared idempotent" in body["error"]
    assert "seq=2" in body["error"]
    timeline = client.get(f"/api/runs/{run.id}/timeline").get_json()
    assert timeline[1]["status"] == "STARTED"
    assert timeline[1]["toolName"] == "charge"
    assert effects == [f"{run.id}/toolu_1"], "never guessed"
    assert runtime.store.get_run(run.id).locked_by is None


def test_operator_supplies_the_result(
    runtime: Runtime, llm: ScriptedLlm, client: FlaskClient
) -> None:
    effects: list[str] = []
    run, _ = _park(runtime, llm, effects)
    resp = client.post(
        f"/api/runs/{run.id}/resolve",
        json={"action": "supply_result", "output": "charged by hand, ref 77"},
    )
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["status"] == "RUNNING"
    drive_to_end(runtime.driver(), _next_message(runtime, run.id))
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    assert effects == [f"{run.id}/toolu_1"]
    assert _result_seen_by_model(llm)["content"] == "charged by hand, ref 77"
    step = runtime.store.steps(run.id)[1]
    assert step.resolution == "supplied"
    again = client.post(f"/api/runs/{run.id}/resolve", json={"action": "retry"})
    assert again.status_code == 409


def test_operator_authorises_a_retry(
    runtime: Runtime, llm: ScriptedLlm, client: FlaskClient
) -> None:
    effects: list[str] = []
    run, _ = _park(runtime, llm, effects)
    resp = client.post(f"/api/runs/{run.id}/resolve", json={"action": "retry"})
    assert resp.status_code == 200
    drive_to_end(runtime.driver(), _next_message(runtime, run.id))
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    assert effects == [f"{run.id}/toolu_1"] * 2
    assert _result_seen_by_model(llm)["content"] == "charged"


def test_operator_fails_the_run(runtime: Runtime, llm: ScriptedLlm, client: FlaskClient) -> None:
    effects: list[str] = []
    run, _ = _park(runtime, llm, effects)
    resp = client.post(
        f"/api/runs/{run.id}/resolve",
        json={"action": "fail", "reason": "customer refunded manually"},
    )
    assert resp.status_code == 200
    assert resp.get_json()["status"] == "FAILED"
    failed = runtime.store.get_run(run.id)
    assert failed.status is RunStatus.FAILED
    assert failed.error == "failed by operator: customer refunded manually"
    assert len(llm.requests) == 1


def test_resolve_rejects_bad_requests(
    runtime: Runtime, llm: ScriptedLlm, client: FlaskClient
) -> None:
    effects: list[str] = []
    run, _ = _park(runtime, llm, effects)
    path = f"/api/runs/{run.id}/resolve"
    assert client.post(path, json={"action": "guess"}).status_code == 400
    missing = client.post(path, json={"action": "supply_result"})
    assert missing.status_code == 400
    assert missing.get_json()["error"]["field"] == "output"
    assert client.post(path, data="x", content_type="text/plain").status_code == 415
    unknown = client.post(
        "/api/runs/00000000-0000-0000-0000-000000000000/resolve", json={"action": "retry"}
    )
    assert unknown.status_code == 404
