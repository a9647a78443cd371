"""The documentation's own command lines, run as printed from a fresh clone (``git clone`` of
this checkout's commit into a temporary folder), with nothing on ``PYTHONPATH``: every
``dar demo`` the README or a page of the docs site prints, an example agent's or the bare one,
and ``dar token new``. The bare demo's output (a line per step, the summary) and the rejected
refund's (FAILED, its reservation compensated) are checked as ``dar demo``'s own tests. The
package comes from the environment, as the README's setup line installs it.

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
    if line == "dar demo":
        _shows_each_step_and_a_summary(done.stdout, clone)
    if agent and agent.group(1) == "order-refund":  # rejected: it fails, its saga undone
        assert "status=FAILED" in done.stdout, out
        assert "compensated: reserve" in done.stdout, out


def _shows_each_step_and_a_summary(out: str, clone: Path) -> None:
    """The bare ``dar demo``: a line per step as it finishes, the summary table, the run's
    status, and the processes' logs in their folder, not on the terminal."""
    progress = [ln.strip() for ln in out.splitlines() if ln.startswith("  seq=")]
    assert [ln.split()[:4] for ln in progress] == [
        ["seq=1", "MODEL", "tool_use", "DONE"],
        ["seq=2", "TOOL", "list_tickets", "DONE"],
        ["seq=3", "MODEL", "end_turn", "DONE"],
    ], out
    assert "SEQ  KIND   STATUS" in out, "the summary table"
    assert "status=SUCCEEDED" in out
    assert "INFO" not in out, "process logs go to the log folder, not the terminal"
    logs = clone / ".dar" / "logs"
    assert any(p.stat().st_size for p in logs.iterdir()), f"no process log in {logs}"
