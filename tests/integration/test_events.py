"""The live event stream, GET /api/runs/{id}/events: durable events from PostgreSQL, text
deltas from Redis, through the real SDK streaming from the fake Messages API."""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.serving import make_server

import api
import cli.main as cli
from api.auth import hash_token
from cli.embedded import EmbeddedRedis
from db.records import RunStatus
from runtime.client import Event, follow, parse_sse
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.observe.live_channel import stream_key
from runtime.tools import Tool, ToolContext, tool
from tests.fakes.messages_api import FakeMessagesApi, cut, slow, text, tool_uses
from tests.support import drive_to_end, pointed_at, register_agent, submit

MODEL = "claude-test-model"


@pytest.fixture
def fake() -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi() as api_:
        yield api_


@pytest.fixture
def claude(settings: Settings, fake: FakeMessagesApi) -> Iterator[Runtime]:
    s = pointed_at(
        settings,
        fake,
        model_timeout_seconds=10,
        events_poll_seconds=0.05,
        cancel_poll_seconds=0.05,
    )
    rt = Runtime.build(s, pool_size=5)
    register_agent(rt.agents)
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture
def client(claude: Runtime) -> FlaskClient:
    app: Flask = api.create_app(runtime=claude)
    app.config["TESTING"] = True
    return app.test_client()


def events(client: FlaskClient, run_id: uuid.UUID, after: str | None = None) -> list[Event]:
    headers = {"Last-Event-ID": after} if after else {}
    resp = client.get(f"/api/runs/{run_id}/events", headers=headers)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.mimetype == "text/event-stream"
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


def test_a_streamed_run_as_events(
    claude: Runtime, client: FlaskClient, fake: FakeMessagesApi
) -> None:
    answer = "The overdue tickets are 7 and 9, both assigned to Kim."
    fake.then(text(answer))
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)

    evs = events(client, run.id)
    names = [e.name for e in evs]
    assert names[0] == "run.status"
    assert evs[0].data == {"status": "QUEUED"}
    assert names[-1] == "run.finished"
    assert evs[-1].data["status"] == "SUCCEEDED"
    assert "text.delta" in names
    finished = [e for e in evs if e.name == "step.finished"]
    assert finished[-1].data["text"] == answer
    assert finished[-1].data["tokens"]["input"] == 10
    assert shown_text(evs, finished[-1].data["key"]) == answer
    # A model step is checkpointed once, after the call: its deltas come first, then its
    # durable step.started and step.finished, from the same row.
    last_delta = len(names) - 1 - names[::-1].index("text.delta")
    key = finished[-1].data["key"]
    assert all(e.data["key"] == key for e in evs if e.name == "text.delta")
    assert names[last_delta + 1 : last_delta + 3] == ["step.started", "step.finished"]
    ids = [e.id for e in evs]
    assert len(set(ids)) == len(ids)
    # The checkpoint is what the non-streaming API would have returned.
    step = claude.store.steps(run.id)[-1]
    assert step.response == [{"type": "text", "text": answer}]


def test_reconnecting_at_any_event_id_resumes_exactly(
    claude: Runtime, client: FlaskClient, fake: FakeMessagesApi
) -> None:
    fake.then(text("first answer, long enough to stream in several deltas"))
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    full = events(client, run.id)
    assert len(full) > 8
    rng = random.Random(15)
    for i in [*rng.sample(range(len(full)), 8), 0, len(full) - 1]:
        rest = events(client, run.id, after=full[i].id)
        assert [(e.id, e.name, e.data) for e in rest] == [
            (e.id, e.name, e.data) for e in full[i + 1 :]
        ], f"resuming after event {i} ({full[i].id})"
    # ?after= is the same as the header.
    resp = client.get(f"/api/runs/{run.id}/events?after={full[3].id}")
    assert [e.id for e in parse_sse(resp.get_data(as_text=True).splitlines())] == [
        e.id for e in full[4:]
    ]


def test_a_retried_attempt_is_retracted_before_the_new_one(
    claude: Runtime, client: FlaskClient, fake: FakeMessagesApi
) -> None:
    answer = "a complete answer after one broken stream"
    fake.then(cut(text(answer), 5), text(answer))
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    assert claude.store.get_run(run.id).status is RunStatus.SUCCEEDED
    evs = events(client, run.id)
    names = [(e.name, e.data.get("attempt")) for e in evs if e.name.startswith("text.")]
    retract = names.index(("text.retract", 1))
    assert ("text.delta", 1) in names[:retract]
    assert all(n == ("text.delta", 2) for n in names[retract + 1 :])
    key = next(e.data["key"] for e in evs if e.name == "text.retract")
    assert shown_text(evs, key) == answer


def test_durable_events_survive_losing_the_deltas(
    claude: Runtime, client: FlaskClient, fake: FakeMessagesApi, redis_client: redis.Redis
) -> None:
    fake.then(text("still complete"))
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    redis_client.delete(stream_key(run.id))
    evs = events(client, run.id)
    assert not [e for e in evs if e.name.startswith("text.")]
    assert [e for e in evs if e.name == "step.finished"][-1].data["text"] == "still complete"


def test_bad_requests(claude: Runtime, client: FlaskClient, fake: FakeMessagesApi) -> None:
    resp = client.get(f"/api/runs/{uuid.uuid4()}/events")
    assert resp.status_code == 404
    fake.then(text("x"))
    run, dispatch = submit(claude.store, model=MODEL)
    other, _ = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    full = events(client, run.id)
    for bad in ("nonsense", "12", f"{run.id.hex[:8]}.x", f"{run.id.hex[:8]}.999999"):
        resp = client.get(f"/api/runs/{run.id}/events", headers={"Last-Event-ID": bad})
        assert resp.status_code == 400, bad
        assert resp.json is not None
        assert resp.json["error"]["code"] == "invalid_event_id"
    resp = client.get(f"/api/runs/{other.id}/events", headers={"Last-Event-ID": full[1].id})
    assert resp.status_code == 400
    assert "not an event of run" in (resp.json or {})["error"]["message"]


def test_cancel_aborts_the_model_call_within_a_second(
    claude: Runtime, client: FlaskClient, fake: FakeMessagesApi
) -> None:
    fake.then(
        slow(
            text("slow " * 200, usage={"input_tokens": 40, "output_tokens": 300}),
            chunk=5,
            interval=0.3,
        )
    )
    run, dispatch = submit(claude.store, model=MODEL)
    results: list[Any] = []
    worker = threading.Thread(
        target=lambda: results.append(drive_to_end(claude.driver(), dispatch)), daemon=True
    )
    worker.start()
    deadline = time.monotonic() + 10
    live = redis.Redis.from_url(claude.settings.require_redis_url())
    while not live.xlen(stream_key(run.id)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live.xlen(stream_key(run.id)), "the model never started streaming"
    asked = time.monotonic()
    assert client.post(f"/api/runs/{run.id}/cancel").status_code == 202
    worker.join(timeout=10)
    ended = time.monotonic()
    assert fake.aborts, "the fake never saw the stream cut"
    cut_latency = fake.aborts[0][1] - asked
    took = (ended - asked) * 1000
    print(f"cancel -> stream cut {cut_latency * 1000:.0f} ms; -> run ended {took:.0f} ms")
    assert cut_latency < 1.0
    done = claude.store.get_run(run.id)
    assert done.status is RunStatus.CANCELLED, done.error
    # What the stream reported as billed (message_start: 40 in, 1 out) is on the run, and
    # the output generated before the cut (reported only at the end) as an estimate that
    # covers the bill.
    assert done.unrecorded_tokens - done.unrecorded_estimated_tokens == 41
    [billed] = fake.billed
    assert 41 < billed.total <= done.unrecorded_tokens
    evs = events(client, run.id)
    assert evs[-1].name == "run.finished"
    assert evs[-1].data["status"] == "CANCELLED"
    live.close()


@contextlib.contextmanager
def serve(app: Flask) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


def _drive_in_background(rt: Runtime, dispatch: Any) -> threading.Thread:
    worker = threading.Thread(target=lambda: drive_to_end(rt.driver(), dispatch), daemon=True)
    worker.start()
    return worker


def test_dar_follow_prints_the_model_typing_and_exits_with_the_status(
    claude: Runtime, fake: FakeMessagesApi, capsys: pytest.CaptureFixture[str]
) -> None:
    answer = "Tickets 7 and 9 are overdue."
    fake.then(slow(text(answer), chunk=3, interval=0.05))
    run, dispatch = submit(claude.store, model=MODEL)
    with serve(api.create_app(runtime=claude)) as url:
        worker = _drive_in_background(claude, dispatch)
        code = cli.main(["follow", "--api", url, run.id.hex[:8]])
        worker.join(timeout=10)
    out = capsys.readouterr().out
    assert code == 0, out
    assert answer in out  # the deltas, printed as they came
    assert f"dar: run {run.id} SUCCEEDED" in out


def test_redis_restarted_while_a_client_listens(settings: Settings, fake: FakeMessagesApi) -> None:
    broker = EmbeddedRedis()
    broker.start()
    s = pointed_at(
        settings,
        fake,
        redis_url=broker.url,
        model_timeout_seconds=20,
        events_poll_seconds=0.1,
    )
    rt = Runtime.build(s, pool_size=5)
    tool = register_agent(rt.agents, _lookup())
    assert tool is not None
    first = "Let me look that up in the ticket system, one moment please."
    second = "Both tickets are overdue; the restart of Redis did not lose this text."
    fake.then(
        slow(tool_uses([("toolu_1", "lookup", {"q": "x"})], preamble=first), chunk=3, interval=0.1)
    )
    fake.then(slow(text(second), chunk=3, interval=0.05))
    try:
        run, dispatch = submit(rt.store, model=MODEL)
        received: list[Event] = []
        with serve(api.create_app(runtime=rt)) as url:
            worker = _drive_in_background(rt, dispatch)
            restarted = False
            for ev in follow(url, str(run.id), reconnect_seconds=0.2, timeout_seconds=10):
                received.append(ev)
                if ev.name == "text.delta" and not restarted:
                    broker.stop()  # mid-stream: the deltas of this step are lost
                    broker.start()
                    restarted = True
            worker.join(timeout=20)
        assert rt.store.get_run(run.id).status is RunStatus.SUCCEEDED
        ids = [e.id for e in received]
        assert len(ids) == len(set(ids)), "no duplicates"
        # Every durable event arrived, in order, and the steps' full text with them.
        replay = [e for e in _events_over_http(rt, run.id) if "." in e.id]
        durable = [e.id for e in replay if e.id.count(".") == 1]
        assert [i for i in ids if i.count(".") == 1] == durable
        texts = [e.data.get("text") for e in received if e.name == "step.finished"]
        assert first in texts
        assert second in texts
    finally:
        rt.close()
        broker.stop()


def _events_over_http(rt: Runtime, run_id: uuid.UUID) -> list[Event]:
    app = api.create_app(runtime=rt)
    resp = app.test_client().get(f"/api/runs/{run_id}/events")
    return list(parse_sse(resp.get_data(as_text=True).splitlines()))


def _lookup() -> Tool:
    @tool(idempotent=True)
    def lookup(q: str, ctx: ToolContext) -> dict[str, str]:
        """Look q up."""
        return {"q": q}

    result: Tool = lookup
    return result


def test_a_tool_in_flight_sees_the_cancel_through_its_context(
    claude: Runtime, client: FlaskClient, fake: FakeMessagesApi
) -> None:
    seen: list[float] = []
    started = threading.Event()

    @tool(idempotent=True)
    def wait_for_cancel(q: str, ctx: ToolContext) -> str:
        """Wait until cancelled (at most 10 s)."""
        started.set()
        if ctx.cancelled.wait(10):
            seen.append(time.monotonic())
            raise RuntimeError("stopped: the run was cancelled")
        return "never cancelled"

    register_agent(claude.agents, wait_for_cancel, name="waiter")
    fake.then(tool_uses([("toolu_w", "wait_for_cancel", {"q": "x"})]))
    run, dispatch = submit(claude.store, agent="waiter", model=MODEL)
    worker = _drive_in_background(claude, dispatch)
    assert started.wait(10)
    asked = time.monotonic()
    assert client.post(f"/api/runs/{run.id}/cancel").status_code == 202
    worker.join(timeout=15)
    assert seen, "the tool never saw ctx.cancelled"
    assert seen[0] - asked < 1.0
    assert claude.store.get_run(run.id).status is RunStatus.CANCELLED


def test_the_demo_model_types_into_the_stream(settings: Settings) -> None:
    rt = Runtime.build(replace(settings, demo_latency_ms=200), pool_size=2)
    try:
        run, dispatch = submit(rt.store, agent="acme-tickets")
        drive_to_end(rt.driver(), dispatch)
        evs = _events_over_http(rt, run.id)
        finished = [e for e in evs if e.name == "step.finished" and e.data.get("text")]
        assert finished
        for step in finished:
            assert shown_text(evs, step.data["key"]) == step.data["text"]
    finally:
        rt.close()


def test_the_stream_is_authorised_like_every_api_route(claude: Runtime) -> None:
    claude.settings = replace(
        claude.settings,
        api_tokens=f"reader:read:{hash_token('r-token')}:team-a,"
        f"other:read:{hash_token('o-token')}:team-b,"
        f"nobody:submit:{hash_token('s-token')}:team-a",
    )
    client = api.create_app(runtime=claude).test_client()
    run, _ = submit(claude.store, model=MODEL, tenant="team-a")
    url = f"/api/runs/{run.id}/events"
    assert client.get(url).status_code == 401
    assert client.get(url, headers={"Authorization": "Bearer s-token"}).status_code == 403
    assert client.get(url, headers={"Authorization": "Bearer o-token"}).status_code == 404
    claude.store.cancel(run.id)  # ends the run, so the stream ends
    resp = client.get(url, headers={"Authorization": "Bearer r-token"})
    assert resp.status_code == 200
    names = [e.name for e in parse_sse(resp.get_data(as_text=True).splitlines())]
    assert names == ["run.status", "run.finished"]


def test_a_delta_published_before_its_step_commits_is_never_dropped(claude: Runtime) -> None:
    """A worker publishes a step's last delta, then commits the step. A reader woken by the
    durable change alone (the hub has not flagged Redis yet) must still send that delta,
    before the step's events: sent after them it would be dropped as superseded."""

    from api.eventhub import EventHub
    from api.events import Cursor, EventStream
    from db.records import NewStep, StepKind, StepStatus, Usage

    live = claude.live
    assert live is not None
    run, dispatch = submit(claude.store)
    stream = EventStream(
        claude.store,
        live,
        run.id,
        Cursor((0, 0, 0)),
        claude.settings,
        hub=EventHub(claude.store, live, 1.0),
    )
    assert [name for _, _, name, _ in stream._batch(read_durable=True)] == ["run.status"]
    stream.durable, stream.last = 1, (1, 0, 0)  # as the stream does once it sent event 1
    live.publish(
        run.id,
        {"type": "text.delta", "key": "model:1", "attempt": 1, "base": 1, "text": "Hello"},
    )
    claim = claude.store.claim(run.id, dispatch.token, "worker-A", 30)
    assert claim is not None
    claude.store.checkpoint_model(
        claim,
        NewStep(
            seq=1,
            step_key="model:1",
            kind=StepKind.MODEL,
            status=StepStatus.DONE,
            response=[{"type": "text", "text": "Hello"}],
            attempt=1,
            model=MODEL,
            prompt_hash="h",
            usage=Usage(3, 1),
            latency_ms=1,
            stop_reason="end_turn",
        ),
    )
    names = [name for _, _, name, _ in stream._batch(read_durable=True)]
    assert "text.delta" in names, names
    assert names.index("text.delta") < names.index("step.started"), names
