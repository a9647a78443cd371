"""Sending drive_run messages. Called only after the step that produced them committed.

Each message goes to the queue of its run's version (``<DAR_QUEUE>.<version>``,
:func:`runtime.engine.deployment.queue_name`), which only workers of that version consume:
routing stays the broker's job. The sender says the version when it knows it (a worker
handing on the run it just drove, the API the run it just stored); otherwise it is read
from the run's row. A run with no version, or one whose version cannot be read now, goes to
``DAR_QUEUE`` itself, which every worker consumes: a worker of another version refuses it
there and sends it on to its own queue (:meth:`runtime.engine.driver.Driver.drive`).
"""

from __future__ import annotations

import logging
from typing import Final

from celery import Celery

from db.deployments import DeploymentStore
from db.records import Dispatch
from db.store import RunStore
from runtime.engine.deployment import queue_name
from tasks.names import DRIVE_RUN
from tasks.publish import publisher

log = logging.getLogger(__name__)


class _Lookup:
    def __repr__(self) -> str:
        return "LOOKUP"


LOOKUP: Final = _Lookup()
"""``send_drive(..., deployment=LOOKUP)``: read the run's version from its row."""


def _versions(app: Celery, store: RunStore) -> DeploymentStore:
    cache: dict[int, DeploymentStore] = app.__dict__.setdefault("_dar_versions", {})
    key = id(store.engine)
    if key not in cache:
        cache[key] = DeploymentStore(store.engine)
    return cache[key]


def drive_queue(
    app: Celery, store: RunStore, run_id: object, deployment: str | _Lookup | None
) -> str:
    """The queue of the run's drive_run messages."""
    base: str = app.conf.dar_settings.queue if hasattr(app.conf, "dar_settings") else "dar"
    if isinstance(deployment, _Lookup):
        try:
            deployment = _versions(app, store).run_deployment(run_id)  # type: ignore[arg-type]
        except Exception as e:  # the database away: every worker consumes the base queue
            log.warning("run=%s version unknown (%s); sent to %s", str(run_id)[:8], e, base)
            deployment = None
    return queue_name(base, deployment)


def send_drive(
    app: Celery,
    store: RunStore,
    dispatch: Dispatch,
    *,
    deployment: str | _Lookup | None = LOOKUP,
) -> bool:
    """Send the message for ``dispatch`` to its run's version's queue (``deployment``: the
    run's version when the caller knows it). When the broker is down the run is marked
    undispatched, so the reaper's next sweep sends it; nothing is lost either way."""
    try:
        queue = drive_queue(app, store, dispatch.run_id, deployment)
        lean = None if dispatch.delay_seconds else publisher(app, DRIVE_RUN)
        if lean is not None:
            lean.send(str(dispatch.run_id), str(dispatch.token), queue)
        else:
            app.send_task(
                DRIVE_RUN,
                args=[str(dispatch.run_id), str(dispatch.token)],
                countdown=dispatch.delay_seconds or None,
                queue=queue,
            )
        return True
    except Exception as e:  # kombu/redis raise a variety of connection errors
        log.warning(
            "run=%s could not send drive_run (%s: %s); the reaper will send it",
            str(dispatch.run_id)[:8],
            type(e).__name__,
            e,
            extra={"run_id": str(dispatch.run_id)},
        )
        try:
            store.mark_undispatched(dispatch)
        except Exception:
            log.exception(
                "run=%s could not mark it undispatched either",
                dispatch.run_id,
                extra={"run_id": str(dispatch.run_id)},
            )
        return False
