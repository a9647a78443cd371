"""``POST /api/runs/{id}/messages`` with ``policy: "interrupt"``, on real PostgreSQL and Redis
through the real SDK streaming from the fake Messages API: the model call in flight is
aborted, its billed tokens recorded and its attempt retracted on the event stream; the
message is delivered as the next step and the model call made again with it. A tool in
flight is not interrupted; a crash between the abort and the message's record loses
nothing and delivers it once."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

import api
from db.records import RunStatus, StepKind
from db.store import RunStore
from runtime.client import Event, parse_sse
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.observe.live_channel import interrupt_key, stream_key
from runtime.tools import tool
from tests.fakes.messages_api import FakeMessagesApi, slow, text, tool_uses
from tests.support import drive_to_end, expire_lease, pointed_at, register_agent, submit

MODEL = "claude-test-model"


@tool(idempotent=True)
def slow_lookup(q: str) -> str:
    """Look something up, slowly."""
    time.sleep(1.0)
    return f"found {q}"


@pytest.fixture
def fake() -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi() as api_:
        yield api_


@pytest.fixture
def claude(settings: Settings, fake: FakeMessagesApi) -> Iterator[Runtime]:
    s = pointed_at(
        settings,
        fake,
        model_timeout_seconds=20,
        events_poll_seconds=0.05,
        cancel_poll_seconds=0.05,
        started_row_after_seconds=0,
    )
    rt = Runtime.build(s, pool_size=5)
    register_agent(rt.agents, slow_lookup)
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture
def client(claude: Runtime) -> FlaskClient:
    app: Flask = api.create_app(runtime=claude)
    app.config["TESTING"] = True
    return app.test_client()


@pytest.fixture
def live(claude: Runtime) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(claude.settings.require_redis_url())
    yield r
    r.close()


def events(client: FlaskClient, run_id: uuid.UUID) -> list[Event]:
    resp = client.get(f"/api/runs/{run_id}/events")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return list(parse_sse(resp.get_data(as_text=True).splitlines()))


def shown_text(evs: list[Event], key: str) -> str:
    """What a client shows for step ``key``: its deltas, minus retracted attempts."""
    by_attempt: dict[int, str] = {}
    for e in evs:
        if e.data.get("key") != key:
            continue
        if e.name == "text.delta":
            by_attempt[e.data["attempt"]] = by_attempt.get(e.data["attempt"], "") + e.data["text"]
        elif e.name == "text.retract":
            by_attempt.pop(e.data["attempt"], None)
    assert len(by_attempt) <= 1, by_attempt
    return "".join(by_attempt.values())


def wait_streaming(live: redis.Redis, run_id: uuid.UUID) -> None:
    deadline = time.monotonic() + 10
    while not live.xlen(stream_key(run_id)):
        assert time.monotonic() < deadline, "the model never started streaming"
        time.sleep(0.02)


def in_background(claude: Runtime, dispatch: Any) -> threading.Thread:
    worker = threading.Thread(target=lambda: drive_to_end(claude.driver(), dispatch), daemon=True)
    worker.start()
    return worker


def slow_answer() -> Any:
    usage = {"input_tokens": 40, "output_tokens": 300}
    long = text("I will list every acme ticket. " * 40, usage=usage)
    return slow(long, chunk=5, interval=0.3)


def assert_counted(run: Any, billed: int) -> None:
    """The run counts a cut call: its exact part (what the stream reported) never exceeds
    the bill, its estimate covers the rest."""
    exact = run.unrecorded_tokens - run.unrecorded_estimated_tokens
    assert exact == 41, (run.unrecorded_tokens, run.unrecorded_estimated_tokens)
    assert exact < billed <= run.unrecorded_tokens, (billed, run.unrecorded_tokens)


def user_texts(body: Any) -> list[str]:
    out: list[str] = []
    for m in body["messages"]:
        if m["role"] != "user":
            continue
        content = m["content"]
        if isinstance(content, str):
            out.append(content)
        else:
            out += [b["text"] for b in content if b.get("type") == "text"]
    return out


def test_an_interrupt_aborts_the_model_call_and_makes_it_again_with_the_message(
    claude: Runtime, client: FlaskClient, fake: FakeMessagesApi, live: redis.Redis
) -> None:
    fake.then(slow_answer(), text("Only Globex: tickets 7 and 9."))
    run, dispatch = submit(claude.store, "Which tickets are overdue?", model=MODEL)
    worker = in_background(claude, dispatch)
    wait_streaming(live, run.id)
    asked = time.monotonic()
    sent = client.post(
        f"/api/runs/{run.id}/messages",
        json={"text": "Only Globex, please", "policy": "interrupt"},
    )
    assert sent.status_code == 202, sent.get_data(as_text=True)
    assert sent.get_json()["policy"] == "interrupt"
    worker.join(timeout=20)
    assert not worker.is_alive()
    assert fake.aborts, "the stream in flight was never cut"
    cut_after = fake.aborts[0][1] - asked
    print(f"interrupt -> stream cut {cut_after * 1000:.0f} ms")
    assert cut_after < 1.0

    done = claude.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, "Only Globex: tickets 7 and 9.")
    steps = claude.store.steps(run.id)
    assert [(s.kind, s.step_key) for s in steps] == [
        (StepKind.MESSAGE, "message:0"),
        (StepKind.MODEL, "model:1"),
    ], "the cut call left no row; the message, then the same step made again"
    assert fake.calls == 2
    assert user_texts(fake.bodies()[1]) == ["Which tickets are overdue?", "Only Globex, please"]
    # The cut call was billed (its input and the output generated so far) and is counted on
    # the run: exactly what the stream reported (message_start: 40 in, 1 out), the output
    # it reports only at its end estimated high from the text received, so the count covers
    # the bill; the call made again is recorded with its row.
    cut = fake.billed[0]
    assert not cut.complete
    assert_counted(done, cut.total)
    assert done.tokens_used == steps[-1].usage.total
    assert claude.store.get_run(run.id).messages_pending == 0
    assert not live.exists(interrupt_key(run.id)), "the flag was consumed"

    evs = events(client, run.id)
    retracts = [e.data for e in evs if e.name == "text.retract" and e.data["key"] == "model:1"]
    assert retracts, "the cut attempt is retracted"
    assert retracts[0]["attempt"] == 1
    assert shown_text(evs, "model:1") == "Only Globex: tickets 7 and 9."
    received = [e.data for e in evs if e.name == "message.received"]
    assert [r["content"] for r in received] == ["Only Globex, please"]


def test_an_interrupt_does_not_stop_a_tool_in_flight(
    claude: Runtime, client: FlaskClient, fake: FakeMessagesApi, live: redis.Redis
) -> None:
    fake.then(tool_uses([("toolu_1", "slow_lookup", {"q": "acme"})]), text("acme found"))
    run, dispatch = submit(claude.store, "Look up acme", model=MODEL)
    worker = in_background(claude, dispatch)
    deadline = time.monotonic() + 10
    while not any(s.kind is StepKind.TOOL for s in claude.store.steps(run.id)):
        assert time.monotonic() < deadline, "the tool never started"
        time.sleep(0.02)
    sent = client.post(
        f"/api/runs/{run.id}/messages", json={"text": "and globex", "policy": "interrupt"}
    )
    assert sent.status_code == 202
    worker.join(timeout=20)
    assert not worker.is_alive()
    done = claude.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    steps = claude.store.steps(run.id)
    assert [(s.kind, s.status.value) for s in steps] == [
        (StepKind.MODEL, "DONE"),
        (StepKind.TOOL, "DONE"),
        (StepKind.MESSAGE, "DONE"),
        (StepKind.MODEL, "DONE"),
    ], "the tool ran to its end; the message followed its result"
    assert steps[1].response == "found acme"
    assert not fake.aborts
    assert fake.calls == 2
    assert done.unrecorded_tokens == 0, "nothing was cut"
    assert not live.exists(interrupt_key(run.id)), "the delivered message took its flag"


class Crash(BaseException):
    """The worker dies (a BaseException: nothing in the engine catches it)."""


def test_a_crash_between_the_abort_and_the_message_record_delivers_it_once(
    claude: Runtime,
    client: FlaskClient,
    fake: FakeMessagesApi,
    live: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake.then(slow_answer(), text("Only Globex."))
    run, dispatch = submit(claude.store, "Which tickets are overdue?", model=MODEL)
    original = RunStore.deliver_message
    crashes: list[int] = []

    def dies_once(self: RunStore, *args: Any, **kwargs: Any) -> Any:
        if not crashes:
            crashes.append(1)
            raise Crash()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RunStore, "deliver_message", dies_once)
    died: list[BaseException] = []

    def first_worker() -> None:
        try:
            drive_to_end(claude.driver(), dispatch)
        except Crash as e:
            died.append(e)

    worker = threading.Thread(target=first_worker, daemon=True)
    worker.start()
    wait_streaming(live, run.id)
    sent = client.post(
        f"/api/runs/{run.id}/messages", json={"text": "Only Globex", "policy": "interrupt"}
    )
    assert sent.status_code == 202
    worker.join(timeout=20)
    assert died, "the worker did not die between the abort and the message's record"
    after_crash = claude.store.get_run(run.id)
    assert after_crash.messages_pending == 1, "the message is still there"
    assert_counted(after_crash, fake.billed[0].total)  # before the message's record
    assert claude.store.steps(run.id) == []

    # Another worker takes the run over once the lease lapses: the message is delivered at
    # the step boundary, once, and the call made again with it.
    expire_lease(claude.store.engine, run.id)
    [due] = [d for d in claude.store.redispatch_due(redispatch_after=0) if d.run_id == run.id]
    drive_to_end(claude.driver(), due)
    done = claude.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, "Only Globex.")
    assert [s.kind for s in claude.store.steps(run.id)] == [StepKind.MESSAGE, StepKind.MODEL]
    assert fake.calls == 2
    assert user_texts(fake.bodies()[1])[-1] == "Only Globex"
    assert done.unrecorded_tokens == after_crash.unrecorded_tokens, "counted once"


def test_a_stale_interrupt_flag_makes_the_call_again(
    claude: Runtime, fake: FakeMessagesApi, live: redis.Redis
) -> None:
    """A flag whose message was already delivered at a boundary (it raced the delivery)
    aborts at most one call, which is made again: nothing is lost, the run goes on."""
    fake.then(slow_answer(), text("All done."))
    run, dispatch = submit(claude.store, "hello", model=MODEL)
    worker = in_background(claude, dispatch)
    wait_streaming(live, run.id)
    assert claude.live is not None
    claude.live.request_interrupt(run.id)  # no message behind it
    worker.join(timeout=20)
    done = claude.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, "All done.")
    assert [s.kind for s in claude.store.steps(run.id)] == [StepKind.MODEL]
    assert fake.calls == 2
    assert len(fake.aborts) == 1
    assert_counted(done, fake.billed[0].total)


def test_a_retried_interrupt_does_not_abort_the_call_that_carries_its_message(
    claude: Runtime, client: FlaskClient, fake: FakeMessagesApi, live: redis.Redis
) -> None:
    """A client that retries its interrupt POST (same Idempotency-Key: one message) while
    the call made again with that message is in flight: the retry is the same message, so
    it interrupts nothing (aborting that call would pay for it twice)."""
    answer = "Only Globex: tickets 7 and 9. " * 4
    carried = slow(text(answer, usage={"input_tokens": 60, "output_tokens": 40}), interval=0.2)
    fake.then(slow_answer(), carried, text("asked a third time"))
    run, dispatch = submit(claude.store, "Which tickets are overdue?", model=MODEL)
    worker = in_background(claude, dispatch)
    wait_streaming(live, run.id)
    key = {"Idempotency-Key": "interrupt-1"}
    body = {"text": "Only Globex, please", "policy": "interrupt"}
    first = client.post(f"/api/runs/{run.id}/messages", json=body, headers=key)
    assert first.get_json()["new"] is True
    deadline = time.monotonic() + 10
    while fake.calls < 2:  # the first call cut, the message delivered, the call made again
        assert time.monotonic() < deadline, "the call was never made again"
        time.sleep(0.02)
    assert [s.kind for s in claude.store.steps(run.id)] == [StepKind.MESSAGE]
    again = client.post(f"/api/runs/{run.id}/messages", json=body, headers=key)
    assert again.status_code == 202, again.get_data(as_text=True)
    assert (again.get_json()["new"], again.get_json()["messageId"]) == (
        False,
        first.get_json()["messageId"],
    )
    worker.join(timeout=20)
    assert not worker.is_alive()
    done = claude.store.get_run(run.id)
    assert (done.status, done.result) == (RunStatus.SUCCEEDED, answer)
    assert fake.calls == 2, "the call that carries the message was not made twice"
    assert [b.complete for b in fake.billed] == [False, True], "only the first call was cut"
    assert [s.kind for s in claude.store.steps(run.id)] == [StepKind.MESSAGE, StepKind.MODEL]
    assert not live.exists(interrupt_key(run.id))
