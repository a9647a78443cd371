"""The idempotency key handed to user code is ``<run id>/<step key>`` (issue 23 defect 2): a
downstream ledger that de-duplicates on it (what the README tells users to do) performs each
run's call once, and a fork gets new keys for every step it runs again. On the bare step key
(``charge:0``, a ``tool_use`` id) every run of a function, and every fork, collided."""

from __future__ import annotations

import uuid
from typing import Any

from db.records import Dispatch, RunStatus, StepKind
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.fork import ForkRequest, fork_run
from runtime.llm.scripted import ScriptedLlm
from runtime.testing.testkit import DurableTester
from runtime.tools import ToolContext, tool
from tests.support import drive_to_end, register_agent, submit


class Ledger:
    """A downstream system that de-duplicates on the idempotency key, as users are told to
    build them: a second request with a key seen before changes nothing."""

    def __init__(self) -> None:
        self.charged: dict[str, Any] = {}

    def charge(self, key: str, amount: int) -> bool:
        if key in self.charged:
            return False
        self.charged[key] = amount
        return True


def test_every_run_of_a_durable_function_gets_its_own_keys(runtime: Runtime) -> None:
    ledger = Ledger()
    seen: list[tuple[uuid.UUID, str | None, str]] = []

    def charge(steps: Steps, amount: int) -> bool:
        context = steps.context
        assert context is not None
        seen.append((steps.run_id, steps.key, context.idempotency_key))
        return ledger.charge(context.idempotency_key, amount)

    @durable_agent("keyed-charge")
    def fn(amount: int, steps: Steps) -> bool:
        return steps.run("charge", charge, steps, amount, type=bool)

    tester = DurableTester(runtime)
    first = tester.run(fn, 5)
    second = tester.run(fn, 5)
    assert (first.result, second.result) == (True, True), "the second run was not charged"
    assert len(ledger.charged) == 2
    assert seen == [
        (first.run_id, f"{first.run_id}/charge:0", f"{first.run_id}/charge:0"),
        (second.run_id, f"{second.run_id}/charge:0", f"{second.run_id}/charge:0"),
    ]


def test_a_fork_running_a_step_again_gets_a_new_key(runtime: Runtime) -> None:
    ledger = Ledger()

    @durable_agent("keyed-fork")
    def fn(amount: int, steps: Steps) -> list[bool]:
        first = steps.run("note", lambda: True, type=bool)
        key = lambda: steps.key or ""  # noqa: E731 - read inside the step
        return [first, steps.run("charge", lambda: ledger.charge(key(), amount), type=bool)]

    tester = DurableTester(runtime)
    original = tester.run(fn, 5)
    assert original.result == [True, True]
    charge_seq = next(s.seq for s in original.steps if s.step_key == "charge:0")
    forked, _ = fork_run(
        runtime.store,
        runtime.agents,
        runtime.settings,
        original.run_id,
        ForkRequest(from_seq=charge_seq),
    )
    done = tester._drive(Dispatch(forked.id, forked.dispatch_token))
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == [True, True], "the fork's charge collided with the original's key"
    assert sorted(ledger.charged) == sorted(
        [f"{original.run_id}/charge:0", f"{forked.id}/charge:0"]
    )


def test_a_fork_replaying_the_model_runs_its_tools_with_new_keys(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    """The replayed answers carry the original's ``tool_use`` ids; the tools the fork runs
    again must still see keys of their own."""
    keys: list[str] = []

    @tool
    def pay(amount: int, ctx: ToolContext) -> str:
        """Pay."""
        keys.append(ctx.idempotency_key)
        return "paid"

    register_agent(runtime.agents, pay)
    llm.then_tool_use("toolu_pay", "pay", {"amount": 3}).then_text("done")
    run, dispatch = submit(runtime.store)
    drive_to_end(runtime.driver(), dispatch)
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    forked, _ = fork_run(
        runtime.store,
        runtime.agents,
        runtime.settings,
        run.id,
        ForkRequest(from_seq=1, replay_model=True),
    )
    drive_to_end(runtime.driver(), Dispatch(forked.id, forked.dispatch_token))
    assert runtime.store.get_run(forked.id).status is RunStatus.SUCCEEDED
    steps = runtime.store.steps(forked.id)
    assert [s.tool_use_id for s in steps if s.kind is StepKind.TOOL] == ["toolu_pay"]
    assert keys == [f"{run.id}/toolu_pay", f"{forked.id}/toolu_pay"]
