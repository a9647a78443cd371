"""The e2e tests' stack: ``dar dev``'s supervisor (:class:`DevStack`) on the test's PostgreSQL
and Redis, with leases short enough that a killed worker's runs move within seconds, and the
processes' log printed at the end (pytest shows it when the test fails)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cli.devstack import DevStack
from cli.embedded import free_port
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
    concurrency: int = 4,
    start_timeout: float = 90.0,
    log_tail: int = 20_000,
    **env: str,
) -> Iterator[DevStack]:
    """API, ``workers`` Celery workers and a beat on the given services; ``env`` adds to (or
    overrides) the children's environment. ``pool`` unset: the shipped default."""
    log_path = tmp_path / "stack.log"
    extra: dict[str, Any] = {} if pool is None else {"pool": pool}
    with log_path.open("wb") as log:
        stack = DevStack(
            data_dir=tmp_path,
            port=free_port(),
            workers=workers,
            concurrency=concurrency,
            env={
                **os.environ,
                "DATABASE_URL": database_url,
                "REDIS_URL": redis_url,
                "DAR_QUEUE": settings.queue,
                **FAST_LEASES,
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
