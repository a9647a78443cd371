"""Recovery you can see: a run whose worker died (its lease lapsed) is re-dispatched by the
reaper and resumed by another worker, and both are on the record: audit events in the
timeline (``recovery.redispatched``: whose lease lapsed, and when; ``recovery.resumed``: at
which seq, by whom) and ``run.recovery`` events in the live stream. A message that was merely
late, or a timer that came due, is not a recovery and records nothing."""

from __future__ import annotations

from api import create_app
from db.records import Dispatch, RunStatus
from runtime.client import parse_sse
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import make_celery
from tests.support import drive_to_end, expire_lease, register_agent, submit


def test_a_lapsed_lease_and_the_resume_are_on_the_record(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    register_agent(runtime.agents)
    llm.then_text("Done.")
    run, dispatch = submit(runtime.store)
    # worker-A claims the run and dies holding it: nothing more from it.
    assert runtime.store.claim(run.id, dispatch.token, "worker-A", 30.0) is not None
    expire_lease(runtime.engine, run.id)
    (again,) = [d for d in runtime.store.redispatch_due(redispatch_after=30) if d.run_id == run.id]
    drive_to_end(runtime.driver(worker="worker-B"), again)
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED

    trail = [(e.actor, e.action, e.detail) for e in runtime.store.audit_events(run.id)]
    assert [t[:2] for t in trail] == [
        ("reaper", "recovery.redispatched"),
        ("worker-B", "recovery.resumed"),
    ]
    assert trail[0][2]["leaseHolder"] == "worker-A"
    assert trail[0][2]["leaseLapsedAt"]
    assert trail[1][2] == {"seq": 1, "worker": "worker-B"}

    app = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    client = app.test_client()
    timeline = client.get(f"/api/runs/{run.id}/timeline").get_json()
    shown = [(t["kind"], t.get("action")) for t in timeline]
    assert shown == [
        ("AUDIT", "recovery.redispatched"),
        ("AUDIT", "recovery.resumed"),
        ("MODEL", None),
    ], "the recovery comes before the step it recovered"
    stream = client.get(f"/api/runs/{run.id}/events").get_data(as_text=True)
    recovery = [e.data for e in parse_sse(stream.splitlines()) if e.name == "run.recovery"]
    assert [(e["action"], e["by"]) for e in recovery] == [
        ("recovery.redispatched", "reaper"),
        ("recovery.resumed", "worker-B"),
    ]
    assert recovery[0]["detail"]["leaseHolder"] == "worker-A"
    assert recovery[1]["detail"]["seq"] == 1


def test_a_late_message_re_sent_is_not_a_recovery(runtime: Runtime, llm: ScriptedLlm) -> None:
    register_agent(runtime.agents)
    llm.then_text("Done.")
    run, _ = submit(runtime.store)
    expire_lease(runtime.engine, run.id)  # no holder: only the message is presumed lost
    (again,) = [d for d in runtime.store.redispatch_due(redispatch_after=0) if d.run_id == run.id]
    drive_to_end(runtime.driver(worker="worker-B"), Dispatch(again.run_id, again.token))
    assert runtime.store.get_run(run.id).status is RunStatus.SUCCEEDED
    assert runtime.store.audit_events(run.id) == []
