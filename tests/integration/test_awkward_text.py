"""NUL and lone surrogates in what a run records (issue 23 defect 5): PostgreSQL ``jsonb``
refuses ``\\u0000`` and a lone surrogate is not UTF-8. A model answer or a tool output holding
them is recorded, billed and read back unchanged (``db/jsontext.py``); a value the database
refuses all the same (a ``NaN``) never leaves the run RUNNING nor a pooled connection in
autocommit. Real PostgreSQL."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DataError

from db.engine import make_engine
from db.fastpath import FastStatements
from db.records import RunStatus, StepKind
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.testing.testkit import DurableTester
from runtime.tools import ToolContext, tool
from tests.support import drive_to_end, register_agent, submit

AWKWARD = "nul:\x00 lone:\ud800 low:\udfff escape:\ue000 both:\ue000e \\u0000 end"


def test_a_model_answer_and_a_tool_output_with_nul_and_surrogates_round_trip(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    outputs: list[str] = []

    @tool(idempotent=False)
    def echo(note: str, ctx: ToolContext) -> str:
        """Echo."""
        assert note == AWKWARD
        outputs.append(AWKWARD)
        return "tool said " + AWKWARD

    register_agent(runtime.agents, echo)
    llm.then_tool_use("toolu_1", "echo", {"note": AWKWARD}, 100, 10).then_text(AWKWARD, 200, 20)
    run, dispatch = submit(runtime.store)
    drive_to_end(runtime.driver(), dispatch)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == AWKWARD
    assert done.tokens_used == 330, "both answers recorded and billed"
    assert outputs == [AWKWARD], "the tool ran once"
    steps = runtime.store.steps(run.id)
    assert steps[0].response[0]["input"] == {"note": AWKWARD}
    assert steps[2].response == [{"type": "text", "text": AWKWARD}]
    (tool_row,) = [s for s in steps if s.kind is StepKind.TOOL]
    assert "tool said " + AWKWARD in str(tool_row.response)
    seen = llm.requests[1].messages[-1]["content"][0]["content"]
    assert seen == "tool said " + AWKWARD, "the model read the output unchanged"


def test_a_durable_steps_value_round_trips_and_replays(runtime: Runtime) -> None:
    calls: list[int] = []
    value: dict[str, Any] = {
        "k\x00": ["v\ud83d", AWKWARD, 1, 2.5, None, True],
        "$dar.jsontext": {"\ue000": "\ue000s0041"},
    }

    def make() -> dict[str, Any]:
        calls.append(1)
        return value

    @durable_agent("awkward")
    def fn(_: object, steps: Steps) -> list[Any]:
        got = steps.run("make", make, type=dict)
        again = steps.run("after", lambda: "x", type=str)
        return [got, again]

    done = DurableTester(runtime).run(fn, {})
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == [value, "x"]
    assert calls == [1], "replayed from the log, not run again"
    assert runtime.store.steps(done.run_id)[0].response == value


@pytest.mark.parametrize("value", ["nul alone:\x00", "nul beside non-ASCII: é\x00"])
def test_nul_without_a_surrogate_is_recorded(runtime: Runtime, value: str) -> None:
    """No surrogate to make the value stand out: the NUL alone must still be escaped."""

    @durable_agent("nul-alone")
    def fn(_: object, steps: Steps) -> str:
        return steps.run("say", lambda: value, type=str)

    done = DurableTester(runtime).run(fn, {})
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == value
    assert runtime.store.steps(done.run_id)[0].response == value


def test_a_value_the_database_refuses_ends_the_run_instead_of_leaving_it_running(
    runtime: Runtime,
) -> None:
    @durable_agent("nan")
    def fn(_: object, steps: Steps) -> float:
        return steps.run("ratio", lambda: float("nan"), type=float)

    done = DurableTester(runtime).run(fn, {})
    run = runtime.store.get_run(done.run_id)
    assert run.status is not RunStatus.RUNNING
    assert run.locked_by is None
    assert run.finished_at is not None
    assert "NaN" in (run.error or "") or "json" in (run.error or "").lower(), run.error


def test_a_statement_error_returns_its_connection_to_the_pool_out_of_autocommit(
    database_url: str,
) -> None:
    """A statement error that is not a disconnect (a DataError) leaves the fast path's
    connection pooled; it must go back out of autocommit, or every transaction that later
    checks it out commits statement by statement and never rolls back."""
    engine = make_engine(database_url, pool_size=1, max_overflow=0)
    try:
        fast = FastStatements(engine, {"bad": text("SELECT CAST(:x AS integer)")})
        with pytest.raises(DataError):
            fast.one("bad", {"x": "not a number"})
        raw = engine.raw_connection()
        try:
            assert raw.driver_connection.autocommit is False  # type: ignore[union-attr]
        finally:
            raw.close()
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS autocommit_probe (n int)"))
        with contextlib.suppress(RuntimeError), engine.begin() as conn:
            conn.execute(text("INSERT INTO autocommit_probe VALUES (1)"))
            raise RuntimeError("the transaction fails")
        with engine.connect() as conn:
            left = conn.execute(text("SELECT count(*) FROM autocommit_probe")).scalar_one()
            conn.execute(text("DROP TABLE autocommit_probe"))
            conn.commit()
        assert left == 0, "the failed transaction was committed: autocommit leaked"
    finally:
        engine.dispose()
