"""Regression tests for defects an invariant review found (each failed before its fix)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from sqlalchemy import text

from db.errors import LeaseLost
from db.queries import QUERIES as Q
from db.records import ApprovalStatus, NewStep, RunStatus, StepKind, StepStatus, Usage
from runtime.durable import Model, Steps, durable_agent, step
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.engine.sweeps import expire_approval
from runtime.llm.base import LlmError, LlmRequest, LlmResponse
from runtime.llm.retry import RetryLater
from runtime.testing.testkit import DurableTester, FakeModel, assert_run
from tests.support import expire_lease


@pytest.fixture
def model() -> FakeModel:
    return FakeModel()


@pytest.fixture
def tester(runtime: Runtime, model: FakeModel) -> DurableTester:
    runtime.settings = replace(runtime.settings, strict_replay=True)
    return DurableTester(runtime, model)


def test_a_model_call_nested_in_a_step_is_charged(
    tester: DurableTester, model: FakeModel, runtime: Runtime
) -> None:
    model.respond_with_text("fine", input_tokens=1000, output_tokens=500)

    @durable_agent("nested-llm")
    def fn(_: object, steps: Steps) -> str:
        return steps.run("outer", lambda: steps.llm("ask", lambda m: m.complete("hi")), type=str)

    done = tester.run(fn, {})
    assert_run(done).completed().output("fine")
    assert runtime.store.get_run(done.run_id).tokens_used == 1500


def test_a_rate_limited_durable_llm_step_waits_on_a_timer(runtime: Runtime) -> None:
    class RateLimited:
        def __init__(self) -> None:
            self.calls = 0

        def send(self, request: LlmRequest) -> LlmResponse:
            self.calls += 1
            if self.calls == 1:
                raise RetryLater(LlmError("slow down", status=429), 30, attempts=1)
            return LlmResponse([{"type": "text", "text": "ok"}], "end_turn", Usage(1, 1), "m")

    runtime.llm = RateLimited()

    @durable_agent("limited")
    def fn(_: object, steps: Steps) -> str:
        return steps.llm("ask", lambda m: m.complete("hi"), type=str)

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("limited", {})
    result = runtime.driver().drive(run.id, dispatch.token)
    assert result.outcome is Outcome.WAITING
    assert result.dispatch is not None
    assert result.dispatch.delay_seconds == 30
    parked = runtime.store.get_run(run.id)
    assert parked.status is RunStatus.RUNNING
    assert parked.locked_by is None
    rows = runtime.store.steps(run.id)
    assert [(s.step_key, s.status) for s in rows] == [("ask:0", StepStatus.PAUSED)], (
        "no error recorded: it is a wait, not a failure"
    )
    done = DurableTester(runtime).resume(run.id)
    assert_run(done).completed().output("ok")


def test_a_finally_cannot_run_a_second_step_in_the_same_task(tester: DurableTester) -> None:
    effects: list[str] = []

    @durable_agent("tidy")
    def fn(_: object, steps: Steps) -> str:
        try:
            steps.run("a", lambda: effects.append("a"))
        finally:
            steps.run("cleanup", lambda: effects.append("cleanup"))
        return "done"

    result = tester.run(fn, {})
    assert_run(result).completed().has_steps("a", "cleanup")
    assert effects == ["a", "cleanup"], "each effect once, each in its own task"


def test_start_step_is_fenced_against_a_claim_committing_meanwhile(runtime: Runtime) -> None:
    run, dispatch = runtime.submit("acme-tickets", "hi")
    stale = runtime.store.claim(run.id, dispatch.token, "A", 5)
    assert stale is not None
    expire_lease(runtime.engine, run.id)
    (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
    conn = runtime.engine.connect()
    txn = conn.begin()
    conn.execute(
        Q["claim_run"],
        {
            "id": run.id,
            "token": redispatch.token,
            "worker": "B",
            "lease_seconds": 5,
            "deployment": runtime.store.deployment,
        },
    )  # B's claim, not yet committed
    outcome: list[str] = []

    def start() -> None:
        try:
            runtime.store.start_step(
                stale,
                NewStep(
                    1, "tool:x", StepKind.TOOL, StepStatus.STARTED, tool_name="t", tool_use_id="x"
                ),
            )
            outcome.append("written")
        except LeaseLost:
            outcome.append("fenced")

    worker_a = threading.Thread(target=start)
    worker_a.start()
    time.sleep(0.5)
    txn.commit()
    conn.close()
    worker_a.join(10)
    assert outcome == ["fenced"]
    assert runtime.store.steps(run.id) == []


def test_a_parent_retry_reruns_its_failed_nested_step(tester: DurableTester) -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("once")
        return "ok"

    @durable_agent("nested-retry")
    def fn(_: object, steps: Steps) -> str:
        return steps.retry(3, 0.01).run("outer", lambda: steps.run("inner", flaky), type=str)

    assert_run(tester.run(fn, {})).completed().output("ok").step("outer").attempts(2)
    assert len(calls) == 2


def test_compensate_after_an_approval_attaches_to_the_approved_step(
    tester: DurableTester,
) -> None:
    undone: list[str] = []

    @durable_agent("pay-then-fail", approval_roles=["finance"])
    def fn(_: object, steps: Steps) -> None:
        steps.run("reserve", lambda: "r1")
        steps.compensate(lambda r: undone.append(f"unreserve {r}"))
        steps.approval("finance", 3600).run("pay", lambda: "p1", type=str)
        steps.compensate(lambda r: undone.append(f"refund {r}"))
        steps.run("ship", lambda: 1 / 0)

    waiting = tester.run(fn, {})
    failed = tester.approve(waiting.run_id)
    assert_run(failed).failed().compensated("pay", "reserve")
    assert undone == ["refund p1", "unreserve r1"]


def test_nested_steps_of_a_failed_step_are_compensated(tester: DurableTester) -> None:
    undone: list[str] = []

    @step(compensate=lambda r: undone.append(r))
    def book(what: str) -> str:
        return what

    @durable_agent("trip-nested")
    def fn(_: object, steps: Steps) -> None:
        def plan() -> None:
            book("flight")
            book("hotel")
            raise RuntimeError("no car available")

        steps.run("plan", plan)

    failed = tester.run(fn, {})
    assert_run(failed).failed()
    assert undone == ["hotel", "flight"]
    statuses = {s.step_key: s.status for s in failed.steps}
    assert statuses["compensate:plan:0/book:1"] is StepStatus.DONE
    assert statuses["compensate:plan:0/book:0"] is StepStatus.DONE


def test_resume_after_an_expired_approval_asks_again(
    tester: DurableTester, runtime: Runtime
) -> None:
    @durable_agent("expiring", approval_roles=["ops"])
    def fn(_: object, steps: Steps) -> str:
        return steps.approval("ops", 0.05).run("go", lambda: "went", type=str)

    waiting = tester.run(fn, {})
    time.sleep(0.1)
    ((approval_id, _),) = runtime.store.due_approvals()
    failed = tester._drive(expire_approval(runtime.store, approval_id, "FAIL"))  # type: ignore[arg-type]
    assert_run(failed).failed()
    runtime.store.resume_failed(waiting.run_id, timeout_seconds=600)
    again = tester.resume(waiting.run_id)
    assert_run(again).waiting()
    (approval,) = runtime.store.list_approvals(run_id=waiting.run_id)
    assert approval.status is ApprovalStatus.PENDING, "asked afresh"
    assert_run(tester.approve(waiting.run_id)).completed().output("went")


def test_a_cancel_during_the_step_that_suspends_ends_the_run(
    tester: DurableTester, runtime: Runtime
) -> None:
    @durable_agent("cancel-me", approval_roles=["ops"])
    def fn(_: object, steps: Steps) -> None:
        steps.approval("ops", 3600).run("go", lambda: None)

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("cancel-me", {})
    claim = runtime.store.claim(run.id, dispatch.token, "w", 30)
    assert claim is not None
    assert runtime.store.cancel(run.id) is RunStatus.RUNNING  # lease live: only the flag
    runtime.driver(worker="w").execute(claim)
    assert runtime.store.get_run(run.id).status is RunStatus.CANCELLED
    assert [a.status for a in runtime.store.list_approvals(status=None, run_id=run.id)] == [
        ApprovalStatus.CANCELLED
    ]


def test_version_inside_a_step_is_refused(tester: DurableTester) -> None:
    @durable_agent("nested-version")
    def fn(_: object, steps: Steps) -> None:
        steps.run("outer", lambda: steps.version("v", 1, 1))

    failed = tester.run(fn, {})
    assert_run(failed).failed()
    assert "steps.version() belongs at the top level" in (failed.error or "")


def test_model_helper_parses_fenced_json(runtime: Runtime, model: FakeModel) -> None:
    model.respond_with_text('```json\n{"a": 1}\n```')
    runtime.llm = model

    @durable_agent("json")
    def fn(_: object, steps: Steps) -> dict[str, int]:
        return steps.llm("ask", lambda m: Model.complete_json(m, "give json"))

    done = DurableTester(runtime).run(fn, {})
    assert_run(done).completed().output({"a": 1})
    with runtime.engine.connect() as conn:  # the step and its one model call
        assert conn.execute(text("SELECT count(*) FROM run_step")).scalar_one() == 2
