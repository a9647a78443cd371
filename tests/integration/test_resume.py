"""Seed 000's ResumeIT: a crash mid-tool, a second worker, no repeated model call."""

from __future__ import annotations

from dataclasses import replace

from db.errors import LeaseLost
from db.records import RunStatus, StepKind, StepStatus
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Driver
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import ToolContext, tool
from tests.support import SimulatedCrash, drive_to_end, expire_lease, register_agent, submit


def test_resumed_run_does_not_repeat_model_calls(runtime: Runtime, llm: ScriptedLlm) -> None:
    # The seed's scenario finds the tool STARTED after the crash: its row is written first
    # (an idempotent tool's otherwise waits DAR_STARTED_ROW_AFTER_MS; the crash before that
    # row is test_deferred_started's).
    runtime.settings = replace(runtime.settings, started_row_after_seconds=0)
    llm.then_tool_use("toolu_1", "lookup", {"q": "x"}, 100, 20).then_text("done", 150, 5)
    executed: list[str] = []

    @tool(idempotent=True)
    def lookup(q: str, ctx: ToolContext) -> str:
        """Look something up."""
        executed.append(ctx.idempotency_key)
        if len(executed) == 1:
            raise SimulatedCrash
        return "found"

    register_agent(runtime.agents, lookup)
    run, dispatch = submit(runtime.store)
    worker_a = runtime.driver(worker="worker-A")
    worker_b = runtime.driver(worker="worker-B")

    # worker A: the model step, then the tool step, which crashes the "process".
    first = worker_a.drive(dispatch.run_id, dispatch.token)
    assert first.dispatch is not None
    try:
        worker_a.drive(first.dispatch.run_id, first.dispatch.token)
    except SimulatedCrash:
        pass
    else:
        raise AssertionError("the crash must escape the driver")
    crashed = runtime.store.get_run(run.id)
    assert crashed.status is RunStatus.RUNNING
    assert crashed.locked_by == "worker-A", "a crash leaves the lease held"
    steps = runtime.store.steps(run.id)
    assert [(s.kind, s.status) for s in steps] == [
        (StepKind.MODEL, StepStatus.DONE),
        (StepKind.TOOL, StepStatus.STARTED),
    ]

    # While A's lease is live, nobody else may take the run.
    assert runtime.store.redispatch_due(redispatch_after=0) == []

    # The lease lapses; the reaper hands the run to a new message; worker B finishes it.
    expire_lease(runtime.engine, run.id)
    (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
    drive_to_end(worker_b, redispatch)

    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "done"
    assert len(llm.requests) == 2, "the first model call was not repeated"
    assert executed == [f"{run.id}/toolu_1"] * 2, "the tool ran again with the same key"
    assert done.tokens_used == 100 + 20 + 150 + 5
    steps = runtime.store.steps(run.id)
    assert [(s.seq, s.kind, s.status) for s in steps] == [
        (1, StepKind.MODEL, StepStatus.DONE),
        (2, StepKind.TOOL, StepStatus.DONE),
        (3, StepKind.MODEL, StepStatus.DONE),
    ]
    assert steps[1].worker == "worker-B"
    # The second request carries the tool result answering the first turn's tool_use.
    second = llm.requests[1].messages
    assert second[1]["content"][0]["id"] == "toolu_1"
    assert second[2] == {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "found"}],
    }


def test_worker_whose_lease_was_taken_over_writes_nothing(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    # Calls are answered in order: A's call starts first but B's is answered first.
    llm.then_text("from B", 10, 1).then_text("from A", 10, 1)
    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store)

    def stall_past_the_lease() -> None:
        # While A waits on the model (a GC pause, SIGSTOP), its lease lapses, the reaper
        # re-dispatches, and worker B completes the same step.
        expire_lease(runtime.engine, run.id)
        (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
        result_b = runtime.driver(worker="worker-B").drive(redispatch.run_id, redispatch.token)
        assert result_b.status is RunStatus.SUCCEEDED  # B's answer ended the run, in its task

    class StallingModel:
        def send(self, request: LlmRequest) -> LlmResponse:
            stall_past_the_lease()
            return llm.send(request)

    worker_a = Driver(
        store=runtime.store,
        agents=runtime.agents,
        llm=StallingModel(),
        settings=runtime.settings,
        worker="worker-A",
    )
    try:
        worker_a.drive(dispatch.run_id, dispatch.token)
    except LeaseLost:
        pass
    else:
        raise AssertionError("a fenced-out worker must get LeaseLost")
    steps = runtime.store.steps(run.id)
    assert len(steps) == 1
    assert steps[0].worker == "worker-B"
    assert steps[0].response == [{"type": "text", "text": "from B"}]
    after = runtime.store.get_run(run.id)
    assert after.tokens_used == 11, "only B's step is counted as a step"
    assert after.unrecorded_tokens == 11, "A's call was billed: it is counted against the run"
    assert len(llm.requests) == 2, "A did call the model; only its checkpoint was refused"


def test_same_worker_name_does_not_defeat_the_fence(runtime: Runtime, llm: ScriptedLlm) -> None:
    """Two processes called the same (a restarted container): the epoch decides."""
    llm.then_text("one", 10, 1).then_text("two", 10, 1)
    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store)
    stale = runtime.store.claim(run.id, dispatch.token, "worker-A", 30)
    assert stale is not None
    expire_lease(runtime.engine, run.id)
    (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
    fresh = runtime.store.claim(redispatch.run_id, redispatch.token, "worker-A", 30)
    assert fresh is not None
    assert fresh.epoch == stale.epoch + 1
    try:
        runtime.driver(worker="worker-A").execute(stale)
    except LeaseLost:
        pass
    else:
        raise AssertionError("the stale epoch must be fenced out")
    assert runtime.store.steps(run.id) == []
