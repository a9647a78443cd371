"""Where the benchmarks run: their own PostgreSQL database and Redis database, created and
migrated on demand, emptied between scenarios.

- ``DAR_BENCH_ADMIN_URL``: a PostgreSQL URL with CREATEDB (default
  ``postgresql://postgres@127.0.0.1:5432/postgres``); the benchmarks use the database
  ``DAR_BENCH_DB`` (default ``dar_bench``) on that server, never the one in the URL.
- ``DAR_BENCH_REDIS_URL``: the broker, default ``redis://127.0.0.1:6379/11`` (a Redis database
  number of its own: the benchmarks delete their queues and Redis' unacked bookkeeping in it).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from db.engine import make_engine, normalize_url
from db.migrate import upgrade
from db.records import Dispatch, NewRun
from db.store import RunStore
from runtime.config import Settings

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUEUE = "dar-bench"
HOP_QUEUE = "dar-bench-hop"
ALL_QUEUES = (QUEUE, QUEUE + "-2", HOP_QUEUE, HOP_QUEUE + "-2")
AGENT = "bench"
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT", "NEEDS_ATTENTION")


def admin_url() -> str:
    return normalize_url(
        os.environ.get("DAR_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )


def bench_db_name() -> str:
    return os.environ.get("DAR_BENCH_DB", "dar_bench")


def redis_url() -> str:
    return os.environ.get("DAR_BENCH_REDIS_URL", "redis://127.0.0.1:6379/11")


@dataclass
class BenchEnv:
    database_url: str
    redis_url: str
    engine: Engine
    store: RunStore
    notes: list[str] = field(default_factory=list)

    # -- database -----------------------------------------------------------------------

    def truncate(self) -> None:
        """Empty the run tables so every scenario starts from the same, small tables."""
        with self.engine.begin() as conn:
            conn.execute(text("TRUNCATE run_step, run CASCADE"))
        with self.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(
                text("VACUUM ANALYZE run, run_step")
            )

    def db_now(self) -> float:
        with self.engine.connect() as conn:
            return float(
                conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one()
            )

    def server_info(self) -> dict[str, Any]:
        with self.engine.connect() as conn:
            info = {
                "postgres": conn.execute(text("SHOW server_version")).scalar_one(),
                "synchronous_commit": conn.execute(text("SHOW synchronous_commit")).scalar_one(),
                "fsync": conn.execute(text("SHOW fsync")).scalar_one(),
                "max_connections": int(conn.execute(text("SHOW max_connections")).scalar_one()),
            }
        r = redis.Redis.from_url(self.redis_url)
        try:
            info["redis"] = r.info("server")["redis_version"]
        finally:
            r.close()
        return info

    # -- redis --------------------------------------------------------------------------

    def reset_redis(self, queues: Iterable[str] = ALL_QUEUES) -> None:
        r = redis.Redis.from_url(self.redis_url)
        try:
            keys = [*queues, "unacked", "unacked_index", "unacked_mutex"]
            for q in queues:
                keys += [f"{q}\x06\x16{p}" for p in range(10)]  # kombu priority sub-queues
            r.delete(*keys)
        finally:
            r.close()

    # -- runs ---------------------------------------------------------------------------

    def create_runs(self, inputs: Sequence[str]) -> list[Dispatch]:
        out: list[Dispatch] = []
        for spec in inputs:
            run, _ = self.store.create_run(
                NewRun(
                    agent=AGENT,
                    input=spec,
                    model="bench-model",
                    max_steps=100_000,
                    token_budget=1_000_000_000,
                    timeout_seconds=3600,
                )
            )
            out.append(Dispatch(run.id, run.dispatch_token))
        return out

    def wait_terminal(
        self, ids: Sequence[uuid.UUID], timeout: float, poll: float = 0.25, stall: float = 60.0
    ) -> dict[str, int]:
        """Wait until every run is terminal (or waiting for a human); returns the count by
        status. Raises TimeoutError when they do not all finish in ``timeout`` seconds, or
        when no step is committed for ``stall`` seconds (look at the workers' log)."""
        deadline = time.monotonic() + timeout
        last_progress, last_seen = time.monotonic(), (-1, -1)
        while True:
            with self.engine.connect() as conn:
                rows = conn.execute(
                    text("SELECT status, count(*) FROM run WHERE id = ANY(:ids) GROUP BY status"),
                    {"ids": list(ids)},
                ).all()
                steps = int(
                    conn.execute(
                        text("SELECT count(*) FROM run_step WHERE run_id = ANY(:ids)"),
                        {"ids": list(ids)},
                    ).scalar_one()
                )
            counts = {r[0]: int(r[1]) for r in rows}
            done = sum(n for s, n in counts.items() if s in TERMINAL)
            if done >= len(ids):
                return counts
            now = time.monotonic()
            if (steps, done) != last_seen:
                last_seen, last_progress = (steps, done), now
            if now > deadline:
                raise TimeoutError(f"runs did not finish within {timeout:.0f}s: {counts}")
            if now - last_progress > stall:
                raise TimeoutError(
                    f"no progress for {stall:.0f}s ({steps} steps, {counts}): see the worker "
                    "logs in bench/results/logs/"
                )
            time.sleep(poll)

    def step_rows(self, ids: Sequence[uuid.UUID]) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = (
                conn.execute(
                    text(
                        "SELECT run_id, seq, kind, status, worker, latency_ms, lease_epoch,"
                        " extract(epoch FROM started_at) AS started,"
                        " extract(epoch FROM finished_at) AS finished"
                        " FROM run_step WHERE run_id = ANY(:ids) ORDER BY run_id, seq"
                    ),
                    {"ids": list(ids)},
                )
                .mappings()
                .all()
            )
        return [
            {**dict(r), "started": float(r["started"]), "finished": float(r["finished"] or 0)}
            for r in rows
        ]

    def run_rows(self, ids: Sequence[uuid.UUID]) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = (
                conn.execute(
                    text(
                        "SELECT id, status, error, locked_by, lease_epoch,"
                        " extract(epoch FROM created_at) AS created,"
                        " extract(epoch FROM finished_at) AS finished"
                        " FROM run WHERE id = ANY(:ids)"
                    ),
                    {"ids": list(ids)},
                )
                .mappings()
                .all()
            )
        return [dict(r) for r in rows]

    # -- settings for processes -----------------------------------------------------------

    def settings(self, **overrides: Any) -> Settings:
        base = Settings(
            database_url=self.database_url,
            redis_url=self.redis_url,
            queue=QUEUE,
            agent_modules=("bench.agents",),
            llm_factory="bench.models:build",
            worker_name="bench-inproc",
        )
        from dataclasses import replace

        return replace(base, **overrides)

    def worker_env(self, **extra: str) -> dict[str, str]:
        """Environment for worker processes: the bench agent and model, our queue."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DAR_", "ANTHROPIC_")) and k not in ("DATABASE_URL", "REDIS_URL")
        }
        env.update(
            {
                "DATABASE_URL": self.database_url,
                "REDIS_URL": self.redis_url,
                "DAR_QUEUE": QUEUE,
                "DAR_AGENT_MODULES": "bench.agents",
                "DAR_LLM_FACTORY": "bench.models:build",
                "DAR_LOG_LEVEL": "INFO",
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
                ),
            }
        )
        env.update(extra)
        return env

    def close(self) -> None:
        self.engine.dispose()


def prepare() -> BenchEnv:
    """Create (if needed) and migrate the benchmark database; check Redis answers."""
    admin = create_engine(admin_url(), isolation_level="AUTOCOMMIT")
    name = bench_db_name()
    try:
        with admin.connect() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            ).first()
            if not exists:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    url = make_url(admin_url()).set(database=name).render_as_string(hide_password=False)
    engine = make_engine(url, pool_size=4, application_name="dar-bench")
    upgrade(engine)
    r = redis.Redis.from_url(redis_url())
    try:
        r.ping()
    finally:
        r.close()
    return BenchEnv(database_url=url, redis_url=redis_url(), engine=engine, store=RunStore(engine))
