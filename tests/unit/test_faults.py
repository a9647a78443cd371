"""The crash points kill a real process, and only when configured."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from runtime.pipeline.faults import Faults, parse

SCRIPT = (
    "from runtime.pipeline.faults import crash_point; crash_point('after_claim'); print('alive')"
)


def _run(env_faults: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DAR_FAULTS": env_faults}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_configured_point_sigkills_the_process() -> None:
    result = _run("after_claim=1")
    assert result.returncode == -signal.SIGKILL
    assert "alive" not in result.stdout


def test_other_points_and_no_configuration_do_nothing() -> None:
    assert _run("after_checkpoint=1").stdout.strip() == "alive"
    assert _run("").stdout.strip() == "alive"


def test_unknown_points_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown crash point 'after_lunch'"):
        parse("after_lunch=0.5")
    assert Faults({"DAR_FAULTS": "after_claim=0.25"}).points == {"after_claim": 0.25}
