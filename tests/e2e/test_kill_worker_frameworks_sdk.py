"""End to end, real processes: the OpenAI Agents SDK half of the framework kill tests, and
its nested-agent kill (the fixtures, fakes and watch live in
``test_kill_worker_frameworks``; imported here, they make this file's own stack, fakes and
ledgers, shared by its tests). A file of its own so that ``pytest --all`` (which gives a
file's tests to one process) runs the two halves side by side: together they held one test
process for ~7 minutes of stack starts, the longest single file of the suite."""

# ruff: noqa: F811 (the fixtures imported below are the tests' parameters)

from __future__ import annotations

import pytest

from cli.devstack import DevStack
from db.records import RunStatus, StepStatus
from tests.e2e.test_kill_worker_frameworks import (  # noqa: F401 (fixtures: this file's own stack)
    Ledgers,
    Tally,
    Watch,
    _wait_marker,
    assert_retracted_then_shown,
    kill_in_a_tool_after_its_nested_agent_answered,
    ledgers,
    messages_api,
    openai_api,
    openai_fake,
    shared_stack,
    stack,
)
from tests.fakes.openai_api import Turn

# This file's stack registers the Agents SDK's agents only (tests/e2e/framework_agent.py).
FRAMEWORKS = "agents_sdk"

# The first test's time includes the file's stack start (~30 s under load).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def test_sigkill_while_an_agents_sdk_run_waits_for_approval(
    stack: DevStack, openai_fake: Tally[Turn], ledgers: Ledgers
) -> None:
    """A RunState interruption became an approval; the worker that ran the agent up to it is
    killed while the run waits; the approval continues the run on the other worker from the
    recorded steps (the SDK's state is rebuilt from them, the model is not asked again)."""
    watch = Watch(stack, "oa-approve", "Refund A-7")
    try:
        run = watch.approve_after_killing("model:0")
        assert run.status is RunStatus.SUCCEEDED, run.error
        assert run.result == "refunded"
        assert [s.step_key for s in watch.steps()] == [
            "agent:0",
            "model:0",
            "approve.refund:0",
            "tool.refund:0",
            "model:1",
        ]
        assert ledgers.tool.count("refund") == 1, "the approved call, once"
        assert openai_fake.calls == 2, "the recorded call was not made again"
        assert run.tokens_used == openai_fake.billed_tokens
    finally:
        watch.close()


def test_sigkill_at_each_step_kind_of_an_agents_sdk_run(
    stack: DevStack, openai_fake: Tally[Turn], ledgers: Ledgers
) -> None:
    """Killed in its first model call, in its function tool, in its MCP call: the run ends
    SUCCEEDED with each completed step once."""
    watch = Watch(stack, "oa-e2e", "Pack A-7 and count the notes")
    mcp = ledgers.mcp
    try:
        watch.until("the first model call", lambda: openai_fake.calls >= 1)
        watch.until("its first text, live", lambda: watch.streamed("model:0"))
        watch.kill_holder()
        _wait_marker(watch, ledgers.tool_marker, "pack")
        watch.kill_holder()
        _wait_marker(watch, ledgers.mcp_marker, "count_notes")
        watch.kill_holder()

        run = watch.end()
        assert run.status is RunStatus.SUCCEEDED, run.error
        assert run.result == "packed and counted"
        steps = watch.steps()
        keys = [s.step_key for s in steps]
        assert keys == [
            "agent:0",
            "mcp.notes.tools:0",
            "model:0",
            "tool.pack:0",
            "mcp.notes.tools:1",
            "model:1",
            "mcp.notes.count_notes:0",
            "mcp.notes.tools:2",
            "model:2",
        ], keys
        assert all(s.status is StepStatus.DONE for s in steps)
        packs = ledgers.tool.entries("pack")
        assert [p["key"] for p in packs] == [f"{run.id}/tool.pack:0"] * 2, "re-run, same key"
        counts = mcp.entries("count_notes")
        assert [c["key"] for c in counts] == [f"{run.id}/mcp.notes.count_notes:0"] * 2
        assert openai_fake.calls == 4, "the cut call once more; no recorded call repeated"
        assert_retracted_then_shown(stack, run.id, "model:0")
        recorded = sum(s.usage.input_tokens + s.usage.output_tokens for s in steps)
        billed = openai_fake.billed
        assert recorded == sum(t.input_tokens + t.output_tokens for t in billed[1:])
        counted = run.tokens_used + run.unrecorded_tokens
        print(f"billed {openai_fake.billed_tokens}, recorded {run.tokens_used}, counted {counted}")
        assert counted >= openai_fake.billed_tokens, "the cut call counted (estimated)"
    finally:
        watch.close()


def test_sigkill_in_a_tool_after_its_nested_agent_answered(
    stack: DevStack, openai_fake: Tally[Turn], ledgers: Ledgers
) -> None:
    """The Agents SDK's case of :func:`kill_in_a_tool_after_its_nested_agent_answered` (the
    Pydantic AI case runs in the other file, on its stack)."""
    kill_in_a_tool_after_its_nested_agent_answered(stack, openai_fake, ledgers, "oa-delegate")
