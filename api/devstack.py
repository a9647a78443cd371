"""The development stack: embedded PostgreSQL and Redis when none is configured, then the
Procfile's processes (web, workers, beat) as children. Stopping it stops all it started.

The end-to-end tests drive the same class, so what they prove is what ``dar dev`` runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from api.embedded import EmbeddedPostgres, EmbeddedRedis
from db.demo import TicketStore
from db.engine import make_engine
from db.migrate import upgrade

log = logging.getLogger(__name__)

WORKER_NAMES = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Children run from the directory that holds our packages, so that a folder called ``api``
# or ``tasks`` in the user's working directory cannot shadow them (gunicorn and celery put
# the working directory first on sys.path).
CODE_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class DevStack:
    data_dir: Path = field(default_factory=lambda: Path(".dar"))
    port: int = 8080
    workers: int = 2
    concurrency: int = 16
    beat: bool = True
    metrics_port_base: int = 0
    """Worker i serves its metrics on base + i; 0 turns the worker endpoints off."""
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    output: IO[bytes] | None = None
    """Where children write; ``None`` inherits this process's stdout/stderr."""

    database_url: str = ""
    redis_url: str = ""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _postgres: EmbeddedPostgres | None = None
    _redis: EmbeddedRedis | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- services -----------------------------------------------------------------------

    def start_services(self) -> None:
        self.database_url = self.env.get("DATABASE_URL", "")
        if not self.database_url:
            self._postgres = EmbeddedPostgres((self.data_dir / "pgdata").resolve())
            self.database_url = self._postgres.start()
            print(f"dar: embedded PostgreSQL at {self.database_url}", flush=True)
        self.redis_url = self.env.get("REDIS_URL", "")
        if not self.redis_url:
            self._redis = EmbeddedRedis()
            self.redis_url = self._redis.start()
            print(f"dar: embedded Redis at {self.redis_url}", flush=True)
        engine = make_engine(self.database_url, pool_size=1)
        try:
            upgrade(engine)
            TicketStore(engine).seed()
        finally:
            engine.dispose()

    # -- processes ----------------------------------------------------------------------

    def _child_env(self, **extra: str) -> dict[str, str]:
        # The user's working directory stays importable (after our packages), so that
        # DAR_AGENT_MODULES can name their own modules.
        path = os.pathsep.join(p for p in (os.getcwd(), self.env.get("PYTHONPATH", "")) if p)
        return {
            **self.env,
            "PYTHONPATH": path,
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def _spawn(self, name: str, args: list[str], **extra_env: str) -> None:
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", *args],
            env=self._child_env(**extra_env),
            cwd=CODE_ROOT,
            stdout=self.output,
            stderr=subprocess.STDOUT if self.output else None,
        )

    def start_web(self) -> None:
        self._spawn(
            "web",
            [
                "gunicorn",
                "--bind", f"127.0.0.1:{self.port}",
                "--workers", "2",
                "--threads", "4",
                "--access-logfile", "-",
                "api.wsgi:app",
            ],
        )  # fmt: skip

    def metrics_port(self, letter: str) -> int:
        return self.metrics_port_base + WORKER_NAMES.index(letter) if self.metrics_port_base else 0

    def start_worker(self, letter: str) -> None:
        name = f"worker-{letter}"
        self._spawn(
            name,
            [
                "celery", "--quiet", "-A", "tasks.app", "worker",
                "--pool", "threads",
                "--concurrency", str(self.concurrency),
                "--hostname", f"{name}@%h",
                "--without-gossip", "--without-mingle",
                "--loglevel", "INFO",
            ],
            DAR_WORKER_NAME=name,
            DAR_METRICS_PORT=str(self.metrics_port(letter)),
        )  # fmt: skip

    def start_beat(self) -> None:
        self._spawn(
            "beat",
            [
                "celery", "-A", "tasks.app", "beat",
                "--schedule", str((self.data_dir / "beat-schedule").resolve()),
                "--loglevel", "WARNING",
            ],
        )  # fmt: skip

    def start(self, timeout: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.start_services()
        self.start_web()
        for i in range(self.workers):
            self.start_worker(WORKER_NAMES[i])
        if self.beat:
            self.start_beat()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with status {proc.returncode}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                if self.request("GET", "/healthz")[0] == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the API did not answer on {self.api_url} within {timeout:.0f}s")

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.api_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def kill(self, name: str) -> None:
        """SIGKILL one process, as a crash would."""
        proc = self.processes[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.processes.clear()
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if self._postgres is not None:
            self._postgres.stop()
            self._postgres = None
