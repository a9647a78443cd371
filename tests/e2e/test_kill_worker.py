"""End to end, real processes: API (gunicorn), two Celery workers, beat, PostgreSQL, Redis.
A worker is SIGKILLed in the middle of a model step; the other worker finishes the run from
its last checkpoint, and every step appears exactly once."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Engine

from cli.devstack import DevStack
from db.engine import make_engine
from db.records import RunStatus, StepKind, StepOrigin, StepStatus
from db.store import RunStore
from tests.e2e.stack import (
    QUICK_RESTARTS,
    emptied,
    output_during,
    running_stack,
    settle,
    shared_settings,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def stacks(
    test_db: str, _truncator: Engine, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], DevStack]]:
    """The stack of a worker pool, started when a test first asks for that pool and shared by
    the tests that follow on it (a start and stop took 10-30 s under CI's load): two stacks
    for the file's three tests, not three. One runs at a time."""
    emptied(_truncator)
    settings = shared_settings(test_db, redis_url)
    running: dict[str, tuple[DevStack, contextlib.ExitStack]] = {}

    def stack_of(pool: str) -> DevStack:
        if pool not in running:
            for _, other in running.values():
                other.close()
            running.clear()
            tmp = tmp_path_factory.mktemp(f"kill-{pool}")
            exits = contextlib.ExitStack()
            s = exits.enter_context(
                running_stack(
                    tmp,
                    test_db,
                    redis_url,
                    settings,
                    pool=pool,
                    start_timeout=60,
                    restart=QUICK_RESTARTS,
                    DAR_DEMO_LATENCY_MS="2500",
                )
            )
            running[pool] = (s, exits)
        return running[pool][0]

    try:
        yield stack_of
    finally:
        for _, exits in running.values():
            exits.close()


@pytest.fixture
def pool() -> str:
    return "gevent"


@pytest.fixture
def stack(stacks: Callable[[str], DevStack], pool: str) -> Iterator[DevStack]:
    """The pool's stack, every process up and ready (a worker an earlier test killed is back);
    its output during the test printed after it."""
    s = stacks(pool)
    settle(s)
    with output_during(s.data_dir / "stack.log"):
        yield s


@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_sigkill_mid_step_resumes_on_the_other_worker(stack: DevStack, pool: str) -> None:
    """The same with either worker pool: a thread per step, or a greenlet per step (gevent,
    for thousands of model calls in flight per process)."""
    for name, proc in stack.processes.items():
        if name.startswith("worker-"):
            assert ["--pool", pool] == [a for a in proc.args if a in ("--pool", pool)][:2]
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    try:
        status, accepted = stack.request(
            "POST",
            "/api/runs",
            {"input": "Which acme tickets are overdue?", "tokenBudget": 50000},
        )
        assert status == 201, accepted
        run_id = uuid.UUID(accepted["id"])

        # Wait until the second model call (seq 3) is in flight: two steps done, lease held.
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the run never reached its second model call"
            # Steps first, then the holder: a holder read after two DONE steps holds the third.
            done = [s for s in store.steps(run_id) if s.status is StepStatus.DONE]
            run = store.get_run(run_id)
            if len(done) == 2 and run.locked_by and run.locked_until:
                break
            time.sleep(0.05)
        victim = run.locked_by
        epoch_at_kill = run.lease_epoch
        stack.kill(victim)
        killed_at = time.monotonic()
        survivor = next(n for n in stack.processes if n.startswith("worker-") and n != victim)

        while True:
            assert time.monotonic() < killed_at + 60, "the run was not resumed"
            run = store.get_run(run_id)
            if run.status.terminal:
                break
            time.sleep(0.1)
        recovered_in = time.monotonic() - killed_at
        print(f"killed {victim} mid-step; run finished on {survivor} {recovered_in:.1f}s later")

        assert run.status is RunStatus.SUCCEEDED, run.error
        steps = store.steps(run_id)
        assert [(s.seq, s.kind, s.status) for s in steps] == [
            (1, StepKind.MODEL, StepStatus.DONE),
            (2, StepKind.TOOL, StepStatus.DONE),
            (3, StepKind.MODEL, StepStatus.DONE),
        ]
        assert len({s.step_key for s in steps}) == 3, "each step appears once"
        assert steps[2].worker == survivor, "the step in flight was redone by the survivor"
        assert steps[2].lease_epoch > epoch_at_kill, "under a new lease"
        assert run.tokens_used == sum(s.usage.total for s in steps)
        _, timeline = stack.request("GET", f"/api/runs/{run_id}/timeline")
        assert [(t["seq"], t["kind"], t["status"]) for t in timeline if t["kind"] != "AUDIT"] == [
            (1, "MODEL", "DONE"),
            (2, "TOOL", "DONE"),
            (3, "MODEL", "DONE"),
        ]
        # The recovery is on the record: whose lease lapsed, and where the run resumed.
        trail = [(t["actor"], t["action"], t["detail"]) for t in timeline if t["kind"] == "AUDIT"]
        lapsed = [d for a, act, d in trail if (a, act) == ("reaper", "recovery.redispatched")]
        assert [d["leaseHolder"] for d in lapsed] == [victim], trail
        assert (survivor, "recovery.resumed", {"seq": 3, "worker": survivor}) in trail
    finally:
        engine.dispose()


def test_sigkill_during_a_forked_run_resumes_it_without_repeating_copied_steps(
    stack: DevStack,
) -> None:
    """A fork's copied steps are history: the worker killed mid-step is replaced, the step in
    flight is redone under a new lease, and nothing before the fork point runs. On the
    shipped pool (gevent), the stack the test before left (its killed worker back)."""
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    try:
        status, accepted = stack.request(
            "POST", "/api/runs", {"input": "Which acme tickets are overdue?", "tokenBudget": 50000}
        )
        assert status == 201, accepted
        original_id = uuid.UUID(accepted["id"])
        deadline = time.monotonic() + 90
        while not store.get_run(original_id).status.terminal:
            assert time.monotonic() < deadline, "the original never finished"
            time.sleep(0.1)
        original = store.get_run(original_id)
        assert original.status is RunStatus.SUCCEEDED, original.error

        status, forked = stack.request("POST", f"/api/runs/{original_id}/fork", {"fromSeq": 3})
        assert status == 201, forked
        fork_id = uuid.UUID(forked["id"])
        deadline = time.monotonic() + 60
        while True:  # the fork's own model call (seq 3) is in flight
            assert time.monotonic() < deadline, "the fork never reached its model call"
            run = store.get_run(fork_id)
            if len(store.steps(fork_id)) == 2 and run.locked_by and run.locked_until:
                break
            time.sleep(0.05)
        victim = run.locked_by
        epoch_at_kill = run.lease_epoch
        stack.kill(victim)
        survivor = next(n for n in stack.processes if n.startswith("worker-") and n != victim)
        killed_at = time.monotonic()
        while not (run := store.get_run(fork_id)).status.terminal:
            assert time.monotonic() < killed_at + 60, "the fork was not resumed"
            time.sleep(0.1)

        assert run.status is RunStatus.SUCCEEDED, run.error
        steps = store.steps(fork_id)
        assert [(s.seq, s.kind, s.origin) for s in steps] == [
            (1, StepKind.MODEL, StepOrigin.COPIED),
            (2, StepKind.TOOL, StepOrigin.COPIED),
            (3, StepKind.MODEL, None),
        ]
        assert steps[2].worker == survivor
        assert steps[2].lease_epoch > epoch_at_kill
        assert run.tokens_used == steps[2].usage.total, "the fork paid for its own step only"
        source = store.steps(original_id)
        assert [s.finished_at for s in steps[:2]] == [s.finished_at for s in source[:2]], (
            "the copies are the original's records, not new executions"
        )
        assert store.get_run(original_id).tokens_used == original.tokens_used
    finally:
        engine.dispose()
