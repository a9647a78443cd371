"""``steps.live_event``: a durable function's own events on the run's event stream, each
published once although the function replays from the top on every task."""

from __future__ import annotations

import json

import pytest

from db.records import RunStatus
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from tests.support import drive_to_end


def test_each_event_is_published_once_across_the_replays(runtime: Runtime) -> None:
    live = runtime.live
    assert live is not None

    @durable_agent("stages")
    def fn(_: object, steps: Steps) -> str:
        steps.live_event("progress.stage", {"stage": "fetch"}, once="fetch")
        steps.run("fetch", lambda: "data", type=str)
        steps.live_event("progress.stage", {"stage": "report"}, once="report")
        return steps.run("report", lambda: "done", type=str)

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("stages", {})
    drive_to_end(runtime.driver(), dispatch)  # three tasks: the first event replays in each
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    published = [e for e in live.entries(run.id) if e.type == "progress.stage"]
    assert [json.loads(e.text) for e in published] == [{"stage": "fetch"}, {"stage": "report"}]
    assert published[0].base < published[1].base, "each after the durable events before it"


@pytest.mark.parametrize("name", ["text.delta", "step.finished", "Progress", "stage"])
def test_the_runtimes_own_names_and_undotted_names_are_refused(runtime: Runtime, name: str) -> None:
    @durable_agent("misnamed")
    def fn(_: object, steps: Steps) -> str:
        steps.live_event(name, {}, once="x")
        return "never"

    runtime.agents.register(fn)
    run, dispatch = runtime.submit("misnamed", {})
    drive_to_end(runtime.driver(), dispatch)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.FAILED
    assert done.error is not None
    assert "live event name" in done.error
