"""End to end, real processes (API, two workers, beat, the demo model): a message posted to a
run whose worker is then SIGKILLed mid-step is delivered once, by the survivor, at the next
step boundary; after the run succeeds, a message continues the same conversation. A message
posted with ``policy: "interrupt"`` whose worker dies between the abort of its model call and
the message's record is delivered once too, and the cut call stays counted."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.devstack import DevStack
from db.engine import make_engine
from db.records import RunStatus, StepKind
from db.store import RunStore
from runtime.config import Settings
from tests.e2e.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def stack(
    database_url: str, redis_url: str, settings: Settings, tmp_path: Path
) -> Iterator[DevStack]:
    yield from _stack(database_url, redis_url, settings, tmp_path)


@pytest.fixture
def interrupt_stack(
    database_url: str, redis_url: str, settings: Settings, tmp_path: Path
) -> Iterator[DevStack]:
    """Every worker SIGKILLs itself right after a message interrupted its model call (the
    survivor delivers the message at a step boundary, a path that never passes there)."""
    yield from _stack(database_url, redis_url, settings, tmp_path, DAR_FAULTS="after_interrupt=1")


def _stack(
    database_url: str, redis_url: str, settings: Settings, tmp_path: Path, **extra: str
) -> Iterator[DevStack]:
    with running_stack(
        tmp_path,
        database_url,
        redis_url,
        settings,
        log_tail=15_000,
        DAR_DEMO_LATENCY_MS="2500",
        **extra,
    ) as s:
        yield s


def wait_terminal(store: RunStore, run_id: uuid.UUID, seconds: float) -> RunStatus:
    deadline = time.monotonic() + seconds
    while True:
        status = store.get_run(run_id).status
        if status.terminal:
            return status
        assert time.monotonic() < deadline, f"run still {status}"
        time.sleep(0.2)


def test_sigkill_with_a_message_pending_delivers_it_once(stack: DevStack) -> None:
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    try:
        status, accepted = stack.request(
            "POST", "/api/runs", {"input": "Which acme tickets are overdue?", "tokenBudget": 50000}
        )
        assert status == 201, accepted
        run_id = uuid.UUID(accepted["id"])
        deadline = time.monotonic() + 60
        while True:  # the first model call in flight: lease held, nothing recorded yet
            assert time.monotonic() < deadline, "the run never started its model call"
            run = store.get_run(run_id)
            if run.locked_by and run.status is RunStatus.RUNNING:
                break
            time.sleep(0.05)
        status, sent = stack.request(
            "POST", f"/api/runs/{run_id}/messages", {"text": "Only Globex, please"}
        )
        assert status == 202, sent
        stack.kill(run.locked_by)  # the message is pending; its run's worker dies mid-step
        assert wait_terminal(store, run_id, 120) is RunStatus.SUCCEEDED
        steps = store.steps(run_id)
        messages = [s for s in steps if s.kind is StepKind.MESSAGE]
        assert [m.response for m in messages] == ["Only Globex, please"], "delivered once"
        assert store.get_run(run_id).messages_pending == 0

        # The conversation goes on after it succeeded: the next turn of the same run.
        status, sent = stack.request("POST", f"/api/runs/{run_id}/messages", {"text": "Thanks!"})
        # QUEUED, or RUNNING already: the API reads the run after sending its message, and
        # an idle worker may have claimed it meanwhile
        assert (status, sent["status"]) in ((202, "QUEUED"), (202, "RUNNING")), sent
        assert wait_terminal(store, run_id, 120) is RunStatus.SUCCEEDED
        kinds = [s.kind for s in store.steps(run_id)]
        assert kinds.count(StepKind.MESSAGE) == 2
        assert kinds[-1] is StepKind.MODEL, "the model answered the next turn"
    finally:
        engine.dispose()


def test_sigkill_between_an_interrupt_and_the_messages_record_delivers_it_once(
    interrupt_stack: DevStack,
) -> None:
    stack = interrupt_stack
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    try:
        status, accepted = stack.request(
            "POST", "/api/runs", {"input": "Which acme tickets are overdue?", "tokenBudget": 50000}
        )
        assert status == 201, accepted
        run_id = uuid.UUID(accepted["id"])
        deadline = time.monotonic() + 60
        while True:  # the first model call in flight (the demo model types for 2.5 s)
            assert time.monotonic() < deadline, "the run never started its model call"
            run = store.get_run(run_id)
            if run.locked_by and run.status is RunStatus.RUNNING:
                break
            time.sleep(0.05)
        time.sleep(0.5)
        victim = stack.processes[run.locked_by]
        status, sent = stack.request(
            "POST",
            f"/api/runs/{run_id}/messages",
            {"text": "Only Globex, please", "policy": "interrupt"},
        )
        assert (status, sent["policy"]) == (202, "interrupt"), sent
        victim.wait(timeout=10)  # it aborted the call, counted it, and died before the record
        assert victim.returncode == -9, "the worker was killed at after_interrupt"
        cut = store.get_run(run_id)
        assert cut.messages_pending == 1, "the message is still there"
        assert cut.unrecorded_tokens > 0, "the cut call was counted before the crash"
        assert wait_terminal(store, run_id, 120) is RunStatus.SUCCEEDED
        steps = store.steps(run_id)
        messages = [s for s in steps if s.kind is StepKind.MESSAGE]
        assert [m.response for m in messages] == ["Only Globex, please"], "delivered once"
        assert steps[0].kind is StepKind.MESSAGE, "before the model call made again"
        done = store.get_run(run_id)
        assert done.unrecorded_tokens == cut.unrecorded_tokens, "counted once"
        assert done.messages_pending == 0
    finally:
        engine.dispose()
