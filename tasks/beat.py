"""The beat's schedule loop: a thread in each beat process that starts the runs of due
schedule ticks (:class:`runtime.engine.sweeps.ScheduleLoop`); here it gets its database
connection and its sender of messages.

Celery beat's own schedule (the reaper, retention) lives in one process; schedules do not
depend on it: every beat claims ticks in PostgreSQL, a unique row per tick, so two beats (or
a beat restarted mid-pass) start exactly one run per tick. The loop needs no schedule file.
"""

from __future__ import annotations

import logging

from celery import Celery

from db.engine import make_engine
from db.store import RunStore, SubmitQuota
from runtime.config import Settings
from runtime.engine.deployment import deployment_version
from runtime.engine.preflight import check_agents
from runtime.engine.sweeps import ScheduleLoop
from runtime.engine.tokens import TokenSource
from tasks.dispatch import send_drive

log = logging.getLogger(__name__)


def beat_deployment(settings: Settings) -> str | None:
    """The version the runs of schedule ticks start on: the beat's code's (it loads the
    agents as a worker does). Agents that do not load here: no version (any worker)."""
    try:
        return deployment_version(check_agents(settings), settings)
    except Exception as e:
        log.error("the beat cannot load the agents (%s): scheduled runs get no version", e)
        return None


def start_schedule_loop(app: Celery, settings: Settings) -> ScheduleLoop:
    engine = make_engine(
        settings.require_database_url(),
        pool_size=1,
        max_overflow=1,
        application_name="dar-beat",
        prepare=settings.db_prepare,
    )
    store = RunStore(engine, deployment=beat_deployment(settings))
    # A schedule is a standing submit by its creator: its ticks start runs within the
    # creator's quota, and only while its token is configured and unexpired (the token file
    # is read again when it changes, as the API does).
    tokens = TokenSource(settings.api_tokens, settings.api_tokens_file)
    loop = ScheduleLoop(
        store,
        settings.schedule_poll_seconds,
        lambda d: send_drive(app, store, d),
        quota=SubmitQuota(settings.submit_rate_per_minute, settings.token_max_active_runs),
        creator_ok=tokens.may_act_for,
    )
    loop.start()
    return loop
