"""``steps.tool`` in durable functions, and agents on the published reference servers
(mcp-server-git on a temporary repository, mcp-server-time) as real third-party servers."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from db.records import RunStatus, StepKind, StepStatus
from runtime.agents import Agent
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.mcp.client import McpClients
from runtime.mcp.servers import McpServer
from runtime.testing.testkit import DurableTester, assert_run
from runtime.tools import tool
from tests.mcp.support import CrashingClients, Ledger, stdio_server
from tests.support import SimulatedCrash, drive_to_end, expire_lease, submit

pytestmark = pytest.mark.slow  # real servers and processes: `pytest --all`


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path / "ledger.jsonl")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    (path / "README.md").write_text("hello\n")
    subprocess.run([*git, "add", "README.md"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    (path / "notes.txt").write_text("draft\n")
    return path


def _commits(repo: Path) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(repo), "log", "--format=%s"], check=True, capture_output=True, text=True
    )
    return out.stdout.split()


@pytest.fixture
def clients() -> Iterator[list[McpClients]]:
    made: list[McpClients] = []
    try:
        yield made
    finally:
        for c in made:
            c.close()


def git_server(repo: Path) -> McpServer:
    return McpServer.stdio(
        "git", [sys.executable, "-m", "mcp_server_git", "--repository", str(repo)]
    )


def time_server() -> McpServer:
    return McpServer.stdio(
        "time", [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"]
    )


# -- durable functions -----------------------------------------------------------------------


def test_steps_tool_is_a_recorded_step_replayed_not_repeated(
    runtime: Runtime, ledger: Ledger, clients: list[McpClients]
) -> None:
    runtime.mcp = McpClients()
    clients.append(runtime.mcp)
    notes = stdio_server(ledger)

    @durable_agent("notes-fn", mcp_servers=[notes])
    def fn(text: str, steps: Steps) -> Any:
        added = steps.tool("notes", "add_note", {"text": text})
        counted = steps.tool("notes", "count_notes")
        return {"added": added, "counted": counted}

    tester = DurableTester(runtime)
    tester.crash_after("notes__add_note")
    crashed = tester.run(fn, "hello")
    assert crashed.crashed
    done = tester.resume(crashed.run_id)
    assert_run(done).completed().has_steps("notes__add_note", "notes__count_notes")
    assert ledger.count("add_note") == 1, "replayed from the log, not called again"
    (entry,) = ledger.entries("add_note")
    assert entry["key"] == f"{crashed.run_id}/notes__add_note:0", "run id / step key"
    assert done.result == {
        "added": {"result": "note 1 added: hello"},
        "counted": {"result": "1 notes"},
    }
    row = next(s for s in done.steps if s.step_key == "notes__add_note:0")
    assert row.kind is StepKind.STEP


def test_steps_tool_error_results_fail_the_step(
    runtime: Runtime, ledger: Ledger, clients: list[McpClients]
) -> None:
    runtime.mcp = McpClients()
    clients.append(runtime.mcp)

    @durable_agent("failing-fn", mcp_servers=[stdio_server(ledger)])
    def fn(_: Any, steps: Steps) -> Any:
        return steps.tool("notes", "fail", {"message": "no disk"})

    done = DurableTester(runtime).run(fn, "x")
    assert_run(done).failed()
    row = next(s for s in done.steps if s.step_key == "notes__fail:0")
    assert row.status is StepStatus.ERROR
    assert row.error == "McpToolError: Error executing tool fail: no disk"


def test_steps_tool_in_doubt_follows_the_annotations(
    runtime: Runtime, ledger: Ledger, clients: list[McpClients]
) -> None:
    runtime.mcp = CrashingClients({"add_note", "count_notes"})
    clients.append(runtime.mcp)

    @durable_agent("doubt-fn", mcp_servers=[stdio_server(ledger)])
    def fn(_: Any, steps: Steps) -> Any:
        steps.tool("notes", "count_notes")
        return steps.tool("notes", "add_note", {"text": "charge"})

    registered = runtime.agents.register(fn)
    run, dispatch = submit(runtime.store, agent=registered.name, text_input="x")
    outcomes: list[str] = []
    current = dispatch
    for _ in range(6):
        try:
            result = runtime.driver().drive(current.run_id, current.token)
        except SimulatedCrash:
            outcomes.append("crash")
            expire_lease(runtime.engine, run.id)
            (current,) = runtime.store.redispatch_due(redispatch_after=3600)
            continue
        if result.dispatch is None:
            break
        current = result.dispatch
    after = runtime.store.get_run(run.id)
    assert outcomes == ["crash", "crash"]
    assert ledger.count("count_notes") == 2, "read-only: called again after the crash"
    assert ledger.count("add_note") == 1, "destructive: not called again"
    assert after.status is RunStatus.NEEDS_ATTENTION
    assert "step 'notes__add_note:0'" in (after.error or "")


# -- the published reference servers ---------------------------------------------------------


@tool(idempotent=True)
def get_order(order_id: str) -> str:
    """Look an order up."""
    return f"order {order_id}: shipped"


def test_an_agent_with_a_python_tool_and_two_reference_servers(
    runtime: Runtime, llm: ScriptedLlm, repo: Path, clients: list[McpClients]
) -> None:
    runtime.mcp = McpClients()
    clients.append(runtime.mcp)
    runtime.agents.register(
        Agent(
            name="repo-helper",
            system_prompt="You help with the repository.",
            tools=(get_order,),
            mcp_servers=(git_server(repo), time_server()),
        )
    )
    runtime.agents.finalize()
    llm.then_tool_use(
        "toolu_1",
        "git__git_status",
        {"repo_path": str(repo)},
        10,
        5,
        (
            "toolu_2",
            "time__convert_time",
            {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"},
        ),
        ("toolu_3", "get_order", {"order_id": "A1"}),
    ).then_text("all good")
    run, dispatch = submit(runtime.store, agent="repo-helper")
    drive_to_end(runtime.driver(), dispatch)
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    names = [t["name"] for t in llm.requests[0].tools]
    assert names[0] == "get_order"
    assert {"git__git_status", "git__git_commit", "time__get_current_time"} <= set(names)
    results = {r["tool_use_id"]: r for r in llm.requests[1].messages[-1]["content"]}
    assert "notes.txt" in results["toolu_1"]["content"]
    assert '"time_difference": "+9.0h"' in results["toolu_2"]["content"]
    assert results["toolu_3"]["content"] == "order A1: shipped"
    assert not any(r.get("is_error") for r in results.values())


def _crash_in_git_call(
    runtime: Runtime, llm: ScriptedLlm, repo: Path, tool_name: str, args: dict[str, Any]
) -> RunStatus:
    runtime.agents.register(
        Agent(name="git-agent", system_prompt="", mcp_servers=(git_server(repo),))
    )
    runtime.agents.finalize()
    llm.then_tool_use("toolu_1", f"git__{tool_name}", {"repo_path": str(repo), **args})
    llm.then_text("done")
    run, dispatch = submit(runtime.store, agent="git-agent")
    driver = runtime.driver(worker="worker-A")
    step = driver.drive(dispatch.run_id, dispatch.token)
    assert step.dispatch is not None
    step = driver.drive(run.id, step.dispatch.token)
    assert step.dispatch is not None
    with pytest.raises(SimulatedCrash):
        driver.drive(run.id, step.dispatch.token)
    expire_lease(runtime.engine, run.id)
    (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
    drive_to_end(runtime.driver(worker="worker-B"), redispatch)
    return runtime.store.get_run(run.id).status


def test_git_commit_in_doubt_is_not_committed_twice(
    runtime: Runtime, llm: ScriptedLlm, repo: Path, clients: list[McpClients]
) -> None:
    runtime.mcp = CrashingClients({"git_commit"})
    clients.append(runtime.mcp)
    subprocess.run(["git", "-C", str(repo), "add", "notes.txt"], check=True)
    status = _crash_in_git_call(runtime, llm, repo, "git_commit", {"message": "second"})
    assert status is RunStatus.NEEDS_ATTENTION
    assert _commits(repo) == ["second", "first"], "committed once"


def test_git_status_in_doubt_is_run_again(
    runtime: Runtime, llm: ScriptedLlm, repo: Path, clients: list[McpClients]
) -> None:
    runtime.mcp = CrashingClients({"git_status"})
    clients.append(runtime.mcp)
    runtime.settings = replace(runtime.settings)
    assert _crash_in_git_call(runtime, llm, repo, "git_status", {}) is RunStatus.SUCCEEDED
    assert "notes.txt" in str(llm.requests[-1].messages[-1]["content"][0]["content"])


def test_the_example_agent_runs_with_the_offline_demo_model(
    runtime: Runtime, repo: Path, clients: list[McpClients]
) -> None:
    from examples.repo_helper import build
    from runtime.llm.demo import DemoModel

    runtime.llm = DemoModel(latency_ms=0)
    runtime.mcp = McpClients()
    clients.append(runtime.mcp)
    runtime.agents.register(build(str(repo)))
    runtime.agents.finalize()
    run, dispatch = submit(
        runtime.store, f"What is the status of the repository at {repo}?", agent="repo-helper"
    )
    drive_to_end(runtime.driver(), dispatch)
    after = runtime.store.get_run(run.id)
    assert after.status is RunStatus.SUCCEEDED, after.error
    tool_row = next(s for s in runtime.store.steps(run.id) if s.kind is StepKind.TOOL)
    assert tool_row.tool_name == "git__git_status"
    assert "notes.txt" in str(after.result)
