"""A process of this runtime with Pydantic AI installed WITHOUT its ``mcp`` extra: fastmcp
cannot be imported here, as on a ``pip install 'pydantic-ai-slim[anthropic]'`` install.
It loads ``tests.frameworks.plain_agent`` as a worker loads ``DAR_AGENT_MODULES``, runs its
agent to the end, and prints what it saw as one JSON line.

    python no_mcp_probe.py <database url> <redis url>    (DAR_TEST_ANTHROPIC_URL set)
"""

from __future__ import annotations

import importlib.abc
import json
import sys
import uuid
from collections.abc import Sequence
from dataclasses import replace
from importlib.machinery import ModuleSpec
from types import ModuleType


class WithoutMcpExtra(importlib.abc.MetaPathFinder):
    """fastmcp is not installed (what ``pydantic-ai-slim[mcp]`` would add)."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name == "fastmcp" or name.startswith("fastmcp."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, WithoutMcpExtra())

from runtime.config import Settings  # noqa: E402
from runtime.engine.bootstrap import Runtime  # noqa: E402
from runtime.llm.scripted import ScriptedLlm  # noqa: E402
from tests.support import drive_to_end  # noqa: E402


def main(database_url: str, redis_url: str) -> None:
    settings = replace(
        Settings(),
        database_url=database_url,
        redis_url=redis_url,
        queue=f"dar-test-{uuid.uuid4().hex[:10]}",
        flow_prefix=f"dar-test-flow:{uuid.uuid4().hex[:10]}",
        agent_modules=("tests.frameworks.plain_agent",),
        demo_latency_ms=0,
    )
    rt = Runtime.build(settings, llm=ScriptedLlm(), pool_size=2)
    try:
        run, dispatch = rt.submit("plain", "Where is A-7?")
        drive_to_end(rt.driver(), dispatch)
        done = rt.store.get_run(run.id)
        steps = [s.step_key for s in rt.store.steps(run.id)]
    finally:
        rt.close()
    print(
        json.dumps(
            {
                "status": done.status.value,
                "error": done.error,
                "result": done.result,
                "steps": steps,
                "fastmcp": "fastmcp" in sys.modules,
                "pydantic_ai.mcp": "pydantic_ai.mcp" in sys.modules,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
