"""Sending drive_run messages. Called only after the step that produced them committed."""

from __future__ import annotations

import logging

from celery import Celery

from db.records import Dispatch
from db.store import RunStore
from tasks.names import DRIVE_RUN
from tasks.publish import publisher

log = logging.getLogger(__name__)


def send_drive(app: Celery, store: RunStore, dispatch: Dispatch) -> bool:
    """Send the message for ``dispatch``. When the broker is down the run is marked
    undispatched, so the reaper's next sweep sends it; nothing is lost either way."""
    try:
        lean = None if dispatch.delay_seconds else publisher(app, DRIVE_RUN)
        if lean is not None:
            lean.send(str(dispatch.run_id), str(dispatch.token))
        else:
            app.send_task(
                DRIVE_RUN,
                args=[str(dispatch.run_id), str(dispatch.token)],
                countdown=dispatch.delay_seconds or None,
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
