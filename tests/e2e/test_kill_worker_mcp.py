"""End to end, real processes: a worker is SIGKILLed in the middle of an MCP call (the
server has made its effect and not yet answered). The destructive call is not made again: the
run stops NEEDS_ATTENTION; the operator supplies its result. The read-only call killed
mid-flight is simply made again, with the same idempotency key, by the other worker."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.devstack import DevStack
from db.engine import make_engine
from db.records import RunStatus, StepStatus
from db.store import RunStore
from runtime.config import Settings
from tests.e2e.stack import running_stack
from tests.mcp.support import Ledger

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path / "ledger.jsonl")


@pytest.fixture
def stack(
    database_url: str,
    redis_url: str,
    settings: Settings,
    tmp_path: Path,
    ledger: Ledger,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[DevStack]:
    monkeypatch.setenv("DAR_TEST_MCP_LEDGER", str(ledger.path))  # the stack's own preflight
    with running_stack(
        tmp_path,
        database_url,
        redis_url,
        settings,
        concurrency=2,
        DAR_AGENT_MODULES="tests.e2e.mcp_agent",
        DAR_LLM_FACTORY="tests.e2e.mcp_agent:build",
        DAR_TEST_MCP_LEDGER=str(ledger.path),
    ) as s:
        yield s


def _kill_holder_mid_call(
    stack: DevStack, store: RunStore, run_id: uuid.UUID, ledger: Ledger, tool: str
) -> str:
    """Wait until ``tool`` is running on the server (its marker file), kill the worker
    holding the run; return its name."""
    marker = ledger.path.with_suffix(".calling")
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"{tool} was never called"
        if marker.exists() and json.loads(marker.read_text())["tool"] == tool:
            break
        time.sleep(0.05)
    run = store.get_run(run_id)
    assert run.locked_by is not None
    stack.kill(run.locked_by)
    marker.unlink()
    return run.locked_by


def _wait(stack: DevStack, store: RunStore, run_id: uuid.UUID, *statuses: RunStatus) -> RunStatus:
    deadline = time.monotonic() + 90
    while True:
        stack.poll()  # restarts a killed worker, as `dar dev` does
        status = store.get_run(run_id).status
        if status in statuses:
            return status
        assert time.monotonic() < deadline, f"run is {status}, waited for {statuses}"
        time.sleep(0.1)


def test_sigkill_mid_mcp_call(stack: DevStack, ledger: Ledger) -> None:
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    try:
        status, accepted = stack.request(
            "POST", "/api/runs", {"input": "note it", "agent": "mcp-e2e", "tokenBudget": 5000}
        )
        assert status == 201, accepted
        run_id = uuid.UUID(accepted["id"])

        victim = _kill_holder_mid_call(stack, store, run_id, ledger, "add_note")
        assert _wait(stack, store, run_id, RunStatus.NEEDS_ATTENTION) is RunStatus.NEEDS_ATTENTION
        run = store.get_run(run_id)
        assert "MCP tool 'notes__add_note' (not re-run after a crash)" in (run.error or "")
        # (the last check, long after this one, proves no second call came later)
        assert [e["key"] for e in ledger.entries("add_note")] == [f"{run_id}/toolu_add"], "once"
        tool_row = next(s for s in store.steps(run_id) if s.tool_use_id == "toolu_add")
        assert tool_row.status is StepStatus.STARTED

        status, _ = stack.request(
            "POST",
            f"/api/runs/{run_id}/resolve",
            {"action": "supply_result", "output": "note 1 added: pay invoice 7"},
        )
        assert status == 200
        second = _kill_holder_mid_call(stack, store, run_id, ledger, "count_notes")
        assert (
            _wait(
                stack,
                store,
                run_id,
                RunStatus.SUCCEEDED,
                RunStatus.FAILED,
                RunStatus.NEEDS_ATTENTION,
            )
            is RunStatus.SUCCEEDED
        ), store.get_run(run_id).error
        counts = ledger.entries("count_notes")
        assert [e["key"] for e in counts] == [f"{run_id}/toolu_count"] * 2, "re-run, same key"
        assert len({e["pid"] for e in counts}) == 2, "by a server of another worker process"
        print(f"killed {victim}, then {second}; run {run_id} SUCCEEDED")
        steps = store.steps(run_id)
        assert [s.kind.value for s in steps] == [
            "TOOLSET",
            "MODEL",
            "TOOL",
            "MODEL",
            "TOOL",
            "MODEL",
        ]
        assert ledger.count("add_note") == 1, "never made again, through the second kill too"
    finally:
        engine.dispose()
