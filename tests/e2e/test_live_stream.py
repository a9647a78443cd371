"""End to end, real processes (the dev stack: gunicorn with gevent, two Celery workers, beat):
a client follows a run's event stream while the worker typing the model's answer is
SIGKILLed. The client sees that attempt retracted, then the new attempt's text, and the
final text exactly once; a second client replaying from the start sees the same events."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.devstack import DevStack
from db.engine import make_engine
from db.records import RunStatus
from db.store import RunStore
from runtime.client import Event, follow
from runtime.config import Settings
from tests.e2e.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture
def stack(
    database_url: str, redis_url: str, settings: Settings, tmp_path: Path
) -> Iterator[DevStack]:
    with running_stack(
        tmp_path,
        database_url,
        redis_url,
        settings,
        pool="threads",
        start_timeout=60,
        DAR_DEMO_LATENCY_MS="4000",
        DAR_EVENTS_POLL_SECONDS="0.2",
    ) as s:
        yield s


def shown(events: list[Event], key: str) -> str:
    by_attempt: dict[int, str] = {}
    for e in events:
        if e.data.get("key") != key:
            continue
        if e.name == "text.delta":
            by_attempt[e.data["attempt"]] = by_attempt.get(e.data["attempt"], "") + e.data["text"]
        elif e.name == "text.retract":
            by_attempt.pop(e.data["attempt"], None)
    assert len(by_attempt) == 1, by_attempt
    return next(iter(by_attempt.values()))


def test_sigkill_mid_stream_retracts_then_streams_the_new_attempt(stack: DevStack) -> None:
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    try:
        status, accepted = stack.request(
            "POST", "/api/runs", {"input": "Which acme tickets are overdue?", "tokenBudget": 50000}
        )
        assert status == 201, accepted
        run_id = uuid.UUID(accepted["id"])
        received: list[Event] = []
        second_model_typing = threading.Event()
        done = threading.Event()

        def listen() -> None:
            tool_done = False
            for ev in follow(stack.api_url, str(run_id), reconnect_seconds=0.2):
                received.append(ev)
                if ev.name == "step.finished" and ev.data["kind"] == "TOOL":
                    tool_done = True
                if tool_done and ev.name == "text.delta":
                    second_model_typing.set()
            done.set()

        threading.Thread(target=listen, daemon=True).start()
        assert second_model_typing.wait(60), "the second model call never streamed"
        victim = store.get_run(run_id).locked_by
        assert victim is not None
        stack.kill(victim)
        assert done.wait(90), "the stream never reached run.finished"

        run = store.get_run(run_id)
        assert run.status is RunStatus.SUCCEEDED, run.error
        ids = [e.id for e in received]
        assert len(ids) == len(set(ids)), "no event twice"
        final = [e for e in received if e.name == "step.finished" and e.data["kind"] == "MODEL"]
        key = final[-1].data["key"]
        texts = [
            (e.name, e.data["attempt"])
            for e in received
            if e.data.get("key") == key and e.name.startswith("text.")
        ]
        retract = texts.index(("text.retract", 1))
        assert ("text.delta", 1) in texts[:retract], "the killed attempt's text came first"
        assert texts[retract + 1 :], "then the new attempt's text"
        assert all(t == ("text.delta", 2) for t in texts[retract + 1 :])
        assert shown(received, key) == final[-1].data["text"], "the final text, once"
        assert received[-1].name == "run.finished"

        # A client that starts now replays exactly what the live client saw.
        replay = list(follow(stack.api_url, str(run_id)))
        assert [(e.id, e.name, e.data) for e in replay] == [
            (e.id, e.name, e.data) for e in received
        ]
    finally:
        engine.dispose()
