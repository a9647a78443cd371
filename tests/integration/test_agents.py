"""Agents registered from users' modules named by configuration, and the startup errors
that catch misconfiguration early."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from db.records import RunStatus
from runtime.agents import AgentConfigError
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from tests.support import drive_to_end, submit


def test_user_agent_module_is_loaded_from_configuration(settings: Settings) -> None:
    llm = ScriptedLlm()
    llm.then_tool_use("toolu_1", "get_order", {"order_id": 1042}).then_text("It shipped.")
    rt = Runtime.build(replace(settings, agent_modules=("examples.orders_agent",)), llm=llm)
    try:
        agent = rt.agents.get("orders")
        assert [t.name for t in agent.tools_by_name.values()] == [
            "get_order",
            "send_status_email",
        ]
        assert agent.tool_definitions()[0]["input_schema"] == {
            "type": "object",
            "properties": {"order_id": {"type": "integer"}},
            "required": ["order_id"],
        }
        run, dispatch = submit(rt.store, "Where is order 1042?", agent="orders")
        drive_to_end(rt.driver(), dispatch)
        done = rt.store.get_run(run.id)
        assert done.status is RunStatus.SUCCEEDED
        assert '"status": "shipped"' in llm.requests[1].messages[2]["content"][0]["content"]
        assert [t["name"] for t in llm.requests[0].tools] == ["get_order", "send_status_email"]
    finally:
        rt.close()


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_duplicate_agent_names_fail_at_startup(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _module(
        tmp_path,
        monkeypatch,
        "dup_agents",
        """
        from runtime import Agent

        def register(registry):
            registry.register(Agent(name="acme-tickets", system_prompt="again"))
        """,
    )
    with pytest.raises(AgentConfigError, match="two agents are registered under the name"):
        Runtime.build(replace(settings, agent_modules=(name,)), llm=ScriptedLlm())


def test_a_tool_reference_to_nothing_fails_at_startup(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _module(
        tmp_path,
        monkeypatch,
        "ref_agents",
        """
        from runtime import Agent, tool

        @tool
        def known() -> str:
            "Known."
            return "k"

        def register(registry):
            registry.register_tool(known)
            registry.register(Agent(name="r", system_prompt="p", tools=("known", "missing")))
        """,
    )
    with pytest.raises(
        AgentConfigError,
        match=r"agent 'r' uses tool 'missing', which is not registered \(registered tools: known\)",
    ):
        Runtime.build(replace(settings, agent_modules=(name,)), llm=ScriptedLlm())


def test_tools_named_by_reference_resolve(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _module(
        tmp_path,
        monkeypatch,
        "ok_agents",
        """
        from runtime import Agent, tool

        @tool
        def known() -> str:
            "Known."
            return "k"

        def register(registry):
            registry.register(Agent(name="r", system_prompt="p", tools=("known",)))
            registry.register_tool(known)
        """,
    )
    rt = Runtime.build(replace(settings, agent_modules=(name,)), llm=ScriptedLlm())
    try:
        assert list(rt.agents.get("r").tools_by_name) == ["known"]
    finally:
        rt.close()


@pytest.mark.parametrize(
    ("modules", "message"),
    [
        (("no_such_module_xyz",), "DAR_AGENT_MODULES names 'no_such_module_xyz'"),
        (("json",), "has no register\\(registry\\) function"),
    ],
)
def test_bad_agent_modules_fail_at_startup(
    settings: Settings, modules: tuple[str, ...], message: str
) -> None:
    with pytest.raises(AgentConfigError, match=message):
        Runtime.build(replace(settings, agent_modules=modules), llm=ScriptedLlm())


def test_unknown_default_agent_fails_at_startup(settings: Settings) -> None:
    with pytest.raises(AgentConfigError, match="DAR_DEFAULT_AGENT is 'nobody'"):
        Runtime.build(replace(settings, default_agent="nobody"), llm=ScriptedLlm())


def test_llm_factory_names_the_model_client(settings: Settings) -> None:
    rt = Runtime.build(replace(settings, llm_factory="runtime.llm.scripted:ScriptedLlm"))
    try:
        assert isinstance(rt.llm, ScriptedLlm)
    finally:
        rt.close()
    with pytest.raises(AgentConfigError, match="DAR_LLM_FACTORY='nope:x' does not name"):
        Runtime.build(replace(settings, llm_factory="nope:x"))
