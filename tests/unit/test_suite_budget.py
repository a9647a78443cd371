"""CI's suite budget (tests/conftest.py): a CI run of ``pytest --all`` over its share of the
15 minutes fails, naming its slowest files; within it, it passes and says how much it used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(budget: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CI": "true", "DAR_SUITE_BUDGET_SECONDS": budget}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--all",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "tests/unit/test_jsontext.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_suite_over_its_budget_fails_naming_its_slowest_files() -> None:
    over = _run("0")
    assert over.returncode == 1, over.stdout[-2000:]
    assert "suite budget EXCEEDED" in over.stdout
    assert "tests/unit/test_jsontext.py" in over.stdout.split("EXCEEDED")[1]


def test_a_suite_within_its_budget_passes_and_says_what_it_used() -> None:
    within = _run("600")
    assert within.returncode == 0, within.stdout[-2000:]
    assert "suite budget: pytest --all took" in within.stdout
    assert "EXCEEDED" not in within.stdout
