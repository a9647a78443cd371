"""Framework agents under the shipped gevent pool: a sync tool that holds the CPU in C code
runs on a native thread, so the worker's other greenlets (its heartbeat, its other steps) go
on meanwhile. Run in a process of its own, patched as the worker is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pydantic_ai")
pytest.importorskip("agents")

PROBE = Path(__file__).with_name("gevent_probe.py")
ROOT = Path(__file__).parents[2]


def test_a_sync_tool_blocking_in_c_does_not_stop_the_workers_greenlets() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["off_hub"], "the tool ran on the worker's own thread"
    # A tool run on a greenlet stops the ticker for its whole second; on a native thread the
    # ticker's 20 ms naps stay short (slack for a loaded machine).
    assert seen["pydantic_ai"] < 0.5, seen
    assert seen["agents"] < 0.5, seen
