"""A worker raises its open-files limit to what its concurrency may hold (issue 26: the
shipped 2,000 steps in flight per process are 2,000 sockets; many hosts start a process with
a soft limit of 1,024)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import logging, resource; logging.basicConfig(); "
    "from tasks.signals import raise_open_files_limit as r; "
    "print(r(2000), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
)


def _run_with_limits(soft: int, hard: int) -> subprocess.CompletedProcess[str]:
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limits,
    )


def _hard() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


@pytest.mark.skipif(
    _hard() != resource.RLIM_INFINITY and _hard() < 8192, reason="needs a hard limit >= 8192"
)
def test_a_low_soft_limit_is_raised_to_what_the_concurrency_needs() -> None:
    done = _run_with_limits(1024, 8192)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4256", "4256"]  # 2 x 2000 + 256
    assert "below" not in done.stderr


def test_a_hard_limit_below_the_need_is_taken_whole_and_said() -> None:
    done = _run_with_limits(256, 1024)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1024", "1024"]
    assert "open files limit 1024 is below the 4256 that --concurrency 2000 may need" in (
        done.stderr
    )


@pytest.mark.skipif(
    _hard() != resource.RLIM_INFINITY and _hard() < 8192, reason="needs a hard limit >= 8192"
)
def test_a_soft_limit_already_high_enough_is_left_alone() -> None:
    done = _run_with_limits(6000, 8192)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["6000", "6000"]
