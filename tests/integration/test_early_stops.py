"""Every way a durable function ends early runs its compensations, exactly once: the guard,
claims without progress (a step that kills its worker every time), a replay that diverges,
an output that cannot be recorded, an agent this process no longer knows. One stop path:
``Execution.stop`` (and, with no function to run, ``unwind_recorded``). Real PostgreSQL; the
worker dies by a ``BaseException`` raised in the step's real code path."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from db.records import Dispatch, RunStatus, StepStatus
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.testing.testkit import SimulatedCrash
from tests.support import expire_lease

RELEASED: list[str] = []
"""Every run of the compensation, across all tasks and workers."""


def reserve() -> str:
    return "seat 12"


def release(seat: str) -> None:
    """The compensation, module-level: found from its row's reference in any process."""
    RELEASED.append(seat)


def drive_through_crashes(runtime: Runtime, dispatch: Dispatch, limit: int = 40) -> RunStatus:
    """Drive the run to its end as a fleet would: a worker that dies leaves the run to the
    reaper once its lease lapses, and another worker goes on."""
    run_id = dispatch.run_id
    current: Dispatch | None = dispatch
    for _ in range(limit):
        if current is None:
            status = runtime.store.get_run(run_id).status
            if status is not RunStatus.RUNNING:
                return status
            expire_lease(runtime.engine, run_id)
            due = runtime.store.redispatch_due(redispatch_after=0)
            current = next((d for d in due if d.run_id == run_id), None)
            continue
        runtime.store.make_due_now(run_id)
        try:
            current = runtime.driver(worker="worker-A").drive(run_id, current.token).dispatch
        except SimulatedCrash:
            current = None
    raise AssertionError("the run did not end")


def _start(runtime: Runtime, agent: Any) -> tuple[uuid.UUID, Dispatch]:
    runtime.agents.register(agent)
    run, dispatch = runtime.submit(agent.name, {})
    return run.id, dispatch


def _reserved(runtime: Runtime, name: str) -> tuple[uuid.UUID, Dispatch]:
    """A run of a two-step function whose first step (with a compensation) is done."""

    @durable_agent(name)
    def fn(_: object, steps: Steps) -> str:
        steps.run("reserve", reserve, type=str, compensate=release)
        return steps.run("next", lambda: "done", type=str)

    run_id, dispatch = _start(runtime, fn)
    first = runtime.driver(worker="worker-A").drive(run_id, dispatch.token)
    assert first.dispatch is not None
    return run_id, first.dispatch


def _ends_compensated_once(runtime: Runtime, run_id: uuid.UUID, status: RunStatus) -> str:
    run = runtime.store.get_run(run_id)
    assert run.status is status, run.error
    assert RELEASED == ["seat 12"], "compensated exactly once"
    rows = {s.step_key: s.status for s in runtime.store.steps(run_id)}
    assert rows["compensate:reserve:0"] is StepStatus.DONE
    assert "compensated: reserve" in (run.error or "")
    return run.error or ""


def test_claims_without_progress_run_the_compensations_once(runtime: Runtime) -> None:
    RELEASED.clear()
    crashes: list[int] = []

    def poison() -> str:
        crashes.append(1)
        raise SimulatedCrash("the step kills its worker, every time")

    @durable_agent("stop-claims")
    def fn(_: object, steps: Steps) -> str:
        steps.run("reserve", reserve, type=str, compensate=release)
        return steps.run("poison", poison, type=str, idempotent=True)  # so it runs again

    run_id, dispatch = _start(runtime, fn)
    assert drive_through_crashes(runtime, dispatch) is RunStatus.FAILED
    error = _ends_compensated_once(runtime, run_id, status=RunStatus.FAILED)
    assert "without completing a step" in error
    assert len(crashes) == runtime.settings.max_claims_without_progress
    assert drive_through_crashes(runtime, dispatch) is RunStatus.FAILED  # a stale message
    assert RELEASED == ["seat 12"]


def test_a_replay_that_diverges_runs_the_compensations_once(runtime: Runtime) -> None:
    RELEASED.clear()
    runtime.settings = replace(runtime.settings, strict_replay=True)
    code = {"version": 1}

    @durable_agent("stop-diverge")
    def fn(_: object, steps: Steps) -> str:
        steps.run("reserve", reserve, type=str, compensate=release)
        if code["version"] == 1:
            steps.run("charge", lambda: "charged", type=str)
        else:
            steps.run("refund", lambda: "refunded", type=str)  # the code changed under it
        return steps.run("confirm", lambda: "confirmed", type=str)

    run_id, dispatch = _start(runtime, fn)
    driver = runtime.driver(worker="worker-A")
    first = driver.drive(run_id, dispatch.token)  # reserve
    assert first.dispatch is not None
    second = driver.drive(run_id, first.dispatch.token)  # charge
    assert second.dispatch is not None
    code["version"] = 2
    assert drive_through_crashes(runtime, second.dispatch) is RunStatus.FAILED
    error = _ends_compensated_once(runtime, run_id, status=RunStatus.FAILED)
    assert "diverged from its history" in error


def test_an_output_that_cannot_be_recorded_runs_the_compensations_once(runtime: Runtime) -> None:
    RELEASED.clear()

    @durable_agent("stop-output")
    def fn(_: object, steps: Steps) -> Any:
        steps.run("reserve", reserve, type=str, compensate=release)
        return object()  # not JSON

    run_id, dispatch = _start(runtime, fn)
    assert drive_through_crashes(runtime, dispatch) is RunStatus.FAILED
    _ends_compensated_once(runtime, run_id, status=RunStatus.FAILED)


def test_an_unknown_agent_runs_the_compensations_its_rows_name_once(runtime: Runtime) -> None:
    RELEASED.clear()

    run_id, first = _reserved(runtime, "stop-unknown")
    runtime.agents._agents.pop("stop-unknown")  # the deploy that dropped it
    assert drive_through_crashes(runtime, first) is RunStatus.FAILED
    error = _ends_compensated_once(runtime, run_id, status=RunStatus.FAILED)
    assert "stop-unknown" in error


def test_the_guard_runs_the_compensations_once(runtime: Runtime) -> None:
    RELEASED.clear()

    run_id, first = _reserved(runtime, "stop-guard")
    runtime.store.cancel(run_id)
    assert drive_through_crashes(runtime, first) is RunStatus.CANCELLED
    _ends_compensated_once(runtime, run_id, status=RunStatus.CANCELLED)


def test_a_value_the_database_refuses_runs_the_compensations_once(runtime: Runtime) -> None:
    """A step's value ``jsonb`` refuses (a ``NaN``) is refused every time: the run ends
    there, and like every other early end it undoes its completed steps first."""
    RELEASED.clear()

    @durable_agent("stop-refused")
    def fn(_: object, steps: Steps) -> float:
        steps.run("reserve", reserve, type=str, compensate=release)
        return steps.run("ratio", lambda: float("nan"), type=float)

    run_id, dispatch = _start(runtime, fn)
    assert drive_through_crashes(runtime, dispatch) is RunStatus.FAILED
    error = _ends_compensated_once(runtime, run_id, status=RunStatus.FAILED)
    assert "refused" in error


def _parked_after(runtime: Runtime, name: str, kind: str) -> tuple[uuid.UUID, Dispatch]:
    """A function whose first step, of ``kind``, has a compensation (``steps.compensate``),
    then parked on a timer: no worker holds it when it is cancelled."""

    @durable_agent(name)
    def fn(_: object, steps: Steps) -> str:
        if kind == "side_effect":
            steps.side_effect("reserve", reserve, type=str)
        else:
            steps.llm("reserve", lambda model: reserve(), type=str)
        steps.compensate(release)
        steps.sleep(600)
        return "done"

    run_id, dispatch = _start(runtime, fn)
    driver = runtime.driver(worker="worker-A")
    first = driver.drive(run_id, dispatch.token)
    assert first.dispatch is not None
    parked = driver.drive(run_id, first.dispatch.token)
    assert runtime.store.get_run(run_id).locked_by is None, "parked, holding nothing"
    return run_id, parked.dispatch or first.dispatch


def test_a_parked_function_cancelled_compensates_every_compensable_kind(
    runtime: Runtime,
) -> None:
    """U4: the cancel's SQL decided there was nothing to undo by looking at STEP and APPROVAL
    rows only, so a function parked after a compensable ``steps.side_effect`` or
    ``steps.llm`` was cancelled at once and its compensation never ran."""
    for kind in ("side_effect", "llm"):
        RELEASED.clear()
        run_id, dispatch = _parked_after(runtime, f"parked-{kind}", kind)
        assert runtime.store.cancel(run_id) is RunStatus.RUNNING, "handed to a worker to undo"
        assert drive_through_crashes(runtime, dispatch) is RunStatus.CANCELLED
        _ends_compensated_once(runtime, run_id, status=RunStatus.CANCELLED)


def test_an_operators_fail_is_the_engines_stop(runtime: Runtime) -> None:
    """U5: ``resolve fail`` was one UPDATE to FAILED: a durable function's completed steps
    were never compensated. Now it is the stop every other early end takes: the run is
    handed to a worker that runs the compensations once and ends it FAILED, the operator's
    reason kept."""
    RELEASED.clear()

    def charge() -> str:
        raise SimulatedCrash("the worker died inside the charge")

    @durable_agent("stop-operator")
    def fn(_: object, steps: Steps) -> str:
        steps.run("reserve", reserve, type=str, compensate=release)
        return steps.run("charge", charge, type=str)  # not idempotent: in doubt after a crash

    run_id, dispatch = _start(runtime, fn)
    assert drive_through_crashes(runtime, dispatch) is RunStatus.NEEDS_ATTENTION
    assert RELEASED == []

    handed = runtime.store.resolve(run_id, "fail", reason="refunded by hand", operator="ops")
    assert handed is not None, "a worker runs its compensations"
    assert runtime.store.get_run(run_id).status is RunStatus.RUNNING
    assert drive_through_crashes(runtime, handed) is RunStatus.FAILED
    error = _ends_compensated_once(runtime, run_id, status=RunStatus.FAILED)
    assert error.startswith("failed by ops: refunded by hand")


def test_an_operators_fail_with_nothing_to_undo_ends_the_run_at_once(runtime: Runtime) -> None:
    def charge() -> str:
        raise SimulatedCrash("the worker died inside the charge")

    @durable_agent("stop-operator-plain")
    def fn(_: object, steps: Steps) -> str:
        return steps.run("charge", charge, type=str)

    run_id, dispatch = _start(runtime, fn)
    assert drive_through_crashes(runtime, dispatch) is RunStatus.NEEDS_ATTENTION
    assert runtime.store.resolve(run_id, "fail", reason="gave up") is None
    run = runtime.store.get_run(run_id)
    assert (run.status, run.error) == (RunStatus.FAILED, "failed by operator: gave up")
