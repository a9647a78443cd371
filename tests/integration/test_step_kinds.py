"""The engine reads each step kind's policy (``runtime.pipeline.kinds.KINDS``) where it decides:
a body that a crash interrupted runs again when its kind says so (``steps.llm``,
``steps.side_effect``), and a ``steps.run`` with an effect does not."""

from __future__ import annotations

from typing import Any

import pytest

from db.records import RunStatus
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.testing.testkit import SimulatedCrash
from tests.integration.test_early_stops import drive_through_crashes


def _crashes_once(calls: list[str], value: str) -> Any:
    def body(*_: Any) -> str:
        calls.append(value)
        if len(calls) == 1:
            raise SimulatedCrash("the worker died inside the step's body")
        return value

    return body


@pytest.mark.parametrize(
    ("kind", "status", "ran"),
    [
        ("side_effect", RunStatus.SUCCEEDED, 2),
        ("llm", RunStatus.SUCCEEDED, 2),
        ("run", RunStatus.NEEDS_ATTENTION, 1),
    ],
)
def test_an_interrupted_body_runs_again_only_when_its_kind_says_so(
    runtime: Runtime, kind: str, status: RunStatus, ran: int
) -> None:
    calls: list[str] = []
    body = _crashes_once(calls, "v")

    @durable_agent(f"kinds-{kind}")
    def fn(_: object, steps: Steps) -> str:
        if kind == "side_effect":
            return steps.side_effect("value", body, type=str)
        if kind == "llm":
            return steps.llm("value", body, type=str)
        return steps.run("value", body, type=str)

    runtime.agents.register(fn)
    _, dispatch = runtime.submit(fn.name, {})
    assert drive_through_crashes(runtime, dispatch) is status
    assert len(calls) == ran
