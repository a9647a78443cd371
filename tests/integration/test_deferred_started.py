"""An idempotent step's STARTED row is written only once it has run DAR_STARTED_ROW_AFTER_MS
(runtime.pipeline.effects, rule 1); every other step's is written before its code runs."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace

import pytest

from db.errors import LeaseLost
from db.records import RunStatus, StepStatus
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import ToolContext, tool
from tests.support import SimulatedCrash, drive_to_end, expire_lease, register_agent, submit


def _row_status(runtime: Runtime, run_id: uuid.UUID, key: str) -> StepStatus | None:
    rows = [s for s in runtime.store.steps(run_id) if s.step_key.endswith(key)]
    return rows[0].status if rows else None


def _wait_for_row(runtime: Runtime, run_id: uuid.UUID, key: str, timeout: float) -> float | None:
    """Seconds until the step's row appears (read from PostgreSQL), or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _row_status(runtime, run_id, key) is not None:
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def _status_seen_by_a_quick_tool(
    runtime: Runtime, llm: ScriptedLlm, *, idempotent: bool
) -> tuple[uuid.UUID, list[StepStatus | None]]:
    """Run one quick tool call; the status of its own row that the tool read while running."""
    seen: list[StepStatus | None] = []
    run_ids: list[uuid.UUID] = []

    @tool(idempotent=idempotent)
    def quick(ctx: ToolContext) -> str:
        """A quick call."""
        seen.append(_row_status(runtime, run_ids[0], "toolu_q"))
        return "done"

    register_agent(runtime.agents, quick)
    llm.then_tool_use("toolu_q", "quick").then_text("ok")
    run, dispatch = submit(runtime.store)
    run_ids.append(run.id)
    drive_to_end(runtime.driver(), dispatch)
    return run.id, seen


def test_a_quick_idempotent_tool_writes_one_row_at_its_end(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    run_id, seen = _status_seen_by_a_quick_tool(runtime, llm, idempotent=True)
    assert seen == [None], "no STARTED row while a quick idempotent tool runs"
    tool_row = runtime.store.steps(run_id)[1]
    assert tool_row.status is StepStatus.DONE
    assert tool_row.finished_at is not None
    assert tool_row.started_at <= tool_row.finished_at
    assert runtime.store.get_run(run_id).status is RunStatus.SUCCEEDED


def test_a_slow_idempotent_tool_shows_as_started_while_it_runs(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    appeared: list[float | None] = []
    run_ids: list[uuid.UUID] = []

    @tool(idempotent=True)
    def crawl(ctx: ToolContext) -> str:
        """A slow read."""
        appeared.append(_wait_for_row(runtime, run_ids[0], "toolu_s", timeout=3))
        return "crawled"

    register_agent(runtime.agents, crawl)
    llm.then_tool_use("toolu_s", "crawl").then_text("ok")
    run, dispatch = submit(runtime.store)
    run_ids.append(run.id)
    drive_to_end(runtime.driver(), dispatch)

    [waited] = appeared
    assert waited is not None, "the row appeared while the tool was still running"
    assert waited >= runtime.settings.started_row_after_seconds - 0.05
    assert runtime.store.steps(run.id)[1].status is StepStatus.DONE


def test_a_non_idempotent_tool_is_started_before_it_runs(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    _, seen = _status_seen_by_a_quick_tool(runtime, llm, idempotent=False)
    assert seen == [StepStatus.STARTED]


def test_zero_writes_every_row_first(runtime: Runtime, llm: ScriptedLlm) -> None:
    runtime.settings = replace(runtime.settings, started_row_after_seconds=0)
    _, seen = _status_seen_by_a_quick_tool(runtime, llm, idempotent=True)
    assert seen == [StepStatus.STARTED]


def test_a_crash_before_the_row_runs_the_tool_again_and_the_run_ends(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    calls: list[str] = []

    @tool(idempotent=True)
    def lookup(ctx: ToolContext) -> str:
        """Crashes its worker the first time."""
        calls.append(ctx.idempotency_key)
        if len(calls) == 1:
            raise SimulatedCrash  # the worker dies: no row was written for this call
        return "found"

    register_agent(runtime.agents, lookup)
    llm.then_tool_use("toolu_c", "lookup").then_text("ok")
    run, dispatch = submit(runtime.store)
    first = runtime.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
    assert first.dispatch is not None
    with pytest.raises(SimulatedCrash):
        runtime.driver(worker="worker-A").drive(run.id, first.dispatch.token)
    assert [s.kind.value for s in runtime.store.steps(run.id)] == ["MODEL"], "nothing recorded"
    expire_lease(runtime.engine, run.id)
    (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
    drive_to_end(runtime.driver(worker="worker-B"), redispatch)

    assert calls == [f"{run.id}/toolu_c"] * 2, "ran again, with the same key"
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    assert [s.status for s in runtime.store.steps(run.id)] == [StepStatus.DONE] * 3


def test_a_lease_lost_before_the_row_cancels_the_tool_and_writes_nothing(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    cancelled = threading.Event()
    run_ids: list[uuid.UUID] = []
    tokens: list[uuid.UUID] = []

    @tool(idempotent=True, timeout_seconds=10)
    def crawl(ctx: ToolContext) -> str:
        """Slow; meanwhile another worker takes the run over."""
        expire_lease(runtime.engine, run_ids[0])
        assert runtime.store.claim(run_ids[0], tokens[0], "worker-B", 30) is not None
        if ctx.cancelled.wait(5):
            cancelled.set()
        return "crawled"

    register_agent(runtime.agents, crawl)
    llm.then_tool_use("toolu_l", "crawl").then_text("ok")
    run, dispatch = submit(runtime.store)
    run_ids.append(run.id)
    first = runtime.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
    assert first.dispatch is not None
    tokens.append(first.dispatch.token)
    with pytest.raises(LeaseLost):
        runtime.driver(worker="worker-A").drive(run.id, first.dispatch.token)
    assert cancelled.wait(2), "the tool was told to stop when the row could not be written"
    assert [s.kind.value for s in runtime.store.steps(run.id)] == ["MODEL"]
    assert runtime.store.get_run(run.id).locked_by == "worker-B"
