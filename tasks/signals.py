"""Worker signals: a configuration check before the worker starts, our logging instead of
Celery's, and a clean shutdown of the heartbeat."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery, signals

from db.errors import DarError
from runtime.agents import AgentRegistry
from runtime.engine.deployment import deployment_version, queue_name
from runtime.engine.preflight import check_startup
from runtime.observe.logctx import configure_logging, set_process_worker
from runtime.observe.tracing import configure_from_env
from tasks.drive import stop_serving, stop_worker_state, worker_state

log = logging.getLogger(__name__)


def raise_open_files_limit(concurrency: int) -> int:
    """Raise this process's soft limit of open files towards what ``concurrency`` steps in
    flight may hold (a socket per model call, with room for the pools, MCP pipes and logs),
    within the hard limit; say so when the hard limit is lower. Returns the soft limit now.

    Many hosts start processes with a soft limit of 1,024: a worker of the shipped
    concurrency would hit "Too many open files" on its 1,000th model call in flight."""
    try:
        import resource
    except ImportError:  # not a POSIX host
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * concurrency + 256
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning(
            "open files limit %d is below the %d that --concurrency %d may need: raise the "
            "hard limit (ulimit -Hn; systemd LimitNOFILE=; compose ulimits: nofile) or lower "
            "DAR_WORKER_CONCURRENCY",
            hard,
            needed,
            concurrency,
        )
    return target


def consume_own_version(app: Celery, worker: Any, registry: AgentRegistry) -> str:
    """The worker consumes its version's queue (``<DAR_QUEUE>.<version>``) besides the
    queues it was given (``DAR_QUEUE`` by default: the sweeps, and the runs with no
    version), before it consumes anything. Returns the version."""
    settings = app.conf.dar_settings
    deployment = deployment_version(registry, settings)
    app.conf.dar_deployment = deployment
    queue = queue_name(settings.queue, deployment)
    worker_app = getattr(worker, "app", None) or app
    worker_app.amqp.queues.select_add(queue)  # type: ignore[arg-type]  # a name is enough
    log.info("worker serves version %s (queue %s)", deployment, queue)
    return deployment


def beside(fn: Callable[..., object], *args: Any) -> None:
    """Call ``fn(*args)`` beside the caller, a signal handler: in a greenlet under the gevent
    pool (where the handler runs in the event loop, and a thread's start would block it), else
    in a daemon thread."""
    if "gevent" in sys.modules:
        from gevent import monkey

        if monkey.is_module_patched("threading"):
            import gevent

            gevent.spawn(fn, *args)
            return
    threading.Thread(target=fn, args=args, name="dar-beside", daemon=True).start()


def connect_signals(app: Celery) -> None:
    @signals.worker_init.connect(weak=False)
    def _check_config(sender: Any = None, **_: Any) -> None:
        concurrency = getattr(sender, "concurrency", None)
        if isinstance(concurrency, int):
            raise_open_files_limit(concurrency)
        # Before the worker consumes anything: a worker that cannot load its agents or reach
        # its database would otherwise say "ready." and fail every message it takes. One
        # line and a non-zero exit (SystemExit is not swallowed by Celery's signal dispatch).
        try:
            registry = check_startup(app.conf.dar_settings)
        except DarError as e:
            print(f"dar: worker cannot start: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        consume_own_version(app, sender, registry)

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
        ready_file = os.environ.get("DAR_READY_FILE")
        if ready_file:  # `dar dev` waits for it before it says the stack is up
            Path(ready_file).write_text(str(os.getpid()))

    @signals.beat_init.connect(weak=False)
    def _start_schedules(**_: Any) -> None:
        # Each beat claims the due ticks of schedules in PostgreSQL (tasks/beat.py).
        from tasks.beat import start_schedule_loop

        start_schedule_loop(app, app.conf.dar_settings)

    @signals.worker_process_init.connect(weak=False)
    def _pool_child(**_: Any) -> None:
        # A prefork pool's child: the main process says which version this worker serves
        # (and stops saying so when it stops); a child's heartbeat must not say it again.
        setattr(app, "dar_pool_child", True)  # noqa: B010 - Celery has no slot

    @signals.worker_shutting_down.connect(weak=False)
    def _stop_serving(**_: Any) -> None:
        # SIGTERM (a warm shutdown): the worker takes no new message from now on, so its
        # version is served by it no more, even while its steps in flight finish. Sent from
        # the signal handler: the database call runs beside it, not inside it.
        beside(stop_serving, app)

    @signals.worker_shutdown.connect(weak=False)
    def _stop_heartbeats(**_: Any) -> None:
        stop_worker_state(app)
