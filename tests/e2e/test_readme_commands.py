"""The documentation's own command lines, run as printed from a fresh clone (``git clone`` of
this checkout's commit into a temporary folder), with nothing on ``PYTHONPATH``: every
``dar demo`` the README or a page of the docs site prints, an example agent's or the bare one,
and ``dar token new``. The package comes from the environment, as the README's setup line
installs it.

The only variables set are documented ones that point the commands at this machine's
services and keep them apart from other stacks: ``DATABASE_URL`` and ``REDIS_URL`` (the test
services; the docs: unset means embedded ones), ``DAR_QUEUE``, ``PORT`` and
``DAR_METRICS_PORT`` (free ports), ``DAR_DEMO_LATENCY_MS`` (a faster demo model).

Every other command line of the docs is accounted for in ``tests/unit/test_docs_site.py``:
those that need a running ``dar dev`` (curl, ``dar ps``, ``kill``) are exercised by
``test_dar_dev.py`` and the API's tests; ``mkdocs build --strict`` by the site's own test;
``pip``, ``docker``, ``pytest`` and the benchmarks are not run here."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli.embedded import free_port
from runtime.config import Settings
from tests.docs_pages import command_lines, pages

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
BIN = str(Path(sys.executable).parent)
# What the docs say each demo exits with ("The second exits 1 by design").
EXPECTED_EXIT = {"order-refund": 1}


def docs_commands() -> list[str]:
    """Every command line of the README's and the site's bash and console blocks, each once."""
    return list(dict.fromkeys(line for path in pages() for line in command_lines(path)))


def _runnable(line: str) -> bool:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # a JSON body split over lines: a curl, never one of these
        return False
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    return words[:2] in (["dar", "demo"], ["dar", "token"])


DEMOS = [line for line in docs_commands() if _runnable(line)]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("readme") / "durable-agent-runtime"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(where)], check=True, timeout=120)
    return where


def test_the_docs_show_the_example_agents() -> None:
    shown = " ".join(DEMOS)
    assert "dar demo" in DEMOS, "the README's tour starts with the bare dar demo"
    for module in (
        "orders_agent",
        "ticket_triage",
        "order_refund",
        "repo_helper",
        "pydantic_ai_agent",
    ):
        assert f"DAR_AGENT_MODULES=examples.{module} dar demo" in shown, module


@pytest.mark.parametrize("line", DEMOS)
def test_a_docs_command_line_works_as_printed(
    line: str, clone: Path, database_url: str, redis_url: str, settings: Settings
) -> None:
    env = {
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": os.environ.get("HOME", str(clone)),
        "TMPDIR": str(clone.parent),
        "LANG": "C.UTF-8",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "DAR_QUEUE": settings.queue,
        "PORT": str(free_port()),
        "DAR_METRICS_PORT": "0",
        "DAR_DEMO_LATENCY_MS": "100",
    }
    done = subprocess.run(
        ["bash", "-c", line], cwd=clone, env=env, capture_output=True, text=True, timeout=300
    )
    out = done.stdout + done.stderr
    agent = re.search(r"--agent (\S+)", line)
    expected = EXPECTED_EXIT.get(agent.group(1), 0) if agent else 0
    assert "No module named" not in out, out
    assert done.returncode == expected, out
    if agent:
        assert "dar: submitted run" in out, out
