"""Real MCP servers for tests: the counting server (stdio and HTTP) and its ledger."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runtime.mcp.client import CallResult, McpClients
from runtime.mcp.servers import McpServer, ToolPolicy
from runtime.testing.testkit import SimulatedCrash

COUNTING = str(Path(__file__).with_name("counting_server.py"))
FIRST_START_FAILS = str(Path(__file__).with_name("first_start_fails.py"))
"""``FIRST_START_FAILS MARKER COUNTING ...``: the counting server, which dies at its first start."""


class Ledger:
    """What the counting server really did: one entry per call that ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self, tool: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        return [r for r in rows if tool is None or r["tool"] == tool]

    def count(self, tool: str) -> int:
        return len(self.entries(tool))


def stdio_server(
    ledger: Ledger,
    name: str = "notes",
    *extra: str,
    tools: dict[str, ToolPolicy] | None = None,
    timeout_seconds: float = 20.0,
) -> McpServer:
    return McpServer.stdio(
        name,
        [sys.executable, COUNTING, "--ledger", str(ledger.path), *extra],
        tools=tools,
        timeout_seconds=timeout_seconds,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def http_server(ledger: Ledger, *extra: str, port: int | None = None) -> Iterator[str]:
    """The counting server over streamable HTTP on loopback; yields its URL."""
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, COUNTING, "--ledger", str(ledger.path), "--http", str(port), *extra],
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"counting server did not start: {proc.stderr!r}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


class CrashingClients(McpClients):
    """Real calls; the worker 'dies' right after the named tools answered, before the step
    is recorded (the window the in-doubt rules are for)."""

    def __init__(self, crash_after: set[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.crash_after = set(crash_after)

    def call(self, server: McpServer, tool: str, *args: Any, **kwargs: Any) -> CallResult:
        result = super().call(server, tool, *args, **kwargs)
        if tool in self.crash_after:
            self.crash_after.discard(tool)
            raise SimulatedCrash
        return result
