"""The Celery tasks: ``dar.drive_run`` (one step of one run), ``dar.reap``,
``dar.retention`` and ``dar.stats_rollup`` (the sweeps), ``dar.upgrade_unserved`` (the
upgrade policies, handed to the newest version's workers). Glue only: what each does is the engine's
(:class:`~runtime.engine.driver.Driver`, :mod:`runtime.engine.sweeps`); a task builds the
process's state once, calls it, and sends the messages it returns."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from celery import Celery
from prometheus_client import CollectorRegistry, start_http_server

from db.deployments import DeploymentStore
from db.errors import LeaseLost
from db.records import Dispatch
from runtime.config import Settings
from runtime.engine import sweeps
from runtime.engine.bootstrap import Runtime
from runtime.engine.deployment import agent_definition, queue_name
from runtime.engine.driver import Driver, Outcome
from runtime.engine.upgrade import PolicyMemo, upgrade_by_policy
from runtime.observe.metrics import Metrics
from runtime.pipeline.heartbeat import Heartbeat
from tasks.dispatch import LOOKUP, send_drive
from tasks.names import DRIVE_RUN, REAP, RETENTION, STATS_ROLLUP, UPGRADE_UNSERVED

log = logging.getLogger(__name__)


class Registration:
    """This worker's row in ``deployment_worker`` (what ``GET /api/versions`` counts as a
    live worker of its version): renewed at every heartbeat, removed when the worker stops
    cleanly. Once :meth:`leave` is called it is never written again, so the heartbeat that
    keeps renewing the leases of the steps still finishing cannot bring it back."""

    def __init__(self, versions: DeploymentStore, worker: str, deployment: str) -> None:
        self.versions = versions
        self.worker = worker
        self.deployment = deployment
        self._lock = threading.Lock()
        self._left = False

    @property
    def left(self) -> bool:
        return self._left

    def seen(self) -> bool:
        """Renew the row; ``False`` once the worker has left (nothing written)."""
        with self._lock:  # a renewal in progress ends before leave() deletes
            if self._left:
                return False
            self.versions.worker_seen(self.worker, self.deployment)
            return True

    def leave(self) -> bool:
        """Serve nothing from now on: the row goes at once (a kill -9 leaves it to age out).
        Returns whether this was the first call; any call deletes again (and waits for one
        in progress), so the last one before the process exits is sure to have ended."""
        with self._lock:
            first = not self._left
            self._left = True
            self.versions.worker_gone(self.worker, self.deployment)
            return first


@dataclass
class WorkerState:
    """What one worker process builds once, lazily, after any fork."""

    runtime: Runtime
    heartbeat: Heartbeat
    driver: Driver
    registry: CollectorRegistry
    registration: Registration | None = None
    policy_memo: PolicyMemo = field(default_factory=PolicyMemo)


_state_lock = threading.Lock()


def worker_state(app: Celery) -> WorkerState:
    """This process's state for ``app``, built on first use. Kept on the app with the pid
    that built it, so a forked child builds its own engine and heartbeat thread."""
    held: tuple[int, WorkerState] | None = getattr(app, "dar_state", None)
    if held is not None and held[0] == os.getpid():
        state: WorkerState = held[1]
        return state
    with _state_lock:
        held = getattr(app, "dar_state", None)
        if held is not None and held[0] == os.getpid():
            state = held[1]
            return state
        settings: Settings = app.conf.dar_settings
        runtime: Runtime | None = getattr(app, "dar_runtime", None)
        if runtime is None:
            runtime = Runtime.build(settings)
        heartbeat = Heartbeat(
            runtime.lease_store(),
            settings.worker_name,
            lease_seconds=settings.lease_seconds,
            interval_seconds=settings.heartbeat_seconds,
        )
        registration = serve_deployment(app, runtime, heartbeat)
        heartbeat.start()
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        if settings.metrics_port:
            try:
                start_http_server(
                    settings.metrics_port, addr=settings.metrics_addr, registry=registry
                )
                log.info("worker metrics on :%d/metrics", settings.metrics_port)
            except OSError as e:
                log.error("worker metrics port %d unavailable: %s", settings.metrics_port, e)
        driver = runtime.driver(heartbeat=heartbeat, metrics=metrics)
        state = WorkerState(runtime, heartbeat, driver, registry, registration)
        setattr(app, "dar_state", (os.getpid(), state))  # noqa: B010 - Celery has no slot
        log.info("worker %s ready (pid %d)", settings.worker_name, os.getpid())
        return state


def serve_deployment(app: Celery, runtime: Runtime, heartbeat: Heartbeat) -> Registration | None:
    """This worker drives runs of its version (the queue the worker's main process chose,
    :func:`tasks.signals.connect_signals`) and says so at every heartbeat
    (``GET /api/versions``). A prefork pool's child does not say so: its main process, the
    one that consumes the version's queue, does, and only it knows when it stops."""
    chosen: str | None = getattr(app.conf, "dar_deployment", None)
    if chosen and chosen != runtime.deployment:
        log.warning(
            "this process's code is version %s, its worker's main process chose %s (agent "
            "definitions that change from one import to the next? set DAR_DEPLOYMENT): "
            "serving %s",
            runtime.deployment,
            chosen,
            chosen,
        )
        runtime.store.deployment = chosen
    deployment = runtime.deployment
    if deployment is None or getattr(app, "dar_pool_child", False):
        return None
    # The main pool's: the lease store's one connection is the heartbeat's native thread's
    # (runtime.pipeline.heartbeat), and this runs on a greenlet.
    versions = runtime.deployments
    registration = Registration(versions, runtime.settings.worker_name, deployment)
    definitions = {n: agent_definition(runtime.agents.get(n)) for n in runtime.agents.names()}
    recorded: list[bool] = []

    def seen() -> None:
        if not registration.seen():
            return
        if not recorded:  # once: what a later upgrade's replay check compares with
            versions.record_definitions(deployment, definitions)
            recorded.append(True)
            warn_if_renamed(deployment, versions.definitions(deployment), definitions)

    try:
        seen()
    except Exception as e:  # the database away: the heartbeat says it later
        log.warning("could not record the version this worker serves yet: %s", e)
    heartbeat.also_renew(seen)
    return registration


def warn_if_renamed(
    deployment: str, recorded: Mapping[str, object], here: Mapping[str, object]
) -> list[str]:
    """Agents whose definition differs from the one recorded under the same version's name:
    DAR_DEPLOYMENT named two different codes, and its runs may meet either."""
    differ = sorted(n for n in here if n in recorded and recorded[n] != here[n])
    if differ:
        log.warning(
            "version %s was recorded with other definitions of %s: give each code its own "
            "DAR_DEPLOYMENT (or leave it unset to derive one), or runs of %s may be driven by "
            "either",
            deployment,
            ", ".join(differ),
            deployment,
        )
    return differ


def served_sender(app: Celery, runtime: Runtime) -> Callable[[Dispatch], bool]:
    """The reaper's sender: a run whose version no live worker serves gets no message (the
    reaper re-sends a presumed-lost message every DAR_REDISPATCH_AFTER_SECONDS: to a queue
    nobody reads they would pile up). Its next sweep asks again; an upgrade sends one."""
    versions = runtime.deployments
    try:
        live: set[str] | None = versions.live_deployments()
    except Exception:  # unknown: send as usual
        live = None

    def send(dispatch: Dispatch) -> bool:
        try:
            deployment = versions.run_deployment(dispatch.run_id)
        except Exception:
            return send_drive(app, runtime.store, dispatch)
        if live is not None and deployment is not None and deployment not in live:
            log.info(
                "run=%s waits for a worker of version %s (none is live)",
                str(dispatch.run_id)[:8],
                deployment,
                extra={"run_id": str(dispatch.run_id)},
            )
            return False
        return send_drive(app, runtime.store, dispatch, deployment=deployment)

    return send


def upgrade_unserved(app: Celery, state: WorkerState) -> int:
    """The agents' upgrade policies (:func:`upgrade_by_policy`): runs of an ``upgrade="replay"``
    agent that no live worker serves move to this worker's version when it is the newest
    live one and their history replays clean. Returns how many moved."""
    runtime = state.runtime
    here = runtime.deployment
    if here is None or (state.registration is not None and state.registration.left):
        return 0  # (a worker that is leaving takes no run over)
    try:
        newest = runtime.deployments.newest_live()
        if newest is not None and newest != here:
            # The beat's sweep went to a worker of an older version: the newest version's
            # workers apply the policies (they know the agents' declared policies), so the
            # sweep is handed to their queue rather than waiting for one of them to draw it.
            if runtime.deployments.count_unserved_runs():
                app.send_task(
                    UPGRADE_UNSERVED,
                    queue=queue_name(runtime.settings.queue, newest),
                    expires=max(5.0, 5 * runtime.settings.reaper_interval_seconds),
                )
            return 0
        reports = upgrade_by_policy(
            runtime.store,
            runtime.deployments,
            runtime.agents,
            here,
            send=lambda d: send_drive(app, runtime.store, d, deployment=here),
            memo=state.policy_memo,
        )
    except Exception:  # the next sweep tries again
        log.exception("the agents' upgrade policies could not run")
        return 0
    return sum(len(r.moved) for r in reports)


def stop_serving(app: Celery) -> bool:
    """This worker process serves its version no more (a warm shutdown began: it takes no
    new message, and finishes the steps it holds): its row goes now, so ``GET
    /api/versions`` and the unserved-runs gauge say so at once, not when the row ages out.
    Returns whether a row was removed."""
    held: tuple[int, WorkerState] | None = getattr(app, "dar_state", None)
    if held is None or held[0] != os.getpid() or held[1].registration is None:
        return False
    registration = held[1].registration
    try:
        first = registration.leave()
    except Exception as e:  # the database away: the row ages out by its heartbeat
        log.warning("could not record that this worker stopped serving: %s", e)
        return False
    if first:
        log.info(
            "worker %s serves version %s no more", registration.worker, registration.deployment
        )
    return True


def stop_worker_state(app: Celery) -> None:
    held: tuple[int, WorkerState] | None = getattr(app, "dar_state", None)
    if held is not None and held[0] == os.getpid():
        held[1].heartbeat.stop()
        stop_serving(app)
        if getattr(app, "dar_runtime", None) is None:
            held[1].runtime.close()
    setattr(app, "dar_state", None)  # noqa: B010


def register_tasks(app: Celery) -> None:
    @app.task(name=DRIVE_RUN, ignore_result=True, shared=False)
    def drive_run(run_id: str, token: str) -> str:
        """Execute at most one step of the run, commit it, then send the next message."""
        state = worker_state(app)
        try:
            result = state.driver.drive(uuid.UUID(run_id), uuid.UUID(token))
        except LeaseLost as e:
            # Another worker took the run over while this step ran: the fence refused our
            # write and rolled it back. Nothing to redo here; the new holder carries on.
            log.warning(
                "run=%s step abandoned, nothing written: %s",
                run_id[:8],
                e,
                extra={"run_id": run_id},
            )
            return "LEASE_LOST"
        if result.dispatch is not None:
            # The run this worker drove is of its version (or of none): its queue, no lookup;
            # a message refused as another version's goes to the queue read from its row.
            own = result.dispatch.run_id == uuid.UUID(run_id)
            served = state.runtime.deployment if own else LOOKUP
            if result.outcome is Outcome.REROUTED:
                served = LOOKUP
            send_drive(app, state.runtime.store, result.dispatch, deployment=served)
        for woken in result.wakes:  # runs waiting for the concurrency-key slot just freed
            send_drive(app, state.runtime.store, woken)
        return str(result.outcome)

    @app.task(name=REAP, ignore_result=True, shared=False)
    def reap() -> int:
        """Re-send drive_run for runs whose message was lost, whose lease lapsed, or whose
        timer is due, and apply expired approvals' policies (:func:`sweeps.reap`)."""
        state = worker_state(app)
        store = state.runtime.store
        sent = sweeps.reap(store, state.runtime.settings, served_sender(app, state.runtime))
        upgrade_unserved(app, state)
        return sent

    @app.task(name=UPGRADE_UNSERVED, ignore_result=True, shared=False)
    def upgrade_unserved_runs() -> int:
        """The upgrade policies, on a worker of the newest live version (handed over by a
        sweep that an older version's worker drew: :func:`upgrade_unserved`)."""
        return upgrade_unserved(app, worker_state(app))

    @app.task(name=RETENTION, ignore_result=True, shared=False)
    def retention() -> int:
        """Delete finished runs older than DAR_RETENTION_DAYS (:func:`sweeps.delete_expired`)."""
        state = worker_state(app)
        return sweeps.delete_expired(state.runtime.store, state.runtime.settings)

    @app.task(name=STATS_ROLLUP, ignore_result=True, shared=False)
    def stats_rollup() -> int:
        """Roll up the closed hours of the console's stats (runtime.engine.sweeps)."""
        return sweeps.roll_up_stats(worker_state(app).runtime.store)
