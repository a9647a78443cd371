"""End to end, real processes (API, two workers, beat, the demo model): an agent loop whose
model hands the question to a sub-agent (``examples/family.py``'s ``team``). A worker is
SIGKILLed while it runs the child's model call (the parent waiting parked, holding no
lease): the child finishes on the other worker, the parent is woken and answers with its
result, the child was started once and its tokens count against the parent. The killed
call's hold on the tree's budget (``budget_hold``) does not outlive the child's next call."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from cli.devstack import DevStack
from db.engine import make_engine
from db.records import RunStatus, StepKind, StepStatus
from db.store import RunStore
from runtime.config import Settings
from tests.e2e.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def stack(
    database_url: str, redis_url: str, settings: Settings, tmp_path: Path
) -> Iterator[DevStack]:
    with running_stack(
        tmp_path,
        database_url,
        redis_url,
        settings,
        log_tail=15_000,
        DAR_DEMO_LATENCY_MS="2500",
        DAR_AGENT_MODULES="examples.family",
    ) as s:
        yield s


def children(engine: object, parent: uuid.UUID) -> list[uuid.UUID]:
    with engine.connect() as conn:  # type: ignore[attr-defined]
        rows = conn.execute(
            text("SELECT id FROM run WHERE parent_run_id = :id ORDER BY created_at"),
            {"id": parent},
        )
        return [r.id for r in rows]


def holds(engine: object, run_id: uuid.UUID) -> list[int]:
    """The lease epochs of the run's model calls held against its tree's budget."""
    with engine.connect() as conn:  # type: ignore[attr-defined]
        rows = conn.execute(
            text("SELECT lease_epoch FROM budget_hold WHERE run_id = :id"), {"id": run_id}
        )
        return [r.lease_epoch for r in rows]


def test_sigkill_of_the_worker_running_a_sub_agent_while_its_parent_waits(
    stack: DevStack,
) -> None:
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    try:
        status, accepted = stack.request(
            "POST",
            "/api/runs",
            {"agent": "team", "input": "Which acme tickets are overdue?", "tokenBudget": 60000},
        )
        assert status == 201, accepted
        parent_id = uuid.UUID(accepted["id"])
        deadline = time.monotonic() + 60
        while True:  # the child's first model call in flight: its lease held
            assert time.monotonic() < deadline, "the sub-agent never started"
            kids = children(engine, parent_id)
            if kids:
                child = store.get_run(kids[0])
                if child.locked_by and child.status is RunStatus.RUNNING:
                    break
            time.sleep(0.05)
        while not holds(engine, child.id):  # admitted against the tree's budget
            assert time.monotonic() < deadline, "the child's call was never admitted"
            time.sleep(0.02)
        parent = store.get_run(parent_id)
        assert parent.locked_by is None, "the parent waits holding no lease"
        assert parent.wait_reason is not None
        assert "waiting for sub-agent" in parent.wait_reason
        victim = child.locked_by
        stack.kill(victim)
        print(f"killed {victim} in the middle of sub-agent run {str(child.id)[:8]}")

        deadline = time.monotonic() + 120
        while not store.get_run(parent_id).status.terminal:
            assert time.monotonic() < deadline, "the parent never finished"
            time.sleep(0.2)
        done = store.get_run(parent_id)
        assert done.status is RunStatus.SUCCEEDED, done.error
        [kid] = children(engine, parent_id)
        finished = store.get_run(kid)
        assert finished.status is RunStatus.SUCCEEDED, "started once, finished elsewhere"
        steps = store.steps(parent_id)
        assert [(s.kind, s.status) for s in steps] == [
            (StepKind.MODEL, StepStatus.DONE),
            (StepKind.CHILD, StepStatus.DONE),
            (StepKind.MODEL, StepStatus.DONE),
        ]
        assert steps[1].response == finished.result, "the child's answer is the tool's result"
        own = steps[0].usage.total + steps[2].usage.total
        # A child's unrecorded tokens (a call lost with the killed worker: its estimate) count
        # against its parent too (the guard sees the tree's spend).
        assert done.tokens_used == own + finished.tokens_used + finished.unrecorded_tokens
        assert holds(engine, kid) == [], "the killed call's hold went with the next call"
        _, shown = stack.request("GET", f"/api/runs/{parent_id}")
        assert [c["id"] for c in shown["children"]] == [str(kid)]
        _, timeline = stack.request("GET", f"/api/runs/{parent_id}/timeline")
        assert [t.get("childRunId") for t in timeline if t["kind"] == "CHILD"] == [str(kid)]
    finally:
        engine.dispose()
