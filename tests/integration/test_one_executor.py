"""The promises of the one step executor, each a scenario on the real engine and PostgreSQL
that failed on the two-executor code (issue "One engine, exactly-once everywhere")."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import text

from db.errors import LeaseLost
from db.records import Dispatch, NewRun, NewStep, RunStatus, Step, StepKind, StepStatus, Usage
from db.store import RunStore
from examples.order_refund import build as build_refund
from runtime.admission.concurrency_keys import Slot
from runtime.durable import (
    Model,
    StepError,
    Steps,
    StepTimeout,
    durable_agent,
    idempotent,
    step,
)
from runtime.durable.errors import InfrastructureError
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Driver
from runtime.llm.base import LlmError, LlmRequest, LlmResponse
from runtime.llm.retry import RetryingLlmClient, RetryPolicy
from runtime.llm.scripted import ScriptedLlm
from runtime.pipeline.heartbeat import Heartbeat
from runtime.testing.testkit import DurableTester, FakeModel, SimulatedCrash
from runtime.tools import ToolContext, tool
from tests.support import drive_to_end, dropped_connection, expire_lease, register_agent, submit

EFFECTS: list[str] = []


def _resume(runtime: Runtime, run_id: uuid.UUID) -> RunStatus:
    """What happens after a worker died holding the run: its lease lapses, the reaper
    re-dispatches, another worker goes on."""
    expire_lease(runtime.engine, run_id)
    due = [d for d in runtime.store.redispatch_due(redispatch_after=3600) if d.run_id == run_id]
    current: Dispatch | None = due[0] if due else None
    driver = runtime.driver(worker="worker-B")
    for _ in range(50):
        if current is None:
            break
        runtime.store.make_due_now(run_id)
        current = driver.drive(current.run_id, current.token).dispatch
    return runtime.store.get_run(run_id).status


def _start(runtime: Runtime, agent: Any, input: Any = None) -> tuple[uuid.UUID, Dispatch]:
    if agent.name not in runtime.agents:
        runtime.agents.register(agent)
    run, dispatch = runtime.submit(agent.name, input or {})
    return run.id, dispatch


def _drive(runtime: Runtime, dispatch: Dispatch, worker: str = "worker-A") -> RunStatus:
    driver = runtime.driver(worker=worker)
    current: Dispatch | None = dispatch
    for _ in range(50):
        if current is None:
            break
        runtime.store.make_due_now(current.run_id)
        current = driver.drive(current.run_id, current.token).dispatch
    return runtime.store.get_run(dispatch.run_id).status


# -- durable steps get the tool steps' rigor ------------------------------------------------


def _crashing_pay(idempotent_pay: bool = False, reconcile: Any = None) -> Any:
    crashed: list[bool] = []

    def pay() -> str:
        EFFECTS.append("pay")
        if not crashed:
            crashed.append(True)
            raise SimulatedCrash("worker died after the effect, before the checkpoint")
        return "paid"

    @durable_agent(f"payer-{idempotent_pay}-{reconcile is not None}")
    def fn(_: object, steps: Steps) -> str:
        return steps.run("pay", pay, type=str, idempotent=idempotent_pay, reconcile=reconcile)

    return fn


def test_a_step_with_an_effect_is_not_run_again_after_a_crash(runtime: Runtime) -> None:
    EFFECTS.clear()
    run_id, dispatch = _start(runtime, _crashing_pay())
    with pytest.raises(SimulatedCrash):
        _drive(runtime, dispatch)
    assert _resume(runtime, run_id) is RunStatus.NEEDS_ATTENTION
    assert EFFECTS == ["pay"], "in doubt: not run again"
    run = runtime.store.get_run(run_id)
    assert "step 'pay:0'" in (run.error or "")
    assert "resolve" in (run.error or "")
    # The operator checked: the payment went through. The supplied result is what replays.
    dispatch2 = runtime.store.resolve(run_id, "supply_result", output="paid")
    assert dispatch2 is not None
    assert _drive(runtime, dispatch2) is RunStatus.SUCCEEDED
    assert runtime.store.get_run(run_id).result == "paid"
    assert EFFECTS == ["pay"]


def test_an_idempotent_step_runs_again_with_the_same_key(runtime: Runtime) -> None:
    EFFECTS.clear()
    run_id, dispatch = _start(runtime, _crashing_pay(idempotent_pay=True))
    with pytest.raises(SimulatedCrash):
        _drive(runtime, dispatch)
    assert _resume(runtime, run_id) is RunStatus.SUCCEEDED
    assert EFFECTS == ["pay", "pay"], "declared idempotent: re-run (downstream dedupes by key)"


def test_a_reconcile_hook_decides_an_in_doubt_step(runtime: Runtime) -> None:
    from runtime.tools import Reconciled

    EFFECTS.clear()
    asked: list[str] = []

    def reconcile(ctx: Any) -> Reconciled:
        asked.append(ctx.idempotency_key)
        return Reconciled("paid (found in the ledger)")

    run_id, dispatch = _start(runtime, _crashing_pay(reconcile=reconcile))
    with pytest.raises(SimulatedCrash):
        _drive(runtime, dispatch)
    assert _resume(runtime, run_id) is RunStatus.SUCCEEDED
    assert asked == [f"{run_id}/pay:0"]
    assert EFFECTS == ["pay"]
    assert runtime.store.get_run(run_id).result == "paid (found in the ledger)"


# -- scenario 1: infrastructure errors are never the user's failure ---------------------------


def test_a_database_error_at_the_checkpoint_is_not_a_failure_of_the_function(
    runtime: Runtime,
) -> None:
    runtime.tickets.seed()
    refund = build_refund(runtime.tickets)
    run_id, dispatch = _start(runtime, refund, {"order_id": 105, "amount": 3.0, "reason": "x"})
    driver = runtime.driver(worker="worker-A")
    first = driver.drive(dispatch.run_id, dispatch.token)  # reserve
    assert first.dispatch is not None
    real = runtime.store.record_steps
    calls = {"n": 0}

    def blip(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        raise dropped_connection()

    waiting = driver.drive(first.dispatch.run_id, first.dispatch.token)
    assert runtime.store.get_run(run_id).status is RunStatus.WAITING, waiting
    (approval,) = runtime.store.list_approvals(run_id=run_id)
    from db.records import ApprovalStatus

    woke = runtime.store.decide_approval(approval.id, ApprovalStatus.APPROVED, decided_by="fin")
    assert woke is not None
    runtime.store.record_steps = blip  # type: ignore[method-assign]
    with pytest.raises(InfrastructureError):
        driver.drive(woke.run_id, woke.token)
    runtime.store.record_steps = real  # type: ignore[method-assign]
    assert calls["n"] > 1, "tried again while the lease lasted (Task.durably), then given up"
    run = runtime.store.get_run(run_id)
    assert run.status is RunStatus.RUNNING, "not failed, not compensated"
    keys = {s.step_key: s.status for s in runtime.store.steps(run_id)}
    assert "compensate:reserve:0" not in keys
    assert keys["pay:0"] is StepStatus.STARTED
    # The next task finds `pay` in doubt and asks a person instead of paying twice.
    assert _resume(runtime, run_id) is RunStatus.NEEDS_ATTENTION
    assert runtime.tickets.count_comments(105) == 2, "reserved once, paid once, released never"


# -- scenarios 2 and 3: every billed call counts, none is repeated ----------------------------


def test_tokens_of_retried_model_attempts_count(runtime: Runtime) -> None:
    model = FakeModel()
    model.respond_with_text("not json", 1000, 500).respond_with_text('{"a": 1}', 1000, 500)
    runtime.llm = model

    @durable_agent("json-retry")
    def fn(_: object, steps: Steps) -> Any:
        return steps.retry(2, 0.01).llm("ask", lambda m: Model.complete_json(m, "json please"))

    run_id, dispatch = _start(runtime, fn)
    assert _drive(runtime, dispatch) is RunStatus.SUCCEEDED
    assert model.calls == 2, "the second attempt called the model afresh"
    assert runtime.store.get_run(run_id).tokens_used == 3000, "both billed attempts counted"


def test_the_guard_sees_every_billed_token(runtime: Runtime) -> None:
    model = FakeModel()
    for _ in range(4):
        model.respond_with_text("x", 1000, 500)
    runtime.llm = model

    @durable_agent("spender")
    def fn(_: object, steps: Steps) -> list[str]:
        return [steps.llm(f"ask{i}", lambda m: m.complete("go")) for i in range(4)]

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("spender", {}, token_budget=2000)
    assert _drive(runtime, dispatch) is RunStatus.FAILED
    after = runtime.store.get_run(run.id)
    assert "token budget exhausted" in (after.error or "")
    assert model.calls == 2, "stopped at the budget, overshoot bounded by one call"
    assert after.tokens_used == 3000


def test_an_answered_call_is_not_repeated_after_a_rate_limit_wait(runtime: Runtime) -> None:
    class Script:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def send(self, request: LlmRequest) -> LlmResponse:
            prompt = request.messages[0]["content"]
            self.calls.append(prompt)
            if prompt == "second" and self.calls.count("second") == 1:
                raise LlmError("rate limited", status=429, retry_after=30)
            return LlmResponse([{"type": "text", "text": prompt}], "end_turn", Usage(5, 5), "m")

    script = Script()
    runtime.llm = RetryingLlmClient(script, RetryPolicy(max_attempts=5, long_wait_threshold=1))

    @durable_agent("two-calls")
    def fn(_: object, steps: Steps) -> str:
        return steps.llm("ask", lambda m: m.complete("first") + m.complete("second"))

    _run_id, dispatch = _start(runtime, fn)
    assert _drive(runtime, dispatch) is RunStatus.SUCCEEDED
    assert script.calls == ["first", "second", "second"], "the answered call was replayed"


def test_answered_calls_are_replayed_after_a_crash_in_the_llm_step(runtime: Runtime) -> None:
    # Found by the durable chaos campaign: the worker died after both calls of a steps.llm
    # were recorded, before the step's checkpoint. The step is re-entered (llm steps are
    # idempotent), but as a new attempt, and a recorded call is replayed only for its own
    # attempt: both calls were made and paid again (README: at most one repeat per crash).
    model = FakeModel()
    for i in range(4):
        model.respond_with_text(f"answer {i}", input_tokens=100 + i, output_tokens=1)
    runtime.llm = model
    crashed: list[bool] = []

    def advise(m: Model) -> str:
        answer = m.complete("one") + " / " + m.complete("two")
        if not crashed:
            crashed.append(True)
            raise SimulatedCrash("died after both calls were recorded, before the checkpoint")
        return answer

    @durable_agent("advise-crash")
    def fn(_: object, steps: Steps) -> str:
        return steps.llm("advise", advise, type=str)

    run_id, dispatch = _start(runtime, fn)
    with pytest.raises(SimulatedCrash):
        _drive(runtime, dispatch)
    assert _resume(runtime, run_id) is RunStatus.SUCCEEDED
    assert model.calls == 2, "the recorded calls were replayed, not made again"
    run = runtime.store.get_run(run_id)
    assert run.result == "answer 0 / answer 1"
    assert run.tokens_used == (100 + 1) + (101 + 1)


# -- scenario 4: model attempts are capped across durable timers ------------------------------


class _Always:
    def __init__(self, status: int) -> None:
        self.status = status
        self.calls = 0

    def send(self, request: LlmRequest) -> LlmResponse:
        self.calls += 1
        raise LlmError("no", status=self.status, retry_after=30)


def test_a_model_that_fails_forever_fails_after_max_attempts(runtime: Runtime) -> None:
    model = _Always(503)
    runtime.llm = RetryingLlmClient(model, RetryPolicy(max_attempts=3, long_wait_threshold=1))
    run, dispatch = runtime.submit("acme-tickets", "hi", timeout_seconds=7 * 86400)
    status = _drive(runtime, dispatch)
    assert status is RunStatus.FAILED
    assert model.calls == 3
    after = runtime.store.get_run(run.id)
    assert "HTTP 503" in (after.error or "")


@pytest.mark.parametrize("status", [429, 529])
def test_back_pressure_never_fails_a_run_before_its_deadline(runtime: Runtime, status: int) -> None:
    model = _Always(status)
    runtime.llm = RetryingLlmClient(model, RetryPolicy(max_attempts=3, long_wait_threshold=1))
    run, dispatch = runtime.submit("acme-tickets", "hi", timeout_seconds=7 * 86400)
    assert _drive(runtime, dispatch) is RunStatus.RUNNING  # 50 claims later: still waiting
    assert model.calls == 50
    after = runtime.store.get_run(run.id)
    assert (after.model_attempts, after.claims_without_progress) == (0, 0)
    assert after.wait_reason is not None
    assert f"HTTP {status}" in after.wait_reason


def test_a_timer_is_not_progress(runtime: Runtime) -> None:
    run, dispatch = runtime.submit("acme-tickets", "hi")
    claim = runtime.store.claim(run.id, dispatch.token, "w", 5)
    assert claim is not None
    runtime.store.schedule(claim, 0, reason="rate limited", model_attempts=2)
    after = runtime.store.get_run(run.id)
    assert after.claims_without_progress == 1
    assert after.model_attempts == 2


# -- scenario 6: an operator's retry authorises exactly one re-execution ----------------------


def test_an_operator_retry_authorises_exactly_one_more_execution(runtime: Runtime) -> None:
    EFFECTS.clear()

    def pay() -> str:
        EFFECTS.append("pay")
        raise SimulatedCrash("died again")

    @durable_agent("twice-crashing")
    def fn(_: object, steps: Steps) -> str:
        return steps.run("pay", pay, type=str)

    run_id, dispatch = _start(runtime, fn)
    with pytest.raises(SimulatedCrash):
        _drive(runtime, dispatch)
    assert _resume(runtime, run_id) is RunStatus.NEEDS_ATTENTION
    retry = runtime.store.resolve(run_id, "retry")
    assert retry is not None
    with pytest.raises(SimulatedCrash):
        _drive(runtime, retry)
    assert _resume(runtime, run_id) is RunStatus.NEEDS_ATTENTION, "the retry was used up"
    assert EFFECTS == ["pay", "pay"]


def test_a_crash_inside_a_nested_step_asks_about_each_step_once(runtime: Runtime) -> None:
    EFFECTS.clear()
    crashed: list[bool] = []

    def charge() -> str:
        EFFECTS.append("charge")
        if not crashed:
            crashed.append(True)
            raise SimulatedCrash("died inside the nested step")
        return "charged"

    @durable_agent("nested-crash")
    def fn(_: object, steps: Steps) -> str:
        def checkout() -> str:
            return steps.run("charge", charge, type=str) + " and boxed"

        return steps.run("checkout", checkout, type=str)

    run_id, dispatch = _start(runtime, fn)
    with pytest.raises(SimulatedCrash):
        _drive(runtime, dispatch)
    assert _resume(runtime, run_id) is RunStatus.NEEDS_ATTENTION
    assert "'checkout:0'" in (runtime.store.get_run(run_id).error or ""), "outer step first"
    retry = runtime.store.resolve(run_id, "retry")
    assert retry is not None
    assert _drive(runtime, retry) is RunStatus.NEEDS_ATTENTION
    error = runtime.store.get_run(run_id).error or ""
    assert "'checkout:0/charge:0'" in error, "then the nested step, which is still in doubt"
    supplied = runtime.store.resolve(run_id, "supply_result", output="charged")
    assert supplied is not None
    assert _drive(runtime, supplied) is RunStatus.SUCCEEDED, "the outer step is not asked again"
    assert runtime.store.get_run(run_id).result == "charged and boxed", "supplied to the inner"
    assert EFFECTS == ["charge"]


# -- scenario 7: compensations of nested steps survive replay ----------------------------------

UNDONE: list[str] = []


def release(booking: str) -> None:
    UNDONE.append(booking)


@step(compensate=release)
def book(what: str) -> str:
    return what


def test_compensations_of_nested_steps_survive_replay(runtime: Runtime) -> None:
    UNDONE.clear()

    @durable_agent("trip")
    def fn(_: object, steps: Steps) -> None:
        steps.run("plan", lambda: [book("flight"), book("hotel")])
        steps.run("pay", lambda: 1 / 0)

    _run_id, dispatch = _start(runtime, fn)
    assert _drive(runtime, dispatch) is RunStatus.FAILED
    assert UNDONE == ["hotel", "flight"], "found again from the rows, in reverse order"


# -- scenario 8: versions -----------------------------------------------------------------------


def test_a_version_marker_added_mid_flight_keeps_old_runs_on_the_old_branch(
    runtime: Runtime,
) -> None:
    @durable_agent("pricing", approval_roles=["ops"])
    def v1(_: object, steps: Steps) -> str:
        steps.run("a", lambda: "a", type=str)
        steps.approval("ops", 3600).run("b", lambda: "b", type=str)
        return "old"

    @durable_agent("pricing", approval_roles=["ops"])
    def v2(_: object, steps: Steps) -> str:
        steps.run("a", lambda: "a", type=str)
        v = steps.version("discount", 1, 2)
        steps.approval("ops", 3600).run("b", lambda: "b", type=str)
        return "new" if v == 2 else "old"

    tester = DurableTester(runtime)
    old = tester.run(v1, {})
    assert old.status is RunStatus.WAITING
    runtime.agents.replace(v2)
    assert tester.approve(old.run_id).result == "old", "history predates the marker"
    new = tester.run("pricing", {})
    assert tester.approve(new.run_id).result == "new"


# -- scenario 9: a guard stop compensates --------------------------------------------------------


def test_a_timed_out_refund_releases_its_reservation(runtime: Runtime) -> None:
    runtime.tickets.seed()
    refund = build_refund(runtime.tickets)
    run_id, dispatch = _start(runtime, refund, {"order_id": 105, "amount": 3.0, "reason": "x"})
    driver = runtime.driver()
    first = driver.drive(dispatch.run_id, dispatch.token)  # reserve
    assert first.dispatch is not None
    with runtime.engine.begin() as conn:
        conn.execute(text("UPDATE run SET deadline_at = now() WHERE id = :id"), {"id": run_id})
    assert _drive(runtime, first.dispatch) is RunStatus.TIMED_OUT
    run = runtime.store.get_run(run_id)
    assert "compensated: reserve" in (run.error or "")
    comments = runtime.tickets.count_comments(105)
    assert comments == 2, "reserved once, released once"


# -- scenario 10: compensations one per task, none repeated --------------------------------------


def test_a_crash_inside_a_compensation_repeats_none(runtime: Runtime) -> None:
    EFFECTS.clear()
    crashed: list[bool] = []

    def undo_a(_: str) -> None:
        EFFECTS.append("undo a")

    def undo_b(_: str) -> None:
        EFFECTS.append("undo b")
        if not crashed:
            crashed.append(True)
            raise SimulatedCrash("died inside the compensation")

    @durable_agent("saga")
    def fn(_: object, steps: Steps) -> None:
        steps.run("a", lambda: "a", type=str, compensate=undo_a)
        steps.run("b", lambda: "b", type=str, compensate=idempotent(undo_b))
        steps.run("c", lambda: 1 / 0)

    run_id, dispatch = _start(runtime, fn)
    with pytest.raises(SimulatedCrash):
        _drive(runtime, dispatch)
    assert _resume(runtime, run_id) is RunStatus.FAILED
    assert EFFECTS == ["undo b", "undo b", "undo a"], "b re-run (idempotent), a once"
    rows = [s for s in runtime.store.steps(run_id) if s.kind is StepKind.COMPENSATION]
    assert [s.step_key for s in rows] == ["compensate:b:0", "compensate:a:0"]


# -- scenario 11: a timer fires within one sweep of due, whatever the clocks say -----------------


def test_an_early_countdown_costs_at_most_one_sweep(runtime: Runtime) -> None:
    run, dispatch = runtime.submit("acme-tickets", "hi")
    claim = runtime.store.claim(run.id, dispatch.token, "w", 5)
    assert claim is not None
    timer = runtime.store.schedule(claim, 0.3, reason="rate limited")
    assert runtime.store.claim(run.id, timer.token, "w", 5) is None, "fired early: dropped"
    time.sleep(0.4)
    due = runtime.store.redispatch_due(redispatch_after=3600)
    assert [d.run_id for d in due] == [run.id], "the next sweep after due sends it"


# -- scenario 12: the heartbeat never waits behind the main pool ---------------------------------


def test_the_heartbeat_has_its_own_connections(runtime: Runtime) -> None:
    run, dispatch = runtime.submit("acme-tickets", "hi")
    claim = runtime.store.claim(run.id, dispatch.token, runtime.settings.worker_name, 2)
    assert claim is not None
    pool: Any = runtime.engine.pool
    held = [runtime.engine.connect() for _ in range(pool.size() + pool._max_overflow)]
    try:  # every connection of the main pool is busy (tools, steps)
        beat = Heartbeat(runtime.lease_store(), claim.worker, lease_seconds=30, interval_seconds=1)
        with beat.hold(claim):
            renewing = threading.Thread(target=beat.beat, daemon=True)
            renewing.start()
            renewing.join(3)
            assert not renewing.is_alive(), "the heartbeat waited for the main pool"
    finally:
        for c in held:
            c.close()
    assert runtime.store.get_run(run.id).locked_until is not None


# -- scenario 13: a message with the current token is never dropped by a passing lock ------------


def test_a_claim_waits_for_a_momentary_row_lock(runtime: Runtime) -> None:
    run, dispatch = runtime.submit("acme-tickets", "hi")
    conn = runtime.engine.connect()
    txn = conn.begin()
    conn.execute(text("SELECT id FROM run WHERE id = :id FOR UPDATE"), {"id": run.id})
    got: list[object] = []
    t = threading.Thread(
        target=lambda: got.append(runtime.store.claim(run.id, dispatch.token, "B", 5))
    )
    t.start()
    time.sleep(0.3)
    txn.commit()
    conn.close()
    t.join(10)
    assert len(got) == 1
    assert got[0] is not None, "claimed after the lock went, not dropped"


# -- scenario 14: every fenced write checks the epoch, not only the name -------------------------


def _reclaimed_under_the_same_name(runtime: Runtime) -> tuple[Any, Any]:
    run, dispatch = runtime.submit("acme-tickets", "hi")
    old = runtime.store.claim(run.id, dispatch.token, "host:1", 5)
    assert old is not None
    expire_lease(runtime.engine, run.id)
    (again,) = runtime.store.redispatch_due(redispatch_after=3600)
    new = runtime.store.claim(run.id, again.token, "host:1", 5)
    assert new is not None
    assert new.epoch == old.epoch + 1
    return old, new


WRITES = {
    "schedule": lambda s, c: s.schedule(c, 5, reason="x"),
    "record_steps": lambda s, c: s.record_steps(
        c, [NewStep(1, "a:0", StepKind.STEP, StepStatus.DONE, response=1)]
    ),
    "record_steps with a timer": lambda s, c: s.record_steps(
        c, [NewStep(1, "a:0", StepKind.STEP, StepStatus.RETRYING)], delay_seconds=1, reason="r"
    ),
    "record_child": lambda s, c: s.record_child(
        c, NewStep(1, "a:0/llm:0", StepKind.LLM, StepStatus.DONE, usage=Usage(5, 5))
    ),
    "start_step": lambda s, c: s.start_step(
        c, NewStep(1, "a:0", StepKind.STEP, StepStatus.STARTED)
    ),
    "suspend_for_approval": lambda s, c: s.suspend_for_approval(
        c, NewStep(1, "ok:0", StepKind.APPROVAL, StepStatus.PENDING, input_hash="h"),
        role="r", payload={}, timeout_seconds=5, timeout_policy="FAIL",
    ),
    "finish": lambda s, c: s.finish(c, RunStatus.SUCCEEDED),
}  # fmt: skip


@pytest.mark.parametrize("write", sorted(WRITES))
def test_an_old_claim_under_the_same_worker_name_writes_nothing(
    runtime: Runtime, write: str
) -> None:
    old, _new = _reclaimed_under_the_same_name(runtime)
    with pytest.raises(LeaseLost):
        WRITES[write](runtime.store, old)
    assert runtime.store.steps(old.run_id) == []
    after = runtime.store.get_run(old.run_id)
    assert (after.status, after.tokens_used, after.lease_epoch) == (
        RunStatus.RUNNING,
        0,
        old.epoch + 1,
    )


def test_the_heartbeat_reports_a_lease_retaken_under_the_same_name(runtime: Runtime) -> None:
    old, _new = _reclaimed_under_the_same_name(runtime)
    taken = runtime.store.renew_leases("host:1", [(old.run_id, old.epoch)], 30)
    assert taken == {old.run_id}


# -- scenario 15 ---------------------------------------------------------------------------------


def test_step_timeout_is_a_step_error_callers_can_catch() -> None:
    from runtime.durable import StepError

    assert issubclass(StepTimeout, StepError)


def test_resume_past_the_deadline_is_judged_by_the_database_clock(runtime: Runtime) -> None:
    run, dispatch = runtime.submit("acme-tickets", "hi", timeout_seconds=60)
    claim = runtime.store.claim(run.id, dispatch.token, "w", 5)
    assert claim is not None
    runtime.store.finish(claim, RunStatus.TIMED_OUT, error="deadline passed")
    with runtime.engine.begin() as conn:  # past by the database's clock only
        conn.execute(
            text("UPDATE run SET deadline_at = now() - interval '1 second' WHERE id = :id"),
            {"id": run.id},
        )
    runtime.store.resume_failed(run.id, default_timeout_seconds=120)
    with runtime.engine.connect() as conn:
        left = conn.execute(
            text("SELECT EXTRACT(EPOCH FROM deadline_at - now()) FROM run WHERE id = :id"),
            {"id": run.id},
        ).scalar_one()
    assert 100 < left <= 120


# -- the step log a process keeps of the runs it hands on (issue "Fast at scale") -----------


class _CheckedStore(RunStore):
    """Every log served from the process's copy is compared with the database's."""

    served: int = 0
    caught_up: int = 0

    def steps(
        self,
        run_id: uuid.UUID,
        *,
        token: uuid.UUID | None = None,
        epoch: int | None = None,
        status_changes: int | None = None,
    ) -> list[Step]:
        hits, catch_ups = self.step_logs.hits, self.step_logs.catch_ups
        got = super().steps(run_id, token=token, epoch=epoch, status_changes=status_changes)
        if self.step_logs.hits > hits:
            _CheckedStore.served += 1
            assert got == super().steps(run_id), "the copy differs from the database"
        if self.step_logs.catch_ups > catch_ups:
            _CheckedStore.caught_up += 1
            assert got == super().steps(run_id), "the caught-up copy differs from the database"
        return got


def test_the_next_step_reads_no_log_when_this_process_handed_the_run_on(
    runtime: Runtime,
) -> None:
    checked = _CheckedStore(runtime.engine)
    runtime.store = checked

    @tool(idempotent=True)
    def lookup(q: str, ctx: ToolContext) -> str:
        """Look up."""
        return q.upper()

    llm = runtime.llm
    assert isinstance(llm, ScriptedLlm)
    for i in range(3):
        llm.then_tool_use(f"toolu_{i}", "lookup", {"q": f"x{i}"})
    llm.then_text("done")
    register_agent(runtime.agents, lookup)
    run, dispatch = submit(checked)
    _CheckedStore.served = 0
    drive_to_end(runtime.driver(), dispatch)
    assert checked.get_run(run.id).status is RunStatus.SUCCEEDED
    assert _CheckedStore.served == 7, "every step after the first was served from the copy"

    # A durable function with a retry timer, nested steps and a model call in a step.
    model = FakeModel().respond_with_text("hi")
    runtime.llm = model

    @durable_agent("cached")
    def fn(_: object, steps: Steps) -> str:
        a = steps.run("a", lambda: steps.run("inner", lambda: "a", type=str), type=str)
        b = steps.retry(2, 0.01).run("b", lambda: "b", type=str)
        c = steps.llm("c", lambda m: m.complete("hello"), type=str)
        return a + b + c

    _CheckedStore.served = 0
    run_id, dispatch2 = _start(runtime, fn)
    assert _drive(runtime, dispatch2) is RunStatus.SUCCEEDED
    assert checked.get_run(run_id).result == "abhi"
    assert _CheckedStore.served >= 3


def _two_processes(runtime: Runtime, *lookups: int) -> tuple[list[_CheckedStore], list[Driver]]:
    """Two workers with a store (a copy of each step log) of their own, as two processes
    have; with ``lookups``, the test agent calls ``lookup`` that many times, then ends."""
    stores = [_CheckedStore(runtime.engine), _CheckedStore(runtime.engine)]
    drivers = [
        replace(runtime, store=store).driver(worker=f"worker-{name}")
        for store, name in zip(stores, "AB", strict=True)
    ]
    if lookups:

        @tool(idempotent=True)
        def lookup(q: str, ctx: ToolContext) -> str:
            """Look up."""
            return q.upper()

        llm = runtime.llm
        assert isinstance(llm, ScriptedLlm)
        for i in range(lookups[0]):
            llm.then_tool_use(f"toolu_{i}", "lookup", {"q": f"x{i}"})
        llm.then_text("done")
        register_agent(runtime.agents, lookup)
    return stores, drivers


def test_a_run_moving_between_two_processes_reads_only_what_the_other_wrote(
    runtime: Runtime,
) -> None:
    """Two processes (two stores, two copies of each log) take a run's steps in turn. Each
    copy catches up with the rows the other wrote and equals the database's log every time
    (``_CheckedStore``); an approval decided meanwhile (a write no worker made) makes the
    next step read the whole log."""
    stores, drivers = _two_processes(runtime, 6)
    run, dispatch = submit(stores[0])
    _CheckedStore.caught_up = 0
    current: Dispatch | None = dispatch
    turn = 0
    while current is not None:
        current = drivers[turn % 2].drive(current.run_id, current.token).dispatch
        turn += 1
    assert stores[0].get_run(run.id).status is RunStatus.SUCCEEDED
    assert len(stores[0].steps(run.id)) == 13
    assert _CheckedStore.caught_up == turn - 2, "every task after each process's first"
    for store in stores:
        logs = store.step_logs
        assert logs.caught_up_wrong == 0
        # Each catch-up reads the other process's step and this process's own last one.
        assert logs.caught_up_rows <= 2 * logs.catch_ups

    # A durable function parked for an approval: the decision rewrites a step row and the
    # run's status; the process that parked it must not trust its copy afterwards.
    @durable_agent("gated", approval_roles=["ops"])
    def gated(_: object, steps: Steps) -> str:
        a = steps.run("a", lambda: "a", type=str)
        b = steps.approval("ops", 3600).run("b", lambda: "b", type=str)
        c = steps.run("c", lambda: "c", type=str)
        return a + b + c

    run_id, current = _start(replace(runtime, store=stores[0]), gated)
    turn = 0
    while current is not None:
        stores[0].make_due_now(current.run_id)
        current = drivers[turn % 2].drive(current.run_id, current.token).dispatch
        turn += 1
        if current is None and stores[0].get_run(run_id).status is RunStatus.WAITING:
            (approval,) = stores[0].list_approvals(run_id=run_id)
            from db.records import ApprovalStatus

            current = stores[1].decide_approval(
                approval.id, ApprovalStatus.APPROVED, decided_by="ops"
            )
    final = stores[0].get_run(run_id)
    assert final.result == "abc", final.error


def test_a_write_whose_commit_this_process_did_not_see_is_read_again(runtime: Runtime) -> None:
    """A copy holds its own last epoch's rows only as far as it applied them (a commit whose
    answer was lost): catching up re-reads that epoch's rows too."""
    stores, (a, b) = _two_processes(runtime, 1)
    run, dispatch = submit(stores[0])
    first = a.drive(dispatch.run_id, dispatch.token)  # the model step, A's copy follows it
    assert first.dispatch is not None
    copy = stores[0].step_logs._logs[run.id]
    (model_row,) = copy.rows.values()
    # As if A's commit of the model step had not been seen: its copy holds an older version.
    copy.rows[model_row.step_key] = replace(model_row, stop_reason="stale")
    second = b.drive(run.id, first.dispatch.token)  # the tool step, on B
    assert second.dispatch is not None
    _CheckedStore.caught_up = 0
    third = a.drive(run.id, second.dispatch.token)  # the last model step, on A again
    assert _CheckedStore.caught_up == 1, "A caught up, and its copy equals the database's"
    assert third.dispatch is None, "its answer ended the run, in the same task"
    assert stores[0].get_run(run.id).status is RunStatus.SUCCEEDED


def test_a_resumed_run_does_not_catch_up_a_copy_made_before_it_failed(
    runtime: Runtime,
) -> None:
    """A resume rewrites a step row written under an older epoch (ERROR -> RETRYING) without
    any worker's epoch: the run's status changed meanwhile, so the copy is not caught up."""
    stores, (a, b) = _two_processes(runtime)
    calls = {"a": 0, "end": 0}

    def flaky() -> str:
        calls["a"] += 1
        if calls["a"] == 1:
            raise RuntimeError("a failed")
        return "a"

    @durable_agent("resumable")
    def resumable(_: object, steps: Steps) -> str:
        try:
            first = steps.run("a", flaky, type=str)
        except StepError:
            first = "-"
        second = steps.run("b", lambda: "b", type=str)
        calls["end"] += 1
        if calls["end"] == 1:
            raise RuntimeError("the end failed")
        return first + second

    run_id, dispatch = _start(replace(runtime, store=stores[0]), resumable)
    one = a.drive(run_id, dispatch.token)  # a: ERROR (epoch 1, A)
    assert one.dispatch is not None
    two = b.drive(run_id, one.dispatch.token)  # b: DONE (epoch 2, B)
    assert two.dispatch is not None
    three = a.drive(run_id, two.dispatch.token)  # the function raises: FAILED (epoch 3, A)
    assert three.dispatch is None
    assert stores[0].get_run(run_id).status is RunStatus.FAILED
    resumed = stores[0].resume_failed(run_id)  # a: ERROR -> RETRYING, no worker's epoch
    # B's copy (epoch 2) survived; A's went with the end of the run.
    drive_to_end(b, resumed)
    final = stores[0].get_run(run_id)
    assert final.result == "ab", final.error
    assert calls["a"] == 2
    assert stores[1].step_logs.caught_up_wrong == 0


def test_a_duplicated_message_after_another_process_wrote_reads_the_log(
    runtime: Runtime,
) -> None:
    """Issue 23 defect 1: A hands the run on with token T. The message is delivered twice (the
    publisher retries a push once on a timeout): B takes the first copy, writes the
    non-idempotent tool's STARTED row and dies. The duplicate reaches A after B's lease
    lapsed: A's copy of the log (handed on with T) lacks B's row and must not be served, or
    the tool runs twice and the run succeeds."""
    stores, (a, b) = _two_processes(runtime)
    calls: list[str] = []

    @tool
    def charge(amount: int, ctx: ToolContext) -> str:
        """Charge a card (not idempotent)."""
        calls.append(ctx.idempotency_key)
        if len(calls) == 1:
            raise SimulatedCrash("B dies inside the charge")
        return "charged"

    llm = runtime.llm
    assert isinstance(llm, ScriptedLlm)
    llm.then_tool_use("toolu_c", "charge", {"amount": 5})
    llm.then_text("done")
    register_agent(runtime.agents, charge)
    run, dispatch = submit(stores[0])
    first = a.drive(dispatch.run_id, dispatch.token)  # the model step; A hands on with T
    assert first.dispatch is not None
    with pytest.raises(SimulatedCrash):
        b.drive(run.id, first.dispatch.token)  # the first copy of T: STARTED, then B dies
    expire_lease(runtime.engine, run.id)
    again = a.drive(run.id, first.dispatch.token)  # the duplicate of T, on A
    while again.dispatch is not None:
        again = a.drive(again.dispatch.run_id, again.dispatch.token)
    assert len(calls) == 1, "the non-idempotent tool ran twice"
    assert stores[0].get_run(run.id).status is RunStatus.NEEDS_ATTENTION


def test_an_old_copy_does_not_take_the_token_of_a_run_parked_for_its_key(
    runtime: Runtime, settings: Any, redis_client: Any
) -> None:
    """A keeps a copy of epoch 1; B runs epochs 2-3. A claims the run (epoch 4) and parks it
    for its concurrency key before reading the log: that hand-over (a timer, no rows) must
    not let A's old copy take the new token, or the woken task on A is served a log without
    B's rows (the copy is compared with the database's by ``_CheckedStore``)."""
    keyed = replace(runtime, settings=replace(settings, key_concurrency=1))
    stores, (a, b) = _two_processes(keyed, 2)
    gate = keyed.key_gate()
    assert gate is not None
    run, _ = stores[0].create_run(
        NewRun(
            agent="test-agent",
            input="find x",
            model="claude-sonnet-4-5",
            max_steps=20,
            token_budget=10_000,
            timeout_seconds=300,
            concurrency_key="acme",
        )
    )
    one = a.drive(run.id, run.dispatch_token)  # epoch 1 on A: its copy follows it
    assert one.dispatch is not None
    two = b.drive(run.id, one.dispatch.token)  # epoch 2 on B: the tool step
    assert two.dispatch is not None
    three = b.drive(run.id, two.dispatch.token)  # epoch 3 on B: the next model step
    assert three.dispatch is not None
    blocker = gate.acquire("acme", uuid.uuid4(), 1, priority=0, submitted_at=0)
    assert isinstance(blocker, Slot)
    parked = a.drive(run.id, three.dispatch.token)  # epoch 4 on A: parked for the key
    assert parked.dispatch is not None
    assert stores[0].get_run(run.id).wait_reason is not None
    gate.release(blocker, continuing=False)
    stores[0].make_due_now(run.id)
    _CheckedStore.served = 0
    current: Dispatch | None = parked.dispatch
    while current is not None:  # epoch 5 on A, and on to the end
        current = a.drive(current.run_id, current.token).dispatch
    assert stores[0].get_run(run.id).status is RunStatus.SUCCEEDED


def test_a_message_this_process_did_not_send_reads_the_log(runtime: Runtime) -> None:
    run, dispatch = runtime.submit("acme-tickets", "hi")
    claim = runtime.store.claim(run.id, dispatch.token, "w", 5)
    assert claim is not None
    runtime.store.steps(run.id, token=dispatch.token, epoch=claim.epoch)
    handed = runtime.store.schedule(claim, 0, reason="x")
    (other,) = runtime.store.redispatch_due(redispatch_after=0)  # the reaper's new token
    assert other.token != handed.token
    before = runtime.store.step_logs.misses
    claim2 = runtime.store.claim(run.id, other.token, "w", 5)
    assert claim2 is not None
    runtime.store.steps(run.id, token=other.token, epoch=claim2.epoch)
    assert runtime.store.step_logs.misses == before + 1


# -- an answer that arrived is not thrown away because PostgreSQL blinked (issue 13) -------


def _blink(store: RunStore, times: int, *, after_commit: bool) -> list[int]:
    """The store's model checkpoint fails ``times`` times as a dropped connection does:
    before its statement ran, or (``after_commit``) after it committed."""
    real = store.checkpoint_model
    failures: list[int] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if len(failures) < times:
            failures.append(1)
            if after_commit:
                real(*args, **kwargs)
            raise dropped_connection()
        return real(*args, **kwargs)

    store.checkpoint_model = flaky  # type: ignore[method-assign]
    return failures


@pytest.mark.parametrize("after_commit", [False, True])
def test_a_model_answer_survives_a_database_blink(runtime: Runtime, after_commit: bool) -> None:
    llm = runtime.llm
    assert isinstance(llm, ScriptedLlm)
    llm.then_text("the answer", 100, 20)
    run, dispatch = runtime.submit("acme-tickets", "hi")
    failures = _blink(runtime.store, 2, after_commit=after_commit)
    status = _drive(runtime, dispatch)
    assert len(failures) == (1 if after_commit else 2), "retried, then found committed"
    assert status is RunStatus.SUCCEEDED
    after = runtime.store.get_run(run.id)
    assert len(llm.requests) == 1, "the answer was kept, not asked for again"
    assert after.tokens_used == 120
    assert after.unrecorded_tokens == 0
    assert [s.step_key for s in runtime.store.steps(run.id)] == ["model:1"]
