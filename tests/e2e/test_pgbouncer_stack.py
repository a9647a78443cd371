"""End to end through a real PgBouncer in transaction mode: the API (gunicorn), two gevent
Celery workers and beat all connect through the pooler (the test database was migrated
directly, as `dar migrate` should be). Runs flow, a worker is SIGKILLed mid-step, every run
finishes with each step once, and nothing fails on session state the pooler does not keep
(prepared statements, above all)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.devstack import DevStack
from db.engine import make_engine
from db.records import RunStatus, StepStatus
from db.store import RunStore
from runtime.config import Settings
from tests.e2e.stack import running_stack
from tests.pgbouncer import PgBouncer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

RUNS = 12


@pytest.fixture
def stack(
    pooled_database_url: str, redis_url: str, settings: Settings, tmp_path: Path
) -> Iterator[DevStack]:
    with running_stack(
        tmp_path,
        pooled_database_url,
        redis_url,
        settings,
        pool="gevent",
        concurrency=20,
        start_timeout=60,
        # a run's next message the killed worker had taken and not started is sent again
        # after this, not the shipped 30 s
        DAR_REDISPATCH_AFTER_SECONDS="3",
        DAR_DEMO_LATENCY_MS="1500",
    ) as s:
        yield s
    text = (tmp_path / "stack.log").read_text(errors="replace")
    for bad in ("InvalidSqlStatementName", "DuplicatePreparedStatement"):
        assert bad not in text, f"{bad} in a process log"


class PoolWatch:
    """Samples PgBouncer's pools while the test runs: the most client and server connections
    of the test database seen at once."""

    def __init__(self, bouncer: PgBouncer, database: str) -> None:
        self.bouncer = bouncer
        self.database = database
        self.clients = 0
        self.servers = 0
        self.waiting = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for pool in self.bouncer.show("POOLS"):
                if pool["database"] != self.database:
                    continue
                self.clients = max(self.clients, pool["cl_active"] + pool["cl_waiting"])
                in_use = pool["sv_active"] + pool["sv_idle"] + pool["sv_used"] + pool["sv_tested"]
                self.servers = max(self.servers, in_use)
                self.waiting = max(self.waiting, pool["cl_waiting"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_runs_and_a_killed_worker_through_pgbouncer(
    stack: DevStack, pgbouncer: PgBouncer, database_url: str
) -> None:
    engine = make_engine(database_url, pool_size=2)  # the checks read directly
    store = RunStore(engine)
    watch = PoolWatch(pgbouncer, engine.url.database or "")
    try:
        ids = []
        for i in range(RUNS):
            status, accepted = stack.request(
                "POST", "/api/runs", {"input": f"Which acme tickets are overdue? {i}"}
            )
            assert status == 201, accepted
            ids.append(uuid.UUID(accepted["id"]))

        deadline = time.monotonic() + 60
        while True:  # a worker holds a run whose first step is done: kill it mid-step
            assert time.monotonic() < deadline, "no run reached its second step"
            held = [
                r
                for r in map(store.get_run, ids)
                if r.locked_by and not r.status.terminal and r.tokens_used > 0
            ]
            if held:
                break
            time.sleep(0.05)
        victim = held[0].locked_by
        assert victim is not None
        stack.kill(victim)

        deadline = time.monotonic() + 120
        while not all(store.get_run(i).status.terminal for i in ids):
            assert time.monotonic() < deadline, "runs did not finish after the kill"
            time.sleep(0.2)
        for run_id in ids:
            run = store.get_run(run_id)
            assert run.status is RunStatus.SUCCEEDED, (run_id, run.error)
            steps = store.steps(run_id)
            assert [s.seq for s in steps] == list(range(1, len(steps) + 1))
            assert len({s.step_key for s in steps}) == len(steps), "each step once"
            assert all(s.status is StepStatus.DONE for s in steps)
            assert run.tokens_used == sum(s.usage.total for s in steps)
            status, timeline = stack.request("GET", f"/api/runs/{run_id}/timeline")
            assert status == 200
            assert len([t for t in timeline if t["kind"] != "AUDIT"]) == len(steps)
    finally:
        watch.stop()
        engine.dispose()
    print(
        f"pgbouncer: at most {watch.clients} client and {watch.servers} server connections "
        f"of the test database at once, {watch.waiting} clients waiting"
    )
    assert watch.servers <= pgbouncer.pool_size
    assert "prepared statement" not in pgbouncer.log_text()
