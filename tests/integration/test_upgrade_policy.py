"""An agent's upgrade policy (``upgrade="replay"``): the runs of a version no live worker
serves move by themselves to the newest live version, through the same replay check and the
same audit as an operator's upgrade (actor ``policy``), on the beat's sweep run by a worker of
that version (a sweep an older version's worker draws is handed to the newest's queue). A
divergent run stays, its divergence logged; a version still served drains first; an agent
left ``pinned`` (the default) waits for an operator."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis
from celery import Celery
from werkzeug.serving import make_server

import api
from cli.main import main
from db.records import Dispatch, NewRun, Run, RunStatus
from runtime.agents import Agent, AgentRegistry
from runtime.config import ConfigError, Settings
from runtime.durable.api import durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.deployment import agent_definition, queue_name
from runtime.engine.upgrade import POLICY_ACTOR
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import REAP, make_celery
from tasks.drive import stop_worker_state
from tasks.names import UPGRADE_UNSERVED
from tests.integration.replay_agents import agents


def _runtime(
    settings: Settings, llm: ScriptedLlm, deployment: str, variant: str, upgrade: str | None
) -> Runtime:
    rt = Runtime.build(replace(settings, deployment=deployment), llm=llm, pool_size=2)
    for agent in agents(variant):
        rt.agents.register(agent, upgrade=upgrade)
    rt.deployments.record_definitions(
        deployment, {n: agent_definition(rt.agents.get(n)) for n in rt.agents.names()}
    )
    return rt


@pytest.fixture
def v1(settings: Settings, llm: ScriptedLlm) -> Iterator[Runtime]:
    rt = _runtime(settings, llm, "v1", "v1", None)
    try:
        yield rt
    finally:
        rt.close()


def _start(rt: Runtime, agent: str, value: object) -> Dispatch:
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
    return Dispatch(run.id, run.dispatch_token)


def _in_flight(rt: Runtime, llm: ScriptedLlm) -> tuple[Run, Run]:
    """An agent-loop run whose model asked for lookup_order, and a durable run asleep."""
    llm.then_tool_use("toolu_1", "lookup_order", {"order_id": "42"}).then_text("shipped")
    d = _start(rt, "support", "where is order 42?")
    rt.driver().drive(d.run_id, d.token)
    flow = _start(rt, "flow", "A-1")
    current: Dispatch | None = flow
    while current is not None and not current.delay_seconds:
        current = rt.driver().drive(current.run_id, current.token).dispatch
    return rt.store.get_run(d.run_id), rt.store.get_run(flow.run_id)


@pytest.fixture
def worker(settings: Settings) -> Iterator[list[Celery]]:
    """Celery apps standing for worker processes (their tasks run in this process)."""
    apps: list[Celery] = []
    try:
        yield apps
    finally:
        for app in apps:
            stop_worker_state(app)
            app.close()


def _worker(apps: list[Celery], settings: Settings, runtime: Runtime, name: str) -> Celery:
    app = make_celery(replace(settings, worker_name=name))
    app.dar_runtime = runtime
    apps.append(app)
    return app


def test_the_policy_moves_a_clean_run_of_a_version_nobody_serves_and_leaves_a_divergent_one(
    v1: Runtime,
    settings: Settings,
    llm: ScriptedLlm,
    worker: list[Celery],
    caplog: pytest.LogCaptureFixture,
) -> None:
    support, flow = _in_flight(v1, llm)
    calls = len(llm.requests)
    # v2: the agent loop's prompt changed (replays: a configuration change), the durable
    # function's first step renamed (diverges); both agents declared upgrade="replay".
    v2 = Runtime.build(replace(settings, deployment="v2"), llm=llm, pool_size=2)
    v2.agents.register(agents("prompt")[0], upgrade="replay")
    v2.agents.register(agents("renamed-step")[1], upgrade="replay")
    try:
        assert v2.agents.get("support").upgrade == "replay"  # type: ignore[attr-defined]
        # No worker of v1 is live (it was stopped); a v2 worker runs the beat's sweep.
        reaper = _worker(worker, settings, v2, "worker-v2")
        with caplog.at_level(logging.WARNING, logger="runtime.engine.upgrade"):
            reaper.tasks[REAP].run()
        assert len(llm.requests) == calls, "the check made no model call"

        moved = v1.store.get_run(support.id)
        assert moved.deployment == "v2"
        (audit,) = [e for e in v1.store.audit_events(support.id) if e.action == "upgrade"]
        assert audit.actor == POLICY_ACTOR
        assert audit.detail["from"] == "v1"
        assert audit.detail["to"] == "v2"
        assert audit.detail["configurationChanges"] == ["system prompt changed"]

        stayed = v1.store.get_run(flow.id)
        assert stayed.deployment == "v1", "a divergent run stays"
        assert [e for e in v1.store.audit_events(flow.id) if e.action == "upgrade"] == []
        (warning,) = [r.getMessage() for r in caplog.records if str(flow.id)[:8] in r.getMessage()]
        assert "fetch:0" in warning
        assert "load:0" in warning

        # The next sweep neither replays nor logs the divergent run again.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="runtime.engine.upgrade"):
            reaper.tasks[REAP].run()
        assert not [r for r in caplog.records if str(flow.id)[:8] in r.getMessage()]

        # The moved run goes on, on v2's code: its tool, then its last model step.
        current: Dispatch | None = Dispatch(moved.id, moved.dispatch_token)
        driver = v2.driver()
        while current is not None:
            current = driver.drive(current.run_id, current.token).dispatch
        done = v2.store.get_run(support.id)
        assert done.status is RunStatus.SUCCEEDED, done.error
        assert done.result == "shipped"
        assert done.deployment == "v2"
        still = v2.store.get_run(flow.id)
        assert still.deployment == "v1"
        assert not still.status.terminal, "it waits for an operator (or a v1 worker)"
    finally:
        v2.close()


def test_nothing_moves_while_its_version_is_served_nor_to_an_older_live_version(
    v1: Runtime, settings: Settings, llm: ScriptedLlm, worker: list[Celery], redis_url: str
) -> None:
    support, flow = _in_flight(v1, llm)
    v2 = _runtime(settings, llm, "v2", "refactor", "replay")
    try:
        v1.deployments.worker_seen("worker-v1", "v1")  # a v1 worker still drains
        reaper = _worker(worker, settings, v2, "worker-v2")
        reaper.tasks[REAP].run()
        assert {v1.store.get_run(r.id).deployment for r in (support, flow)} == {"v1"}

        # v1's worker stops; v3 is deployed after v2 and is live: v3 takes them, not v2.
        v1.deployments.worker_gone("worker-v1", "v1")
        v1.deployments.worker_seen("worker-v3", "v3")
        v1.deployments.record_definitions("v3", {"support": {}})
        v3_queue = queue_name(settings.queue, "v3")
        broker = redis.Redis.from_url(redis_url)
        broker.delete(v3_queue)
        reaper.tasks[REAP].run()
        assert {v1.store.get_run(r.id).deployment for r in (support, flow)} == {"v1"}
        # ... and the sweep v2's worker drew is handed to v3's workers' queue, so the move
        # does not wait for a v3 worker to draw the beat's next sweep by chance.
        handed = [json.loads(m)["headers"]["task"] for m in broker.lrange(v3_queue, 0, -1)]
        assert handed == [UPGRADE_UNSERVED]
        broker.delete(v3_queue)

        v1.deployments.worker_gone("worker-v3", "v3")  # v3 rolled back: v2 is the newest
        reaper.tasks[UPGRADE_UNSERVED].run()  # as the handed-over sweep runs on the newest
        assert {v1.store.get_run(r.id).deployment for r in (support, flow)} == {"v2"}
    finally:
        v2.close()


def test_a_pinned_agent_s_runs_wait_for_an_operator(
    v1: Runtime, settings: Settings, llm: ScriptedLlm, worker: list[Celery]
) -> None:
    support, flow = _in_flight(v1, llm)
    v2 = _runtime(settings, llm, "v2", "refactor", None)  # the default: pinned
    try:
        reaper = _worker(worker, settings, v2, "worker-v2")
        reaper.tasks[REAP].run()
        assert {v1.store.get_run(r.id).deployment for r in (support, flow)} == {"v1"}
    finally:
        v2.close()


def test_the_policy_is_declared_with_the_agent_and_checked() -> None:
    assert Agent(name="a", system_prompt="p").upgrade == "pinned"
    assert Agent(name="a", system_prompt="p", upgrade="replay").upgrade == "replay"

    @durable_agent("f", upgrade="replay")
    def f(value: object, steps: object) -> object:
        return value

    assert f.upgrade == "replay"
    registry = AgentRegistry()
    registered = registry.register(Agent(name="b", system_prompt="p"), upgrade="replay")
    assert registered.upgrade == "replay"  # type: ignore[attr-defined]
    assert agent_definition(registered) == agent_definition(Agent(name="b", system_prompt="p"))
    with pytest.raises(ConfigError, match="upgrade='auto' is not a policy"):
        Agent(name="c", system_prompt="p", upgrade="auto")
    with pytest.raises(ConfigError, match="'pinned', 'replay'"):
        registry.register(Agent(name="d", system_prompt="p"), upgrade="always")


def test_the_api_and_dar_versions_show_each_agent_s_policy(
    settings: Settings, llm: ScriptedLlm, capsys: pytest.CaptureFixture[str]
) -> None:
    v2 = _runtime(settings, llm, "v2", "v1", None)
    v2.agents.replace(replace(v2.agents.get("flow"), upgrade="replay"))  # type: ignore[type-var]
    celery = make_celery(settings, register=False)
    server = make_server("127.0.0.1", 0, api.create_app(runtime=v2, celery=celery), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        body = api.create_app(runtime=v2, celery=celery).test_client().get("/api/versions")
        policies = body.get_json()["upgradePolicies"]
        assert policies["flow"] == "replay"
        assert policies["support"] == "pinned", "the default"
        assert main(["versions", "--api", url]) == 0
        out = capsys.readouterr().out
        assert 'once their version is served no more: flow (upgrade="replay")' in out
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()
        celery.close()
        v2.close()
