"""The replay check and upgrades: a run's recorded history replayed against new code, with
no model call and no tool effect, decides whether the run may move to the new version; the
CLI's offline check gates a deploy with its exit status."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis
from celery import Celery
from flask.testing import FlaskClient
from werkzeug.serving import make_server

import api
from cli.main import main
from db.records import Dispatch, NewRun, Run, RunStatus, StepStatus
from runtime.agents import Agent
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.deployment import agent_definition, queue_name
from runtime.engine.driver import Outcome
from runtime.engine.replaycheck import check_run
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import make_celery
from tests.integration.replay_agents import agents, find_order


def _runtime(settings: Settings, llm: ScriptedLlm, deployment: str, variant: str) -> Runtime:
    rt = Runtime.build(replace(settings, deployment=deployment), llm=llm, pool_size=2)
    for agent in agents(variant):
        rt.agents.register(agent)
    rt.deployments.record_definitions(
        deployment, {n: agent_definition(rt.agents.get(n)) for n in rt.agents.names()}
    )
    return rt


@pytest.fixture
def v1(settings: Settings, llm: ScriptedLlm) -> Iterator[Runtime]:
    rt = _runtime(settings, llm, "v1", "v1")
    try:
        yield rt
    finally:
        rt.close()


def _start(rt: Runtime, agent: str, value: object) -> tuple[Run, Dispatch]:
    run, _ = rt.store.create_run(
        NewRun(
            agent=agent,
            input=value,
            model="claude-sonnet-4-5",
            max_steps=20,
            token_budget=10_000,
            timeout_seconds=600,
        )
    )
    return run, Dispatch(run.id, run.dispatch_token)


def _support_in_flight(rt: Runtime, llm: ScriptedLlm) -> Run:
    """An agent-loop run whose model asked for lookup_order: one step recorded."""
    llm.then_tool_use("toolu_1", "lookup_order", {"order_id": "42"}).then_text("shipped")
    run, d = _start(rt, "support", "where is order 42?")
    rt.driver().drive(d.run_id, d.token)
    return rt.store.get_run(run.id)


def _flow_in_flight(rt: Runtime) -> Run:
    """A durable run that fetched and now sleeps: two steps recorded."""
    run, d = _start(rt, "flow", "A-1")
    driver = rt.driver()
    current: Dispatch | None = d
    while current is not None and not current.delay_seconds:
        current = driver.drive(current.run_id, current.token).dispatch
    return rt.store.get_run(run.id)


@pytest.mark.parametrize(
    ("variant", "clean", "changes"),
    [
        ("v1", True, ()),
        ("prompt", True, ("system prompt changed",)),
        ("renamed-tool", False, ("tool 'find_order' added", "tool 'lookup_order' removed")),
    ],
)
def test_the_agent_loop_replays_unless_a_recorded_tool_is_gone(
    v1: Runtime,
    settings: Settings,
    llm: ScriptedLlm,
    variant: str,
    clean: bool,
    changes: tuple[str, ...],
) -> None:
    run = _support_in_flight(v1, llm)
    calls = len(llm.requests)
    new = _runtime(settings, llm, f"v2-{variant}", variant)
    try:
        recorded = new.deployments.definitions("v1")["support"]
        check = check_run(new.agents, run, v1.store.steps(run.id), recorded)
    finally:
        new.close()
    assert check.clean is clean
    assert set(check.configuration) == set(changes)
    assert len(llm.requests) == calls, "no model call"
    if not clean:
        assert check.divergence is not None
        assert check.divergence.seq == 1
        assert "lookup_order" in check.divergence.recorded
        assert "find_order" in check.divergence.asked


@pytest.mark.parametrize(("variant", "clean"), [("refactor", True), ("renamed-step", False)])
def test_a_durable_function_replays_when_it_asks_for_the_recorded_steps_in_order(
    v1: Runtime, settings: Settings, llm: ScriptedLlm, variant: str, clean: bool
) -> None:
    run = _flow_in_flight(v1)
    steps = v1.store.steps(run.id)
    assert [s.step_key for s in steps] == ["fetch:0", "sleep:0"]
    new = _runtime(settings, llm, f"v2-{variant}", variant)
    try:
        check = check_run(new.agents, run, steps)
    finally:
        new.close()
    assert check.clean is clean
    if not clean:
        assert check.divergence is not None
        assert check.divergence.seq == steps[0].seq
        assert "fetch:0" in check.divergence.recorded
        assert "load:0" in check.divergence.asked
    assert len(v1.store.steps(run.id)) == 2, "nothing written"


@pytest.fixture
def celery(settings: Settings) -> Iterator[Celery]:
    app = make_celery(settings, register=False)
    try:
        yield app
    finally:
        app.close()


def test_an_upgrade_moves_the_runs_that_replay_and_leaves_the_others_with_their_divergence(
    v1: Runtime,
    settings: Settings,
    llm: ScriptedLlm,
    celery: Celery,
    redis_client: redis.Redis,
) -> None:
    support = _support_in_flight(v1, llm)
    flow = _flow_in_flight(v1)
    # v2 renamed the agent loop's tool and refactored the durable function.
    v2 = Runtime.build(replace(settings, deployment="v2"), llm=llm, pool_size=2)
    v2.agents.register(agents("renamed-tool")[0])
    v2.agents.register(agents("refactor")[1])
    try:
        client: FlaskClient = api.create_app(runtime=v2, celery=celery).test_client()
        versions = client.get("/api/versions").get_json()
        assert versions["current"] == "v2"
        by_name = {v["deployment"]: v for v in versions["versions"]}
        assert by_name["v1"]["inFlight"] == 2
        assert by_name["v1"]["served"] is False
        assert versions["unservedRuns"] == 2
        metrics = client.get("/metrics").get_data(as_text=True)
        assert "dar_runs_unserved 2.0" in metrics

        dry = client.post("/api/versions/v1/upgrade", json={"dryRun": True}).get_json()
        assert dry["moved"] == []
        assert v1.store.get_run(flow.id).deployment == "v1"

        response = client.post("/api/versions/v1/upgrade", json={})
        assert response.status_code == 200
        report = response.get_json()
        assert report["moved"] == [str(flow.id)]
        (stayed,) = report["stayed"]
        assert stayed["runId"] == str(support.id)
        assert stayed["divergence"]["seq"] == 1
        assert "lookup_order" in stayed["divergence"]["recorded"]

        assert v1.store.get_run(flow.id).deployment == "v2"
        assert v1.store.get_run(support.id).deployment == "v1", "a divergent run stays"
        audit = [e for e in v1.store.audit_events(flow.id) if e.action == "upgrade"]
        assert len(audit) == 1
        assert audit[0].detail["from"] == "v1"
        assert audit[0].detail["to"] == "v2"
        run = client.get(f"/api/runs/{flow.id}").get_json()
        assert run["deployment"] == "v2"
        # It sleeps on its timer: its message waits in v2's queue with the new token.
        (raw,) = redis_client.lrange(queue_name(settings.queue, "v2"), 0, -1)
        body = json.loads(__import__("base64").b64decode(json.loads(raw)["body"]))
        assert body[0] == [str(flow.id), str(v1.store.get_run(flow.id).dispatch_token)]

        again = client.post("/api/versions/v2/upgrade", json={})
        assert again.status_code == 409
        bad = client.post("/api/versions/v1/upgrade", json={"runIds": ["x"]})
        assert bad.status_code == 400
        # null is not a list, nor "every run" (that is the field left out): the fuzzer's find
        null = client.post("/api/versions/v1/upgrade", json={"runIds": None, "dryRun": True})
        assert null.status_code == 400, null.get_json()
        assert "runIds" in null.get_json()["error"]["message"]
    finally:
        v2.close()

    # The moved run finishes on v2's code after its timer.
    v2 = Runtime.build(replace(settings, deployment="v2"), llm=llm, pool_size=2)
    v2.agents.register(agents("refactor")[1])
    try:
        v2.store.make_due_now(flow.id)
        after = v2.store.get_run(flow.id)
        current: Dispatch | None = Dispatch(after.id, after.dispatch_token)
        driver = v2.driver()
        time.sleep(1.1)  # its steps.sleep(1)
        while current is not None:
            current = driver.drive(current.run_id, current.token).dispatch
        done = v2.store.get_run(flow.id)
        assert done.status is RunStatus.SUCCEEDED
        assert done.result == "A-1"
    finally:
        v2.close()


@pytest.mark.parametrize(
    ("variant", "status", "text"),
    [
        ("refactor", 0, "0 diverge"),
        ("prompt", 0, "system prompt changed"),
        ("renamed-tool", 1, "find_order"),
        ("renamed-step", 1, "load:0"),
    ],
)
def test_dar_replay_check_gates_a_change_with_its_exit_status(
    v1: Runtime,
    llm: ScriptedLlm,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variant: str,
    status: int,
    text: str,
) -> None:
    _support_in_flight(v1, llm)
    _flow_in_flight(v1)
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("DAR_AGENT_MODULES", "tests.integration.replay_agents")
    monkeypatch.setenv("DAR_TEST_VARIANT", variant)
    monkeypatch.setenv("DAR_DEFAULT_AGENT", "support")
    assert main(["replay-check", "--deployment", "v1"]) == status
    out = capsys.readouterr().out
    assert text in out
    assert "2 recorded runs replayed" in out


def test_a_run_keeps_its_version_s_configuration_and_a_missing_tool_names_both_versions(
    v1: Runtime, settings: Settings, llm: ScriptedLlm
) -> None:
    llm.then_tool_use("toolu_1", "lookup_order", {"order_id": "42"}).then_text("shipped")
    run, d = _start(v1, "support", "where is order 42?")
    v2 = Runtime.build(replace(settings, deployment="v2"), llm=llm, pool_size=2)
    v2.agents.register(Agent(name="support", system_prompt="Be thorough.", tools=(find_order,)))
    try:
        assert v2.driver().drive(d.run_id, d.token).outcome is Outcome.REROUTED
        assert llm.requests == [], "v2's configuration never met v1's run"
        v1.driver().drive(d.run_id, d.token)
        (request,) = llm.requests
        assert "Be brief." in json.dumps(request.system), "v1's prompt, v1's run"
        assert [t["name"] for t in request.tools or []] == ["lookup_order"]

        # A run with no version (stored before versions) is any worker's: v2's lacks the
        # tool the run's model asked for, and says which code the run started on.
        with v1.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE run SET deployment = NULL WHERE id = %s", (run.id,))
        after = v1.store.get_run(run.id)
        v2.driver().drive(after.id, after.dispatch_token)
        tool_step = next(s for s in v1.store.steps(run.id) if s.step_key == "tool:toolu_1")
        assert tool_step.status is StepStatus.ERROR
        assert "unknown tool 'lookup_order'" in (tool_step.error or "")
        assert "this worker runs version v2" in (tool_step.error or "")
        assert "before versions were recorded" in (tool_step.error or "")
    finally:
        v2.close()


def test_dar_versions_and_dar_upgrade_show_what_waits_and_what_moved(
    v1: Runtime,
    settings: Settings,
    llm: ScriptedLlm,
    celery: Celery,
    capsys: pytest.CaptureFixture[str],
) -> None:
    support = _support_in_flight(v1, llm)
    flow = _flow_in_flight(v1)
    v2 = Runtime.build(replace(settings, deployment="v2"), llm=llm, pool_size=2)
    v2.agents.register(agents("renamed-tool")[0])
    v2.agents.register(agents("refactor")[1])
    server = make_server("127.0.0.1", 0, api.create_app(runtime=v2, celery=celery), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert main(["versions", "--api", url]) == 0
        out = capsys.readouterr().out
        (line,) = [row for row in out.splitlines() if row.startswith("v1 ")]
        assert line.split()[1:4] == ["0/0", "2", "NO"]
        assert "2 runs in flight belong to a version no worker serves" in out

        assert main(["upgrade", "v1", "--dry-run", "--api", url]) == 1
        out = capsys.readouterr().out
        assert "DIVERGES" in out
        assert "(dry run)" in out
        assert v1.store.get_run(flow.id).deployment == "v1"

        assert main(["upgrade", "v1", "--api", url]) == 1, "a run stayed"
        out = capsys.readouterr().out
        assert "1 moved, 1 stayed" in out
        assert str(support.id)[:8] in out
        assert v1.store.get_run(flow.id).deployment == "v2"
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()
        v2.close()


def test_a_failed_run_replays_clean_when_the_code_fails_as_recorded(
    v1: Runtime, settings: Settings, llm: ScriptedLlm
) -> None:
    run, d = _start(v1, "charge-or-fail", "A-2")
    driver = v1.driver()
    current: Dispatch | None = d
    while current is not None:
        current = driver.drive(current.run_id, current.token).dispatch
    failed = v1.store.get_run(run.id)
    assert failed.status is RunStatus.FAILED
    check = check_run(v1.agents, failed, v1.store.steps(run.id))
    assert check.clean, check.divergence
    assert check.steps == 2
