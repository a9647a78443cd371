"""Durable waits and signals on real PostgreSQL: ``steps.sleep`` parks the run on its timer
(no lease), ``steps.wait_for`` returns a signal's payload once (one sent before the wait is
kept for it), ``steps.send`` sends exactly once (the signal is written with its step)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, event, text

import api
from db.errors import LeaseLost
from db.records import Dispatch, NewStep, RunStatus, StepKind, StepStatus
from runtime.durable import SignalTimeout, Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from tasks.celery_app import make_celery


@durable_agent("sleeper")
def sleeper(seconds: float, steps: Steps) -> str:
    steps.sleep(seconds)
    return "woke"


@durable_agent("waiter")
def waiter(_: Any, steps: Steps) -> Any:
    first = steps.wait_for("go")
    return {"first": first}


@durable_agent("twice")
def twice(_: Any, steps: Steps) -> Any:
    return [steps.wait_for("go"), steps.wait_for("go")]


@durable_agent("patient")
def patient(_: Any, steps: Steps) -> str:
    try:
        steps.wait_for("go", timeout=0.3)
    except SignalTimeout:
        return "gave up"
    return "got it"


@durable_agent("sender")
def sender(target: str, steps: Steps) -> str:
    steps.send(target, "go", {"from": str(steps.run_id)})
    return "sent"


@pytest.fixture
def rt(runtime: Runtime) -> Runtime:
    for agent in (sleeper, waiter, twice, patient, sender):
        runtime.agents.register(agent)
    return runtime


@pytest.fixture
def celery(settings: Any) -> Iterator[Celery]:
    app = make_celery(settings, register=False)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def client(rt: Runtime, celery: Celery) -> FlaskClient:
    app: Flask = api.create_app(runtime=rt, celery=celery)
    return app.test_client()


def drive(rt: Runtime, dispatch: Dispatch | None) -> list[Dispatch]:
    """Follow the run's messages until it ends or parks; the wakes it produced."""
    driver = rt.driver()
    wakes: list[Dispatch] = []
    for _ in range(50):
        if dispatch is None:
            return wakes
        result = driver.drive(dispatch.run_id, dispatch.token)
        wakes += result.wakes
        if result.outcome in (Outcome.WAITING, Outcome.DROPPED, Outcome.FINISHED):
            return wakes
        dispatch = result.dispatch
    raise AssertionError("the run did not settle")


def start(rt: Runtime, agent: str, value: Any) -> uuid.UUID:
    run, dispatch = rt.submit(agent, value)
    drive(rt, dispatch)
    return run.id


def due(rt: Runtime, run_id: uuid.UUID) -> Dispatch | None:
    """What the reaper sends for the run now, if anything."""
    found = [d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id == run_id]
    return found[0] if found else None


def test_sleep_parks_the_run_holding_nothing_and_wakes_it_on_time(rt: Runtime) -> None:
    run_id = start(rt, "sleeper", 1.0)
    run = rt.store.get_run(run_id)
    assert run.status is RunStatus.RUNNING
    assert (run.locked_by, run.locked_until) == (None, None), "no lease while it sleeps"
    assert (run.run_at - run.updated_at).total_seconds() == pytest.approx(1.0, abs=0.3)
    [pending] = rt.store.steps(run_id)
    assert (pending.step_key, pending.kind, pending.status) == (
        "sleep:0",
        StepKind.WAIT,
        StepStatus.PENDING,
    )
    assert due(rt, run_id) is None, "not before its time"
    time.sleep(1.1)
    drive(rt, due(rt, run_id))
    run = rt.store.get_run(run_id)
    assert (run.status, run.result) == (RunStatus.SUCCEEDED, "woke")
    assert [(s.step_key, s.status) for s in rt.store.steps(run_id)] == [
        ("sleep:0", StepStatus.DONE)
    ]


def test_a_sleeper_woken_early_goes_back_to_sleep(rt: Runtime) -> None:
    run_id = start(rt, "sleeper", 30.0)
    rt.store.make_due_now(run_id)  # an early wake (an operator, a stray signal)
    drive(rt, due(rt, run_id))
    run = rt.store.get_run(run_id)
    assert run.status is RunStatus.RUNNING
    assert (run.run_at - run.updated_at).total_seconds() > 25, "parked until its time again"


def test_a_signal_sent_before_the_wait_is_kept_for_it(rt: Runtime, client: FlaskClient) -> None:
    run, dispatch = rt.submit("waiter", {})
    response = client.post(f"/api/runs/{run.id}/signals/go", json={"payload": {"n": 1}})
    assert response.status_code == 202, response.get_data(as_text=True)
    drive(rt, dispatch)
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, {"first": {"n": 1}})
    [step] = rt.store.steps(run.id)
    assert (step.step_key, step.kind, step.status) == (
        "signal.go:0",
        StepKind.WAIT,
        StepStatus.DONE,
    )


def test_a_waiting_run_is_woken_by_its_signal_delivered_once(
    rt: Runtime, client: FlaskClient
) -> None:
    run_id = start(rt, "twice", {})
    run = rt.store.get_run(run_id)
    assert run.status is RunStatus.RUNNING
    assert run.locked_by is None
    assert "waiting for signal 'go'" in (run.wait_reason or "")
    headers = {"Idempotency-Key": "k-1"}
    first = client.post(f"/api/runs/{run_id}/signals/go", json={"payload": 1}, headers=headers)
    again = client.post(f"/api/runs/{run_id}/signals/go", json={"payload": 1}, headers=headers)
    assert first.get_json()["signalId"] == again.get_json()["signalId"]
    assert again.get_json()["new"] is False
    # The POST woke it: a new token, due now (the test's queue holds the message).
    woken = rt.store.get_run(run_id)
    assert woken.dispatch_token != run.dispatch_token
    drive(rt, Dispatch(run_id, woken.dispatch_token))
    run = rt.store.get_run(run_id)
    assert run.status is RunStatus.RUNNING, "the second wait is not served by the first signal"
    client.post(f"/api/runs/{run_id}/signals/go", json={"payload": 2})
    drive(rt, Dispatch(run_id, rt.store.get_run(run_id).dispatch_token))
    run = rt.store.get_run(run_id)
    assert (run.status, run.result) == (RunStatus.SUCCEEDED, [1, 2])
    with rt.engine.connect() as conn:
        consumed = conn.execute(
            text("SELECT consumed_by FROM run_signal WHERE run_id = :id ORDER BY id"),
            {"id": run_id},
        ).scalars()
        assert list(consumed) == ["signal.go:0", "signal.go:1"]


def test_a_wait_past_its_timeout_raises_signal_timeout_into_the_function(rt: Runtime) -> None:
    run_id = start(rt, "patient", {})
    assert rt.store.get_run(run_id).status is RunStatus.RUNNING
    time.sleep(0.5)
    drive(rt, due(rt, run_id))
    run = rt.store.get_run(run_id)
    assert (run.status, run.result) == (RunStatus.SUCCEEDED, "gave up")
    [step] = rt.store.steps(run_id)
    assert step.status is StepStatus.ERROR
    assert (step.error or "").startswith("SignalTimeout:")


def test_send_wakes_the_waiting_run_with_its_payload(rt: Runtime) -> None:
    target = start(rt, "waiter", {})
    run, dispatch = rt.submit("sender", str(target))
    wakes = drive(rt, dispatch)
    assert rt.store.get_run(run.id).result == "sent"
    assert [w.run_id for w in wakes] == [target], "the sender's task wakes the target"
    drive(rt, wakes[0])
    done = rt.store.get_run(target)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, {"first": {"from": str(run.id)}})


def test_send_to_no_such_run_fails_the_step(rt: Runtime) -> None:
    run_id = start(rt, "sender", str(uuid.uuid4()))
    run = rt.store.get_run(run_id)
    assert run.status is RunStatus.FAILED
    assert "no run with id" in (run.error or "")


def test_a_send_whose_checkpoint_is_fenced_out_sends_nothing(rt: Runtime) -> None:
    """Exactly once: the signal is written in the transaction of the step's record, so a
    worker that lost its lease (its checkpoint refused) leaves no signal behind."""
    target = start(rt, "waiter", {})
    run, dispatch = rt.submit("sender", str(target))
    claim = rt.store.claim(run.id, dispatch.token, "worker-A", 30)
    assert claim is not None
    with rt.engine.begin() as conn:  # another worker took the run over
        conn.execute(
            text("UPDATE run SET lease_epoch = lease_epoch + 1 WHERE id = :id"), {"id": run.id}
        )
    row = NewStep(1, "send.go:0", StepKind.SEND, StepStatus.DONE, attempt=1)
    with pytest.raises(LeaseLost):
        rt.store.send_signal(
            claim, row, target=target, name="go", payload=1, idempotency_key=f"{run.id}/send.go:0"
        )
    with rt.engine.connect() as conn:
        n = conn.execute(text("SELECT count(*) FROM run_signal WHERE run_id = :id"), {"id": target})
        assert n.scalar_one() == 0


def test_a_signal_for_a_finished_or_unknown_run_is_refused(
    rt: Runtime, client: FlaskClient
) -> None:
    run_id = start(rt, "sleeper", 0.0)
    drive(rt, due(rt, run_id))
    assert rt.store.get_run(run_id).status is RunStatus.SUCCEEDED
    assert client.post(f"/api/runs/{run_id}/signals/go").status_code == 409
    assert client.post(f"/api/runs/{uuid.uuid4()}/signals/go").status_code == 404
    assert client.post(f"/api/runs/{run_id}/signals/bad name").status_code in (400, 404)


def test_the_test_kit_returns_a_waiting_run_parked(rt: Runtime) -> None:
    from runtime.testing.testkit import DurableTester

    parked = DurableTester(rt).run(waiter, {})
    assert parked.status is RunStatus.RUNNING
    assert [s.status for s in parked.steps] == [StepStatus.PENDING]


def test_signals_kept_for_a_run_are_read_oldest_first(rt: Runtime, client: FlaskClient) -> None:
    run, dispatch = rt.submit("twice", {})
    for n in (1, 2):  # both sent before the run's first wait
        sent = client.post(f"/api/runs/{run.id}/signals/go", json={"payload": n})
        assert sent.status_code == 202, sent.get_data(as_text=True)
    drive(rt, dispatch)
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, [1, 2]), "in the order sent"


def test_two_runs_sending_one_name_to_a_run_both_arrive(rt: Runtime) -> None:
    """``steps.send``'s idempotency key names the sender run: two senders' ``send.go:0`` are
    two signals, not one retried (the second is not silently taken for the first)."""
    target = start(rt, "twice", {})
    senders = []
    for _ in range(2):
        run, dispatch = rt.submit("sender", str(target))
        drive(rt, dispatch)
        assert rt.store.get_run(run.id).result == "sent"
        senders.append(run.id)
    with rt.engine.connect() as conn:
        kept = conn.execute(
            text("SELECT sent_by FROM run_signal WHERE run_id = :id ORDER BY id"), {"id": target}
        ).scalars()
        assert list(kept) == [f"run:{s}" for s in senders]
    for _ in range(3):  # the sends woke it; each wake is one task (or the reaper's sweep)
        if rt.store.get_run(target).status.terminal:
            break
        rt.store.make_due_now(target)
        drive(rt, due(rt, target))
    done = rt.store.get_run(target)
    assert (done.status, done.result) == (
        RunStatus.SUCCEEDED,
        [{"from": str(senders[0])}, {"from": str(senders[1])}],
    )


def _lock_waiters(engine: Engine) -> int:
    """Sessions of this test's database waiting for a lock another transaction holds."""
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar_one()


def test_a_signal_sent_while_the_run_parks_for_it_wakes_it(
    rt: Runtime, client: FlaskClient
) -> None:
    """The race between a wait and its signal, made to happen: the signal is POSTed after
    the waiting task looked for it (none) and before it parked the run. The waiter holds its
    run's row lock from the look to the park, so the POST waits for the park and then finds
    the run parked and wakes it (without the lock the wake finds the run still held, does
    nothing, and the run sleeps until its deadline with its signal unread)."""
    run, dispatch = rt.submit("waiter", {}, timeout_seconds=600)
    posted: list[int] = []
    poster = threading.Thread(
        target=lambda: posted.append(
            client.post(f"/api/runs/{run.id}/signals/go", json={"payload": 7}).status_code
        ),
        daemon=True,
    )

    def between_the_look_and_the_park(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        # the waiter's PENDING row, the first write of the transaction that parks the run
        if poster.is_alive() or posted or "INSERT INTO run_step" not in statement:
            return
        if "signal.go:0" not in str(params):
            return
        poster.start()
        deadline = time.monotonic() + 10
        while poster.is_alive() and not _lock_waiters(rt.engine):
            assert time.monotonic() < deadline, "the POST neither ended nor waited"
            time.sleep(0.01)

    event.listen(rt.engine, "before_cursor_execute", between_the_look_and_the_park)
    try:
        result = rt.driver().drive(dispatch.run_id, dispatch.token)
    finally:
        event.remove(rt.engine, "before_cursor_execute", between_the_look_and_the_park)
    poster.join(timeout=10)
    assert posted == [202], "the POST was made inside the window, and answered"
    assert result.outcome is Outcome.WAITING, "it looked before the signal came: it parked"
    parked = rt.store.get_run(run.id)
    assert parked.dispatch_token != dispatch.token
    woken = due(rt, run.id)
    assert woken is not None, (
        f"the run was not woken: it sleeps until {parked.run_at} with its signal unread"
    )
    drive(rt, woken)
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, {"first": 7})
