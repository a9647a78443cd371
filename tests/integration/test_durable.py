"""Durable functions on the real engine and PostgreSQL, through the shipped test kit."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import pydantic
import pytest

from db.records import ApprovalStatus, RunStatus, StepKind, StepStatus
from examples.order_refund import RefundRequest
from examples.order_refund import build as build_refund
from examples.ticket_triage import Classification, Ticket
from examples.ticket_triage import build as build_triage
from runtime.durable import Steps, StepTimeout, durable_agent, step
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.engine.sweeps import expire_approval
from runtime.testing.testkit import DurableTester, FakeModel, assert_run

TICKET = Ticket(101, "Invoice wrong", "VAT is 19%, should be 7%")


@pytest.fixture
def model() -> FakeModel:
    return FakeModel()


@pytest.fixture
def tester(runtime: Runtime, model: FakeModel) -> DurableTester:
    runtime.settings = replace(runtime.settings, strict_replay=True)
    runtime.tickets.seed()
    return DurableTester(runtime, model)


# -- seed 002's resumesAfterCrash --------------------------------------------------------------


def test_resumes_after_crash(tester: DurableTester, model: FakeModel, runtime: Runtime) -> None:
    model.respond_with_json(Classification("billing", "normal", "wrong VAT"))
    tester.crash_after("classify")

    crashed = tester.run(build_triage(runtime.tickets), TICKET)
    assert crashed.crashed
    suspended = tester.resume(crashed.run_id)
    assert_run(suspended).waiting()
    done = tester.approve(crashed.run_id, "lead")

    assert_run(done).completed().has_steps("classify", "find_similar", "propose", "apply").step(
        "propose"
    ).was_approved()
    assert model.calls == 1, "replayed, not repeated"
    assert runtime.tickets.count_comments(101) == 1, "applied exactly once"
    classify = next(s for s in done.steps if s.step_key == "classify:0")
    assert classify.kind is StepKind.LLM
    call = next(s for s in done.steps if s.step_key == "classify:0/llm:0")
    assert call.usage.input_tokens == 10, "each model call is its own recorded child step"
    assert call.prompt_hash is not None
    assert runtime.store.get_run(done.run_id).tokens_used == 15
    assert done.result == {
        "ticket_id": 101,
        "action": "route to billing",
        "note": "wrong VAT (similar: #101)",
    }


def test_suspended_runs_hold_no_lease_and_no_message(
    tester: DurableTester, model: FakeModel, runtime: Runtime
) -> None:
    model.respond_with_json(Classification("login", "high", "loops"))
    waiting = tester.run(build_triage(runtime.tickets), TICKET)
    run = runtime.store.get_run(waiting.run_id)
    assert run.status is RunStatus.WAITING
    assert run.locked_by is None
    assert run.locked_until is None
    assert run.wait_reason == "waiting for approval by support_lead (propose:0)"
    assert runtime.store.redispatch_due(redispatch_after=0) == [], "the reaper leaves it alone"
    stale = runtime.driver().drive(run.id, run.dispatch_token)
    assert stale.outcome is Outcome.DROPPED, "no message can wake it but a decision"
    (approval,) = runtime.store.list_approvals(run_id=run.id)
    assert approval.role == "support_lead"
    assert approval.payload["stepKey"] == "propose:0"
    assert approval.payload["input"][0] == {
        "id": 101,
        "subject": "Invoice wrong",
        "body": TICKET.body,
    }


# -- keys, loops, nesting, types ------------------------------------------------------------------


@dataclass
class Point:
    x: int
    y: int


class Label(pydantic.BaseModel):
    name: str
    weight: float


def test_loops_nested_keys_and_type_round_trip(tester: DurableTester) -> None:
    seen: list[object] = []

    @durable_agent("shapes")
    def shapes(_: dict[str, int], steps: Steps) -> dict[str, object]:
        points = [steps.run("point", lambda i=i: Point(i, i * i), type=Point) for i in range(3)]
        seen.append(points)
        label = steps.run("label", lambda: Label(name="a", weight=0.5), type=Label)
        many = steps.run(
            "many", lambda: {"p": [Point(1, 2)], "l": [Label(name="b", weight=1)]},
            type=dict[str, list[Point] | list[Label]],
        )  # fmt: skip

        def outer() -> int:
            return steps.run("inner", lambda: 40) + steps.run("inner", lambda: 2)

        total = steps.run("outer", outer, type=int)
        assert isinstance(label, Label)
        assert all(isinstance(p, Point) for p in points)
        assert isinstance(many["p"][0], Point)
        return {"points": points, "label": label, "total": total}

    result = tester.run(shapes, {})
    assert_run(result).completed().has_steps("point", "point", "point", "label", "many", "outer")
    keys = [s.step_key for s in result.steps]
    assert keys == [
        "point:0", "point:1", "point:2", "label:0", "many:0",
        "outer:0", "outer:0/inner:0", "outer:0/inner:1",
    ]  # fmt: skip
    assert result.result["total"] == 42
    assert result.result["points"][2] == {"x": 2, "y": 4}
    assert all(isinstance(p, Point) for batch in seen for p in batch), "decoded on every replay"


# -- retry, timeout, version --------------------------------------------------------------------


def test_retry_attempts_persist_across_a_crash(tester: DurableTester, runtime: Runtime) -> None:
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(len(attempts) + 1)
        if len(attempts) < 3:
            raise ConnectionError(f"attempt {len(attempts)} failed")
        return "found"

    @durable_agent("flaky")
    def fn(_: object, steps: Steps) -> str:
        return steps.retry(3, backoff=0.01).run("search", flaky, type=str)

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("flaky", {})
    first = runtime.driver().drive(dispatch.run_id, dispatch.token)
    assert first.outcome is Outcome.WAITING, "a failed attempt waits on a durable timer"
    row = runtime.store.steps(run.id)[0]
    assert (row.status, row.attempt) == (StepStatus.RETRYING, 1)
    assert "attempt 1 failed" in (row.error or "")
    # The worker dies while the run waits; another resumes it later.
    done = tester.resume(run.id)
    assert_run(done).completed().output("found").step("search").attempts(3)
    assert attempts == [1, 2, 3], "attempts were counted across the crash, not restarted"


def test_retries_exhausted_fail_the_run_with_the_last_error(tester: DurableTester) -> None:
    @durable_agent("always-fails")
    def fn(_: object, steps: Steps) -> str:
        return steps.retry(2, backoff=0.01).run("call", lambda: 1 / 0)

    result = tester.run(fn, {})
    assert_run(result).failed().step("call").attempts(2)
    assert "ZeroDivisionError" in (result.error or "")


def test_timeout(tester: DurableTester) -> None:
    @durable_agent("slow")
    def fn(_: object, steps: Steps) -> str:
        def wait() -> str:
            context = steps.context
            assert context is not None
            if context.cancelled.wait(3):  # cooperative: stops when cancelled
                raise TimeoutError("stopped")
            return "late"

        try:
            return steps.timeout(0.2).run("wait", wait, type=str)
        except StepTimeout as e:  # the recorded error, raised again on every replay
            return f"gave up: {type(e).__name__}"

    result = tester.run(fn, {})
    assert_run(result).completed().output("gave up: StepTimeout")
    (row,) = [s for s in result.steps if s.step_key == "wait:0"]
    assert row.status is StepStatus.ERROR
    assert StepTimeout.__name__ in (row.error or "")
    assert row.latency_ms is not None
    assert row.latency_ms < 2000


def test_version_for_changing_code_with_runs_in_flight(
    tester: DurableTester, runtime: Runtime
) -> None:
    @durable_agent("versioned", approval_roles=["ops"])
    def v1(_: object, steps: Steps) -> int:
        version = steps.version("pricing", 1, 2)
        steps.approval("ops", 3600).run("gate", lambda: None)
        return version

    waiting = tester.run(v1, {})
    assert_run(waiting).waiting()

    # New code ships while the run waits: it still supports version 2.
    @durable_agent("versioned", approval_roles=["ops"])
    def v2(_: object, steps: Steps) -> int:
        version = steps.version("pricing", 2, 3)
        steps.approval("ops", 3600).run("gate", lambda: None)
        return version * 10

    runtime.agents.replace(v2)
    assert_run(tester.approve(waiting.run_id)).completed().output(20)

    # A later deploy drops version 2: a run recorded at 2 fails with a clear message.
    runtime.agents.replace(v1)
    fresh = tester.run(v1, {})
    runtime.agents.replace(replace(v2, fn=lambda _, steps: steps.version("pricing", 3, 3)))
    failed = tester.approve(fresh.run_id)
    assert_run(failed).failed()
    assert "recorded version 2 of 'pricing'; this code supports 3 to 3" in (failed.error or "")


# -- approvals: timeouts and rejection --------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "status", "message"),
    [
        ("APPROVE", RunStatus.SUCCEEDED, None),
        ("REJECT", RunStatus.FAILED, "rejected by timeout-policy"),
        ("FAIL", RunStatus.FAILED, "ApprovalExpired"),
    ],
)
def test_approval_timeout_policies(
    tester: DurableTester, runtime: Runtime, policy: str, status: RunStatus, message: str | None
) -> None:
    @durable_agent("gated", approval_roles=["ops"])
    def fn(_: object, steps: Steps) -> str:
        return steps.approval("ops", 0.05, policy=policy).run("go", lambda: "went", type=str)

    tester.run(fn, {})
    time.sleep(0.1)
    ((approval_id, applied),) = runtime.store.due_approvals()
    assert applied == policy
    dispatch = expire_approval(runtime.store, approval_id, policy)
    assert dispatch is not None
    result = tester._drive(dispatch)
    assert result.status is status, result.error
    if message:
        assert message in (result.error or "")
    assert runtime.store.due_approvals() == []


def test_rejection_compensates_the_reservation_exactly_once(
    tester: DurableTester, runtime: Runtime
) -> None:
    refund = build_refund(runtime.tickets)
    waiting = tester.run(refund, RefundRequest(105, 42.5, "damaged"))
    assert runtime.tickets.count_comments(105) == 1, "reserved"
    failed = tester.reject(waiting.run_id, "finance-bob", "no proof of damage")
    assert_run(failed).failed().compensated("reserve").step("pay").was_rejected()
    assert "rejected by finance-bob: no proof of damage" in (failed.error or "")
    assert "compensated: reserve" in (failed.error or "")
    assert runtime.tickets.count_comments(105) == 2, "reserved, then released once"
    # A duplicate message or a resume after the end changes nothing.
    assert tester.resume(waiting.run_id).status is RunStatus.FAILED
    assert runtime.tickets.count_comments(105) == 2


def test_approved_refund_pays(tester: DurableTester, runtime: Runtime) -> None:
    waiting = tester.run(build_refund(runtime.tickets), RefundRequest(104, 10, "late"))
    done = tester.approve(waiting.run_id, "finance-ann")
    assert_run(done).completed().output("paid").step("pay").was_approved()
    approval = runtime.store.list_approvals(status=None, run_id=done.run_id)[0]
    assert approval.status is ApprovalStatus.APPROVED
    assert approval.decided_by == "finance-ann"
    assert runtime.tickets.count_comments(104) == 2, "reserved and paid, nothing undone"


def test_compensations_run_in_reverse_each_once(tester: DurableTester) -> None:
    undone: list[str] = []

    @step(compensate=lambda r: undone.append(r))
    def book(what: str) -> str:
        return what

    @durable_agent("trip")
    def trip(_: object, steps: Steps) -> None:
        book("flight")
        book("hotel")
        steps.run("car", lambda: "car")
        steps.compensate(lambda r: undone.append(f"{r} (registered after)"))
        steps.run("charge", lambda: 1 / 0)

    failed = tester.run(trip, {})
    assert_run(failed).failed().compensated("car", "book", "book")
    assert undone == ["car (registered after)", "hotel", "flight"]


# -- strict replay -----------------------------------------------------------------------------


def test_strict_replay_names_the_divergence(tester: DurableTester, runtime: Runtime) -> None:
    @durable_agent("changing", approval_roles=["ops"])
    def before(_: object, steps: Steps) -> None:
        steps.run("work", lambda: 1)
        steps.run("work", lambda: 2)
        steps.approval("ops", 3600).run("gate", lambda: None)

    waiting = tester.run(before, {})

    @durable_agent("changing", approval_roles=["ops"])
    def after(_: object, steps: Steps) -> None:
        steps.run("work", lambda: 1)
        steps.run("changed", lambda: 2)
        steps.approval("ops", 3600).run("gate", lambda: None)

    runtime.agents.replace(after)
    failed = tester.approve(waiting.run_id)
    assert_run(failed).failed()
    assert failed.error == (
        f"Run {waiting.run_id} diverged from its history at step #1: recorded 'work' but the "
        "code called 'changed'. Recorded sequence: [work, work, gate]. Either the agent code "
        "changed in an incompatible way or it is not deterministic between steps."
    )


def test_recorded_errors_are_raised_again_on_replay(tester: DurableTester) -> None:
    calls: list[int] = []

    @durable_agent("handles")
    def fn(_: object, steps: Steps) -> str:
        try:
            steps.run("explode", lambda: calls.append(1) or (_ for _ in ()).throw(KeyError("k")))
        except Exception as e:
            kind = type(e).__name__
            return steps.run("handled", lambda: f"handled {kind}", type=str)
        return "unreachable"

    result = tester.run(fn, {})
    assert_run(result).completed().output("handled StepError")
    assert calls == [1], "the failed step ran once; replays raised its recorded error"
