"""``runtime.record_usage``: a model call a step's code makes itself (a tool running another
agent, a durable step calling a model through its own client) is counted with that step,
once, against the run: tokens, cost, budgets; after a replay, a retry and a crash."""

from __future__ import annotations

from decimal import Decimal

import pytest
from sqlalchemy import text

from db.errors import LeaseLost
from db.records import RunStatus, StepKind, StepStatus, Usage
from runtime import record_usage
from runtime.agents import Agent
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.pipeline.usage import NotInStep
from runtime.testing.testkit import SimulatedCrash
from runtime.tools import ToolContext, tool
from tests.support import drive_to_end, expire_lease

INNER = "claude-haiku-4-5"
INNER_USAGE = Usage(input_tokens=300, output_tokens=40)


def _inner_call() -> str:
    """What a nested agent or a model client of the step's own does: a call the engine does
    not make, reported by the code that makes it."""
    record_usage(INNER, input_tokens=300, output_tokens=40, request_id="req_inner")
    return "summary"


def test_a_durable_steps_own_model_call_is_counted_once_across_replays(runtime: Runtime) -> None:
    ran: list[str] = []

    @durable_agent("summarise")
    def fn(_: object, steps: Steps) -> str:
        first = steps.run("summarise", lambda: ran.append("s") or _inner_call(), type=str)
        second = steps.run("finish", lambda: first.upper(), type=str)
        return second

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("summarise", {})
    drive_to_end(runtime.driver(), dispatch)  # three tasks: each replays the first step

    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert ran == ["s"]
    cost = runtime.pricing.cost(INNER, INNER_USAGE)
    assert cost > 0
    assert (done.tokens_used, done.cost_usd) == (340, cost), "counted once, priced as its model"
    rows = {s.step_key: s for s in runtime.store.steps(run.id)}
    inner = rows["summarise:0/usage:0"]
    assert (inner.kind, inner.status, inner.model) == (StepKind.LLM, StepStatus.DONE, INNER)
    assert (inner.usage, inner.cost_usd, inner.request_id) == (INNER_USAGE, cost, "req_inner")
    assert inner.prompt_hash is None
    assert "finish:0/usage:0" not in rows


def test_each_attempt_of_a_retried_step_counts_what_it_billed(runtime: Runtime) -> None:
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(1)
        _inner_call()
        if len(attempts) == 1:
            raise RuntimeError("the nested agent's answer did not parse")
        return "ok"

    @durable_agent("flaky")
    def fn(_: object, steps: Steps) -> str:
        return steps.retry(2, 0.0).run("ask", flaky, type=str)

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("flaky", {})
    drive_to_end(runtime.driver(), dispatch)

    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert len(attempts) == 2
    assert done.tokens_used == 680, "both attempts were billed"
    rows = [s for s in runtime.store.steps(run.id) if "/usage:" in s.step_key]
    assert [(s.step_key, s.attempt) for s in rows] == [("ask:0/usage:0", 1), ("ask:0/usage:1", 2)]


def test_an_idempotent_step_run_again_after_a_crash_counts_both_executions(
    runtime: Runtime,
) -> None:
    """The worker died after the nested call, before the step was recorded: the call was
    billed and is counted; the step runs again and its second call is counted too."""
    executions: list[int] = []

    def body() -> str:
        executions.append(1)
        _inner_call()
        if len(executions) == 1:
            raise SimulatedCrash("the worker dies before the step is recorded")
        return "ok"

    @durable_agent("crashy")
    def fn(_: object, steps: Steps) -> str:
        return steps.run("ask", body, type=str, idempotent=True)

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("crashy", {})
    with pytest.raises(SimulatedCrash):
        runtime.driver().drive(run.id, dispatch.token)
    assert runtime.store.get_run(run.id).tokens_used == 340, "counted before the crash"
    expire_lease(runtime.engine, run.id)
    again = runtime.store.get_run(run.id)
    drive_to_end(runtime.driver(), _dispatch(again))

    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert len(executions) == 2
    assert done.tokens_used == 680
    keys = [s.step_key for s in runtime.store.steps(run.id) if "/usage:" in s.step_key]
    assert keys == ["ask:0/usage:0", "ask:0/usage:1"]


def _dispatch(run: object) -> object:
    from db.records import Dispatch

    return Dispatch(run.id, run.dispatch_token)  # type: ignore[attr-defined]


def test_an_unpriced_model_is_charged_at_the_highest_known_rate(runtime: Runtime) -> None:
    @durable_agent("unpriced")
    def fn(_: object, steps: Steps) -> str:
        def body() -> str:
            record_usage("some-model-nobody-priced", Usage(input_tokens=1000, output_tokens=100))
            return "ok"

        return steps.run("ask", body, type=str)

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("unpriced", {})
    drive_to_end(runtime.driver(), dispatch)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    highest = runtime.pricing.cost("claude-opus-4", Usage(input_tokens=1000, output_tokens=100))
    assert done.cost_usd == highest > Decimal(0)


def test_reported_usage_counts_against_the_token_budget(runtime: Runtime) -> None:
    asked: list[int] = []

    @durable_agent("spender")
    def fn(_: object, steps: Steps) -> str:
        steps.run("nested", lambda: record_usage(INNER, input_tokens=5000) or "ok", type=str)
        return steps.llm("ask", lambda m: asked.append(1) or m.complete("hi"), type=str)

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("spender", {}, token_budget=3000)
    drive_to_end(runtime.driver(), dispatch)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.FAILED
    assert done.error is not None
    assert "budget" in done.error, done.error
    assert asked == [], "the next model step was not made"
    assert done.tokens_used == 5000


def test_outside_a_step_it_says_where_it_belongs(runtime: Runtime) -> None:
    with pytest.raises(NotInStep, match="inside a tool"):
        record_usage(INNER, input_tokens=1)

    @durable_agent("misplaced")
    def fn(_: object, steps: Steps) -> str:
        record_usage(INNER, input_tokens=1)
        return "never"

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("misplaced", {})
    drive_to_end(runtime.driver(), dispatch)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.FAILED
    assert done.error is not None
    assert "NotInStep" in done.error


def test_a_tool_of_the_agent_loop_reports_the_model_call_it_made(runtime: Runtime) -> None:
    @tool
    def research(topic: str, ctx: ToolContext) -> str:
        """Ask a research agent."""
        record_usage(INNER, Usage(input_tokens=300, output_tokens=40))
        return f"notes on {topic}"

    llm = runtime.llm
    assert isinstance(llm, ScriptedLlm)
    llm.then_tool_use("toolu_r", "research", {"topic": "tides"}).then_text("done")
    runtime.agents.register(Agent(name="researcher", system_prompt="Help.", tools=(research,)))
    run, dispatch = runtime.submit("researcher", "tides?")
    drive_to_end(runtime.driver(), dispatch)

    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.tokens_used == 15 + 15 + 340
    assert done.cost_usd == runtime.pricing.cost(INNER, INNER_USAGE)
    rows = [s for s in runtime.store.steps(run.id) if "/usage:" in s.step_key]
    assert [(s.step_key, s.model, s.usage) for s in rows] == [
        ("tool:toolu_r/usage:0", INNER, INNER_USAGE)
    ]


def test_a_report_fenced_out_by_a_takeover_is_still_counted(runtime: Runtime) -> None:
    """The run was taken over while the step's code ran (its worker's lease lapsed): the
    report's row is refused with the rest of the step, and the call it reports was billed
    whoever holds the run now, so it is counted as the run's unrecorded tokens, as a model
    call of the engine's own whose checkpoint is fenced out is."""

    def taken_over() -> str:
        with runtime.engine.begin() as conn:  # what another worker's claim does to the row
            conn.execute(
                text(
                    "UPDATE run SET lease_epoch = lease_epoch + 1, locked_by = 'other'"
                    " WHERE id = :id"
                ),
                {"id": run.id},
            )
        return _inner_call()

    @durable_agent("taken")
    def fn(_: object, steps: Steps) -> str:
        return steps.run("ask", taken_over, type=str)

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("taken", {})
    with pytest.raises(LeaseLost):
        runtime.driver().drive(run.id, dispatch.token)
    done = runtime.store.get_run(run.id)
    cost = runtime.pricing.cost(INNER, INNER_USAGE)
    assert (done.tokens_used, done.unrecorded_tokens) == (0, 340), "billed: counted"
    assert done.unrecorded_cost_usd == cost
    assert not [s for s in runtime.store.steps(run.id) if "/usage:" in s.step_key]


def test_a_tool_reporting_its_model_call_hands_the_model_one_result_per_tool_use(
    runtime: Runtime,
) -> None:
    """The report's row (``tool:<id>/usage:0``) is recorded inside the tool's step: it is no
    tool result of the conversation. Taken for one, the next request carried a
    ``tool_result`` with ``tool_use_id: null``, which the Messages API refuses (400) and the
    run failed (issue 35, U1)."""

    @tool
    def summarise(text: str, ctx: ToolContext) -> str:
        """Summarise with a model of the tool's own."""
        record_usage(INNER, Usage(input_tokens=300, output_tokens=40))
        return "short"

    llm = runtime.llm
    assert isinstance(llm, ScriptedLlm)
    llm.then_tool_use("toolu_s", "summarise", {"text": "long"}).then_text("done")
    runtime.agents.register(Agent(name="summariser", system_prompt="Help.", tools=(summarise,)))
    run, dispatch = runtime.submit("summariser", "summarise this")
    drive_to_end(runtime.driver(), dispatch)

    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    last = llm.requests[-1].messages[-1]
    assert last["role"] == "user"
    results = [b for b in last["content"] if b.get("type") == "tool_result"]
    assert [(b["tool_use_id"], b["content"]) for b in results] == [("toolu_s", "short")]
