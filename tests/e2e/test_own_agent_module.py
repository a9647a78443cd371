"""A user's own agent module beside them, as the docs show it: ``my_agent.py`` in the
working directory and ``DAR_AGENT_MODULES=my_agent dar demo --agent mine``, with no
``PYTHONPATH``. ``dar`` checks the module in its own process before it starts anything, so
that process must import from the working directory as the workers do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.embedded import free_port
from runtime.config import Settings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

DAR = str(Path(sys.executable).with_name("dar"))
# The code under test (a worktree may differ from the installed checkout): the only entry of
# PYTHONPATH, and never the agent's folder.
CODE_ROOT = str(Path(__file__).resolve().parents[2])

MY_AGENT = '''
from runtime import Agent, tool


@tool(idempotent=True)
def lookup_parcel(parcel: int) -> str:
    """Where a parcel is."""
    return f"parcel {parcel} is in Utrecht"


def register(registry):
    registry.register(Agent(name="mine", system_prompt="Answer.", tools=(lookup_parcel,)))
'''


def _env(database_url: str, redis_url: str, settings: Settings, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAR_", "PYTHON"))}
    env.update(
        PYTHONPATH=CODE_ROOT,
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        DAR_QUEUE=settings.queue,
        DAR_DEMO_LATENCY_MS="50",
        ANTHROPIC_API_KEY="",
        TMPDIR=str(tmp),
        DAR_AGENT_MODULES="my_agent",
    )
    return env


def test_dar_demo_runs_an_agent_module_from_the_working_directory(
    database_url: str, redis_url: str, settings: Settings, tmp_path: Path
) -> None:
    (tmp_path / "my_agent.py").write_text(MY_AGENT)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = subprocess.run(
        [
            DAR,
            "demo",
            "--agent",
            "mine",
            "--question",
            "Where is parcel 77?",
            "--port",
            str(free_port()),
            "--metrics-port",
            "0",
        ],
        cwd=tmp_path,
        env=_env(database_url, redis_url, settings, tmp),
        capture_output=True,
        text=True,
        timeout=150,
    )
    out = done.stdout + done.stderr
    assert "No module named" not in out, out
    assert done.returncode == 0, out
    assert "parcel 77 is in Utrecht" in out, out
