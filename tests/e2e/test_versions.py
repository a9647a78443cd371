"""End to end, real processes: workers of two versions side by side on one database and one
Redis. Each version's runs are driven only by its own workers, through a kill -9 of a worker
of each version; the runs a dead version leaves behind wait, visibly, until an operator
upgrades them through the replay check, and then finish on the other version's workers."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from sqlalchemy import Engine

from cli.devstack import DevStack
from cli.embedded import free_port
from db.engine import make_engine
from db.records import Dispatch, NewRun, RunStatus
from db.store import RunStore
from runtime.config import Settings
from tasks.celery_app import make_celery
from tasks.dispatch import send_drive
from tests.e2e.stack import (
    QUICK_RESTARTS,
    emptied,
    output_during,
    retire,
    running_stack,
    settle,
    shared_settings,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

V1_WORKERS = ("worker-A", "worker-B")
V2_WORKER = "worker-V2"
QUESTION = "Which acme tickets are overdue?"


@dataclass(frozen=True)
class Shared:
    stack: DevStack
    settings: Settings
    processes: frozenset[str]
    """The processes every test starts with (what a test adds is stopped after it)."""


@pytest.fixture(scope="module")
def shared(
    test_db: str, _truncator: Engine, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Shared]:
    """web, beat and two workers of v1; one worker of v2 beside them, whose demo agent has
    the upgrade policy ``replay`` (tests.e2e.policy_agents). One stack for the file's tests
    (a start and stop took 10-30 s each under CI's load): each test kills or stops workers,
    and the ``stack`` fixture brings them back before the next. In the file's order, only
    the last test waits for that (the one before killed a worker of each version).

    (The first test's policy move once waited for the v2 worker to draw the beat's sweep,
    which whichever worker reads it first takes: within a second in most runs, after 20 to
    60 s in some. A v1 worker that draws it now hands it to v2's queue.)"""
    emptied(_truncator)
    settings = shared_settings(test_db, redis_url)
    with running_stack(
        tmp_path_factory.mktemp("versions"),
        test_db,
        redis_url,
        settings,
        pool="threads",
        start_timeout=90,
        restart=QUICK_RESTARTS,
        DAR_DEMO_LATENCY_MS="1500",
        DAR_DEPLOYMENT="v1",
        # A message a killed worker had taken and not started is sent again after this, not
        # the shipped 30 s: the v1 run it carried waited that long after the kill.
        DAR_REDISPATCH_AFTER_SECONDS="3",
    ) as s:
        _spawn_worker(
            s,
            V2_WORKER,
            "v2",
            pool="threads",
            concurrency=4,
            DAR_AGENT_MODULES="tests.e2e.policy_agents",
        )
        yield Shared(s, settings, frozenset(s.supervised))


@pytest.fixture
def settings(shared: Shared) -> Settings:
    """The stack's settings (its queue), not a test's own: those come with a ``database_url``
    that empties the database under the shared stack."""
    return shared.settings


@pytest.fixture
def stack(shared: Shared) -> Iterator[DevStack]:
    """The file's stack, every process of it up and ready (what an earlier test killed or
    stopped is back); what the test added to it is stopped after it."""
    s = shared.stack
    settle(s)
    try:
        with output_during(s.data_dir / "stack.log"):
            yield s
    finally:
        for name in set(s.supervised) - shared.processes:
            retire(s, name)


V3_WORKER = "worker-V3"


def test_a_worker_stopped_cleanly_serves_its_version_no_more_at_once(
    stack: DevStack, settings: Settings, redis_url: str
) -> None:
    """SIGTERM (a warm shutdown) to the only worker of a version while it holds a long model
    step: the version shows unserved at once, while the worker still finishes that step (its
    row goes when the shutdown begins, not when the process exits nor when its last heartbeat
    ages out a minute later), and the heartbeat that renews the step's lease meanwhile does
    not bring the row back. The shipped pool (gevent).

    Then the upgrade policy, in real processes: v2, the newest live version, declares its
    demo agent ``upgrade="replay"``, so the beat's sweep on v2's worker moves the run left on
    v3 (once v3's worker let go of it) through the replay check, and it finishes on v2."""
    _spawn_worker(
        stack,
        V3_WORKER,
        "v3",
        pool="gevent",
        concurrency=20,
        DAR_DEMO_LATENCY_MS="8000",  # a model call the shutdown waits for
    )
    worker = stack.processes[V3_WORKER]
    engine = make_engine(stack.database_url, pool_size=2)
    v3_store = RunStore(engine, deployment="v3")
    app = make_celery(replace(settings, redis_url=redis_url), register=False)

    def v3() -> dict[str, Any]:
        status, versions = stack.request("GET", "/api/versions")
        assert status == 200, versions
        found = [v for v in versions["versions"] if v["deployment"] == "v3"]
        return found[0] if found else {"served": False, "liveWorkers": 0, "workers": []}

    try:
        deadline = time.monotonic() + 30
        while not v3()["served"]:
            assert time.monotonic() < deadline, "the v3 worker never said it serves v3"
            time.sleep(0.2)
        run, _ = v3_store.create_run(_question())
        assert send_drive(app, v3_store, Dispatch(run.id, run.dispatch_token))
        deadline = time.monotonic() + 30
        while v3_store.get_run(run.id).locked_by != V3_WORKER:  # inside its first model call
            assert time.monotonic() < deadline, "the v3 worker never took the run"
            time.sleep(0.05)

        worker.terminate()
        stopped_at = time.monotonic()
        while v3()["served"]:
            # well under the 60 s a row takes to age out, and under the step's 8 s
            assert time.monotonic() - stopped_at < 5, "the stopping worker still serves v3"
            time.sleep(0.1)
        assert worker.poll() is None, "unserved at once: the worker still finishes its step"
        _, versions = stack.request("GET", "/api/versions")
        assert versions["unservedRuns"] >= 1, versions
        worker.wait(timeout=90)
        assert v3_store.steps(run.id), "the step in flight was finished, not lost"
        time.sleep(2.5)  # past two of the stack's heartbeats (DAR_HEARTBEAT_SECONDS=1)
        after = v3()
        assert not after["served"], after
        assert after["workers"] == [], after
        log = (stack.data_dir / "stack.log").read_text(errors="replace")
        assert "BlockingSwitchOutError" not in log  # nothing blocked gevent's signal handler

        deadline = time.monotonic() + 90
        while not (done := v3_store.get_run(run.id)).status.terminal:
            assert time.monotonic() < deadline, f"the policy never moved it: {done}"
            time.sleep(0.2)
        assert done.status is RunStatus.SUCCEEDED, done.error
        assert done.deployment == "v2"
        workers = [s.worker for s in v3_store.steps(run.id)]
        assert workers[0] == V3_WORKER
        assert set(workers[1:]) == {V2_WORKER}, workers
        (audit,) = [e for e in v3_store.audit_events(run.id) if e.action == "upgrade"]
        assert (audit.actor, audit.detail["from"], audit.detail["to"]) == ("policy", "v3", "v2")
    finally:
        app.close()
        engine.dispose()


def _wait_for_holder(store: RunStore, run_ids: list[uuid.UUID], workers: set[str]) -> str:
    """A worker of ``workers`` inside a step of one of the runs."""
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"no run held by {workers}"
        for run_id in run_ids:
            run = store.get_run(run_id)
            if run.locked_by in workers and store.steps(run_id):
                return run.locked_by
        time.sleep(0.05)


def test_each_version_drives_only_its_runs_and_an_upgrade_moves_a_dead_version_s_runs(
    stack: DevStack, settings: Settings, redis_url: str
) -> None:
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    v2_store = RunStore(engine, deployment="v2")  # a v2 web process's submits
    app = make_celery(replace(settings, redis_url=redis_url), register=False)
    try:
        status, versions = stack.request("GET", "/api/versions")
        assert status == 200, versions
        # (only this stack's versions: a worker another test of this process stopped a moment
        # ago may still be listed, under its own version, until its last heartbeat ages out)
        live = {
            v["deployment"]: v["liveWorkers"]
            for v in versions["versions"]
            if v["deployment"] in ("v1", "v2")
        }
        assert live == {"v1": 2, "v2": 1}, versions

        v1_runs = []
        for _ in range(4):
            status, accepted = stack.request("POST", "/api/runs", {"input": QUESTION})
            assert status == 201, accepted
            v1_runs.append(uuid.UUID(accepted["id"]))
        v2_runs = []
        for _ in range(3):
            run, _ = v2_store.create_run(_question())
            assert run.deployment == "v2"
            assert send_drive(app, v2_store, Dispatch(run.id, run.dispatch_token))
            v2_runs.append(run.id)

        # kill -9 a worker of each version in the middle of a step.
        v1_victim = _wait_for_holder(store, v1_runs, set(V1_WORKERS))
        stack.kill(v1_victim)
        _wait_for_holder(store, v2_runs, {V2_WORKER})
        stack.kill(V2_WORKER)
        killed_at = time.monotonic()

        # v1's runs finish on the surviving v1 worker; v2's wait: no v2 worker is left.
        deadline = killed_at + 120
        while not all(store.get_run(r).status.terminal for r in v1_runs):
            assert time.monotonic() < deadline, "v1's runs did not finish"
            time.sleep(0.2)
        time.sleep(4)  # past the killed v2 worker's lease: the reaper has re-sent its run
        waiting = [store.get_run(r) for r in v2_runs]
        assert not any(r.status.terminal for r in waiting), "no v1 worker drove a v2 run"
        for run_id in v2_runs:
            assert {s.worker for s in store.steps(run_id)} <= {V2_WORKER}

        # The operator upgrades v2's runs to the web's version (v1) through the replay check.
        moved: set[str] = set()
        deadline = time.monotonic() + 60
        while len(moved) < len(v2_runs):
            assert time.monotonic() < deadline, f"not every run moved: {moved}"
            status, report = stack.request("POST", "/api/versions/v2/upgrade", {})
            assert status == 200, report
            assert report["stayed"] == [], report
            moved |= set(report["moved"])
            time.sleep(0.5)
        deadline = time.monotonic() + 120
        while not all(store.get_run(r).status.terminal for r in v2_runs):
            assert time.monotonic() < deadline, "the upgraded runs did not finish"
            time.sleep(0.2)

        for run_id in v1_runs:
            run = store.get_run(run_id)
            assert run.status is RunStatus.SUCCEEDED, run.error
            assert run.deployment == "v1"
            workers = {s.worker for s in store.steps(run_id)}
            assert workers <= set(V1_WORKERS), f"a v1 run's step by {workers}"
        started_on_v2 = 0
        for run_id in v2_runs:
            run = store.get_run(run_id)
            assert run.status is RunStatus.SUCCEEDED, run.error
            assert run.deployment == "v1"
            steps = store.steps(run_id)
            assert len({s.step_key for s in steps}) == len(steps), "each step once"
            by_v2 = [s.seq for s in steps if s.worker == V2_WORKER]
            by_v1 = [s.seq for s in steps if s.worker in V1_WORKERS]
            assert by_v1, "it finished on v1"
            # (a run whose first step was in flight when v2's worker died recorded none on v2)
            if by_v2:
                started_on_v2 += 1
                assert max(by_v2) < min(by_v1), "v2's steps, then (after the upgrade) v1's"
            actions = [e.action for e in store.audit_events(run_id)]
            assert actions.count("upgrade") == 1
        assert started_on_v2 >= 1, "the run held when v2's worker died had steps on v2"
    finally:
        app.close()
        engine.dispose()


def _request(url: str, method: str, path: str, body: object = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
    except OSError as e:
        return 0, str(e)


def _question() -> NewRun:
    """A run of the demo agent on the file's question, as the API would create it."""
    return NewRun(
        agent="acme-tickets",
        input=QUESTION,
        model="claude-sonnet-4-5",
        max_steps=20,
        token_budget=50_000,
        timeout_seconds=600,
    )


def _spawn_worker(
    stack: DevStack, name: str, deployment: str, *, pool: str, concurrency: int, **env: str
) -> None:
    """A worker of version ``deployment`` beside the stack's, once it is ready."""
    stack._spawn(
        name,
        [
            "celery", "--quiet", "-A", "tasks.app", "worker",
            "--pool", pool, "--concurrency", str(concurrency),
            "--hostname", f"{name}@%h",
            "--without-gossip", "--without-mingle", "--loglevel", "INFO",
        ],
        DAR_WORKER_NAME=name,
        DAR_DEPLOYMENT=deployment,
        DAR_METRICS_PORT="0",
        **env,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not stack.is_ready(name):
        assert time.monotonic() < deadline, f"the {deployment} worker never became ready"
        assert stack.processes[name].poll() is None, f"the {deployment} worker exited"
        time.sleep(0.1)


def _spawn_web(stack: DevStack, name: str, deployment: str) -> str:
    """A web process of another version beside the stack's (a rolling deploy's new web)."""
    port = free_port()
    stack._spawn(
        name,
        [
            "gunicorn", "--bind", f"127.0.0.1:{port}", "--worker-class", "gevent",
            "--workers", "1", "--logger-class", "api.gunicorn_logging.Logger", "api.wsgi:app",
        ],
        DAR_DEPLOYMENT=deployment,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while _request(url, "GET", "/healthz")[0] != 200:
        assert time.monotonic() < deadline, f"{name} never answered"
        assert stack.processes[name].poll() is None, f"{name} exited"
        time.sleep(0.2)
    return url


def test_a_rolling_deploy_drains_the_old_version_and_starts_new_runs_on_the_new(
    stack: DevStack,
) -> None:
    """v1's web and workers run; v2's web and worker start beside them: runs submitted to
    v1's web finish on v1's workers, runs submitted to v2's web on v2's worker; once v1 has
    no run in flight its workers stop, and the versions say so."""
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    try:
        v1_runs = []
        for _ in range(3):
            status, accepted = stack.request("POST", "/api/runs", {"input": QUESTION})
            assert status == 201, accepted
            v1_runs.append(uuid.UUID(accepted["id"]))
        v2_web = _spawn_web(stack, "web-v2", "v2")
        v2_runs = []
        for _ in range(3):
            status, accepted = _request(v2_web, "POST", "/api/runs", {"input": QUESTION})
            assert status == 201, accepted
            v2_runs.append(uuid.UUID(accepted["id"]))
        assert {store.get_run(r).deployment for r in v1_runs} == {"v1"}
        assert {store.get_run(r).deployment for r in v2_runs} == {"v2"}
        status, versions = _request(v2_web, "GET", "/api/versions")
        assert versions["current"] == "v2"

        deadline = time.monotonic() + 120
        while True:  # drain: v1 has no run in flight
            assert time.monotonic() < deadline, "v1 never drained"
            _, versions = stack.request("GET", "/api/versions")
            in_flight = {v["deployment"]: v["inFlight"] for v in versions["versions"]}
            if in_flight.get("v1", 0) == 0:
                break
            time.sleep(0.2)
        for name in V1_WORKERS:  # stop v1's workers (SIGTERM: a clean stop)
            stack.processes[name].terminate()
            stack.processes[name].wait(timeout=30)
        _, versions = stack.request("GET", "/api/versions")
        by_version = {v["deployment"]: v for v in versions["versions"]}
        assert "v1" not in by_version or by_version["v1"]["workers"] == [], versions

        deadline = time.monotonic() + 120
        while not all(store.get_run(r).status.terminal for r in v2_runs):
            assert time.monotonic() < deadline, "v2's runs did not finish"
            time.sleep(0.2)
        for run_id in v1_runs:
            assert store.get_run(run_id).status is RunStatus.SUCCEEDED
            assert {s.worker for s in store.steps(run_id)} <= set(V1_WORKERS)
        for run_id in v2_runs:
            assert store.get_run(run_id).status is RunStatus.SUCCEEDED
            assert {s.worker for s in store.steps(run_id)} == {V2_WORKER}
    finally:
        engine.dispose()
