"""Worker signals: our logging instead of Celery's, and a clean shutdown of the heartbeat."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery, signals

from runtime.logctx import configure_logging, set_process_worker
from runtime.tracing import configure_from_env
from tasks.drive import stop_worker_state, worker_state


def connect_signals(app: Celery) -> None:
    @signals.setup_logging.connect(weak=False)
    def _setup_logging(**_: Any) -> None:
        configure_logging(
            os.environ.get("DAR_LOG_FORMAT", "console"), os.environ.get("DAR_LOG_LEVEL", "INFO")
        )
        set_process_worker(app.conf.dar_settings.worker_name)
        configure_from_env()

    @signals.worker_ready.connect(weak=False)
    def _build_eagerly(**_: Any) -> None:
        # Connect to PostgreSQL, start the heartbeat and the metrics endpoint at boot rather
        # than on the first task, so a misconfigured worker fails now and scrapes work.
        worker_state(app)

    @signals.worker_shutdown.connect(weak=False)
    def _stop_heartbeats(**_: Any) -> None:
        stop_worker_state(app)
