"""The deployment version: the same code gives the same version in every process; a change
to what decides how a run replays gives another; DAR_DEPLOYMENT names it instead."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.agents import Agent, AgentRegistry
from runtime.config import ConfigError, Settings
from runtime.durable.api import durable_agent
from runtime.engine.deployment import agent_definition, deployment_version, queue_name
from runtime.tools import tool


@tool
def lookup(order_id: str) -> str:
    """Look an order up."""
    return order_id


@tool(name="find_order")
def renamed(order_id: str) -> str:
    """Look an order up."""
    return order_id


def _registry(*agents: Any) -> AgentRegistry:
    registry = AgentRegistry(agents)
    registry.finalize()
    return registry


def _agent(**changes: Any) -> Agent:
    fields: dict[str, Any] = {"name": "support", "system_prompt": "Be brief.", "tools": (lookup,)}
    return Agent(**{**fields, **changes})


def test_the_same_definitions_give_the_same_version() -> None:
    settings = Settings()
    first = deployment_version(_registry(_agent()), settings)
    assert first == deployment_version(_registry(_agent()), settings)
    assert len(first) == 12
    assert int(first, 16) >= 0


@pytest.mark.parametrize(
    "change",
    [
        {"system_prompt": "Be thorough."},
        {"model": "claude-haiku-4-5"},
        {"tools": (renamed,)},
        {"max_steps": 3},
        {"max_tokens": 100},
    ],
)
def test_a_changed_agent_definition_is_another_version(change: dict[str, Any]) -> None:
    settings = Settings()
    assert deployment_version(_registry(_agent(**change)), settings) != deployment_version(
        _registry(_agent()), settings
    )


def test_a_durable_function_s_code_is_part_of_its_version() -> None:
    @durable_agent("flow")
    def one(value: Any, steps: Any) -> Any:
        return steps.run("a", lambda: value)

    @durable_agent("flow")
    def two(value: Any, steps: Any) -> Any:
        return steps.run("b", lambda: value)

    assert agent_definition(one)["code_sha256"] != agent_definition(two)["code_sha256"]
    settings = Settings()
    assert deployment_version(_registry(one), settings) != deployment_version(
        _registry(two), settings
    )


def test_dar_deployment_names_the_version() -> None:
    settings = Settings.from_env({"DAR_DEPLOYMENT": "v2.1-rc_3"})
    assert deployment_version(_registry(_agent()), settings) == "v2.1-rc_3"
    assert queue_name("dar", "v2.1-rc_3") == "dar.v2.1-rc_3"
    assert queue_name("dar", None) == "dar", "a run with no version: the queue every worker reads"


@pytest.mark.parametrize("bad", ["v 2", "-v2", "v2/x", "x" * 65, "v2:1"])
def test_a_dar_deployment_that_cannot_name_a_queue_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="DAR_DEPLOYMENT"):
        Settings.from_env({"DAR_DEPLOYMENT": bad})


def test_one_name_for_two_codes_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    from tasks.drive import warn_if_renamed

    ours = {"support": agent_definition(_agent())}
    assert warn_if_renamed("v1", ours, ours) == []
    theirs = {"support": agent_definition(_agent(system_prompt="Be thorough."))}
    assert warn_if_renamed("v1", theirs, ours) == ["support"]
    assert "give each code its own DAR_DEPLOYMENT" in caplog.text


def test_a_framework_agent_s_shape_is_part_of_its_version() -> None:
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.test import TestModel

    def lookup(order_id: str) -> str:
        """Look an order up."""
        return order_id

    def find(order_id: str) -> str:
        """Look an order up."""
        return order_id

    def registry(tool: Any) -> AgentRegistry:
        agent = pydantic_ai.Agent(TestModel(), name="support", tools=[tool])
        r = AgentRegistry()
        r.register(agent)
        return r

    settings = Settings()
    first = deployment_version(registry(lookup), settings)
    assert first == deployment_version(registry(lookup), settings), "the same in every process"
    assert first != deployment_version(registry(find), settings), "a renamed tool"
