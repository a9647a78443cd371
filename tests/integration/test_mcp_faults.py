"""MCP faults against real servers: a crash between the call and its record (resume
semantics from the annotations, and the operator's override), HTTP servers answering
401/500 or restarting, servers that are missing or die at startup, bad configuration."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from db.records import Dispatch, RunStatus, StepStatus
from runtime.agents import Agent, AgentConfigError, AgentRegistry
from runtime.config import ConfigError, Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.preflight import check_mcp_servers
from runtime.llm.scripted import ScriptedLlm
from runtime.mcp.client import McpClients
from runtime.mcp.errors import McpUnavailable
from runtime.mcp.servers import McpConfigError, McpServer, parse_servers, parse_tool_overrides
from tests.mcp.support import (
    COUNTING,
    CrashingClients,
    Ledger,
    free_port,
    http_server,
    stdio_server,
)
from tests.support import SimulatedCrash, drive_to_end, expire_lease, submit

pytestmark = pytest.mark.slow  # real servers and processes: `pytest --all`


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path / "ledger.jsonl")


@pytest.fixture
def clients() -> Iterator[list[McpClients]]:
    made: list[McpClients] = []
    try:
        yield made
    finally:
        for c in made:
            c.close()


def _register(runtime: Runtime, *servers: McpServer) -> None:
    runtime.agents.register(
        Agent(name="mcp-agent", system_prompt="You help.", mcp_servers=tuple(servers))
    )
    runtime.agents.finalize()


def _crash_then_resume(
    runtime: Runtime, llm: ScriptedLlm, tool: str, tool_input: dict[str, Any]
) -> uuid.UUID:
    """Toolset, model, then the MCP call crashes its worker; the lease lapses, another
    worker picks the run up and drives it as far as it goes."""
    llm.then_tool_use("toolu_1", f"notes__{tool}", tool_input).then_text("done")
    run, dispatch = submit(runtime.store, agent="mcp-agent")
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
    return run.id


def test_a_read_only_tool_in_doubt_is_called_again_with_the_same_key(
    runtime: Runtime, llm: ScriptedLlm, ledger: Ledger, clients: list[McpClients]
) -> None:
    runtime.mcp = CrashingClients({"count_notes"})
    clients.append(runtime.mcp)
    _register(runtime, stdio_server(ledger))
    run_id = _crash_then_resume(runtime, llm, "count_notes", {})
    assert runtime.store.get_run(run_id).status is RunStatus.SUCCEEDED
    assert [e["key"] for e in ledger.entries("count_notes")] == [f"{run_id}/toolu_1"] * 2


def test_a_destructive_tool_in_doubt_is_not_called_again(
    runtime: Runtime, llm: ScriptedLlm, ledger: Ledger, clients: list[McpClients]
) -> None:
    runtime.mcp = CrashingClients({"add_note"})
    clients.append(runtime.mcp)
    _register(runtime, stdio_server(ledger))
    run_id = _crash_then_resume(runtime, llm, "add_note", {"text": "pay"})
    run = runtime.store.get_run(run_id)
    assert run.status is RunStatus.NEEDS_ATTENTION
    assert "MCP tool 'notes__add_note' (not re-run after a crash)" in (run.error or "")
    assert ledger.count("add_note") == 1, "the destructive call happened exactly once"
    assert runtime.store.steps(run_id)[-1].status is StepStatus.STARTED


def test_an_unannotated_tool_counts_as_destructive(
    runtime: Runtime, llm: ScriptedLlm, ledger: Ledger, clients: list[McpClients]
) -> None:
    runtime.mcp = CrashingClients({"unannotated"})
    clients.append(runtime.mcp)
    _register(runtime, stdio_server(ledger))
    run_id = _crash_then_resume(runtime, llm, "unannotated", {"x": 2})
    assert runtime.store.get_run(run_id).status is RunStatus.NEEDS_ATTENTION
    assert ledger.count("unannotated") == 1


def test_an_operator_override_makes_a_destructive_tool_re_run(
    runtime: Runtime, llm: ScriptedLlm, ledger: Ledger, clients: list[McpClients]
) -> None:
    """DAR_MCP_TOOLS: the operator knows this server de-duplicates by the _meta key."""
    overrides = parse_tool_overrides('{"notes__add_note": {"idempotent": true}}')
    runtime.mcp = CrashingClients({"add_note"}, tool_overrides=overrides)
    clients.append(runtime.mcp)
    _register(runtime, stdio_server(ledger))
    run_id = _crash_then_resume(runtime, llm, "add_note", {"text": "pay"})
    assert runtime.store.get_run(run_id).status is RunStatus.SUCCEEDED
    assert [e["key"] for e in ledger.entries("add_note")] == [f"{run_id}/toolu_1"] * 2


def already_written(ctx: Any) -> Any:
    from runtime.tools import Reconciled

    return Reconciled(f"already written under {ctx.idempotency_key}")


def test_a_configured_reconcile_decides_for_a_destructive_tool(
    runtime: Runtime, llm: ScriptedLlm, ledger: Ledger, clients: list[McpClients]
) -> None:
    overrides = parse_tool_overrides(
        '{"notes__add_note": {"reconcile": "tests.integration.test_mcp_faults:already_written"}}'
    )
    runtime.mcp = CrashingClients({"add_note"}, tool_overrides=overrides)
    clients.append(runtime.mcp)
    _register(runtime, stdio_server(ledger))
    run_id = _crash_then_resume(runtime, llm, "add_note", {"text": "pay"})
    assert runtime.store.get_run(run_id).status is RunStatus.SUCCEEDED
    assert ledger.count("add_note") == 1
    assert runtime.store.steps(run_id)[2].response == f"already written under {run_id}/toolu_1"


# -- HTTP ------------------------------------------------------------------------------------


def test_http_server_with_a_token_from_the_environment(
    runtime: Runtime,
    llm: ScriptedLlm,
    ledger: Ledger,
    clients: list[McpClients],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "s3cret-" + uuid.uuid4().hex
    monkeypatch.setenv("NOTES_TOKEN", f"Bearer {secret}")
    runtime.mcp = McpClients()
    clients.append(runtime.mcp)
    with http_server(ledger, "--token", secret) as url:
        _register(
            runtime,
            McpServer.http("notes", url, headers_from_env={"Authorization": "NOTES_TOKEN"}),
        )
        llm.then_tool_use("toolu_1", "notes__add_note", {"text": "over http"}).then_text("ok")
        run, dispatch = submit(runtime.store, agent="mcp-agent")
        drive_to_end(runtime.driver(), dispatch)
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    assert [e["key"] for e in ledger.entries("add_note")] == [f"{run.id}/toolu_1"]
    assert secret not in caplog.text


def test_http_401_names_the_server_and_the_variable(
    ledger: Ledger, clients: list[McpClients], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTES_TOKEN", "Bearer wrong-token")
    c = McpClients(connect_timeout_seconds=10)
    clients.append(c)
    with http_server(ledger, "--token", "right") as url:
        server = McpServer.http("notes", url, headers_from_env={"Authorization": "NOTES_TOKEN"})
        with pytest.raises(McpUnavailable) as caught:
            c.check(server)
    message = str(caught.value)
    assert f"MCP server 'notes' ({url})" in message
    assert "answered HTTP 401 (check the credentials in NOTES_TOKEN)" in message
    assert "wrong-token" not in message


def test_http_500_on_a_call_leaves_a_destructive_call_in_doubt_and_a_read_only_one_an_error(
    runtime: Runtime, llm: ScriptedLlm, ledger: Ledger, clients: list[McpClients]
) -> None:
    runtime.mcp = McpClients()
    clients.append(runtime.mcp)
    with http_server(ledger, "--fail-calls") as url:
        _register(runtime, McpServer.http("notes", url))
        llm.then_tool_use("toolu_1", "notes__count_notes", {})
        llm.then_tool_use("toolu_2", "notes__add_note", {"text": "x"})
        run, dispatch = submit(runtime.store, agent="mcp-agent")
        drive_to_end(runtime.driver(), dispatch)
    steps = runtime.store.steps(run.id)
    assert steps[2].status is StepStatus.ERROR
    assert "answered HTTP 500" in steps[2].response
    after = runtime.store.get_run(run.id)
    assert after.status is RunStatus.NEEDS_ATTENTION
    assert "answered HTTP 500 to the call to 'add_note'" in (after.error or "")


def test_an_http_server_restart_reopens_the_session(
    ledger: Ledger, clients: list[McpClients]
) -> None:
    c = McpClients(connect_timeout_seconds=10)
    clients.append(c)
    port = free_port()
    run_id = uuid.uuid4()
    with http_server(ledger, port=port) as url:
        server = McpServer.http("notes", url)
        first = c.call(server, "count_notes", {}, key="k1", run_id=run_id, timeout_seconds=10)
    with http_server(ledger, port=port):
        second = c.call(server, "count_notes", {}, key="k2", run_id=run_id, timeout_seconds=10)
    assert (first.text, second.text) == ("0 notes", "0 notes")
    assert [e["key"] for e in ledger.entries("count_notes")] == ["k1", "k2"]


def test_an_unreachable_server_at_the_first_model_step_waits_on_a_timer(
    runtime: Runtime, llm: ScriptedLlm, clients: list[McpClients]
) -> None:
    runtime.mcp = McpClients(connect_timeout_seconds=5)
    clients.append(runtime.mcp)
    _register(runtime, McpServer.http("notes", f"http://127.0.0.1:{free_port()}/mcp"))
    run, dispatch = submit(runtime.store, agent="mcp-agent")
    result = runtime.driver().drive(dispatch.run_id, dispatch.token)
    after = runtime.store.get_run(run.id)
    assert after.status is RunStatus.RUNNING
    assert after.wait_reason is not None
    assert "MCP server 'notes'" in after.wait_reason
    assert "connection refused" in after.wait_reason
    assert isinstance(result.dispatch, Dispatch)
    assert llm.requests == []


# -- startup ----------------------------------------------------------------------------------


def _settings_with(agent_servers: list[McpServer], **kw: Any) -> tuple[Settings, AgentRegistry]:
    registry = AgentRegistry()
    registry.register(Agent(name="a", system_prompt="", mcp_servers=tuple(agent_servers)))
    registry.finalize()
    return Settings(**kw), registry


def test_startup_check_names_a_server_whose_command_is_missing() -> None:
    settings, registry = _settings_with([McpServer.stdio("git", ["/no/such/mcp-server-git"])])
    with pytest.raises(ConfigError) as caught:
        check_mcp_servers(settings, registry)
    assert str(caught.value).startswith(
        "MCP server 'git' (stdio: /no/such/mcp-server-git) could not be started: "
        "command not found: '/no/such/mcp-server-git'"
    )


def test_startup_check_names_a_server_that_dies_at_startup(tmp_path: Path) -> None:
    server = McpServer.stdio(
        "notes", [sys.executable, COUNTING, "--ledger", str(tmp_path / "l"), "--crash-at-start"]
    )
    settings, registry = _settings_with([server])
    with pytest.raises(ConfigError) as caught:
        check_mcp_servers(settings, registry)
    message = str(caught.value)
    assert "MCP server 'notes'" in message
    assert "it exited during startup" in message
    assert "cannot open the ledger" in message, "its stderr says why"


def test_startup_check_can_warn_instead(caplog: pytest.LogCaptureFixture) -> None:
    settings, registry = _settings_with(
        [McpServer.stdio("git", ["/no/such/cmd"])], mcp_startup_check="warn"
    )
    check_mcp_servers(settings, registry)
    assert "MCP startup check: MCP server 'git'" in caplog.text


# -- configuration ------------------------------------------------------------------------------


def test_servers_from_configuration_attach_to_agents() -> None:
    (git, crm) = parse_servers(
        '{"git": {"command": ["python", "-m", "mcp_server_git"], "agents": ["a"],'
        ' "tools": {"git_commit": {"idempotent": false}}},'
        ' "crm": {"url": "https://crm.internal/mcp", "headers_from_env": {"Authorization":'
        ' "CRM_TOKEN"}, "timeout_seconds": 5}}'
    )
    registry = AgentRegistry()
    registry.register(Agent(name="a", system_prompt="", mcp_servers=("crm",)))
    registry.register_mcp_server(git.server, git.agents)
    registry.register_mcp_server(crm.server, crm.agents)
    registry.finalize()
    agent = registry.get("a")
    assert isinstance(agent, Agent)
    assert list(agent.servers) == ["crm", "git"]
    assert agent.servers["crm"].timeout_seconds == 5
    assert agent.servers["git"].tools["git_commit"].idempotent is False


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[", "DAR_MCP_SERVERS is not valid JSON"),
        ('{"git": {}}', "needs exactly one of command (stdio) or url (http)"),
        ('{"git": {"command": ["x"], "colour": 1}}', "unknown key 'colour'"),
        ('{"a__b": {"command": ["x"]}}', "MCP server name 'a__b' must be"),
        ('{"crm": {"url": "ftp://x"}}', "an http server needs an http:// or https:// url"),
        (
            '{"git": {"command": ["x"], "tools": {"t": {"reconcile": "nowhere:fn"}}}}',
            "reconcile 'nowhere:fn' does not name a function",
        ),
    ],
)
def test_bad_server_configuration_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(McpConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_servers(text)


def test_an_agent_naming_an_unconfigured_server_fails_at_load() -> None:
    registry = AgentRegistry()
    registry.register(Agent(name="a", system_prompt="", mcp_servers=("git",)))
    with pytest.raises(AgentConfigError, match="uses MCP server 'git', which is not configured"):
        registry.finalize()


def test_tool_overrides_need_namespaced_names() -> None:
    with pytest.raises(McpConfigError, match="must name a tool as <server>__<tool>"):
        parse_tool_overrides('{"add_note": {"idempotent": true}}')
