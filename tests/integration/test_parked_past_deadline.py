"""A run parked on a sleep or a wait (holding no lease) is not left RUNNING, counted in
flight, past its deadline: its timer never lies beyond the deadline, so the reaper sends it
then and the guard ends it TIMED_OUT."""

from __future__ import annotations

import time
from typing import Any

import pytest

from db.records import Dispatch, NewRun, RunStatus
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from tests.support import drive_to_end


@durable_agent("deadline-sleeper")
def sleeper(_: Any, steps: Steps) -> str:
    steps.sleep(3600)
    return "woke"


@durable_agent("deadline-waiter")
def waiter(_: Any, steps: Steps) -> Any:
    return steps.wait_for("go", timeout=3600)


@pytest.mark.parametrize("agent", [sleeper, waiter])
def test_a_parked_run_ends_timed_out_at_its_deadline(runtime: Runtime, agent: Any) -> None:
    runtime.agents.register(agent)
    run, _ = runtime.store.create_run(
        NewRun(
            agent=agent.name,
            input="x",
            model="m",
            max_steps=10,
            token_budget=1000,
            timeout_seconds=1,
        )
    )
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    parked = runtime.store.get_run(run.id)
    assert parked.status is RunStatus.RUNNING
    assert parked.run_at <= parked.deadline_at, "the timer lies beyond the deadline"
    time.sleep(max(0.0, (parked.deadline_at - parked.created_at).total_seconds()) + 0.3)
    (due,) = [d for d in runtime.store.redispatch_due(redispatch_after=0) if d.run_id == run.id]
    drive_to_end(runtime.driver(), due)
    assert runtime.store.get_run(run.id).status is RunStatus.TIMED_OUT
