"""Log lines carry run_id, step_seq and the worker; prompts, tool inputs and secrets never
appear in them at the default level."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest

from api import create_app
from db.records import ApprovalStatus, Dispatch, NewRun, RunStatus
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.observe.logctx import configure_logging, set_log_data
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


# -- data in the worker log (issue 28.6) -------------------------------------------------------

DATA = "SECRET-DATA-77c1"


def _durable_runs_that_fail_with_data(runtime: Runtime) -> None:
    """A durable input that cannot be decoded, a step whose exception quotes data, and an
    approval rejected with a comment: each ends its run FAILED with the data in the error."""

    @durable_agent("log-probe", approval_roles=["lead"])
    def probe(order: Order, steps: Steps) -> str:
        if order.kind == "raise":
            steps.run("charge", lambda: _raise(f"card {DATA} declined"))
        return str(steps.approval("lead", 3600).run("pay", lambda: "paid"))

    runtime.agents.register(probe)
    driver = runtime.driver(worker="worker-A")
    _, d1 = submit(runtime.store, "x", agent="log-probe")  # not even an object
    for run_input in (
        {"kind": "x", "amount": [DATA] * 500},
        {"kind": "raise", "amount": 1},
        {"kind": "ask", "amount": 1},
    ):
        run, _ = runtime.store.create_run(
            NewRun(
                agent="log-probe",
                input=run_input,
                model="m",
                max_steps=50,
                token_budget=1000,
                timeout_seconds=600,
            )
        )
        drive_to_end(driver, Dispatch(run.id, run.dispatch_token))
    (pending,) = runtime.store.list_approvals(status="PENDING")
    dispatch = runtime.store.decide_approval(
        pending.id,
        ApprovalStatus.REJECTED,
        decided_by="lead",
        comment=f"no: {DATA}",
        payload_hash=pending.payload_hash,
    )
    assert dispatch is not None
    drive_to_end(driver, dispatch)
    drive_to_end(driver, d1)
    assert {r.status for r in runtime.store.list_runs()} == {RunStatus.FAILED}
    try:
        raise ValueError(f"model said {DATA}")
    except ValueError:
        logging.getLogger("celery.app.trace").error(
            "Task %(name)s[%(id)s] raised unexpected: %(exc)s",
            {"name": "drive_run", "id": "1", "exc": f"ValueError('model said {DATA}')"},
            exc_info=True,
        )


def _raise(message: str) -> None:
    raise RuntimeError(message)


@dataclass
class Order:
    kind: str
    amount: int


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_the_worker_log_holds_kinds_lengths_and_hashes_never_data(
    runtime: Runtime, captured: io.StringIO, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DAR_LOG_DATA", raising=False)
    configure_logging(fmt, "INFO", stream=captured)
    _durable_runs_that_fail_with_data(runtime)
    out = captured.getvalue()
    assert "FAILED" in out
    assert DATA not in out, [line for line in out.splitlines() if DATA in line][:3]
    assert "sha256:" in out, "what was left out is still identifiable"
    assert "RuntimeError" in out
    assert max(len(line) for line in out.splitlines()) < 2000


def test_dar_log_data_opts_in_loudly(
    runtime: Runtime, captured: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAR_LOG_DATA", "1")
    try:
        configure_logging("console", "INFO", stream=captured)
        _durable_runs_that_fail_with_data(runtime)
    finally:
        set_log_data(False)
    out = captured.getvalue()
    assert "DAR_LOG_DATA IS ON" in out
    assert DATA in out
