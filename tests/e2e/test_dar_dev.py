"""The walkthrough (docs/try/walkthrough.md, the README's tour), exactly as a newcomer runs
it: ``dar dev`` as a subprocess, a run submitted over HTTP, the worker holding it SIGKILLed by
the pid ``dar ps`` prints. The run finishes with every step once; the killed worker comes
back; SIGHUP stops everything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.devstack import pid_alive
from cli.embedded import free_port
from runtime.config import Settings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

DAR = [str(Path(sys.executable).with_name("dar"))]


class DarDev:
    def __init__(self, cwd: Path, env: dict[str, str], port: int) -> None:
        self.port = port
        self.cwd = cwd
        self.env = env
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [*DAR, "dev", "--port", str(port), "--metrics-port", "0", "--concurrency", "4"],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.proc.poll() is None, f"dar dev exited:\n{self.output}"
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.output}"
            time.sleep(0.1)

    def api(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data, method=method)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def ps(self) -> dict[str, int]:
        out = subprocess.run(
            [*DAR, "ps"], cwd=self.cwd, env=self.env, capture_output=True, text=True, check=True
        ).stdout
        pids: dict[str, int] = {}
        for line in out.splitlines()[1:]:  # PROCESS PID STATE [HOLDS RUN ...]; then API: …
            if line.startswith("dar dev"):
                pids["dar"] = int(line.split()[2])
            elif line and not line.startswith("API:"):
                pids[line.split()[0]] = int(line.split()[1])
        return pids


@pytest.fixture
def dar_dev(
    database_url: str, redis_url: str, settings: Settings, tmp_path: Path
) -> Iterator[DarDev]:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "DAR_QUEUE": settings.queue,
        "DAR_LEASE_SECONDS": "3",
        "DAR_HEARTBEAT_SECONDS": "1",
        "DAR_REAPER_INTERVAL_SECONDS": "0.5",
        "DAR_DEMO_LATENCY_MS": "2500",
        "ANTHROPIC_API_KEY": "",
        "TMPDIR": str(tmp),
    }
    dev = DarDev(tmp_path, env, free_port())
    try:
        yield dev
    finally:
        if dev.proc.poll() is None:
            dev.proc.send_signal(signal.SIGTERM)
            dev.proc.wait(timeout=30)
        dev.reader.join(timeout=10)
        assert dev.proc.stdout is not None
        dev.proc.stdout.close()
        print(dev.output[-20000:])


def test_the_readme_kill_demo_under_dar_dev(dar_dev: DarDev, tmp_path: Path) -> None:
    dar_dev.wait_for("dar: the stack is up")
    console = f"Console:    http://127.0.0.1:{dar_dev.port}/"
    assert console in dar_dev.output, "dar dev prints the console's URL"
    pool = "2 x celery worker --pool gevent --concurrency 4"  # the Procfile's pool, shipped
    assert pool in dar_dev.output, "and the pool and concurrency it runs"
    with urllib.request.urlopen(f"http://127.0.0.1:{dar_dev.port}/", timeout=10) as page:
        assert b"/static/console/console.js" in page.read(), "and the console answers there"
    assert "Sending due task" not in dar_dev.output, "the beat's per-second line is quiet"
    assert "Context impl" not in dar_dev.output, "Alembic's lines are quiet"

    # `dar ps` before the run: on a loaded machine a command can take longer than the model
    # step it must interrupt (the pids do not change until the kill).
    pids = dar_dev.ps()
    accepted = dar_dev.api(
        "POST",
        "/api/runs",
        {"input": "Which acme tickets are overdue?", "tokenBudget": 50000, "timeoutSeconds": 300},
    )
    run_id = accepted["id"]
    deadline = time.monotonic() + 60
    while True:  # the second model call in flight: two steps done, a worker holds the lease
        assert time.monotonic() < deadline, "the run never reached its second model call"
        # Steps first, then the holder: a holder read after two DONE steps holds the third.
        steps = dar_dev.api("GET", f"/api/runs/{run_id}/timeline")
        run = dar_dev.api("GET", f"/api/runs/{run_id}")
        done = [t for t in steps if t["kind"] != "AUDIT" and t["status"] == "DONE"]
        if len(done) == 2 and run["lockedBy"]:  # (a STARTED tool row: the tool still runs)
            break
        time.sleep(0.05)
    victim = run["lockedBy"]
    os.kill(pids[victim], signal.SIGKILL)  # `kill -9 <pid>`, the pid `dar ps` printed

    dar_dev.wait_for(f"dar: {victim} (pid {pids[victim]}) was killed by SIGKILL; restarting")
    dar_dev.wait_for(f"dar: {victim} is ready again")
    deadline = time.monotonic() + 60
    while run["status"] not in ("SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT"):
        assert time.monotonic() < deadline, "the run was not resumed"
        time.sleep(0.2)
        run = dar_dev.api("GET", f"/api/runs/{run_id}")
    assert run["status"] == "SUCCEEDED", run["error"]
    timeline = dar_dev.api("GET", f"/api/runs/{run_id}/timeline")
    assert [(t["seq"], t["kind"], t["status"]) for t in timeline if t["kind"] != "AUDIT"] == [
        (1, "MODEL", "DONE"),
        (2, "TOOL", "DONE"),
        (3, "MODEL", "DONE"),
    ]
    recovery = [
        (t["action"], t["detail"])
        for t in timeline
        if t["kind"] == "AUDIT" and t["action"].startswith("recovery.")
    ]
    assert ("recovery.redispatched", victim) in [(a, d["leaseHolder"]) for a, d in recovery[:1]]
    assert recovery[-1][0] == "recovery.resumed"
    assert recovery[-1][1]["seq"] == 3
    assert f"run={run_id[:8]} resumed at seq=3" in dar_dev.output
    assert dar_dev.proc.poll() is None, "the stack kept running"

    # SIGHUP (a closed terminal) stops every child and cleans up after itself.
    children = dar_dev.ps()
    del children["dar"]
    assert children[victim] != pids[victim], "the killed worker came back with a new pid"
    dar_dev.proc.send_signal(signal.SIGHUP)
    assert dar_dev.proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in children.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n, p in children.items() if pid_alive(p)], "no child outlives dar dev"
    assert not (tmp_path / ".dar" / "stack.json").exists()
    assert list((tmp_path / "tmp").iterdir()) == [], "temporary directories are removed"
