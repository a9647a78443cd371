"""Durable functions the console's browser tests run in a real stack
(``DAR_AGENT_MODULES=tests.e2e.console_agents``).

- ``console-family``: a parent with two child runs of ``console-kid``;
- ``console-tree``: three levels: a parent whose first child (``console-family``) starts two
  children of its own, and whose second is a ``console-kid``;
- ``console-slow``: many short steps, so there is a RUNNING run to cancel from the page;
- ``console-crash``: a step with an effect, not idempotent, whose first execution kills its
  worker (``SIGKILL``, as an OOM kill would) once the step is recorded STARTED. The worker that
  claims the run next cannot know whether the charge happened: the run stops
  NEEDS_ATTENTION, for an operator to resolve from the page. ``DAR_CONSOLE_CRASH_FLAG`` names
  the file that marks "already crashed once". Its next step fails once and is retried.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from runtime import AgentRegistry
from runtime.durable import Steps, durable_agent, step


@durable_agent("console-slow", max_steps=200)
def slow(data: Any, steps: Steps) -> str:
    ticks = int(data.get("ticks", 60)) if isinstance(data, dict) else 60
    for i in range(ticks):
        steps.run("tick", lambda i=i: time.sleep(0.25) or i, type=int)
    return f"{ticks} ticks"


def _charge(amount: float) -> str:
    flag = Path(os.environ["DAR_CONSOLE_CRASH_FLAG"])
    if not flag.exists():
        flag.write_text("crashed once")
        os.kill(os.getpid(), signal.SIGKILL)
    return f"charged {amount:.2f}"


@step(retry=3, backoff=0.1)
def notify(receipt: str) -> str:
    """Fails its first attempt (a flaky mail server), so the timeline shows a retry."""
    flag = Path(os.environ["DAR_CONSOLE_CRASH_FLAG"] + ".notify")
    if not flag.exists():
        flag.write_text("failed once")
        raise ConnectionError("mail server busy")
    return f"notified: {receipt}"


@durable_agent("console-crash")
def crash(data: Any, steps: Steps) -> str:
    amount = float(data.get("amount", 1)) if isinstance(data, dict) else 1.0
    receipt = steps.run("charge", lambda: _charge(amount), type=str)
    return notify(receipt)


@durable_agent("console-kid")
def kid(x: Any, steps: Steps) -> int:
    return steps.run("double", lambda: 2 * int(x), type=int)


@durable_agent("console-family")
def family(_: Any, steps: Steps) -> str:
    """A parent with two child runs, for the run page's family panel and timeline links."""
    return f"{steps.child('console-kid', 2)} and {steps.child('console-kid', 3)}"


@durable_agent("console-tree")
def tree(_: Any, steps: Steps) -> str:
    """A grandparent, for the run page's tree: its child ``console-family`` has children."""
    return f"{steps.child('console-family', {})}; {steps.child('console-kid', 5)}"


def register(registry: AgentRegistry) -> None:
    registry.register(slow)
    registry.register(crash)
    registry.register(kid)
    registry.register(family)
    registry.register(tree)
