"""The MCP tool set: names within the API's rules, annotations to resume semantics, the
operator's override, and the recorded form round-tripping exactly."""

from __future__ import annotations

import json

import pytest
from mcp_types import Tool, ToolAnnotations

from runtime.mcp.servers import McpConfigError, McpServer, ToolPolicy, namespaced
from runtime.mcp.toolset import Toolset, idempotent, offered

SERVER = McpServer.stdio("git", ["mcp-server-git"])


def _tool(name: str, annotations: ToolAnnotations | None = None) -> Tool:
    return Tool(
        name=name,
        description=f"{name} tool",
        input_schema={"type": "object", "properties": {"repo_path": {"type": "string"}}},
        annotations=annotations,
    )


def test_names_are_namespaced_within_the_api_rules() -> None:
    assert namespaced("git", "git_status") == "git__git_status"
    assert namespaced("web", "fetch.url v2") == "web__fetch_url_v2"
    assert len(namespaced("s", "x" * 100)) == 64


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        (ToolAnnotations(read_only_hint=True), True),
        (ToolAnnotations(idempotent_hint=True, destructive_hint=True), True),
        (ToolAnnotations(destructive_hint=True), False),
        (ToolAnnotations(read_only_hint=False, idempotent_hint=False), False),
        (None, False),
    ],
)
def test_annotations_decide_what_runs_again(
    annotations: ToolAnnotations | None, expected: bool
) -> None:
    (t,) = offered(SERVER, [_tool("x", annotations)], set())
    assert idempotent(t, None) is expected
    assert idempotent(t, ToolPolicy(idempotent=not expected)) is (not expected)
    assert idempotent(t, ToolPolicy(timeout_seconds=3)) is expected


def test_the_recorded_tool_set_round_trips_byte_for_byte() -> None:
    tools = offered(SERVER, [_tool("git_status", ToolAnnotations(read_only_hint=True))], set())
    toolset = Toolset(tuple(tools))
    again = Toolset.from_json(json.loads(json.dumps(toolset.to_json())))
    assert json.dumps(again.definitions()) == json.dumps(toolset.definitions())
    assert again.get("git__git_status") == tools[0]


def test_allow_and_collisions() -> None:
    server = McpServer.stdio("git", ["x"], allow=["git_status"])
    assert [t.name for t in offered(server, [_tool("git_status"), _tool("git_log")], set())] == [
        "git__git_status"
    ]
    with pytest.raises(McpConfigError, match="a name another tool already has"):
        offered(SERVER, [_tool("a.b"), _tool("a_b")], set())
