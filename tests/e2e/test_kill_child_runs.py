"""End to end, real processes (API, two workers, beat): a parent durable function with two
child runs. A worker is SIGKILLed while it runs a child's step (the parent waiting on that
child, parked, holding no lease): the child finishes on the other worker, the parent is woken
and finishes, and no child is started twice."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from cli.devstack import DevStack
from db.engine import make_engine
from db.records import RunStatus
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
        DAR_AGENT_MODULES="tests.e2e.family_agents",
    ) as s:
        yield s


def children(engine: object, parent: uuid.UUID) -> list[tuple[uuid.UUID, str]]:
    with engine.connect() as conn:  # type: ignore[attr-defined]
        rows = conn.execute(
            text("SELECT id, status FROM run WHERE parent_run_id = :id ORDER BY created_at"),
            {"id": parent},
        )
        return [(r.id, r.status) for r in rows]


def test_sigkill_of_the_worker_running_a_child_while_its_parent_waits(stack: DevStack) -> None:
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    try:
        status, accepted = stack.request(
            "POST", "/api/runs", {"agent": "family-parent", "input": {}}
        )
        assert status == 201, accepted
        parent_id = uuid.UUID(accepted["id"])
        deadline = time.monotonic() + 60
        while True:  # the first child's step in flight: STARTED, lease held
            assert time.monotonic() < deadline, "the first child never started its step"
            kids = children(engine, parent_id)
            if kids:
                child = store.get_run(kids[0][0])
                started = [s for s in store.steps(child.id) if s.step_key == "double:0"]
                if started and child.locked_by:
                    break
            time.sleep(0.05)
        parent = store.get_run(parent_id)
        assert parent.locked_by is None, "the parent waits holding no lease"
        assert parent.status is RunStatus.RUNNING
        victim = child.locked_by
        stack.kill(victim)
        print(f"killed {victim} in the middle of child {str(child.id)[:8]}'s step")

        deadline = time.monotonic() + 120
        while not store.get_run(parent_id).status.terminal:
            assert time.monotonic() < deadline, "the parent never finished"
            time.sleep(0.2)
        done = store.get_run(parent_id)
        assert (done.status, done.result) == (RunStatus.SUCCEEDED, 6), done.error
        kids = children(engine, parent_id)
        assert [s for _, s in kids] == ["SUCCEEDED", "SUCCEEDED"], "each child started once"
        _, shown = stack.request("GET", f"/api/runs/{parent_id}")
        assert [c["id"] for c in shown["children"]] == [str(k) for k, _ in kids]
    finally:
        engine.dispose()
