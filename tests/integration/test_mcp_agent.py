"""Agents with MCP tools, against a real MCP server (the SDK-built counting server over stdio):
the tool set offered and recorded, calls as TOOL steps, results, errors, limits, timeouts."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from db.records import RunStatus, StepKind, StepStatus
from runtime.agents import Agent
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.mcp.client import McpClients
from runtime.mcp.servers import McpServer, ToolPolicy
from runtime.tools import tool
from tests.mcp.support import Ledger, stdio_server
from tests.support import drive_to_end, submit

pytestmark = pytest.mark.slow  # real servers and processes: `pytest --all`


@tool(idempotent=True)
def get_order(order_id: str) -> str:
    """Look an order up."""
    return f"order {order_id}: 2 items"


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path / "ledger.jsonl")


@pytest.fixture
def mcp_runtime(runtime: Runtime) -> Iterator[Runtime]:
    runtime.mcp = McpClients(connect_timeout_seconds=20)
    try:
        yield runtime
    finally:
        runtime.mcp.close()


def _agent(runtime: Runtime, *servers: McpServer, name: str = "mcp-agent") -> Agent:
    agent = Agent(
        name=name, system_prompt="You help.", tools=(get_order,), mcp_servers=tuple(servers)
    )
    if name in runtime.agents:
        runtime.agents.replace(agent)
    else:
        runtime.agents.register(agent)
    runtime.agents.finalize()
    return agent


def _run(runtime: Runtime, agent: str = "mcp-agent") -> tuple[object, list[object]]:
    run, dispatch = submit(runtime.store, agent=agent)
    drive_to_end(runtime.driver(), dispatch)
    return runtime.store.get_run(run.id), runtime.store.steps(run.id)


def _tool_result(llm: ScriptedLlm, n: int = 1) -> dict[str, object]:
    block: dict[str, object] = llm.requests[n].messages[-1]["content"][0]
    return block


def test_mcp_tools_are_offered_next_to_python_tools_and_called_as_tool_steps(
    mcp_runtime: Runtime, llm: ScriptedLlm, ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="runtime.mcp.client")
    _agent(mcp_runtime, stdio_server(ledger))
    llm.then_tool_use(
        "toolu_1",
        "get_order",
        {"order_id": "A1"},
        10,
        5,
        ("toolu_2", "notes__add_note", {"text": "hi"}),
    ).then_text("done")
    run, steps = _run(mcp_runtime)
    assert run.status is RunStatus.SUCCEEDED, run.error
    offered = [t["name"] for t in llm.requests[0].tools]
    assert offered[0] == "get_order"
    assert "notes__add_note" in offered
    assert "notes__count_notes" in offered
    add_note = next(t for t in llm.requests[0].tools if t["name"] == "notes__add_note")
    assert add_note["input_schema"]["required"] == ["text"], "schemas passed through"
    kinds = [(s.kind, s.status) for s in steps]
    assert kinds == [
        (StepKind.TOOLSET, StepStatus.DONE),
        (StepKind.MODEL, StepStatus.DONE),
        (StepKind.TOOL, StepStatus.DONE),
        (StepKind.TOOL, StepStatus.DONE),
        (StepKind.MODEL, StepStatus.DONE),
    ]
    assert steps[3].tool_name == "notes__add_note"
    assert steps[3].response == "note 1 added: hi"
    (entry,) = ledger.entries("add_note")
    assert entry["key"] == f"{run.id}/toolu_2", (
        "the tool_use id travels as the idempotency key in _meta"
    )
    results = llm.requests[1].messages[-1]["content"]
    assert [r["tool_use_id"] for r in results] == ["toolu_1", "toolu_2"]
    assert llm.requests[1].tools == llm.requests[0].tools
    deadline = time.monotonic() + 5
    wanted = f"run={str(run.id)[:8]} mcp=notes stderr: calling add_note key={run.id}/toolu_2"
    while wanted not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)  # the stderr pump is a thread of its own
    assert wanted in caplog.text, "the server's stderr is in the worker log, with the run id"
    record = next(r for r in caplog.records if "calling add_note" in r.getMessage())
    assert getattr(record, "run_id", None) == str(run.id)


def test_the_tool_set_is_fixed_at_the_first_model_step(
    mcp_runtime: Runtime, llm: ScriptedLlm, ledger: Ledger
) -> None:
    """The server gains a tool mid-run: the run keeps offering what it offered (byte for
    byte: the prompt cache stays warm); a new run sees the new tool."""
    _agent(mcp_runtime, stdio_server(ledger))
    llm.then_tool_use("toolu_1", "notes__count_notes", {}).then_text("done")
    run, dispatch = submit(mcp_runtime.store, agent="mcp-agent")
    driver = mcp_runtime.driver()
    toolset = driver.drive(dispatch.run_id, dispatch.token)
    assert toolset.dispatch is not None
    model = driver.drive(run.id, toolset.dispatch.token)  # first model step
    assert model.dispatch is not None
    _agent(mcp_runtime, stdio_server(ledger, "notes", "--extra-tool"))  # a deploy
    drive_to_end(driver, model.dispatch)
    assert mcp_runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    first, second = (r.to_json() for r in llm.requests)
    assert json.dumps(first["tools"]) == json.dumps(second["tools"])
    assert "notes__added_later" not in json.dumps(second["tools"])

    llm.then_text("fresh")
    _run(mcp_runtime)
    assert "notes__added_later" in [t["name"] for t in llm.requests[-1].tools]


def test_a_vanished_tool_is_an_error_result_not_a_crash(
    mcp_runtime: Runtime, llm: ScriptedLlm, ledger: Ledger
) -> None:
    _agent(mcp_runtime, stdio_server(ledger, "notes", "--extra-tool"))
    llm.then_tool_use("toolu_1", "notes__added_later", {}).then_text("ok")
    run, dispatch = submit(mcp_runtime.store, agent="mcp-agent")
    driver = mcp_runtime.driver()
    step = driver.drive(dispatch.run_id, dispatch.token)
    assert step.dispatch is not None
    step = driver.drive(run.id, step.dispatch.token)  # the model asks for added_later
    assert step.dispatch is not None
    _agent(mcp_runtime, stdio_server(ledger))  # the server restarted without it
    drive_to_end(driver, step.dispatch)
    assert mcp_runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    seen = _tool_result(llm)
    assert seen["is_error"] is True
    assert "no longer offered by MCP server 'notes'" in str(seen["content"])


def test_is_error_results_are_error_steps(
    mcp_runtime: Runtime, llm: ScriptedLlm, ledger: Ledger
) -> None:
    _agent(mcp_runtime, stdio_server(ledger))
    llm.then_tool_use("toolu_1", "notes__fail", {"message": "disk full"}).then_text("ok")
    run, steps = _run(mcp_runtime)
    assert run.status is RunStatus.SUCCEEDED
    assert steps[2].status is StepStatus.ERROR
    seen = _tool_result(llm)
    assert seen["is_error"] is True
    assert "disk full" in str(seen["content"])


def test_a_json_rpc_error_is_an_error_result_with_its_code(
    mcp_runtime: Runtime, llm: ScriptedLlm, ledger: Ledger
) -> None:
    _agent(mcp_runtime, stdio_server(ledger))
    llm.then_tool_use("toolu_1", "notes__rpc_error", {}).then_text("ok")
    run, steps = _run(mcp_runtime)
    assert run.status is RunStatus.SUCCEEDED
    assert steps[2].status is StepStatus.ERROR
    assert "answered with error -32099: the ledger is locked" in str(_tool_result(llm)["content"])


def test_input_is_validated_against_the_recorded_schema(
    mcp_runtime: Runtime, llm: ScriptedLlm, ledger: Ledger
) -> None:
    _agent(mcp_runtime, stdio_server(ledger))
    llm.then_tool_use("toolu_1", "notes__add_note", {"text": 7}).then_text("ok")
    run, _ = _run(mcp_runtime)
    assert run.status is RunStatus.SUCCEEDED
    seen = _tool_result(llm)
    assert seen["is_error"] is True
    assert "invalid input for tool 'notes__add_note': text: 7 is not of type 'string'" in str(
        seen["content"]
    )
    assert ledger.count("add_note") == 0, "the server never saw invalid input"


def test_a_huge_result_is_cut_to_the_output_limit(
    mcp_runtime: Runtime, llm: ScriptedLlm, ledger: Ledger
) -> None:
    mcp_runtime.settings = replace(mcp_runtime.settings, max_tool_output_chars=1000)
    _agent(mcp_runtime, stdio_server(ledger))
    llm.then_tool_use("toolu_1", "notes__huge", {"size": 2_000_000}).then_text("ok")
    run, steps = _run(mcp_runtime)
    assert run.status is RunStatus.SUCCEEDED
    assert len(steps[2].response) < 1200
    assert "[output truncated: 2000000 characters, the first 1000 shown]" in steps[2].response


def test_a_call_that_never_returns_times_out_as_an_error_when_read_only(
    mcp_runtime: Runtime, llm: ScriptedLlm, ledger: Ledger
) -> None:
    _agent(mcp_runtime, stdio_server(ledger, tools={"hang": ToolPolicy(timeout_seconds=1)}))
    llm.then_tool_use("toolu_1", "notes__hang", {}).then_text("ok")
    run, steps = _run(mcp_runtime)
    assert run.status is RunStatus.SUCCEEDED
    assert steps[2].status is StepStatus.ERROR
    assert "did not return within 1s" in str(_tool_result(llm)["content"])


def test_a_destructive_call_that_times_out_stops_the_run_for_a_person(
    mcp_runtime: Runtime, llm: ScriptedLlm, ledger: Ledger
) -> None:
    _agent(mcp_runtime, stdio_server(ledger, tools={"add_note": ToolPolicy(timeout_seconds=1)}))
    llm.then_tool_use("toolu_1", "notes__add_note", {"text": "x", "delay": 3}).then_text("ok")
    run, steps = _run(mcp_runtime)
    assert run.status is RunStatus.NEEDS_ATTENTION
    assert "did not return within 1s" in (run.error or "")
    assert "not declared idempotent" in (run.error or "")
    assert steps[2].status is StepStatus.STARTED, "left for the operator to resolve"
    assert len(llm.requests) == 1, "the model never saw a timeout it could retry"


def test_a_server_dying_mid_call_leaves_a_destructive_call_in_doubt(
    mcp_runtime: Runtime, llm: ScriptedLlm, ledger: Ledger
) -> None:
    _agent(mcp_runtime, stdio_server(ledger))
    llm.then_tool_use("toolu_1", "notes__crash", {})
    run, steps = _run(mcp_runtime)
    assert run.status is RunStatus.NEEDS_ATTENTION
    assert "went away during the call to 'crash'" in (run.error or "")
    assert steps[-1].status is StepStatus.STARTED
    assert ledger.count("crash") == 1

    # The operator says it happened: the run goes on, on a fresh session to a new server.
    dispatch = mcp_runtime.store.resolve(run.id, "supply_result", output="it wrote")
    assert dispatch is not None
    llm.then_tool_use("toolu_2", "notes__count_notes", {}).then_text("fine")
    drive_to_end(mcp_runtime.driver(), dispatch)
    assert mcp_runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    assert ledger.count("count_notes") == 1, "the session was re-opened after the server died"
