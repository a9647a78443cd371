"""`dar` answers at once: the CLI and the Python client load no framework, driver or SDK
(those cost ~1.5 s of CPU per command). Timings are in bench/cli_startup.py; this checks the
cause, which does not flake on a loaded machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("sqlalchemy", "psycopg", "celery", "kombu", "flask", "anthropic", "redis", "mcp")


def _loaded_after(statement: str) -> set[str]:
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return {m.split(".")[0] for m in json.loads(out)}


@pytest.mark.parametrize(
    "statement",
    [
        "import cli.main",
        "from cli.main import build_parser; build_parser()",
        "from runtime.client import Client",
    ],
)
def test_the_cli_and_the_client_load_no_heavy_package(statement: str) -> None:
    assert _loaded_after(statement) & set(HEAVY) == set()


def test_the_packages_still_export_their_names_on_first_use() -> None:
    from api import create_app
    from runtime import Agent, tool

    assert callable(create_app)
    assert Agent.__module__ == "runtime.agents"
    assert tool.__module__ == "runtime.tools"
