"""What the one advance asks each kind (issue 35, item 1), on the real engine and PostgreSQL:
where it may be called (a kind that belongs at the top level says so, whatever it is), and
what a recorded row answers (an approval granted for other arguments raises, it never runs
what was not approved)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from db.records import RunStatus
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.testing.testkit import DurableTester, FakeModel


@pytest.fixture
def tester(runtime: Runtime) -> DurableTester:
    runtime.settings = replace(runtime.settings, strict_replay=True)
    return DurableTester(runtime, FakeModel())


@pytest.mark.parametrize(
    ("inner", "error"),
    [
        (lambda steps: steps.child("other", {}), "steps.child belongs at the top level"),
        (lambda steps: steps.sleep(1), "steps.sleep belongs at the top level"),
        (
            lambda steps: steps.approval("lead", 60).run("act", lambda: 1),
            "an approval cannot be asked for inside another step",
        ),
    ],
    ids=["child", "sleep", "approval"],
)
def test_a_top_level_kind_inside_a_step_fails_the_run_saying_so(
    tester: DurableTester, inner: Any, error: str
) -> None:
    @durable_agent("misplaced", approval_roles=["lead"])
    def misplaced(_: dict[str, int], steps: Steps) -> Any:
        return steps.run("outer", lambda: inner(steps))

    done = tester.run(misplaced, {})
    assert done.status is RunStatus.FAILED
    assert error in (done.error or "")


ARGUMENT = {"amount": 10}


def test_an_approval_granted_for_other_arguments_never_runs(tester: DurableTester) -> None:
    ran: list[int] = []

    def pay(amount: int) -> int:
        ran.append(amount)
        return amount

    @durable_agent("payer", approval_roles=["lead"])
    def payer(_: dict[str, int], steps: Steps) -> int:
        return steps.approval("lead", 60).run("pay", pay, ARGUMENT["amount"])

    waiting = tester.run(payer, {})
    assert waiting.status is RunStatus.WAITING
    ARGUMENT["amount"] = 1_000  # the code now would pay another amount than was approved
    try:
        done = tester.approve(waiting.run_id, "lead")
    finally:
        ARGUMENT["amount"] = 10
    assert done.status is RunStatus.FAILED
    assert "was approved for input hash" in (done.error or "")
    assert ran == []
