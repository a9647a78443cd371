"""A checkpoint retried across a database blink decides "an earlier try committed" only from a
row that try wrote: this run's worker, this lease (issue 23 defect 6 and the section 4
mutants of the checkpoint retry). Real PostgreSQL; the blink is the store raising the
driver's own ``OperationalError``, before or after its statement committed."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from db.records import Claim, Dispatch, NewStep, RunStatus, StepStatus
from db.store import RunStore
from runtime.durable import Model, Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.fork import ForkRefused, ForkRequest, fork_run
from runtime.testing.testkit import DurableTester, FakeModel
from tests.integration.test_one_executor import _CheckedStore
from tests.support import dropped_connection


def _blink_child(store: RunStore, *, on_call: int, after_commit: bool) -> list[int]:
    """The ``on_call``-th record of a model call inside a step (``record_child``) fails once
    as a dropped connection does: before its statement ran, or after it committed."""
    real = store.record_child
    calls: list[int] = []

    def flaky(claim: Claim, step: NewStep) -> None:
        calls.append(1)
        if len(calls) == on_call:
            if after_commit:
                real(claim, step)
                # the answer was lost: this process never applied the row to its copy
                held = store.step_logs._logs.get(claim.run_id)
                if held is not None:
                    held.rows.pop(step.step_key, None)
            raise dropped_connection()
        real(claim, step)

    store.record_child = flaky  # type: ignore[method-assign]
    return calls


def _quote(fail: dict[str, bool]) -> Any:
    def body(m: Model) -> str:
        answer = m.complete("quote, please")
        if fail["on"]:
            raise ValueError("the quote does not add up")
        return answer

    return body


def _child(steps: list[Any]) -> Any:
    (row,) = [s for s in steps if s.step_key.startswith("quote:0/")]  # the model call
    return row


def test_a_resumed_forks_model_call_is_not_taken_for_its_copied_row(runtime: Runtime) -> None:
    """Defect 6: a fork copies its source's rows with their lease epochs. A resumed fork runs
    a copied failed ``steps.llm`` again; its model call's record meets a blink, and the row
    found under its key is the copy (the epochs happen to match): that is not this try's
    commit. The answer is recorded, billed to the fork, and the row is the fork's own."""
    model = FakeModel().respond_with_text("7 EUR", 100, 10).respond_with_text("9 EUR", 300, 30)
    fail = {"on": True}

    @durable_agent("quote-fork")
    def fn(_: object, steps: Steps) -> str:
        return steps.llm("quote", _quote(fail), type=str)

    tester = DurableTester(runtime, model)
    source = tester.run(fn, {})
    assert source.status is RunStatus.FAILED
    last = max(s.seq for s in source.steps)
    forked, _ = fork_run(
        runtime.store, runtime.agents, runtime.settings, source.run_id, ForkRequest(last + 1)
    )
    first = tester._drive(Dispatch(forked.id, forked.dispatch_token))
    assert first.status is RunStatus.FAILED, "the copied failure replays"
    fail["on"] = False
    resumed = runtime.store.resume_failed(forked.id)
    with runtime.engine.begin() as conn:  # the copy's epoch is the next claim's
        conn.execute(
            text(
                "UPDATE run_step SET lease_epoch = (SELECT lease_epoch + 1 FROM run WHERE id = :id)"
                " WHERE run_id = :id AND step_key LIKE 'quote:0/%'"
            ),
            {"id": forked.id},
        )
    blinks = _blink_child(runtime.store, on_call=1, after_commit=False)
    done = tester._drive(resumed)
    assert len(blinks) == 2, "the record was tried again"
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "9 EUR"
    assert model.calls == 2
    row = _child(done.steps)
    assert row.origin is None, "written by the fork's worker: the fork's own"
    assert row.usage.total == 330
    assert runtime.store.get_run(forked.id).tokens_used == 330, "the re-run answer was billed"


def test_an_earlier_attempts_row_is_not_taken_for_this_tries_commit(runtime: Runtime) -> None:
    """``steps.retry`` runs a ``steps.llm`` again under a later lease, with the same model-call
    key: attempt 2's record meets a blink before its statement ran, and the row found is
    attempt 1's (an older epoch). Not committed: written, and billed."""
    model = FakeModel().respond_with_text("7 EUR", 100, 10).respond_with_text("9 EUR", 300, 30)
    fail = {"on": True}

    def quote(m: Model) -> str:
        answer = _quote(fail)(m)
        return answer

    def first_fails(m: Model) -> str:
        try:
            return quote(m)
        finally:
            fail["on"] = False

    @durable_agent("quote-retry")
    def fn(_: object, steps: Steps) -> str:
        return steps.retry(2, 0.01).llm("quote", first_fails, type=str)

    blinks = _blink_child(runtime.store, on_call=2, after_commit=False)
    done = DurableTester(runtime, model).run(fn, {})
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "9 EUR"
    assert len(blinks) == 3, "attempt 2's record was tried again"
    assert runtime.store.get_run(done.run_id).tokens_used == 440, "attempt 2 was billed"
    assert _child(done.steps).response == [{"type": "text", "text": "9 EUR"}]


def test_a_commit_found_after_a_blink_drops_the_processs_copy_of_the_log(
    runtime: Runtime,
) -> None:
    """The record of a model call inside ``steps.llm`` commits but its answer is lost; the
    retry finds it committed. This process never applied that row to its copy of the step
    log, so the copy must go: the next task reads the database (``_CheckedStore`` compares
    every log served from the copy with the database's)."""
    checked = _CheckedStore(runtime.engine)
    runtime.store = checked
    model = FakeModel().respond_with_text("7 EUR", 100, 10)

    @durable_agent("quote-once")
    def fn(_: object, steps: Steps) -> str:
        quote = steps.llm("quote", lambda m: m.complete("quote, please"), type=str)
        return quote + steps.run("after", lambda: "!", type=str)

    blinks = _blink_child(checked, on_call=1, after_commit=True)
    done = DurableTester(runtime, model).run(fn, {})
    assert len(blinks) == 1, "found committed, not written twice"
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "7 EUR!"
    assert runtime.store.get_run(done.run_id).tokens_used == 110


def test_a_fork_after_a_step_being_retried_is_refused(runtime: Runtime) -> None:
    """A step waiting for its next attempt (``RETRYING``) has not completed: a fork copying
    it would run it again while keeping it marked copied (never compensated by the fork,
    billed as a copy). Refused, as after a ``STARTED`` step."""
    tries: list[int] = []

    def flaky() -> str:
        tries.append(1)
        raise RuntimeError("not yet")

    @durable_agent("retrying")
    def fn(_: object, steps: Steps) -> str:
        return steps.retry(3, 3600).run("flaky", flaky, type=str)

    tester = DurableTester(runtime)
    waiting = tester.run(fn, {})
    (row,) = waiting.steps
    assert row.status is StepStatus.RETRYING
    with pytest.raises(ForkRefused, match="not completed") as refused:
        fork_run(
            runtime.store,
            runtime.agents,
            runtime.settings,
            waiting.run_id,
            ForkRequest(row.seq + 1),
        )
    assert refused.value.conflict
