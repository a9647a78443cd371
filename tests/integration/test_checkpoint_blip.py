"""Every checkpoint survives a PostgreSQL blip within the lease (``Task.durably``), and only a
blip: a step that ran is not run again, or left in doubt, because the database dropped its
connections while the step was being recorded; any other error is raised at once."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DataError

from db.engine import make_engine
from db.errors import ValueRefused
from db.records import Dispatch, RunStatus, StepStatus
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import ToolContext, tool
from tests.support import register_agent

CALLS: list[str] = []


@pytest.fixture
def admin(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url, pool_size=1, application_name="blip-admin")
    try:
        yield engine
    finally:
        engine.dispose()


def cut_connections(admin: Engine) -> int:
    """What a PostgreSQL restart or a dropped network does to the worker: every connection
    of the engine (``dar``, ``dar-heartbeat``) is terminated by the server."""
    with admin.connect() as conn:
        killed = conn.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name LIKE 'dar%'"
            )
        ).scalar_one()
        conn.commit()
    return int(killed)


def _drive(runtime: Runtime, dispatch: Dispatch) -> RunStatus:
    driver = runtime.driver(worker="worker-A")
    current: Dispatch | None = dispatch
    for _ in range(20):
        if current is None:
            break
        runtime.store.make_due_now(current.run_id)
        current = driver.drive(current.run_id, current.token).dispatch
    return runtime.store.get_run(dispatch.run_id).status


def test_a_durable_step_is_recorded_across_a_blip_and_not_run_again(
    runtime: Runtime, admin: Engine
) -> None:
    CALLS.clear()

    def pay() -> str:
        CALLS.append("pay")
        assert cut_connections(admin) > 0  # the record of this step meets dead connections
        return "paid"

    @durable_agent("blip-payer")
    def payer(_: object, steps: Steps) -> str:
        paid = steps.run("pay", pay, type=str)  # not idempotent: in doubt if not recorded
        return steps.run("receipt", lambda: f"receipt for {paid}", type=str)

    runtime.agents.register(payer)
    run, dispatch = runtime.submit("blip-payer", {})
    assert _drive(runtime, dispatch) is RunStatus.SUCCEEDED
    assert CALLS == ["pay"], "ran once: recorded after the blip, not left in doubt"
    steps = {s.step_key: s.status for s in runtime.store.steps(run.id)}
    assert steps == {"pay:0": StepStatus.DONE, "receipt:0": StepStatus.DONE}
    assert runtime.store.get_run(run.id).result == "receipt for paid"


def test_a_tool_step_is_recorded_across_a_blip_and_not_run_again(
    runtime: Runtime, admin: Engine
) -> None:
    CALLS.clear()

    @tool
    def refund(order_id: int, ctx: ToolContext) -> str:
        """Refund an order."""
        CALLS.append(ctx.idempotency_key)
        assert cut_connections(admin) > 0
        return f"refunded {order_id}"

    register_agent(runtime.agents, refund, name="blip-agent")
    llm = runtime.llm
    assert isinstance(llm, ScriptedLlm)
    llm.then_tool_use("toolu_1", "refund", {"order_id": 7}).then_text("done")
    run, dispatch = runtime.submit("blip-agent", "refund order 7")
    assert _drive(runtime, dispatch) is RunStatus.SUCCEEDED
    assert len(CALLS) == 1, "the refund ran once"
    (tool_row,) = [s for s in runtime.store.steps(run.id) if s.step_key == "tool:toolu_1"]
    assert tool_row.status is StepStatus.DONE
    assert tool_row.response == "refunded 7"


def test_the_end_of_a_run_is_recorded_across_a_blip(runtime: Runtime, admin: Engine) -> None:
    @durable_agent("blip-ender")
    def ender(_: object, steps: Steps) -> str:
        if steps.run("first", lambda: "ok", type=str) == "ok":
            cut_connections(admin)  # the code between steps: then the run's end is recorded
        return "finished"

    runtime.agents.register(ender)
    run, dispatch = runtime.submit("blip-ender", {})
    assert _drive(runtime, dispatch) is RunStatus.SUCCEEDED
    assert runtime.store.get_run(run.id).result == "finished"


@pytest.mark.parametrize(
    "error",
    [
        ValueError("a bug in the write"),
        # what the store raises for the driver's DataError
        ValueRefused.from_error(DataError("INSERT", {}, Exception("bad data"))),
    ],
    ids=["bug", "data-error"],
)
def test_an_error_that_is_not_a_blip_is_not_retried(runtime: Runtime, error: Exception) -> None:
    """Only a database that went away is worth waiting for: a write that fails for another
    reason fails at once, however long the lease (the model checkpoint included)."""
    llm = runtime.llm
    assert isinstance(llm, ScriptedLlm)
    llm.then_text("the answer")
    register_agent(runtime.agents, name="no-retry-agent")
    run, dispatch = runtime.submit("no-retry-agent", "hi")
    real = runtime.store.checkpoint_model
    calls: list[float] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)

    runtime.store.checkpoint_model = failing  # type: ignore[method-assign]
    started = time.monotonic()
    if isinstance(error, ValueRefused):
        # The database refused a value: refused again on every claim, so the run ends,
        # saying why, instead of staying RUNNING (issue 23 defect 5).
        runtime.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
        ended = runtime.store.get_run(run.id)
        assert ended.status is RunStatus.FAILED
        assert "the database refused to store a value" in (ended.error or "")
    else:
        with pytest.raises(type(error)):
            runtime.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
        assert runtime.store.get_run(run.id).status is RunStatus.RUNNING
    assert len(calls) == 1, "not tried again"
    assert time.monotonic() - started < runtime.settings.lease_seconds
    assert isinstance(run.id, uuid.UUID)
