"""Quiet logs by default, and JSON all the way down with DAR_LOG_FORMAT=json: the web's
banner and access lines are JSON, the beat's per-tick line is off at INFO, and the recovery
lines (reaper re-dispatch, could not send) carry run_id as a field."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from cli.embedded import free_port
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.observe.logctx import configure_logging
from tasks.celery_app import make_celery
from tasks.dispatch import send_drive
from tests.support import expire_lease, submit

pytestmark = pytest.mark.slow  # real servers and processes: `pytest --all`

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buffer = io.StringIO()
    yield buffer
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def _procfile(name: str) -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.partition(":")[2].strip()
    raise AssertionError(name)


def _env(settings: Settings, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "DATABASE_URL": settings.database_url or "",
        "REDIS_URL": settings.redis_url or "",
        "DAR_QUEUE": settings.queue,
        **extra,
    }


def test_the_web_process_is_json_to_the_last_line(settings: Settings) -> None:
    port = free_port()
    proc = subprocess.Popen(
        ["sh", "-c", _procfile("web")],
        cwd=ROOT,
        env=_env(settings, PORT=str(port), DAR_LOG_FORMAT="json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "web did not start"
                time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    lines = [line for line in out.splitlines() if line.strip()]
    assert any("Starting gunicorn" in line for line in lines), out
    assert any("GET /healthz" in line for line in lines), "the access line is there"
    for line in lines:
        json.loads(line)  # every line, banner and access lines included


def test_the_beat_does_not_log_every_tick_at_info(settings: Settings, tmp_path: Path) -> None:
    line = _procfile("beat").replace("/tmp/dar-beat-schedule", str(tmp_path / "schedule"))
    proc = subprocess.Popen(
        ["sh", "-c", line],
        cwd=ROOT,
        env=_env(settings, DAR_REAPER_INTERVAL_SECONDS="0.2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    time.sleep(4)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert "Sending due task" not in out
    assert "celery beat v" not in out, "no banner outside the log format"


def test_recovery_lines_carry_run_id_as_a_field(
    runtime: Runtime, settings: Settings, captured: io.StringIO
) -> None:
    configure_logging("json", "INFO", stream=captured)
    run, dispatch = submit(runtime.store)
    dead = Celery("dead", broker="redis://127.0.0.1:1/0", set_as_current=False)
    dead.conf.update(broker_connection_timeout=0.5, task_publish_retry=False)
    assert send_drive(dead, runtime.store, dispatch) is False

    app = make_celery(settings)
    app.dar_runtime = runtime  # type: ignore[attr-defined]
    try:
        expire_lease(runtime.engine, run.id)
        app.tasks["dar.reap"]()
    finally:
        from tasks.drive import stop_worker_state

        stop_worker_state(app)
        app.close()
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    wanted = {
        "could not send drive_run": False,
        "re-dispatched by the reaper": False,
    }
    for line in lines:
        for text in wanted:
            if text in line["message"]:
                assert line.get("run_id") == str(run.id), line
                wanted[text] = True
    assert all(wanted.values()), lines
