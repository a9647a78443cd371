"""Log lines carry run_id, step_seq and the worker; prompts, tool inputs and secrets never
appear in them at the default level."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from dataclasses import replace

import pytest

from api import create_app
from runtime.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.logctx import configure_logging
from runtime.tools import tool
from tasks.celery_app import make_celery
from tests.support import drive_to_end, register_agent, submit

PROMPT = "SECRET-PROMPT-9f3a which cards are due"
TOOL_INPUT = "SECRET-INPUT-4111111111111111"
API_KEY = "sk-ant-SECRET-KEY-abc"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buffer = io.StringIO()
    yield buffer
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def _run(runtime: Runtime, llm: ScriptedLlm) -> None:
    @tool(idempotent=True)
    def charge(card: str) -> str:
        """Charge."""
        return "ok"

    llm.then_tool_use("toolu_1", "charge", {"card": TOOL_INPUT}, 10, 2).then_text("done", 12, 3)
    register_agent(runtime.agents, charge)
    runtime.settings = replace(runtime.settings, anthropic_api_key=API_KEY)
    _, dispatch = submit(runtime.store, PROMPT)
    drive_to_end(runtime.driver(worker="worker-A"), dispatch)


def test_json_lines_carry_the_run_context_and_no_secrets(
    runtime: Runtime, llm: ScriptedLlm, captured: io.StringIO
) -> None:
    configure_logging("json", "DEBUG", stream=captured)
    _run(runtime, llm)
    text = captured.getvalue()
    for secret in (PROMPT, "SECRET-PROMPT", TOOL_INPUT, API_KEY):
        assert secret not in text
    lines = [json.loads(line) for line in text.splitlines()]
    step_lines = [ln for ln in lines if " MODEL " in ln["message"] or " TOOL " in ln["message"]]
    assert len(step_lines) >= 4
    for line in step_lines:
        assert line["worker"] == "worker-A"
        assert line["run_id"]
        assert line["step_seq"] in {"1", "2", "3"}
    assert {ln["step_seq"] for ln in step_lines} == {"1", "2", "3"}
    assert any(ln["message"].endswith("SUCCEEDED tokens=27") for ln in lines)


def test_console_lines_read_like_the_seed(
    runtime: Runtime, llm: ScriptedLlm, captured: io.StringIO
) -> None:
    configure_logging("console", "INFO", stream=captured)
    _run(runtime, llm)
    text = captured.getvalue()
    assert "worker-A run=" in text
    assert " seq=1 MODEL stop=tool_use in=10 out=2 latency=" in text
    assert " seq=2 TOOL charge id=toolu_1 started" in text
    assert " seq=3 MODEL stop=end_turn in=12 out=3 latency=" in text
    assert TOOL_INPUT not in text


def test_api_request_lines_carry_the_run_id(runtime: Runtime, captured: io.StringIO) -> None:
    configure_logging("json", "INFO", stream=captured)
    app = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))

    @app.get("/api/runs/<run_id>/probe")
    def probe(run_id: str) -> str:
        logging.getLogger("probe").info("probing")
        return "ok"

    run, _ = submit(runtime.store)
    app.test_client().get(f"/api/runs/{run.id}/probe")
    (line,) = [json.loads(ln) for ln in captured.getvalue().splitlines() if "probing" in ln]
    assert line["run_id"] == str(run.id)


def test_unknown_log_format_is_refused() -> None:
    with pytest.raises(ValueError, match="DAR_LOG_FORMAT must be console or json"):
        configure_logging("xml")
