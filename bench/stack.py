"""Worker fleets for the benchmarks: the runtime's own (through cli.devstack.DevStack, the
class `dar dev` and the end-to-end tests use) and the bare-hop baseline's."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from celery import Celery

from bench.env import HOP_QUEUE, QUEUE, RESULTS, ROOT, BenchEnv
from bench.hop import make_hop_app
from cli.devstack import WORKER_NAMES, DevStack
from tasks.celery_app import make_celery


def log_file(name: str) -> IO[bytes]:
    d = RESULTS / "logs"
    d.mkdir(parents=True, exist_ok=True)
    return (d / f"{name}.log").open("wb")


def wait_ping(app: Celery, names: list[str], timeout: float = 60) -> None:
    """Until every named worker answers a broadcast ping (it consumes from the broker)."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            for reply in app.control.ping(timeout=0.5) or []:
                seen.update(h.split("@")[0] for h in reply)
        if all(n in seen for n in names):
            return
        time.sleep(0.2)
    raise RuntimeError(f"workers {sorted(set(names) - seen)} did not answer within {timeout}s")


class RuntimeFleet:
    """N runtime worker processes (``celery -A tasks.app worker --pool threads|gevent``) and
    optionally beat, configured for the bench agent and model."""

    def __init__(
        self,
        env: BenchEnv,
        *,
        workers: int,
        concurrency: int,
        beat: bool = True,
        name: str = "fleet",
        extra_env: dict[str, str] | None = None,
        queue: str = QUEUE,
        first: int = 0,
        pool: str = "threads",
    ) -> None:
        self.env = env
        self.n = workers
        self.first = first
        self.name = name
        self.queue = queue
        self.concurrency = concurrency
        self.log = log_file(name)
        self.stack = DevStack(
            data_dir=RESULTS / ".stack",
            workers=workers,
            concurrency=concurrency,
            pool=pool,
            beat=beat,
            env=env.worker_env(DAR_QUEUE=queue, **(extra_env or {})),
            output=self.log,
        )
        self.stack.database_url = env.database_url
        self.stack.redis_url = env.redis_url
        self.app = make_celery(env.settings(queue=queue), register=False)

    @property
    def worker_names(self) -> list[str]:
        return [f"worker-{WORKER_NAMES[self.first + i]}" for i in range(self.n)]

    def start(self) -> RuntimeFleet:
        (RESULTS / ".stack").mkdir(parents=True, exist_ok=True)
        for i in range(self.n):
            self.stack.start_worker(WORKER_NAMES[self.first + i])
        if self.stack.beat:
            self.stack.start_beat()
        try:
            wait_ping(self.app, self.worker_names)
        except Exception:
            self.stop()
            raise
        return self

    @property
    def hostnames(self) -> list[str]:
        """Celery node names, for ``app.control`` commands aimed at this fleet only."""
        return [f"{n}@{socket.gethostname()}" for n in self.worker_names]

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.stack.processes.items() if n.startswith("worker-")}

    def alive(self) -> dict[str, bool]:
        return {n: p.poll() is None for n, p in self.stack.processes.items()}

    def kill(self, name: str) -> None:
        self.stack.kill(name)

    def stop(self) -> None:
        try:
            self.stack.stop()
        finally:
            with contextlib.suppress(Exception):
                self.app.close()
            self.log.close()

    def __enter__(self) -> RuntimeFleet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class HopFleet:
    """N worker processes of the bare-hop baseline."""

    def __init__(
        self,
        env: BenchEnv,
        *,
        workers: int,
        concurrency: int,
        events: bool = False,
        name: str = "hop",
        queue: str = HOP_QUEUE,
        first: int = 0,
    ) -> None:
        self.env = env
        self.n = workers
        self.first = first
        self.concurrency = concurrency
        self.events = events
        self.queue = queue
        self.log = log_file(name)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.app = make_hop_app(env.redis_url, queue, events=events)

    @property
    def worker_names(self) -> list[str]:
        return [f"hop-{WORKER_NAMES[self.first + i]}" for i in range(self.n)]

    def start(self) -> HopFleet:
        env = {
            **os.environ,
            "DATABASE_URL": self.env.database_url,
            "REDIS_URL": self.env.redis_url,
            "BENCH_HOP_QUEUE": self.queue,
            "BENCH_HOP_EVENTS": "1" if self.events else "0",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        for name in self.worker_names:
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "celery",
                        "--quiet",
                        "-A",
                        "bench.hop_app",
                        "worker",
                        "--pool",
                        "threads",
                        "--concurrency",
                        str(self.concurrency),
                        "--hostname",
                        f"{name}@%h",
                        "-Q",
                        self.queue,
                        "--without-gossip",
                        "--without-mingle",
                        "--loglevel",
                        "WARNING",
                    ],
                    env=env,
                    cwd=ROOT,
                    stdout=self.log,
                    stderr=subprocess.STDOUT,
                )
            )
        try:
            wait_ping(self.app, self.worker_names)
        except Exception:
            self.stop()
            raise
        return self

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in zip(self.worker_names, self.procs, strict=False)}

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()
        with contextlib.suppress(Exception):
            self.app.close()
        self.log.close()

    def __enter__(self) -> HopFleet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def pg_sockets(pid: int) -> int:
    """How many TCP connections to PostgreSQL (remote port 5432) process ``pid`` holds,
    read from /proc (Linux)."""
    inodes: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    except OSError:
        return 0
    count = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            remote_port = int(parts[2].rsplit(":", 1)[1], 16)
            if remote_port == 5432 and parts[3] == "01" and parts[9] in inodes:  # ESTABLISHED
                count += 1
    return count


def pg_client_ports(pid: int) -> set[int]:
    """Local ports of process ``pid``'s connections to PostgreSQL, to match against
    pg_stat_activity.client_port."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if int(parts[2].rsplit(":", 1)[1], 16) == 5432 and parts[9] in inodes:
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports
