"""The engine's sweeps run without Celery (``runtime.engine.sweeps``): the reaper and the
approval timeouts hand each message to the sender they are given, after its commit; the
Celery tasks only pass theirs (``tasks.drive``)."""

from __future__ import annotations

import time

from db.records import Dispatch, RunStatus
from runtime.durable import Steps, durable_agent
from runtime.engine import sweeps
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.testing.testkit import DurableTester, FakeModel
from tests.support import drive_to_end, register_agent, submit


def test_the_reaper_resends_a_lost_message_once_through_any_sender(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    llm.then_text("done")
    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store)
    runtime.store.mark_undispatched(dispatch)  # as if the message was lost
    sent: list[Dispatch] = []

    assert sweeps.reap(runtime.store, runtime.settings, sent.append) == 1
    (resent,) = sent
    assert resent.run_id == run.id
    assert resent.token != dispatch.token, "a new token: the lost message, if it turns up, is stale"
    assert sweeps.reap(runtime.store, runtime.settings, sent.append) == 0
    assert len(sent) == 1, "sent once"

    drive_to_end(runtime.driver(), resent)
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED


def test_an_expired_approval_wakes_its_run_through_the_sender(runtime: Runtime) -> None:
    @durable_agent("sweep-gated", approval_roles=["ops"])
    def gated(_: object, steps: Steps) -> str:
        return steps.approval("ops", 0.05, policy="APPROVE").run("go", lambda: "went", type=str)

    tester = DurableTester(runtime, FakeModel())
    waiting = tester.run(gated, {})
    assert waiting.status is RunStatus.WAITING
    time.sleep(0.1)
    sent: list[Dispatch] = []

    sweeps.reap(runtime.store, runtime.settings, sent.append)
    (woke,) = [d for d in sent if d.run_id == waiting.run_id]
    assert runtime.store.due_approvals() == [], "applied once"
    result = tester._drive(woke)
    assert result.status is RunStatus.SUCCEEDED, result.error
    assert result.result == "went"
