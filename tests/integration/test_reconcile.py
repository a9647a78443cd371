"""A reconcile hook decides every time an effect's outcome is unknown, and only a clear answer
counts (issue 23 defect 3 and the section 4 mutant of the hook read as "not happened").
Real PostgreSQL; crashes are real ``BaseException``s."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from db.records import RunStatus, StepStatus
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.testing.testkit import DurableTester, SimulatedCrash
from runtime.tools import OutcomeUnknown, Reconciled, ToolContext
from tests.support import drive_to_end, expire_lease


def test_an_answer_lost_again_after_reconcile_is_reconciled_again(runtime: Runtime) -> None:
    """Defect 3: the charge's answer is lost; reconcile says it did not happen; the charge runs
    again and its answer is lost again. That is in doubt again, not a plain failure: the hook
    is asked again before any further charge, ``steps.retry`` included."""
    events: list[str] = []

    def charge() -> str:
        events.append("charge")
        if events.count("charge") <= 2:
            raise OutcomeUnknown("the payment service did not answer")
        return "charged"

    def reconcile(ctx: ToolContext) -> Reconciled | None:
        events.append("reconcile")
        return None  # the ledger has no such charge

    @durable_agent("charge-unknown")
    def fn(_: object, steps: Steps) -> str:
        return steps.retry(3, 0.01).run("charge", charge, type=str, reconcile=reconcile)

    done = DurableTester(runtime).run(fn, {})
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "charged"
    assert events == ["charge", "reconcile", "charge", "reconcile", "charge"], events
    (row,) = done.steps
    assert row.attempt == 1, "no attempt was spent on an unknown outcome"


def test_answers_lost_every_time_stop_the_run_for_an_operator(runtime: Runtime) -> None:
    events: list[str] = []

    def charge() -> str:
        events.append("charge")
        raise OutcomeUnknown("the payment service did not answer")

    def reconcile(ctx: ToolContext) -> Reconciled | None:
        events.append("reconcile")
        return None

    @durable_agent("charge-never")
    def fn(_: object, steps: Steps) -> str:
        return steps.retry(5, 0.01).run("charge", charge, type=str, reconcile=reconcile)

    done = DurableTester(runtime).run(fn, {})
    assert done.status is RunStatus.NEEDS_ATTENTION
    assert "reconcile hook said the effect had not happened" in (done.error or "")
    assert events[-1] == "charge"
    assert events.count("charge") == events.count("reconcile") + 1 <= 4
    (row,) = done.steps
    assert row.status is StepStatus.STARTED, "left for the operator, in doubt"


def _crashed_charge(runtime: Runtime, name: str, reconcile: Any, effects: list[str]) -> Any:
    """A durable function whose non-idempotent charge crashes its worker after the effect:
    left ``STARTED``, in doubt, for the next task's reconcile hook."""

    def charge() -> str:
        effects.append("charge")
        if len(effects) == 1:
            raise SimulatedCrash("the worker died after charging")
        return "charged"

    @durable_agent(name)
    def fn(_: object, steps: Steps) -> str:
        return steps.timeout(0.5).run("charge", charge, type=str, reconcile=reconcile)

    runtime.agents.register(fn)
    run, dispatch = runtime.submit(name, {})
    with pytest.raises(SimulatedCrash):
        drive_to_end(runtime.driver(worker="worker-A"), dispatch)
    expire_lease(runtime.engine, run.id)
    (again,) = runtime.store.redispatch_due(redispatch_after=3600)
    drive_to_end(runtime.driver(worker="worker-B"), again)
    return runtime.store.get_run(run.id)


def test_a_reconcile_hook_that_hangs_past_its_grace_is_not_read_as_not_happened(
    runtime: Runtime,
) -> None:
    runtime.settings = replace(runtime.settings, cancel_grace_seconds=0.3)
    effects: list[str] = []

    def hangs(ctx: ToolContext) -> Reconciled | None:
        time.sleep(2.0)  # past its 0.5 s timeout and the 0.3 s grace, ignoring ctx.cancelled
        return None

    done = _crashed_charge(runtime, "charge-hang", hangs, effects)
    assert effects == ["charge"], "charged again on a hook that never answered"
    assert done.status is not RunStatus.SUCCEEDED
    assert runtime.store.steps(done.id)[0].status is StepStatus.STARTED


@pytest.mark.parametrize("error", [RuntimeError("the ledger is down"), ValueError("bad row")])
def test_a_reconcile_hook_that_raises_is_not_read_as_not_happened(
    runtime: Runtime, error: Exception
) -> None:
    effects: list[str] = []

    def raises(ctx: ToolContext) -> Reconciled | None:
        raise error

    done = _crashed_charge(runtime, f"charge-raise-{type(error).__name__}", raises, effects)
    assert effects == ["charge"], "charged again on a hook that failed"
    assert done.status is RunStatus.NEEDS_ATTENTION
    assert "its reconcile hook failed" in (done.error or "")
    assert type(error).__name__ in (done.error or "")
