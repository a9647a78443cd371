"""The beat's schedule loop: a thread in each beat process that starts the runs of due
schedule ticks (:func:`runtime.engine.schedules.tick_schedules`).

Celery beat's own schedule (the reaper, retention) lives in one process; schedules do not
depend on it: every beat claims ticks in PostgreSQL, a unique row per tick, so two beats (or
a beat restarted mid-pass) start exactly one run per tick. The loop needs no schedule file.
"""

from __future__ import annotations

import logging
import threading

from celery import Celery

from db.engine import make_engine
from db.store import RunStore
from runtime.config import Settings
from runtime.engine.schedules import tick_schedules
from tasks.dispatch import send_drive

log = logging.getLogger(__name__)


class ScheduleLoop:
    """Every ``DAR_SCHEDULE_POLL_SECONDS``: one pass over the due schedules, then the
    drive_run messages of the runs it started (after their commit)."""

    def __init__(self, app: Celery, store: RunStore, interval_seconds: float) -> None:
        self.app = app
        self.store = store
        self.interval_seconds = interval_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dar-schedules", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("schedule loop started (every %gs)", self.interval_seconds)

    def stop(self) -> None:
        self._stop.set()

    def pass_once(self) -> int:
        started = tick_schedules(self.store)
        for dispatch in started:
            log.info(
                "run=%s started by its schedule's tick",
                str(dispatch.run_id)[:8],
                extra={"run_id": str(dispatch.run_id)},
            )
            send_drive(self.app, self.store, dispatch)
        return len(started)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                self.pass_once()
            except Exception as e:  # the database away for a moment: try again next pass
                log.warning(
                    "schedule pass failed (%s: %s); next pass in %gs",
                    type(e).__name__,
                    e,
                    self.interval_seconds,
                )


def start_schedule_loop(app: Celery, settings: Settings) -> ScheduleLoop:
    engine = make_engine(
        settings.require_database_url(),
        pool_size=1,
        max_overflow=1,
        application_name="dar-beat",
        prepare=settings.db_prepare,
    )
    loop = ScheduleLoop(app, RunStore(engine), settings.schedule_poll_seconds)
    loop.start()
    return loop
