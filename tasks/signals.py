"""Worker signals: our logging instead of Celery's, and a clean shutdown of the heartbeat."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery, signals

from runtime.logctx import configure_logging
from tasks.drive import stop_worker_state


def connect_signals(app: Celery) -> None:
    @signals.setup_logging.connect(weak=False)
    def _setup_logging(**_: Any) -> None:
        configure_logging(
            os.environ.get("DAR_LOG_FORMAT", "console"), os.environ.get("DAR_LOG_LEVEL", "INFO")
        )

    @signals.worker_shutdown.connect(weak=False)
    def _stop_heartbeats(**_: Any) -> None:
        stop_worker_state(app)
