"""The framework installs this runtime supports: a range of versions per framework (refused in
one line outside it), and Pydantic AI without its optional extras.

CI runs tests/frameworks twice: in its main venv (the newest releases, every extra) and in a
venv of the oldest supported releases with ``pydantic-ai-slim[anthropic]`` alone (no ``mcp``
extra), where ``DAR_FRAMEWORKS_AT=oldest`` makes the last test check that it is so."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.function import AgentInfo, FunctionModel

from db.errors import DarError
from db.records import RunStatus
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime, load_agents
from runtime.frameworks import FrameworkVersionError, adapt
from runtime.frameworks.versions import OPENAI_AGENTS, PYDANTIC_AI, SUPPORTED, release
from tests.fakes.messages_api import FakeMessagesApi

ROOT = Path(__file__).parents[2]
PROBE = Path(__file__).with_name("no_mcp_probe.py")


@pytest.fixture
def fake() -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi(api_key="test") as server:
        yield server


def test_a_plain_agent_runs_end_to_end_without_pydantic_ais_mcp_extra(
    settings: Settings, fake: FakeMessagesApi
) -> None:
    # A process with fastmcp absent (pydantic-ai-slim[anthropic] alone) loads a module that
    # registers a plain agent with registry.register(agent), then runs it to the end.
    fake.then_tool_use("toolu_1", "lookup", {"order": "A-7"}).then_text("A-7 has shipped.")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DAR_TEST_ANTHROPIC_URL": fake.url}
    done = subprocess.run(
        [sys.executable, str(PROBE), settings.require_database_url(), settings.redis_url or ""],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["status"] == RunStatus.SUCCEEDED.value, seen["error"]
    assert seen["result"] == "A-7 has shipped."
    assert seen["steps"] == ["agent:0", "model.request:0", "tool.lookup:0", "model.request:1"]
    assert fake.calls == 2
    assert not seen["fastmcp"], "fastmcp was blocked in the probe"
    assert not seen["pydantic_ai.mcp"], "the adapter did not load Pydantic AI's MCP support"


def frameworks_extra() -> dict[str, str]:
    """pyproject's ``frameworks`` extra: distribution -> its version specifier."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found: dict[str, str] = {}
    for requirement in project["optional-dependencies"]["frameworks"]:
        name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?(.*)", requirement).groups()  # type: ignore[union-attr]
        found[name] = spec.replace(" ", "")
    return found


def test_the_extra_declares_the_ranges_the_adapters_check() -> None:
    assert frameworks_extra() == {
        PYDANTIC_AI.distribution: f">={PYDANTIC_AI.oldest},<{PYDANTIC_AI.below}",
        OPENAI_AGENTS.distribution: f">={OPENAI_AGENTS.oldest},<{OPENAI_AGENTS.below}",
    }, "pyproject.toml and runtime/frameworks/versions.py name the same ranges"


def test_the_installed_frameworks_are_in_their_ranges() -> None:
    for supported in SUPPORTED.values():
        if supported.installed() is not None:
            assert supported.problem() is None


def test_release_numbers_compare_as_versions() -> None:
    assert release("2.62.0") == (2, 62, 0)
    assert release("2.62") < release("2.62.1") < release("2.100.0") < release("3")
    assert release("0.24.0rc1") == (0, 24, 0)
    assert release("garbage") == ()


@pytest.mark.parametrize(
    ("installed", "supported"),
    [("2.61.0", False), ("2.62.0", True), ("2.78.0", True), ("2.99.9", True), ("3.0.0", False)],
)
def test_a_version_outside_the_range_is_named_with_the_range_in_one_line(
    monkeypatch: pytest.MonkeyPatch, installed: str, supported: bool
) -> None:
    monkeypatch.setattr(type(PYDANTIC_AI), "installed", lambda self: installed)
    problem = PYDANTIC_AI.problem()
    if supported:
        assert problem is None
        return
    assert problem == (
        f"pydantic-ai-slim {installed} is installed; this runtime supports "
        "pydantic-ai-slim>=2.62,<3 for Pydantic AI agents (pip install 'pydantic-ai-slim>=2.62,<3')"
    )


def test_a_framework_that_is_not_installed_is_named_with_the_range() -> None:
    missing = replace(OPENAI_AGENTS, distribution="no-such-dist-dar", module="no_such_module_dar")
    assert missing.installed() is None
    with pytest.raises(FrameworkVersionError, match=r"is not installed; this runtime supports"):
        missing.require()


def answer(messages: list[Any], info: AgentInfo) -> Any:
    raise AssertionError("not run")


def test_registering_an_agent_of_an_unsupported_version_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, runtime: Runtime
) -> None:
    monkeypatch.setattr(type(PYDANTIC_AI), "installed", lambda self: "2.50.0")
    agent = PydanticAgent(FunctionModel(answer), name="old")
    with pytest.raises(FrameworkVersionError) as refused:
        adapt(agent)
    assert "\n" not in str(refused.value)
    assert "pydantic-ai-slim 2.50.0 is installed" in str(refused.value)
    assert "pydantic-ai-slim>=2.62,<3" in str(refused.value)
    # At start: what the web and worker processes print as their one "cannot start" line.
    monkeypatch.setenv("DAR_TEST_ANTHROPIC_URL", "http://127.0.0.1:9")
    configured = replace(runtime.settings, agent_modules=("tests.frameworks.plain_agent",))
    with pytest.raises(DarError, match=r"supports pydantic-ai-slim>=2\.62,<3") as at_start:
        load_agents(configured, runtime.tickets, runtime.engine)
    assert "\n" not in str(at_start.value)


def test_ci_runs_the_oldest_supported_versions_without_the_mcp_extra() -> None:
    if os.environ.get("DAR_FRAMEWORKS_AT") != "oldest":
        pytest.skip("CI's oldest-version venv sets DAR_FRAMEWORKS_AT=oldest")
    for supported in SUPPORTED.values():
        installed = supported.installed()
        assert installed is not None
        assert release(installed) == release(supported.oldest) + (0,) * (
            len(release(installed)) - len(release(supported.oldest))
        ), f"{supported.distribution} {installed} is not the range's oldest"
    assert importlib.util.find_spec("fastmcp") is None, "the mcp extra is not installed"


@dataclass(frozen=True)
class ModelFrobnicateId:
    """An operation of a Pydantic AI release newer than this adapter."""

    model_id: str | None = None


def test_an_operation_of_a_newer_release_gets_a_step_name_instead_of_failing() -> None:
    from pydantic_ai import durable_exec

    from runtime.frameworks.pydantic_ai import StepNamer

    namer = StepNamer()
    assert namer.operation_name(ModelFrobnicateId()) == "model.frobnicate"  # type: ignore[arg-type]
    assert namer.operation_name(ModelFrobnicateId("m")) == "model.frobnicate.m"  # type: ignore[arg-type]
    counts = getattr(durable_exec, "ModelCountTokensId", None)  # 2.7x: count before a request
    if counts is not None:
        assert namer.operation_name(counts(model_name="x")) == "model.count_tokens"
        assert namer.operation_name(counts("other", model_name="x")) == "model.count_tokens.other"
