"""The records of the kinds that wait or start other runs go through the one checkpoint
(issue 35, U6 and U3): a message delivered, a signal consumed or sent, a child run started is
tried again across a database blip within the lease, an earlier try that committed (its
answer lost with the connection) is recognised instead of being written twice or taken for
"nothing there", and what a record wakes is woken in its own transaction."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from db.records import Dispatch, RunStatus, StepKind, StepStatus
from db.store import RunStore
from runtime.agents import Agent
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.llm.scripted import ScriptedLlm
from tests.support import dropped_connection


def lose_answer_once(store: RunStore, method: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``store.<method>`` commits, then its answer is lost with the connection (what a
    PostgreSQL restart between the COMMIT and its reply does): the checkpoint must find its
    own commit. Returns the calls made, counted."""
    real: Callable[..., Any] = getattr(store, method)
    calls: list[int] = []

    def once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        result = real(*args, **kwargs)
        if len(calls) == 1:
            raise dropped_connection()
        return result

    monkeypatch.setattr(store, method, once)
    return calls


def blip_once(store: RunStore, method: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``store.<method>`` meets the database away once, before it writes anything."""
    real: Callable[..., Any] = getattr(store, method)
    calls: list[int] = []

    def once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise dropped_connection()
        return real(*args, **kwargs)

    monkeypatch.setattr(store, method, once)
    return calls


def drive(rt: Runtime, dispatch: Dispatch | None, *, limit: int = 30) -> list[Outcome]:
    """Follow the run's own messages (waking it when it parks) until it ends."""
    driver = rt.driver()
    outcomes: list[Outcome] = []
    for _ in range(limit):
        if dispatch is None:
            break
        rt.store.make_due_now(dispatch.run_id)
        result = driver.drive(dispatch.run_id, dispatch.token)
        outcomes.append(result.outcome)
        if result.outcome is Outcome.FINISHED:
            break
        dispatch = result.dispatch or next(
            (d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id == dispatch.run_id),
            None,
        )
    return outcomes


@durable_agent("rd-waiter")
def waiter(_: Any, steps: Steps) -> Any:
    return [steps.wait_for("go"), steps.wait_for("go")]


@durable_agent("rd-sender")
def sender(target: str, steps: Steps) -> str:
    steps.send(uuid.UUID(target), "go", "from the sender")
    return "sent"


@durable_agent("rd-leaf")
def leaf(value: Any, steps: Steps) -> Any:
    return {"leaf": value}


@durable_agent("rd-parent")
def parent(_: Any, steps: Steps) -> Any:
    return steps.child("rd-leaf", 7)


@pytest.mark.parametrize("fault", [blip_once, lose_answer_once])
def test_a_signal_consumed_across_a_blip_is_delivered_once_in_order(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, fault: Any
) -> None:
    runtime.agents.register(waiter)
    run, dispatch = runtime.submit("rd-waiter", {})
    runtime.store.post_signal(run.id, "go", "first")
    runtime.store.post_signal(run.id, "go", "second")
    calls = fault(runtime.store, "consume_signal", monkeypatch)

    outcomes = drive(runtime, dispatch)

    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == ["first", "second"], "each signal once, in the order sent"
    assert len(calls) >= 2, "the blip was met"
    assert Outcome.DROPPED not in outcomes


@pytest.mark.parametrize("fault", [blip_once, lose_answer_once])
def test_a_message_delivered_across_a_blip_is_delivered_once_in_order(
    runtime: Runtime, llm: ScriptedLlm, monkeypatch: pytest.MonkeyPatch, fault: Any
) -> None:
    runtime.agents.register(Agent(name="rd-chat", system_prompt="Chat."))
    llm.then_text("hello").then_text("both read")
    run, dispatch = runtime.submit("rd-chat", "hi")
    runtime.store.post_message(run.id, "one")
    runtime.store.post_message(run.id, "two")
    fault(runtime.store, "deliver_message", monkeypatch)

    drive(runtime, dispatch)

    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    delivered = [s.response for s in runtime.store.steps(run.id) if s.kind is StepKind.MESSAGE]
    assert delivered == ["one", "two"], "neither lost nor twice, in order"
    texts = [
        b.get("text")
        for m in llm.requests[-1].messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
    ]
    assert texts[-2:] == ["one", "two"]


def test_a_signal_sent_across_a_lost_answer_is_sent_once(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime.agents.register(waiter)
    runtime.agents.register(sender)
    target, _ = runtime.submit("rd-waiter", {})
    lose_answer_once(runtime.store, "send_signal", monkeypatch)
    run, dispatch = runtime.submit("rd-sender", str(target.id))

    drive(runtime, dispatch)

    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    rows = [s for s in runtime.store.steps(run.id) if s.step_key.startswith("send.")]
    assert [(s.step_key, s.status) for s in rows] == [("send.go:0", StepStatus.DONE)]
    runtime.store.post_signal(target.id, "go", "from the test")
    assert drive(runtime, runtime.store.wake(target.id) or dispatch_of(runtime, target.id))
    assert runtime.store.get_run(target.id).result == ["from the sender", "from the test"]


def dispatch_of(rt: Runtime, run_id: uuid.UUID) -> Dispatch:
    rt.store.make_due_now(run_id)
    return next(d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id == run_id)


@pytest.mark.parametrize("fault", [blip_once, lose_answer_once])
def test_a_child_started_across_a_blip_is_started_once(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, fault: Any
) -> None:
    runtime.agents.register(leaf)
    runtime.agents.register(parent)
    fault(runtime.store, "start_children", monkeypatch)
    run, dispatch = runtime.submit("rd-parent", {})

    driver = runtime.driver()
    result = driver.drive(run.id, dispatch.token)
    assert result.outcome is Outcome.WAITING
    [first] = result.wakes
    children = runtime.store.children(run.id)
    assert [c["id"] for c in children] == [first.run_id], "one child, the one handed on"
    drive(runtime, first)
    drive(runtime, dispatch_of(runtime, run.id))
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == {"leaf": 7}


def test_a_signal_wakes_its_parked_target_in_the_senders_transaction(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """U3: the sender commits the signal and the target's wake together; a sender that dies
    right after its commit (before it sends anything) leaves the target due now, for the
    reaper's sweep, not asleep until its deadline."""
    runtime.agents.register(waiter)
    runtime.agents.register(sender)
    target, target_dispatch = runtime.submit("rd-waiter", {})
    assert runtime.driver().drive(target.id, target_dispatch.token).outcome is Outcome.WAITING
    parked = runtime.store.get_run(target.id)
    assert parked.locked_by is None
    assert (parked.run_at - parked.updated_at).total_seconds() > 60, "parked until its deadline"

    run, dispatch = runtime.submit("rd-sender", str(target.id))

    class SenderDied(BaseException):
        pass

    real = runtime.store.send_signal

    def then_die(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise SenderDied  # the process is gone: nothing after the commit runs

    monkeypatch.setattr(runtime.store, "send_signal", then_die)
    with pytest.raises(SenderDied):
        runtime.driver().drive(run.id, dispatch.token)

    woken = runtime.store.get_run(target.id)
    assert (parked.run_at - woken.run_at).total_seconds() > 60, "woken with the signal's commit"
