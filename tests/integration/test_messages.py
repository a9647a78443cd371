"""Messages into an agent-loop run on real PostgreSQL: delivered at the next step boundary as
a user turn after the turn's tool results, never lost, never twice; a SUCCEEDED run takes a
message and continues as the next turn of the same conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from api.events import durable_event
from db.records import Dispatch, RunStatus, StepKind
from runtime.config import Settings
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import tool
from tests.support import api_client, register_agent, submit


@tool(idempotent=True)
def lookup(q: str) -> str:
    """Look something up."""
    return f"found {q}"


@durable_agent("a-function")
def a_function(_: Any, steps: Steps) -> str:
    return steps.wait_for("go")


@pytest.fixture
def rt(runtime: Runtime) -> Runtime:
    runtime.settings = replace(runtime.settings, started_row_after_seconds=0)
    register_agent(runtime.agents, lookup)
    runtime.agents.register(a_function)
    return runtime


@pytest.fixture
def client(rt: Runtime, settings: Any) -> Iterator[FlaskClient]:
    with api_client(rt, settings) as c:
        yield c


def step(rt: Runtime, dispatch: Dispatch) -> Dispatch | None:
    result = rt.driver().drive(dispatch.run_id, dispatch.token)
    assert result.outcome is not Outcome.DROPPED
    return result.dispatch


def to_end(rt: Runtime, dispatch: Dispatch | None) -> None:
    for _ in range(30):
        if dispatch is None:
            return
        dispatch = step(rt, dispatch)
    raise AssertionError("the run did not end")


def kinds(rt: Runtime, run_id: Any) -> list[tuple[str, str]]:
    return [(str(s.kind), s.step_key) for s in rt.store.steps(run_id)]


def test_a_message_sent_while_a_tool_runs_follows_its_result_in_one_user_turn(
    rt: Runtime, llm: ScriptedLlm, client: FlaskClient
) -> None:
    llm.then_tool_use("toolu_1", "lookup", {"q": "x"}).then_text("done, and noted")
    run, dispatch = submit(rt.store)
    after_model = step(rt, dispatch)  # the model asked for the tool
    sent = client.post(f"/api/runs/{run.id}/messages", json={"text": "also check y"})
    assert sent.status_code == 202, sent.get_data(as_text=True)
    assert sent.get_json()["new"] is True
    to_end(rt, after_model)
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, "done, and noted")
    assert kinds(rt, run.id) == [
        ("MODEL", "model:1"),
        ("TOOL", "tool:toolu_1"),
        ("MESSAGE", "message:0"),
        ("MODEL", "model:2"),
    ]
    last_user = llm.requests[1].messages[-1]
    assert last_user["role"] == "user"
    assert [b["type"] for b in last_user["content"]] == ["tool_result", "text"]
    assert last_user["content"][1]["text"] == "also check y"


def test_a_succeeded_run_continues_as_the_next_turn(
    rt: Runtime, llm: ScriptedLlm, client: FlaskClient
) -> None:
    llm.then_text("first answer").then_text("second answer")
    run, dispatch = submit(rt.store, "hello")
    to_end(rt, dispatch)
    assert rt.store.get_run(run.id).status is RunStatus.SUCCEEDED
    key = {"Idempotency-Key": "m-1"}
    sent = client.post(f"/api/runs/{run.id}/messages", json={"text": "and then?"}, headers=key)
    again = client.post(f"/api/runs/{run.id}/messages", json={"text": "and then?"}, headers=key)
    assert sent.get_json()["status"] == "QUEUED"
    assert again.get_json()["new"] is False, "a retried message is one message"
    reopened = rt.store.get_run(run.id)
    assert (reopened.status, reopened.finished_at, reopened.messages_pending) == (
        RunStatus.QUEUED,
        None,
        1,
    )
    to_end(rt, Dispatch(run.id, reopened.dispatch_token))
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, "second answer")
    assert [k for k, _ in kinds(rt, run.id)] == ["MODEL", "MESSAGE", "MODEL"]
    assert [m["role"] for m in llm.requests[1].messages] == ["user", "assistant", "user"]
    assert done.messages_pending == 0
    events = [durable_event(row) for row in rt.store.run_events_after(run.id, 0)]
    received = [data for name, data in events if name == "message.received"]
    assert received == [{"seq": 2, "key": "message:0", "content": "and then?"}]
    talk = client.get(f"/api/runs/{run.id}/conversation").get_json()["entries"]
    assert {"type": "message", "content": "and then?"}.items() <= talk[2].items()
    timeline = client.get(f"/api/runs/{run.id}/timeline").get_json()
    assert [t["kind"] for t in timeline if t["kind"] != "AUDIT"] == ["MODEL", "MESSAGE", "MODEL"]
    recoveries = [t for t in timeline if str(t.get("action", "")).startswith("recovery.")]
    assert recoveries == [], "a continued conversation is not a recovery from a crash"


def test_a_run_about_to_succeed_with_a_message_pending_goes_on(
    rt: Runtime, llm: ScriptedLlm
) -> None:
    """The message arrives between the claim of the run's last task and its end: the end is
    refused as an end, the run stays due, and the message is delivered, not lost."""
    llm.then_text("first").then_text("second")
    run, dispatch = submit(rt.store, "hello")
    separate = rt.driver()
    separate.end_in_place = False  # the run's end as a task of its own, from its message
    last = separate.drive(dispatch.run_id, dispatch.token).dispatch
    assert last is not None
    claim = rt.store.claim(run.id, last.token, "worker-A", 30)
    assert claim is not None
    rt.store.post_message(run.id, "wait, one more thing")
    rt.store.finish(claim, RunStatus.SUCCEEDED, result="first")
    still = rt.store.get_run(run.id)
    assert (still.status, still.finished_at, still.result) == (RunStatus.RUNNING, None, None)
    [due] = [d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id == run.id]
    to_end(rt, due)
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, "second")
    assert [k for k, _ in kinds(rt, run.id)] == ["MODEL", "MESSAGE", "MODEL"]


def test_a_message_posted_during_the_last_model_call_is_delivered_not_ended_over(
    rt: Runtime, llm: ScriptedLlm
) -> None:
    """The answer ends the conversation, but a message was posted while the call was in
    flight: the worker does not end the run in the same task (the end's claim is refused
    while a message is pending); the message goes out, and its delivery is the next step."""
    run, dispatch = submit(rt.store, "hello")

    class PostsDuringTheCall:
        def send(self, request: LlmRequest) -> LlmResponse:
            if len(request.messages) == 1:
                rt.store.post_message(run.id, "wait, one more thing")
            return llm.send(request)

    llm.then_text("first").then_text("second")
    driver = rt.driver()
    driver.llm = PostsDuringTheCall()
    result = driver.drive(dispatch.run_id, dispatch.token)
    assert result.outcome is Outcome.CONTINUE
    assert result.dispatch is not None
    assert rt.store.get_run(run.id).status is RunStatus.RUNNING
    to_end(rt, result.dispatch)
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, "second")
    assert [k for k, _ in kinds(rt, run.id)] == ["MODEL", "MESSAGE", "MODEL"]
    assert done.lease_epoch == 4, "one claim per step, and one for the end"


def test_a_message_posted_as_the_run_ends_is_no_recovery(
    rt: Runtime, llm: ScriptedLlm, client: FlaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message posted as the run ends, after the claim that ends it: the run goes on to
    deliver it, and nothing crashed, so its timeline shows no recovery (the claim that was
    to end it counted as one without progress, and the next claim took the run for one its
    worker had died in)."""
    llm.then_text("first").then_text("second")
    run, dispatch = submit(rt.store, "hello")
    real, posted = rt.store.finish, []

    def posting(claim: Any, status: RunStatus, **kw: Any) -> Any:
        if not posted and status is RunStatus.SUCCEEDED:
            posted.append(rt.store.post_message(run.id, "wait, one more thing"))
        return real(claim, status, **kw)

    monkeypatch.setattr(rt.store, "finish", posting)
    to_end(rt, dispatch)
    assert posted, "the message came as the run ended"
    for _ in range(3):  # the reaper sends it on
        due = [d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id == run.id]
        to_end(rt, due[0] if due else None)
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, "second")
    assert [k for k, _ in kinds(rt, run.id)] == ["MODEL", "MESSAGE", "MODEL"]
    timeline = client.get(f"/api/runs/{run.id}/timeline").get_json()
    recoveries = [t for t in timeline if str(t.get("action", "")).startswith("recovery.")]
    assert recoveries == [], "a conversation that went on is not a recovery from a crash"


def test_content_blocks_policies_and_refusals(
    rt: Runtime, llm: ScriptedLlm, client: FlaskClient
) -> None:
    llm.then_text("ok").then_text("ok again")
    run, dispatch = submit(rt.store, "hello")
    claim = rt.store.claim(run.id, dispatch.token, "worker-A", 30)
    assert claim is not None  # inside a step now
    refused = client.post(f"/api/runs/{run.id}/messages", json={"text": "now?", "policy": "reject"})
    assert refused.status_code == 409
    assert "inside a step" in refused.get_json()["error"]["message"]
    blocks = {"content": [{"type": "text", "text": "as blocks"}]}
    assert client.post(f"/api/runs/{run.id}/messages", json=blocks).status_code == 202
    assert client.post(f"/api/runs/{run.id}/messages", json={}).status_code == 400
    fn_run, _ = rt.submit("a-function", {})
    not_loop = client.post(f"/api/runs/{fn_run.id}/messages", json={"text": "hi"})
    assert not_loop.status_code == 409
    assert rt.store.get_run(run.id).messages_pending == 1
    assert [s.kind for s in rt.store.steps(run.id)] == []
    assert StepKind.MESSAGE.value == "MESSAGE"


def test_a_finished_run_past_its_deadline_continues_with_a_deadline_from_the_message(
    rt: Runtime, llm: ScriptedLlm, client: FlaskClient
) -> None:
    """A deadline is per turn: a conversation continued after its first turn's timeout
    passed gets ``timeoutSeconds`` again from the message, not an end TIMED_OUT at once."""
    llm.then_text("first answer").then_text("second answer")
    run, dispatch = submit(rt.store, "hello", timeout_seconds=60)
    to_end(rt, dispatch)
    with rt.engine.begin() as conn:  # an hour has passed since (test-only SQL)
        conn.execute(
            text("UPDATE run SET deadline_at = now() - interval '1 hour' WHERE id = :id"),
            {"id": run.id},
        )
    sent = client.post(f"/api/runs/{run.id}/messages", json={"text": "and then?"})
    assert sent.status_code == 202, sent.get_data(as_text=True)
    reopened = rt.store.get_run(run.id)
    assert (reopened.deadline_at - reopened.updated_at).total_seconds() == pytest.approx(60, abs=5)
    to_end(rt, Dispatch(run.id, reopened.dispatch_token))
    done = rt.store.get_run(run.id)
    assert (done.status, done.result, done.error) == (RunStatus.SUCCEEDED, "second answer", None)


def test_messages_are_delivered_in_the_order_posted(
    rt: Runtime, llm: ScriptedLlm, client: FlaskClient
) -> None:
    llm.then_text("first answer").then_text("second answer")
    run, dispatch = submit(rt.store, "hello")
    to_end(rt, dispatch)
    for said in ("one", "two"):
        assert client.post(f"/api/runs/{run.id}/messages", json={"text": said}).status_code == 202
    to_end(rt, Dispatch(run.id, rt.store.get_run(run.id).dispatch_token))
    steps = rt.store.steps(run.id)
    assert [(s.step_key, s.response) for s in steps if s.kind is StepKind.MESSAGE] == [
        ("message:0", "one"),
        ("message:1", "two"),
    ]
    assert llm.requests[1].messages[-1]["content"][-2:] == [
        {"type": "text", "text": "one"},
        {"type": "text", "text": "two"},
    ]


@pytest.fixture
def limited(settings: Settings, llm: ScriptedLlm) -> Iterator[Runtime]:
    """One model call a minute, fleet-wide: a second run waits for admission, parked."""
    s = replace(
        settings,
        model_limits_json=json.dumps({"claude-*": {"requestsPerMinute": 1}}),
        started_row_after_seconds=0,
    )
    rt = Runtime.build(s, llm=llm, pool_size=5)
    register_agent(rt.agents, lookup)
    try:
        yield rt
    finally:
        rt.close()


def test_a_message_wakes_a_run_parked_on_a_timer_and_is_delivered_now(
    limited: Runtime, llm: ScriptedLlm, settings: Settings
) -> None:
    """A run parked for a minute (flow control admits no model call before) takes a message
    now: the POST makes it due, and its next task records the message (no model call: the
    call still waits for its admission)."""
    llm.then_text("done").then_text("done too")
    _, first = submit(limited.store)
    to_end(limited, first)
    run, dispatch = submit(limited.store, "hello")
    assert limited.driver().drive(dispatch.run_id, dispatch.token).outcome is Outcome.WAITING
    parked = limited.store.get_run(run.id)
    assert (parked.wait_reason or "").startswith("rate limit")
    assert (parked.run_at - parked.updated_at).total_seconds() > 30
    with api_client(limited, settings) as client:
        sent = client.post(f"/api/runs/{run.id}/messages", json={"text": "one more thing"})
    assert sent.status_code == 202, sent.get_data(as_text=True)
    woken = limited.store.get_run(run.id)
    assert woken.dispatch_token != parked.dispatch_token, "the POST sent it a drive_run"
    assert (parked.run_at - woken.run_at).total_seconds() > 30, "due now, not in a minute"
    limited.driver().drive(run.id, woken.dispatch_token)
    assert [(s.kind, s.response) for s in limited.store.steps(run.id)] == [
        (StepKind.MESSAGE, "one more thing")
    ]
    assert len(llm.requests) == 1, "no model call before its admission"
