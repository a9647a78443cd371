"""Child runs on real PostgreSQL: ``steps.child`` starts another agent as its own run with
``parentRunId``; the parent waits parked (no lease) and resumes with the child's result or
error; a parent crash never starts the same child twice; the child's tokens count against
the parent; cancelling the parent cancels its children."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from db.errors import LeaseLost
from db.records import Dispatch, NewRun, NewStep, RunStatus, StepKind, StepStatus
from runtime.durable import ChildRunFailed, Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.llm.scripted import ScriptedLlm
from tests.support import api_client, fork_over_http


@durable_agent("double")
def double(x: int, steps: Steps) -> int:
    return steps.run("double", lambda: 2 * x)


@durable_agent("ask")
def ask(question: str, steps: Steps) -> str:
    return steps.llm("answer", lambda model: model.complete(question))


@durable_agent("broken")
def broken(_: Any, steps: Steps) -> None:
    steps.run("explode", lambda: 1 / 0)


@durable_agent("two-children")
def two_children(_: Any, steps: Steps) -> int:
    return steps.child("double", 2) + steps.child("double", 3)


@durable_agent("asks-a-child")
def asks_a_child(question: str, steps: Steps) -> str:
    return steps.child("ask", question)


@durable_agent("careful")
def careful(_: Any, steps: Steps) -> str:
    try:
        steps.child("broken", {})
    except ChildRunFailed as e:
        return f"child failed: {'ZeroDivisionError' in str(e)}"
    return "no"


@durable_agent("grandparent")
def grandparent(_: Any, steps: Steps) -> int:
    return steps.child("two-children", {})


@pytest.fixture
def rt(runtime: Runtime) -> Runtime:
    for agent in (double, ask, broken, two_children, asks_a_child, careful, grandparent):
        runtime.agents.register(agent)
    return runtime


@pytest.fixture
def client(rt: Runtime, settings: Any) -> Iterator[FlaskClient]:
    with api_client(rt, settings) as c:
        yield c


def drive_tree(rt: Runtime, dispatch: Dispatch, *, follow_wakes: bool = True) -> None:
    """Drive every run the messages reach, as the workers would, until nothing is left."""
    driver = rt.driver()
    queue = [dispatch]
    for _ in range(200):
        if not queue:
            return
        d = queue.pop(0)
        result = driver.drive(d.run_id, d.token)
        if result.dispatch is not None and result.outcome is not Outcome.WAITING:
            queue.append(result.dispatch)
        if follow_wakes:
            queue += result.wakes
    raise AssertionError("the tree did not settle")


def children_of(rt: Runtime, run_id: uuid.UUID) -> list[Any]:
    with rt.engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT id, status FROM run WHERE parent_run_id = :id ORDER BY created_at"),
                {"id": run_id},
            )
        )


def test_a_parent_with_two_children_gets_their_results(rt: Runtime, client: FlaskClient) -> None:
    run, dispatch = rt.submit("two-children", {})
    drive_tree(rt, dispatch)
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, 10)
    kids = children_of(rt, run.id)
    assert [k.status for k in kids] == ["SUCCEEDED", "SUCCEEDED"]
    steps = rt.store.steps(run.id)
    assert [(s.step_key, s.kind, s.status) for s in steps] == [
        ("child.double:0", StepKind.CHILD, StepStatus.DONE),
        ("child.double:1", StepKind.CHILD, StepStatus.DONE),
    ]
    shown = client.get(f"/api/runs/{run.id}").get_json()
    assert [c["id"] for c in shown["children"]] == [str(k.id) for k in kids]
    child = client.get(f"/api/runs/{kids[0].id}").get_json()
    assert child["parentRunId"] == str(run.id)
    assert child["children"] == []


def test_the_parent_waits_holding_no_lease(rt: Runtime) -> None:
    run, dispatch = rt.submit("two-children", {})
    result = rt.driver().drive(dispatch.run_id, dispatch.token)
    assert result.outcome is Outcome.WAITING
    parked = rt.store.get_run(run.id)
    assert parked.status is RunStatus.RUNNING
    assert (parked.locked_by, parked.locked_until) == (None, None)
    assert "waiting for child run" in (parked.wait_reason or "")
    assert [w.run_id for w in result.wakes] == [children_of(rt, run.id)[0].id]


def test_a_parent_crash_never_starts_the_same_child_twice(rt: Runtime) -> None:
    run, dispatch = rt.submit("two-children", {})
    rt.driver().drive(dispatch.run_id, dispatch.token)  # child started; its message "lost"
    for _ in range(3):  # the parent is claimed again and again (reaper, restarts)
        rt.store.make_due_now(run.id)
        again = [d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id == run.id]
        rt.driver().drive(again[0].run_id, again[0].token)
    assert len(children_of(rt, run.id)) == 1
    [child] = children_of(rt, run.id)
    lost = [d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id == child.id]
    drive_tree(rt, lost[0])  # the reaper sends the child's lost message; all goes on
    done = rt.store.get_run(run.id)
    assert done.result == 10, done.error
    assert len(children_of(rt, run.id)) == 2


def test_a_child_start_whose_checkpoint_is_fenced_out_starts_no_child(rt: Runtime) -> None:
    run, dispatch = rt.submit("two-children", {})
    claim = rt.store.claim(run.id, dispatch.token, "worker-A", 30)
    assert claim is not None
    with rt.engine.begin() as conn:  # another worker took the run over
        conn.execute(
            text("UPDATE run SET lease_epoch = lease_epoch + 1 WHERE id = :id"), {"id": run.id}
        )
    step = NewStep(1, "child.double:0", StepKind.CHILD, StepStatus.PENDING, attempt=1)
    child = NewRun("double", 2, "m", 10, 1000, 60, parent_run_id=run.id)
    with pytest.raises(LeaseLost):
        rt.store.start_children(claim, [(step, child, uuid.uuid4())], 30, "waiting")
    assert children_of(rt, run.id) == []


def test_the_childs_tokens_count_against_the_parent(rt: Runtime, llm: ScriptedLlm) -> None:
    llm.then_text("forty-two", input_tokens=700, output_tokens=300)
    run, dispatch = rt.submit("asks-a-child", "the answer?", token_budget=5000)
    drive_tree(rt, dispatch)
    parent = rt.store.get_run(run.id)
    [kid] = children_of(rt, run.id)
    child = rt.store.get_run(kid.id)
    assert (parent.status, parent.result) == (RunStatus.SUCCEEDED, "forty-two")
    assert child.tokens_used == 1000
    assert child.token_budget <= 5000, "a child's budget is at most what the parent has left"
    assert parent.tokens_used == 1000, "the child's tokens are the parent's too"
    assert parent.cost_usd == child.cost_usd


def test_a_failed_child_raises_in_the_parent(rt: Runtime) -> None:
    run, dispatch = rt.submit("careful", {})
    drive_tree(rt, dispatch)
    assert rt.store.get_run(run.id).result == "child failed: True"


def test_cancelling_the_parent_cancels_its_children(rt: Runtime, client: FlaskClient) -> None:
    run, dispatch = rt.submit("two-children", {})
    rt.driver().drive(dispatch.run_id, dispatch.token)
    [kid] = children_of(rt, run.id)
    assert client.post(f"/api/runs/{run.id}/cancel").status_code == 202
    assert rt.store.get_run(run.id).status is RunStatus.CANCELLED
    assert rt.store.get_run(kid.id).status is RunStatus.CANCELLED


def test_a_fork_of_the_parent_reuses_its_completed_children(
    rt: Runtime, client: FlaskClient
) -> None:
    run, dispatch = rt.submit("two-children", {})
    drive_tree(rt, dispatch)
    fork_id = fork_over_http(client, run.id, 2)
    drive_tree(rt, Dispatch(fork_id, rt.store.get_run(fork_id).dispatch_token))
    fork = rt.store.get_run(fork_id)
    assert (fork.status, fork.result) == (RunStatus.SUCCEEDED, 10)
    assert len(children_of(rt, fork_id)) == 1, "the first child was copied, not run again"
    assert len(children_of(rt, run.id)) == 2


def test_a_fork_of_a_parent_whose_child_still_works(rt: Runtime, client: FlaskClient) -> None:
    """The child has not ended: a fork from after its step is refused (409, the step has
    not completed); a fork from the step starts a child of its own, the source's child
    goes on for the source alone."""
    run, dispatch = rt.submit("two-children", {})
    rt.driver().drive(dispatch.run_id, dispatch.token)
    [kid] = children_of(rt, run.id)
    [row] = rt.store.steps(run.id)
    assert row.status is StepStatus.PENDING
    refused = client.post(f"/api/runs/{run.id}/fork", json={"fromSeq": row.seq + 1})
    assert refused.status_code == 409, refused.get_data(as_text=True)
    assert "PENDING, not completed" in refused.get_json()["error"]["message"]
    fork_id = fork_over_http(client, run.id, row.seq)
    drive_tree(rt, Dispatch(fork_id, rt.store.get_run(fork_id).dispatch_token))
    fork = rt.store.get_run(fork_id)
    assert (fork.status, fork.result) == (RunStatus.SUCCEEDED, 10)
    assert len(children_of(rt, fork_id)) == 2, "the fork ran its own children"
    assert rt.store.get_run(kid.id).status is RunStatus.QUEUED, "the source's child untouched"
    drive_tree(rt, Dispatch(kid.id, rt.store.get_run(kid.id).dispatch_token))
    assert rt.store.get_run(run.id).result == 10


def test_the_walkthroughs_family_asks_the_agent_loop_two_questions(
    rt: Runtime, llm: ScriptedLlm
) -> None:
    from examples.family import family

    rt.agents.register(family)
    llm.then_text("three are overdue").then_text("two are high")
    run, dispatch = rt.submit("family", {})
    drive_tree(rt, dispatch)
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (
        RunStatus.SUCCEEDED,
        {"answers": ["three are overdue", "two are high"]},
    )
    kids = [rt.store.get_run(k.id) for k in children_of(rt, run.id)]
    assert [k.agent for k in kids] == ["acme-tickets", "acme-tickets"]
    assert done.tokens_used == sum(k.tokens_used for k in kids) == 30


def test_a_parent_that_times_out_while_it_waits_cancels_its_child(rt: Runtime) -> None:
    run, dispatch = rt.submit("two-children", {}, timeout_seconds=1)
    rt.driver().drive(dispatch.run_id, dispatch.token)
    [kid] = children_of(rt, run.id)
    parked = rt.store.get_run(run.id)
    assert (parked.run_at - parked.updated_at).total_seconds() <= 2.5, "not past its deadline"
    time.sleep(2.5)  # past the deadline and the timer (the deadline, plus a second)
    [due] = [d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id == run.id]
    rt.driver().drive(due.run_id, due.token)
    assert rt.store.get_run(run.id).status is RunStatus.TIMED_OUT
    assert rt.store.get_run(kid.id).status is RunStatus.CANCELLED


def test_cancelling_a_run_cancels_its_grandchildren_too(rt: Runtime, client: FlaskClient) -> None:
    run, dispatch = rt.submit("grandparent", {})
    started = rt.driver().drive(dispatch.run_id, dispatch.token)
    [kid] = children_of(rt, run.id)
    rt.driver().drive(kid.id, started.wakes[0].token)  # the child starts its own child
    [grandkid] = children_of(rt, kid.id)
    assert rt.store.get_run(grandkid.id).status is RunStatus.QUEUED
    assert client.post(f"/api/runs/{run.id}/cancel").status_code == 202
    assert [rt.store.get_run(r).status for r in (run.id, kid.id, grandkid.id)] == [
        RunStatus.CANCELLED
    ] * 3, "the whole tree ends, not its first level only"
    # its message, delivered now, runs nothing (and bills nothing)
    token = rt.store.get_run(grandkid.id).dispatch_token
    rt.driver().drive(grandkid.id, token)
    assert rt.store.steps(grandkid.id) == []


def test_a_parent_resumed_after_timing_out_while_it_waited_starts_its_child_again(
    rt: Runtime, client: FlaskClient
) -> None:
    """U9 (issue 35): the parent's end cancels the child it waits for, and leaves no step a
    resume would misread as that child's: the resumed parent does not fail on the child it
    cancelled itself, it starts the child again and goes on."""
    run, dispatch = rt.submit("two-children", {}, timeout_seconds=60)
    rt.driver().drive(dispatch.run_id, dispatch.token)
    [kid] = children_of(rt, run.id)
    with rt.engine.begin() as conn:  # its deadline passes while it waits (test-only SQL)
        conn.execute(
            text("UPDATE run SET deadline_at = now() - interval '1 second' WHERE id = :id"),
            {"id": run.id},
        )
    rt.store.make_due_now(run.id)
    [due] = [d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id == run.id]
    rt.driver().drive(due.run_id, due.token)
    assert rt.store.get_run(run.id).status is RunStatus.TIMED_OUT
    assert rt.store.get_run(kid.id).status is RunStatus.CANCELLED
    assert [s.status for s in rt.store.steps(run.id)] != [StepStatus.PENDING]

    resumed = client.post(f"/api/runs/{run.id}/resume", json={"timeoutSeconds": 60})
    assert resumed.status_code == 202, resumed.get_data(as_text=True)
    drive_tree(rt, Dispatch(run.id, rt.store.get_run(run.id).dispatch_token))
    done = rt.store.get_run(run.id)
    assert (done.status, done.result, done.error) == (RunStatus.SUCCEEDED, 10, None)
    kids = children_of(rt, run.id)
    assert [k.status for k in kids] == ["CANCELLED", "SUCCEEDED", "SUCCEEDED"]
    assert [(s.step_key, s.status, s.attempt) for s in rt.store.steps(run.id)] == [
        ("child.double:0", StepStatus.DONE, 2),
        ("child.double:1", StepStatus.DONE, 1),
    ]
    timeline = client.get(f"/api/runs/{run.id}/timeline").get_json()
    shown = [t["childRunId"] for t in timeline if t["kind"] == "CHILD"]
    assert shown == [str(kids[1].id), str(kids[2].id)], "each step shows the child it read"
