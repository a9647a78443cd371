"""repo-helper: an agent whose tools come from MCP servers next to a Python ``@tool``.

mcp-server-git (the published reference server) runs as a stdio subprocess of each worker
process, on the repository named by ``DAR_REPO_HELPER_REPO`` (default: the current
directory); mcp-server-time answers time questions. The model sees ``git__git_status``,
``git__git_log``, ... ``time__convert_time`` next to ``word_count``. Read-only git tools are
re-run after a crash; ``git__git_commit`` (not idempotent) stops the run for a person.

    pip install -e '.[mcp-servers]'
    DAR_AGENT_MODULES=examples.repo_helper dar demo --agent repo-helper --question \\
        "What is the status of the repository at $PWD?"

Works with the offline demo model (no ANTHROPIC_API_KEY): it picks ``git__git_status`` for
that question and passes the path it finds in it.
"""

from __future__ import annotations

import os
import sys

from runtime import Agent, AgentRegistry, McpServer, tool


@tool(idempotent=True)
def word_count(text: str) -> int:
    """Count the words of a text (a commit message, a file)."""
    return len(text.split())


def build(repository: str) -> Agent:
    return Agent(
        name="repo-helper",
        system_prompt=(
            "You help with one git repository. Look before you change anything: "
            "git__git_status and git__git_log first; commit only when asked."
        ),
        tools=(word_count,),
        mcp_servers=(
            McpServer.stdio(
                "git", [sys.executable, "-m", "mcp_server_git", "--repository", repository]
            ),
            McpServer.stdio(
                "time", [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"]
            ),
        ),
    )


def register(registry: AgentRegistry) -> None:
    registry.register(build(os.path.abspath(os.environ.get("DAR_REPO_HELPER_REPO") or ".")))
