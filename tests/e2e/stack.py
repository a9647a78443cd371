"""The e2e tests' stack: ``dar dev``'s supervisor (:class:`DevStack`) on the test's PostgreSQL
and Redis, with leases short enough that a killed worker's runs move within seconds, and the
processes' log printed at the end (pytest shows it when the test fails).

A file whose tests can share one stack (a start and stop took 10-30 s each under CI's load)
starts it once (:func:`shared_stack`, in a module-scoped fixture) and hands each test the
stack settled (:func:`settle`: every process an earlier test killed or stopped is back and
ready) with the stack's output during that test printed (:func:`test_output`)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.error
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

from cli.devstack import DevStack, RestartPolicy
from cli.embedded import free_port
from db.schema import metadata
from runtime.config import Settings

FAST_LEASES = {
    "DAR_LEASE_SECONDS": "3",
    "DAR_HEARTBEAT_SECONDS": "1",
    "DAR_REAPER_INTERVAL_SECONDS": "0.5",
}


@contextlib.contextmanager
def running_stack(
    tmp_path: Path,
    database_url: str,
    redis_url: str,
    settings: Settings,
    *,
    pool: str | None = None,
    workers: int = 2,
    concurrency: int | None = 4,
    start_timeout: float = 90.0,
    log_tail: int = 20_000,
    restart: RestartPolicy | None = None,
    leases: dict[str, str] = FAST_LEASES,
    own_settings_only: bool = False,
    **env: str,
) -> Iterator[DevStack]:
    """API, ``workers`` Celery workers and a beat on the given services (the queue of
    ``settings``), ``leases`` short (:data:`FAST_LEASES`; ``{}``: the shipped ones); ``env``
    adds to (or overrides) the children's environment. ``pool`` or ``concurrency`` unset: the
    shipped default. ``own_settings_only``: no DAR_* or ANTHROPIC_* setting of this process
    leaks into the children. The processes' output goes to ``<tmp_path>/stack.log``, whose
    last ``log_tail`` characters are printed when the stack stops."""
    log_path = tmp_path / "stack.log"
    extra: dict[str, Any] = {} if pool is None else {"pool": pool}
    if concurrency is not None:
        extra["concurrency"] = concurrency
    if restart is not None:
        extra["restart"] = restart
    inherited = {
        k: v
        for k, v in os.environ.items()
        if not (own_settings_only and k.startswith(("DAR_", "ANTHROPIC_")))
    }
    with log_path.open("wb") as log:
        stack = DevStack(
            data_dir=tmp_path,
            port=free_port(),
            workers=workers,
            env={
                **inherited,
                "DATABASE_URL": database_url,
                "REDIS_URL": redis_url,
                "DAR_QUEUE": settings.queue,
                **leases,
                "ANTHROPIC_API_KEY": "",
                **env,
            },
            output=log,
            **extra,
        )
        try:
            stack.start(timeout=start_timeout)
            yield stack
        finally:
            stack.stop()
            print(log_path.read_text(errors="replace")[-log_tail:])


# -- one stack shared by a file's tests ------------------------------------------------------

QUICK_RESTARTS = RestartPolicy(base=0.5, cap=1.0, limit=50)
"""A killed worker back within a second, not after the shipped backoff (1 s doubling to
10 s), and no giving up after five deaths a minute: files that share a stack kill often."""


def shared_settings(test_db: str, redis_url: str) -> Settings:
    """What :func:`running_stack` takes from a test's ``settings`` for a stack shared by a
    file: the session's database, its own queue."""
    return replace(
        Settings(),
        database_url=test_db,
        redis_url=redis_url,
        queue=f"dar-test-{uuid.uuid4().hex[:10]}",
    )


def emptied(truncator: Engine) -> None:
    """The session's database as an earlier file of this process left it (the per-test
    ``database_url`` empties it for each test, not after the last one), emptied once for a
    file whose tests share a stack (and so do not ask for ``database_url``)."""
    tables = ", ".join(f'"{t.name}"' for t in reversed(metadata.sorted_tables))
    with truncator.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))


def settle(stack: DevStack, timeout: float = 120) -> None:
    """Supervise until every process of the stack runs and is ready (a worker an earlier
    test killed or stopped restarted, after its backoff) and the web answers."""
    deadline = time.monotonic() + timeout
    while True:
        stack.poll()
        down = [
            name
            for name in stack.supervised
            if (proc := stack.processes.get(name)) is None
            or proc.poll() is not None
            or not stack.is_ready(name)
        ]
        if not down:
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                if stack.request("GET", "/healthz")[0] == 200:
                    return
            down = ["web (/healthz)"]
        assert time.monotonic() < deadline, f"the stack is not back within {timeout:g}s: {down}"
        time.sleep(0.1)


def retire(stack: DevStack, name: str) -> None:
    """Kill a process a test added to a shared stack (its part is over), its children too
    (its own process group: a gunicorn's worker, a prefork pool), and forget it:
    :func:`settle` does not bring it back."""
    stack.supervised.pop(name, None)
    proc = stack.processes.pop(name, None)
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # DevStack starts each child in its own session
        proc.wait(timeout=10)


@contextlib.contextmanager
def output_during(log_path: Path, tail: int = 20_000) -> Iterator[None]:
    """The stack's output while the block runs, printed after it (pytest shows it when the
    test failed)."""
    start = log_path.stat().st_size
    try:
        yield
    finally:
        with log_path.open("rb") as log:
            log.seek(start)
            print(log.read().decode(errors="replace")[-tail:])
