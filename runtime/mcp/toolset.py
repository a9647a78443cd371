"""The MCP tools offered in a run: listed once, namespaced, recorded, replayed as recorded.

A run's tool set is fixed at its first model step and written down as a ``TOOLSET`` step, so
every later request of the run (and a replay of it) sends exactly the same ``tools``, even
when a server's list changed meanwhile: the prompt cache stays warm and the model is never
offered a tool it did not see before. A tool that vanished or changed since is an error
result when called, never a crash.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.mcp.servers import McpConfigError, McpServer, ToolPolicy, namespaced

JsonObj = dict[str, Any]

TOOLSET_KEY = "toolset"
"""The step key of a run's recorded tool set."""


@dataclass(frozen=True)
class OfferedTool:
    name: str
    """As the model sees it: ``<server>__<tool>``."""
    server: str
    tool: str
    """As the server knows it."""
    description: str
    input_schema: JsonObj
    annotations: JsonObj
    """``readOnlyHint``, ``destructiveHint``, ``idempotentHint``, ``openWorldHint`` as listed."""

    def definition(self) -> JsonObj:
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
        }

    @property
    def annotated_idempotent(self) -> bool:
        """Safe to call again by its annotations: read only, or idempotent."""
        return bool(self.annotations.get("readOnlyHint") or self.annotations.get("idempotentHint"))

    def to_json(self) -> JsonObj:
        return {
            "name": self.name,
            "server": self.server,
            "tool": self.tool,
            "description": self.description,
            "input_schema": self.input_schema,
            "annotations": self.annotations,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> OfferedTool:
        return cls(
            name=raw["name"],
            server=raw["server"],
            tool=raw["tool"],
            description=raw.get("description") or "",
            input_schema=raw.get("input_schema") or {"type": "object"},
            annotations=raw.get("annotations") or {},
        )


@dataclass(frozen=True)
class Toolset:
    tools: tuple[OfferedTool, ...]

    def definitions(self) -> list[JsonObj]:
        return [t.definition() for t in self.tools]

    def get(self, name: str) -> OfferedTool | None:
        return next((t for t in self.tools if t.name == name), None)

    def to_json(self) -> JsonObj:
        return {"tools": [t.to_json() for t in self.tools]}

    @classmethod
    def from_json(cls, raw: Any) -> Toolset:
        tools = raw.get("tools", []) if isinstance(raw, dict) else []
        return cls(tuple(OfferedTool.from_json(t) for t in tools))


def offered(server: McpServer, listed: Iterable[Any], taken: set[str]) -> list[OfferedTool]:
    """The tools of ``server`` to offer, from its ``tools/list`` answer (SDK ``Tool``
    objects), in the server's order. ``taken``: names already offered (updated)."""
    out: list[OfferedTool] = []
    for tool in listed:
        if server.allow is not None and tool.name not in server.allow:
            continue
        name = namespaced(server.name, tool.name)
        if name in taken:
            raise McpConfigError(
                f"{server.where} offers {tool.name!r} as {name!r}, a name another tool "
                "already has: rename the server or leave one out with allow=[...]"
            )
        taken.add(name)
        annotations = (
            tool.annotations.model_dump(by_alias=True, exclude_none=True, mode="json")
            if tool.annotations is not None
            else {}
        )
        annotations.pop("title", None)
        out.append(
            OfferedTool(
                name=name,
                server=server.name,
                tool=tool.name,
                description=tool.description or tool.title or "",
                input_schema=dict(tool.input_schema),
                annotations=annotations,
            )
        )
    return out


def idempotent(tool: OfferedTool, policy: ToolPolicy | None) -> bool:
    """Run it again after a crash? The operator's policy, else the annotations."""
    if policy is not None and policy.idempotent is not None:
        return policy.idempotent
    return tool.annotated_idempotent


def same_schema(a: JsonObj, b: JsonObj) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
