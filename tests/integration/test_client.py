"""``runtime.client.Client`` against the real API (werkzeug on loopback, real PostgreSQL and
Redis): typed results, every error answer as its exception, and the CLI built on it."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator

import pytest
from werkzeug.serving import make_server

from api import create_app
from db.records import Dispatch
from examples.order_refund import build as build_refund
from runtime.client import (
    Accepted,
    ApiUnreachable,
    BadRequest,
    Client,
    Conflict,
    NotFound,
    Run,
    Step,
)
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import make_celery
from tests.support import drive_to_end


@pytest.fixture
def client(runtime: Runtime) -> Iterator[Client]:
    runtime.tickets.seed()
    runtime.agents.register(build_refund(runtime.tickets))
    app = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Client(f"http://127.0.0.1:{server.server_port}", token="")
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


def _drive(runtime: Runtime, run_id: str) -> None:
    run = runtime.store.get_run(uuid.UUID(run_id))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))


def test_submit_wait_get_and_timeline_are_typed(
    client: Client, runtime: Runtime, llm: ScriptedLlm
) -> None:
    llm.then_text("Nothing is overdue.")
    accepted = client.submit("Which acme tickets are overdue?", token_budget=50_000)
    assert isinstance(accepted, Accepted)
    assert (accepted.status, accepted.created) == ("QUEUED", True)
    again = client.submit("x", idempotency_key="k-1")
    assert client.submit("x", idempotency_key="k-1") == Accepted(again.id, "QUEUED", False)

    _drive(runtime, accepted.id)
    run = client.wait(accepted.id, timeout_seconds=30)
    assert isinstance(run, Run)
    assert run.ended
    assert run.id == accepted.id
    assert run.raw["id"] == accepted.id
    timeline = client.timeline(accepted.id)
    assert all(isinstance(s, Step) for s in timeline)
    steps = [s for s in timeline if s.kind != "AUDIT"]  # audit entries have no seq
    assert [s.seq for s in steps] == [1]
    page = client.runs(limit=1)
    assert len(page.items) == 1
    assert page.next_cursor


def test_wait_gives_up_after_its_timeout(client: Client) -> None:
    accepted = client.submit("never driven")
    with pytest.raises(TimeoutError, match="still QUEUED"):
        client.wait(accepted.id, timeout_seconds=0.3, poll_seconds=0.1)


def test_the_apis_errors_are_exceptions_with_status_code_and_field(client: Client) -> None:
    with pytest.raises(NotFound) as missing:
        client.get(str(uuid.uuid4()))
    assert missing.value.status == 404
    assert missing.value.code
    with pytest.raises(BadRequest) as bad:
        client.submit("x", token_budget=-1)
    assert (bad.value.status, bad.value.field) == (400, "tokenBudget")
    assert str(bad.value).startswith("400 tokenBudget")

    accepted = client.submit("cancel me")
    assert client.cancel(accepted.id) == Accepted(accepted.id, "CANCELLED")
    with pytest.raises(Conflict):
        client.cancel(accepted.id)
    with pytest.raises(Conflict):
        client.resume(accepted.id)


def test_approvals_approve_reject_and_a_changed_payload(client: Client, runtime: Runtime) -> None:
    ids = []
    for order in (105, 106):
        accepted = client.submit(
            {"order_id": order, "amount": 9.5, "reason": "x"}, agent="order-refund"
        )
        _drive(runtime, accepted.id)
        ids.append(accepted.id)
    pending = client.approvals()
    assert sorted(a.run_id for a in pending) == sorted(ids)
    first, second = pending
    with pytest.raises(Conflict, match="payloadHash differs"):
        client.approve(first.id, payload_hash="0" * 64)
    decided = client.approve(first.id, comment="ok", payload_hash=first.payload_hash)
    assert (decided.id, decided.status) == (first.id, "APPROVED")
    assert client.reject(second.id, comment="no").status == "REJECTED"


def test_fork_and_diff(client: Client, runtime: Runtime, llm: ScriptedLlm) -> None:
    llm.then_text("Nothing is overdue.")
    accepted = client.submit("Which acme tickets are overdue?")
    _drive(runtime, accepted.id)
    fork = client.fork(accepted.id, 1, input="Which acme tickets are open?")
    assert fork.created
    assert fork.id != accepted.id
    diff = client.diff(accepted.id, fork.id)
    assert diff["a"]["id"] == accepted.id
    assert "input" in diff["runDifferences"]


def test_events_follow_a_finished_run_to_its_end(
    client: Client, runtime: Runtime, llm: ScriptedLlm
) -> None:
    llm.then_text("Nothing is overdue.")
    accepted = client.submit("Which acme tickets are overdue?")
    _drive(runtime, accepted.id)
    names = [e.name for e in client.events(accepted.id)]
    assert names[-1] == "run.finished"
    assert "step.finished" in names
    with pytest.raises(NotFound):
        list(client.events(str(uuid.uuid4())))


def test_an_api_that_does_not_answer() -> None:
    with pytest.raises(
        ApiUnreachable, match=re.escape("cannot reach the API at http://127.0.0.1:9")
    ):
        Client("http://127.0.0.1:9").get(str(uuid.uuid4()))


def test_send_message_to_a_run(client: Client) -> None:
    accepted = client.submit("Which acme tickets are overdue?")
    sent = client.send_message(accepted.id, "Only the urgent ones, please.", idempotency_key="m1")
    assert (sent.run_id, sent.new) == (accepted.id, True)
    again = client.send_message(accepted.id, "Only the urgent ones, please.", idempotency_key="m1")
    assert (again.message_id, again.new) == (sent.message_id, False)
    with pytest.raises(NotFound):
        client.send_message(str(uuid.uuid4()), "hello")
