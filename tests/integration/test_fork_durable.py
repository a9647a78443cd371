"""Forks of durable functions: copied steps replay from the log (strict replay applies), an
approval is reused only for an unchanged payload, a fork never compensates the original's
steps, and ``replay_model`` answers ``steps.llm`` calls from the recording."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import pytest

from db.errors import InvalidTransition
from db.records import ApprovalStatus, Dispatch, RunStatus, StepKind, StepOrigin, StepStatus
from runtime.durable import DurableAgent, Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.fork import ForkRefused, ForkRequest, fork_run
from runtime.testing.testkit import DurableTester, FakeModel, RunResult, assert_run

ORDER = {"id": 1, "item": "book"}


class Shop:
    """Effects we can count, by run: every step body records what it did."""

    def __init__(self) -> None:
        self.log: list[tuple[uuid.UUID, str, Any]] = []

    def by(self, run_id: uuid.UUID) -> list[tuple[str, Any]]:
        return [(what, arg) for rid, what, arg in self.log if rid == run_id]

    def agent(self) -> DurableAgent:
        log = self.log

        @durable_agent("fork-refund", approval_roles=["lead"])
        def refund(order: dict[str, Any], steps: Steps) -> dict[str, Any]:
            def effect(what: str, arg: Any) -> Any:
                log.append((steps.run_id, what, arg))
                return arg

            amount = steps.llm("quote", lambda m: m.complete_json(f"refund {order['item']}?"))
            steps.run(
                "hold", lambda: effect("hold", amount), compensate=lambda a: effect("unhold", a)
            )
            reserved = steps.run(
                "reserve",
                lambda: effect("reserve", amount),
                compensate=lambda a: effect("release", a),
            )

            def pay(oid: int, r: int) -> Any:  # the approved action charges in a nested step
                return steps.run("charge", lambda: effect("pay", [oid, r]))

            paid = steps.approval("lead", 3600).run("pay", pay, order["id"], reserved)
            if order.get("fail_notify"):
                raise RuntimeError("notify failed")
            receipt = steps.run("notify", lambda: effect("notify", paid))
            return {"receipt": receipt}

        return refund


# seqs of the original: quote 1 (its model call 2), hold 3, reserve 4, pay 5 (its charge 6),
# notify 7
QUOTE, CALL, HOLD, RESERVE, PAY, CHARGE, NOTIFY = 1, 2, 3, 4, 5, 6, 7


@pytest.fixture
def model() -> FakeModel:
    return FakeModel()


@pytest.fixture
def tester(runtime: Runtime, model: FakeModel) -> DurableTester:
    runtime.settings = replace(runtime.settings, strict_replay=True)
    return DurableTester(runtime, model)


@pytest.fixture
def shop(runtime: Runtime) -> Shop:
    s = Shop()
    runtime.agents.register(s.agent())
    return s


def original(tester: DurableTester, model: FakeModel, order: dict[str, Any] = ORDER) -> RunResult:
    model.respond_with_json(20, input_tokens=300, output_tokens=30)
    waiting = tester.run("fork-refund", order)
    assert_run(waiting).waiting()
    done = tester.approve(waiting.run_id, "alice")
    assert [(s.seq, s.step_key) for s in done.steps][:6] == [
        (QUOTE, "quote:0"),
        (CALL, "quote:0/llm:0"),
        (HOLD, "hold:0"),
        (RESERVE, "reserve:0"),
        (PAY, "pay:0"),
        (CHARGE, "pay:0/charge:0"),
    ]
    return done


def fork(tester: DurableTester, source: uuid.UUID, **kwargs: Any) -> RunResult:
    runtime = tester.runtime
    run, _ = fork_run(
        runtime.store, runtime.agents, runtime.settings, source, ForkRequest(**kwargs)
    )
    return tester._drive(Dispatch(run.id, run.dispatch_token))


def test_an_unchanged_approval_reused_is_copied_as_decided(
    tester: DurableTester, model: FakeModel, shop: Shop, runtime: Runtime
) -> None:
    first = original(tester, model)
    done = fork(tester, first.run_id, from_seq=NOTIFY, reuse_approval=True)
    assert_run(done).completed().output({"receipt": [1, 20]})
    assert shop.by(done.run_id) == [("notify", [1, 20])], "nothing before N ran again"
    assert model.calls == 1
    (approval,) = runtime.store.list_approvals(status=None, run_id=done.run_id)
    assert approval.status is ApprovalStatus.APPROVED
    assert approval.decided_by == "alice"
    assert approval.copied_from == first.run_id, "labelled: alice decided for the original"
    pay = next(s for s in done.steps if s.step_key == "pay:0")
    assert pay.origin is StepOrigin.COPIED
    assert runtime.store.get_run(done.run_id).tokens_used == 0


def test_a_fork_after_an_approval_asks_again_before_anything_after_it_runs(
    tester: DurableTester, model: FakeModel, shop: Shop, runtime: Runtime
) -> None:
    """A decision authorises its effects once: a fork from a step after the approval (the
    approved action copied, its downstream steps run by the fork) asks the approver again
    before any of them runs, unless the decision is reused explicitly."""
    first = original(tester, model)
    waiting = fork(tester, first.run_id, from_seq=NOTIFY)
    assert_run(waiting).waiting()
    assert shop.by(waiting.run_id) == [], "notify did not run on the original's decision"
    (pending,) = runtime.store.list_approvals(run_id=waiting.run_id)
    assert (pending.status, pending.copied_from, pending.step_key) == (
        ApprovalStatus.PENDING,
        None,
        "pay:0",
    )
    done = tester.approve(waiting.run_id, "bob")
    assert_run(done).completed().output({"receipt": [1, 20]})
    assert shop.by(done.run_id) == [("pay", [1, 20]), ("notify", [1, 20])]
    (decided,) = runtime.store.list_approvals(status=None, run_id=done.run_id)
    assert (decided.decided_by, decided.copied_from) == ("bob", None)


def test_the_approval_of_a_failed_action_is_never_copied_as_a_decision(
    tester: DurableTester, model: FakeModel, runtime: Runtime
) -> None:
    """An approved action that failed: a fork copies its failed step, never the approval as a
    decision, so resuming the fork asks again instead of running the action on it."""
    ran: list[uuid.UUID] = []
    broken = {"yes": True}

    @durable_agent("fork-failed-approval", approval_roles=["lead"])
    def act(_: Any, steps: Steps) -> str:
        def pay() -> str:
            ran.append(steps.run_id)
            if broken["yes"]:
                raise RuntimeError("gateway down")
            return "paid"

        return str(steps.approval("lead", 3600).run("pay", pay))

    runtime.agents.register(act)
    waiting = tester.run(act, {})
    failed = tester.approve(waiting.run_id, "alice")
    assert_run(failed).failed()
    after_all = max(s.seq for s in failed.steps) + 1
    forked = fork(tester, failed.run_id, from_seq=after_all, reuse_approval=False)
    assert_run(forked).failed()
    assert [
        a
        for a in runtime.store.list_approvals(status=None, run_id=forked.run_id)
        if a.status is ApprovalStatus.APPROVED
    ] == [], "an approval of a failed action is no decision the fork may act on"
    with pytest.raises(InvalidTransition, match="no decision to reuse"):
        fork(tester, failed.run_id, from_seq=after_all, reuse_approval=True)
    broken["yes"] = False
    resumed = tester._drive(runtime.store.resume_failed(forked.run_id))
    assert_run(resumed).waiting()
    assert forked.run_id not in ran, "the fork asked before it paid"


def test_an_approval_whose_payload_an_edit_changed_is_asked_again(
    tester: DurableTester, model: FakeModel, shop: Shop, runtime: Runtime
) -> None:
    first = original(tester, model)
    waiting = fork(tester, first.run_id, from_seq=NOTIFY, tool_result=(RESERVE, 99))
    assert_run(waiting).waiting()
    (pending,) = runtime.store.list_approvals(run_id=waiting.run_id)
    assert pending.payload == {"stepKey": "pay:0", "input": [1, 99]}
    assert shop.by(waiting.run_id) == [], "the old decision did not pay the new amount"
    assert "pay:0/charge:0" not in {s.step_key for s in waiting.steps}, (
        "the original's charge, nested in the old approval, is no history of the new one"
    )
    pay = next(s for s in waiting.steps if s.step_key == "pay:0")
    assert (pay.seq, pay.status, pay.origin) == (PAY, StepStatus.PENDING, None)
    reserve = next(s for s in waiting.steps if s.step_key == "reserve:0")
    assert reserve.origin is StepOrigin.EDITED

    done = tester.approve(waiting.run_id, "bob")
    assert_run(done).completed().output({"receipt": [1, 99]})
    assert shop.by(done.run_id) == [("pay", [1, 99]), ("notify", [1, 99])]
    assert shop.by(first.run_id).count(("pay", [1, 20])) == 1


def test_an_input_edit_that_changes_the_payload_asks_again(
    tester: DurableTester, model: FakeModel, shop: Shop, runtime: Runtime
) -> None:
    first = original(tester, model)
    waiting = fork(tester, first.run_id, from_seq=NOTIFY, input={"id": 2, "item": "book"})
    assert_run(waiting).waiting()
    (pending,) = runtime.store.list_approvals(run_id=waiting.run_id)
    assert pending.payload["input"] == [2, 20]
    done = tester.approve(waiting.run_id)
    assert_run(done).completed().output({"receipt": [2, 20]})


def test_a_fork_compensates_its_own_steps_never_the_copied_ones(
    tester: DurableTester, model: FakeModel, shop: Shop
) -> None:
    first = original(tester, model)
    failing = {**ORDER, "fail_notify": True}
    waiting = fork(tester, first.run_id, from_seq=RESERVE, input=failing)
    assert_run(waiting).waiting()  # the approval was not copied: it is after N
    failed = tester.approve(waiting.run_id)
    assert_run(failed).failed().compensated("reserve")
    assert shop.by(failed.run_id) == [
        ("reserve", 20),
        ("pay", [1, 20]),
        ("release", 20),
    ], "its own reservation released; the original's hold is not touched"
    assert "not compensated, copied from the original run: hold" in (failed.error or "")
    assert ("unhold", 20) not in [(w, a) for _, w, a in shop.log]


def test_a_fork_of_a_compensated_run_before_its_failure_can_succeed(
    tester: DurableTester, model: FakeModel, shop: Shop
) -> None:
    first = original(tester, model, {**ORDER, "fail_notify": True})
    assert_run(first).failed().compensated("reserve", "hold")
    assert first.steps[6].step_key == "compensate:reserve:0"
    # before the compensations; the decision reused, so only notify runs
    done = fork(tester, first.run_id, from_seq=7, input=ORDER, reuse_approval=True)
    assert_run(done).completed().output({"receipt": [1, 20]})
    assert shop.by(done.run_id) == [("notify", [1, 20])]
    assert not any(s.kind is StepKind.COMPENSATION for s in done.steps), "not copied: after N"


def test_replay_model_answers_steps_llm_from_the_recording(
    tester: DurableTester, model: FakeModel, shop: Shop
) -> None:
    first = original(tester, model)
    waiting = fork(tester, first.run_id, from_seq=QUOTE, replay_model=True)
    assert model.calls == 1, "no model call in the fork"
    call = next(s for s in waiting.steps if s.step_key == "quote:0/llm:0")
    assert (call.origin, call.usage.total, call.original_tokens) == (
        StepOrigin.REPLAYED,
        0,
        330,
    )
    done = tester.approve(waiting.run_id)
    assert_run(done).completed().output({"receipt": [1, 20]})
    assert tester.runtime.store.get_run(done.run_id).tokens_used == 0


def test_a_copied_failed_step_a_resumed_fork_runs_again_is_the_forks_own(
    tester: DurableTester, model: FakeModel, shop: Shop, runtime: Runtime
) -> None:
    """Resuming a failed fork retries its failed steps, copied ones included: the fork
    executes such a step itself, so the row is its own (not "copied", billed to it, what the
    original paid no longer shown apart) and the fork compensates it like any of its own."""
    declined = {"card": "declined"}

    @durable_agent("fork-retry")
    def pay(order: dict[str, Any], steps: Steps) -> str:
        def effect(what: str, arg: Any) -> Any:
            shop.log.append((steps.run_id, what, arg))
            return arg

        def charge() -> str:
            if declined["card"]:
                raise RuntimeError(f"card {declined['card']}")
            return str(effect("charge", "20 EUR"))

        quote = steps.llm("quote", lambda m: m.complete_json("price?"))
        charged = steps.run("charge", charge, compensate=lambda a: effect("refund", a))
        if order.get("fail_ship"):
            raise RuntimeError("ship failed")
        return f"{charged} for {quote}"

    runtime.agents.register(pay)
    model.respond_with_json(20, input_tokens=300, output_tokens=30)
    first = tester.run(pay, {})
    assert_run(first).failed()
    charge = next(s for s in first.steps if s.step_key == "charge:0")
    assert charge.status is StepStatus.ERROR
    after_all = max(s.seq for s in first.steps) + 1
    failed = fork(tester, first.run_id, from_seq=after_all, input={"fail_ship": True})
    assert_run(failed).failed()
    copied = next(s for s in failed.steps if s.step_key == "charge:0")
    assert (copied.status, copied.origin) == (StepStatus.ERROR, StepOrigin.COPIED)

    declined["card"] = ""
    dispatch = runtime.store.resume_failed(failed.run_id)
    resumed = tester._drive(dispatch)
    assert_run(resumed).failed().compensated("charge")
    assert shop.by(resumed.run_id) == [("charge", "20 EUR"), ("refund", "20 EUR")], (
        "the fork charged, so the fork refunds"
    )
    own = next(s for s in resumed.steps if s.step_key == "charge:0")
    assert (own.status, own.origin, own.original_tokens, own.original_cost_usd) == (
        StepStatus.DONE,
        None,
        None,
        None,
    )
    quote = next(s for s in resumed.steps if s.step_key == "quote:0/llm:0")
    assert quote.origin is StepOrigin.COPIED, "a step the fork did not run stays copied"
    assert "not compensated, copied" not in (resumed.error or "")
    assert model.calls == 1


def test_a_fork_point_inside_a_step_is_refused(
    tester: DurableTester, model: FakeModel, shop: Shop
) -> None:
    first = original(tester, model)
    with pytest.raises(ForkRefused, match=r"seq 6 is inside step pay:0 \(seq 5\)"):
        fork(tester, first.run_id, from_seq=CHARGE)
    with pytest.raises(ForkRefused) as refused:
        fork(tester, first.run_id, from_seq=CALL)
    assert refused.value.field == "fromSeq"
    assert "seq 2 is inside step quote:0 (seq 1)" in str(refused.value)
    with pytest.raises(ForkRefused, match=r"toolResult: step 5 \(pay:0\) is of kind APPROVAL"):
        fork(tester, first.run_id, from_seq=NOTIFY, tool_result=(PAY, 1))


def test_strict_replay_applies_to_a_fork_whose_input_changes_its_path(
    tester: DurableTester, model: FakeModel, runtime: Runtime
) -> None:
    @durable_agent("branchy")
    def branchy(order: dict[str, Any], steps: Steps) -> str:
        if order.get("express"):
            steps.run("express", lambda: 1)
        steps.run("ship", lambda: 2)
        return "shipped"

    runtime.agents.register(branchy)
    first = tester.run(branchy, {"express": False})
    assert_run(first).completed()
    diverged = fork(tester, first.run_id, from_seq=2, input={"express": True})
    assert diverged.status is RunStatus.FAILED
    assert "diverged from its history at step #0" in (diverged.error or "")


def test_a_fork_from_an_approval_asks_again_unless_its_decision_is_reused(
    tester: DurableTester, model: FakeModel, shop: Shop, runtime: Runtime
) -> None:
    first = original(tester, model)
    asked = fork(tester, first.run_id, from_seq=PAY)
    assert_run(asked).waiting()
    assert shop.by(asked.run_id) == [], "an approval authorises one execution in one run"
    (pending,) = runtime.store.list_approvals(run_id=asked.run_id)
    assert pending.copied_from is None

    reused = fork(tester, first.run_id, from_seq=PAY, reuse_approval=True)
    assert_run(reused).completed().output({"receipt": [1, 20]})
    assert shop.by(reused.run_id) == [("pay", [1, 20]), ("notify", [1, 20])]
    (carried,) = runtime.store.list_approvals(status=None, run_id=reused.run_id)
    assert (carried.status, carried.decided_by, carried.copied_from) == (
        ApprovalStatus.APPROVED,
        "alice",
        first.run_id,
    )
    # What the decision was about must not have changed: an edit asks again, reuse or not.
    edited = fork(
        tester, first.run_id, from_seq=PAY, reuse_approval=True, tool_result=(RESERVE, 99)
    )
    assert_run(edited).waiting()
