"""A wake never brings a parked run forward past the floor of what it is parked on (issue 35,
U2): a signal, a message, ``steps.send`` or a child's end wakes a run waiting for it, never a
run waiting out a server's ``retry-after``, a ``steps.retry`` backoff or a ``steps.sleep``."""

from __future__ import annotations

from typing import Any

from db.records import RunStatus
from runtime.agents import Agent
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.llm.base import LlmError
from runtime.llm.retry import RetryLater
from runtime.llm.scripted import ScriptedLlm

FAILS: list[int] = []


def _flaky() -> str:
    FAILS.append(1)
    if len(FAILS) == 1:
        raise RuntimeError("the downstream service is down")
    return "ok"


@durable_agent("wf-backoff")
def backoff(_: Any, steps: Steps) -> Any:
    return steps.retry(2, 120.0).run("call", _flaky, type=str)


@durable_agent("wf-sleeper")
def sleeper(_: Any, steps: Steps) -> str:
    steps.sleep(120)
    return steps.wait_for("go")


def _seconds_to_timer(rt: Runtime, run_id: Any) -> float:
    run = rt.store.get_run(run_id)
    with rt.engine.connect() as conn:
        from sqlalchemy import text

        now = conn.execute(text("SELECT now()")).scalar_one()
    return (run.run_at - now).total_seconds()


def test_a_signal_does_not_cut_a_retry_backoff_short(runtime: Runtime) -> None:
    FAILS.clear()
    runtime.agents.register(backoff)
    run, dispatch = runtime.submit("wf-backoff", {})
    result = runtime.driver().drive(run.id, dispatch.token)
    assert result.outcome is Outcome.WAITING
    assert _seconds_to_timer(runtime, run.id) > 100, "backing off for 120 s"

    _, created, woken = runtime.store.post_signal(run.id, "anything", {"x": 1})
    assert created
    assert woken is None, "a backoff is a floor: not woken"
    assert _seconds_to_timer(runtime, run.id) > 100


def test_a_message_does_not_cut_a_servers_retry_after_short(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    runtime.agents.register(Agent(name="wf-chat", system_prompt="Chat."))
    overloaded = LlmError("overloaded", status=529, retry_after=120.0)
    # what the retrying client raises for a wait too long to sleep in a worker
    llm.then_fail(RetryLater(overloaded, 120.0, attempts=1)).then_text("hi")
    run, dispatch = runtime.submit("wf-chat", "hello")
    result = runtime.driver().drive(run.id, dispatch.token)
    assert result.outcome is Outcome.WAITING
    assert _seconds_to_timer(runtime, run.id) > 100, "waiting out the server's retry-after"

    _, created, dispatch_after = runtime.store.post_message(run.id, "are you there?")
    assert created
    assert dispatch_after is None, "the server's floor holds: the run is not woken"
    assert _seconds_to_timer(runtime, run.id) > 100
    assert runtime.store.get_run(run.id).status is RunStatus.RUNNING


def test_a_signal_does_not_cut_a_sleep_short(runtime: Runtime) -> None:
    runtime.agents.register(sleeper)
    run, dispatch = runtime.submit("wf-sleeper", {})
    assert runtime.driver().drive(run.id, dispatch.token).outcome is Outcome.WAITING
    _, _, woken = runtime.store.post_signal(run.id, "go", "now")
    assert woken is None, "asleep for 120 s: the signal is kept for the wait after it"
    assert _seconds_to_timer(runtime, run.id) > 100
