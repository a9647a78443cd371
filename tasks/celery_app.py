"""The Celery app, configured for a durable system.

- Redis delivers at most once (``ack_emulation`` off): PostgreSQL, not the broker, decides
  what still has to run, and the reaper re-sends the message of any run that no worker holds.
  Kombu's ack emulation (an "unacked" hash restored on reconnect) adds nothing here and, in
  Celery/kombu 5.7, makes a thread-pool worker exit with "Unrecoverable error" when Redis
  restarts while tasks are in flight (found by the chaos suite);
- late acks and reject-on-worker-lost stay on for brokers that honour them;
- prefetch 1: a worker reserves no more than it runs;
- no result backend: PostgreSQL holds every result;
- short broker timeouts and few publish retries, so a dead Redis never hangs the API: the
  run is stored and the reaper sends its message later.
"""

from __future__ import annotations

from celery import Celery

from runtime.config import Settings
from tasks.names import DRIVE_RUN as DRIVE_RUN
from tasks.names import REAP as REAP
from tasks.names import RETENTION as RETENTION
from tasks.names import STATS_ROLLUP as STATS_ROLLUP

STATS_ROLLUP_INTERVAL_SECONDS = 300.0
"""How often the beat rolls up the closed hours of the console's stats (db/store/)."""


def make_celery(settings: Settings, *, register: bool = True) -> Celery:
    app = Celery("dar", broker=settings.require_redis_url(), set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        result_backend=None,
        # One backend object per process, not one per thread: under the gevent pool every
        # task runs on a new greenlet, and a per-"thread" backend was built afresh for each
        # task (~3% of a worker's CPU per step). There is no backend (DisabledBackend): no
        # state to share.
        result_backend_thread_safe=True,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=settings.queue,
        task_routes={
            DRIVE_RUN: {"queue": settings.queue},
            REAP: {"queue": settings.queue},
            RETENTION: {"queue": settings.queue},
            STATS_ROLLUP: {"queue": settings.queue},
        },
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=3,
        broker_transport_options={
            "ack_emulation": False,
            "visibility_timeout": settings.visibility_timeout_seconds,
            "socket_timeout": 5,
            "socket_connect_timeout": 3,
            # A connection that died quietly (Redis failed over, a partition) is found by a
            # PING before use after 10 s idle and by TCP keepalives, not at the next timeout.
            "health_check_interval": 10,
            "socket_keepalive": True,
        },
        task_publish_retry=True,
        task_publish_retry_policy={
            "max_retries": 2,
            "interval_start": 0,
            "interval_step": 0.2,
            "interval_max": 0.5,
        },
        worker_hijack_root_logger=False,
        # Off by default: four event publishes per step cost ~25% of a hop. Flower switches
        # the workers' events on at run time when it starts.
        worker_send_task_events=False,
        task_send_sent_event=False,
        beat_schedule={
            "reap": {"task": REAP, "schedule": settings.reaper_interval_seconds},
            "retention": {"task": RETENTION, "schedule": settings.retention_interval_seconds},
            "stats-rollup": {"task": STATS_ROLLUP, "schedule": STATS_ROLLUP_INTERVAL_SECONDS},
        },
    )
    app.conf.dar_settings = settings
    if register:
        from tasks.drive import register_tasks

        register_tasks(app)
    return app
