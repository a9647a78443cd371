"""Agents: a name, a system prompt, tools and limits, registered in Python."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from db.errors import DarError
from runtime.config import UPGRADE_POLICIES as UPGRADE_POLICIES
from runtime.config import check_upgrade_policy
from runtime.mcp.servers import McpServer
from runtime.tools import Tool


class UnknownAgent(DarError):
    """No agent with this name is registered."""


class AgentConfigError(DarError):
    """An agent is misconfigured."""


_TOOL_NAME = re.compile(r"[^a-zA-Z0-9_-]")


@dataclass(frozen=True)
class Subagent:
    """Another registered agent the model may hand a task to, offered as a tool
    (``Agent(..., subagents=(Subagent("researcher", description=...),))``; a bare name does
    too). A call starts the agent as a child run of its own (``parentRunId``) with the text
    the model wrote (``task``) as its input; the run waits for it holding nothing and the
    model gets the child's result (or its error) as the tool's result."""

    agent: str
    """The registered agent that runs as the child (an agent loop or a durable function)."""
    description: str = ""
    """What the model is told the sub-agent does (a default names the agent)."""
    name: str | None = None
    """The tool's name as the model sees it (default: the agent's name, with characters a
    tool name may not hold replaced by ``_``)."""
    token_budget: int | None = None
    """At most this many tokens for one child (never more than its share of what the parent
    has left: children started together split it)."""
    timeout_seconds: int | None = None
    """At most this long for one child (never past the parent's deadline)."""

    @property
    def tool_name(self) -> str:
        return self.name or _TOOL_NAME.sub("_", self.agent)[:64]

    def definition(self) -> dict[str, Any]:
        description = self.description or (
            f"Hand a task to the sub-agent {self.agent!r}: it works on it on its own and "
            "answers with its result."
        )
        return {
            "name": self.tool_name,
            "description": description,
            "input_schema": {
                "type": "object",
                "properties": {
                    "task": {
                        "type": "string",
                        "description": "What the sub-agent should do, with everything it "
                        "needs to know: it sees nothing else of this conversation.",
                    }
                },
                "required": ["task"],
            },
        }


def upgrade_policy(agent: object) -> str:
    """The agent's upgrade policy (:data:`runtime.config.UPGRADE_POLICIES`)."""
    return str(getattr(agent, "upgrade", "pinned"))


@dataclass(frozen=True)
class Agent:
    """An agent loop: the model decides, the tools run. A ``name`` (what runs are submitted
    to), a ``system_prompt``, its tools and limits; register it in a module's
    ``register(registry)``."""

    name: str
    system_prompt: str
    tools: tuple[Tool | str, ...] = ()
    """Tools, or names of tools registered with :meth:`AgentRegistry.register_tool`."""
    model: str | None = None
    """The model to use; ``None`` takes DAR_DEFAULT_MODEL."""
    max_tokens: int | None = None
    max_steps: int | None = None
    mcp_servers: tuple[McpServer | str, ...] = ()
    """MCP servers whose tools the model is offered next to ``tools`` (as ``<server>__<tool>``),
    or names of servers configured in ``DAR_MCP_SERVERS`` / registered with
    :meth:`AgentRegistry.register_mcp_server`."""
    subagents: tuple[Subagent | str, ...] = ()
    """Agents the model may hand tasks to, as tools (:class:`Subagent`, or an agent's name)."""
    upgrade: str = "pinned"
    """How its runs move to a new version: ``"pinned"`` (by an operator) or ``"replay"`` (by
    the new version's workers once the old version is served no more, after the replay
    check): :data:`UPGRADE_POLICIES`."""
    tools_by_name: dict[str, Tool] = field(init=False, repr=False, compare=False)
    subagents_by_name: dict[str, Subagent] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_upgrade_policy(self.name, self.upgrade)
        by_name: dict[str, Tool] = {}
        for t in self.tools:
            if isinstance(t, str):
                continue
            if t.name in by_name:
                raise AgentConfigError(f"agent {self.name!r} declares tool {t.name!r} twice")
            by_name[t.name] = t
        object.__setattr__(self, "tools_by_name", by_name)
        subs: dict[str, Subagent] = {}
        for entry in self.subagents:
            sub = Subagent(entry) if isinstance(entry, str) else entry
            if sub.tool_name in by_name or sub.tool_name in subs:
                raise AgentConfigError(
                    f"agent {self.name!r} offers two tools named {sub.tool_name!r} (a sub-agent "
                    "and a tool, or two sub-agents): give the sub-agent a name= of its own"
                )
            subs[sub.tool_name] = sub
        object.__setattr__(self, "subagents_by_name", subs)
        seen: set[str] = set()
        for server in self.mcp_servers:
            name = server if isinstance(server, str) else server.name
            if name in seen:
                raise AgentConfigError(f"agent {self.name!r} declares MCP server {name!r} twice")
            seen.add(name)

    @property
    def servers(self) -> dict[str, McpServer]:
        """The MCP servers by name (after :meth:`AgentRegistry.finalize` resolved names)."""
        return {s.name: s for s in self.mcp_servers if isinstance(s, McpServer)}

    def tool_definitions(self) -> list[dict[str, Any]]:
        own = [t.definition() for t in self.tools_by_name.values()]
        return own + [s.definition() for s in self.subagents_by_name.values()]

    @property
    def tool_references(self) -> list[str]:
        return [t for t in self.tools if isinstance(t, str)]


class AnyAgent(Protocol):
    """What the registry needs of an agent: an :class:`Agent` (the agent loop) or a
    ``DurableAgent`` (a durable function)."""

    @property
    def name(self) -> str: ...

    @property
    def max_steps(self) -> int | None: ...


class AgentRegistry:
    """Every agent a process can run, by name: agent loops, durable functions and framework
    agents. ``DAR_AGENT_MODULES`` names the modules whose ``register(registry)`` fills it."""

    def __init__(
        self, agents: Iterable[AnyAgent] = (), *, resources: dict[str, Any] | None = None
    ) -> None:
        self._agents: dict[str, AnyAgent] = {}
        self._tools: dict[str, Tool] = {}
        self._mcp_servers: dict[str, McpServer] = {}
        self._mcp_attach: dict[str, list[str]] = {}
        self.resources: dict[str, Any] = dict(resources or {})
        """What agent modules may use: ``engine``, ``tickets`` (the demo's store), ``settings``."""
        for a in agents:
            self.register(a)

    def register_tool(self, tool: Tool) -> Tool:
        """A tool agents may name in their ``tools`` instead of passing it."""
        if tool.name in self._tools:
            raise AgentConfigError(f"two tools are registered under the name {tool.name!r}")
        self._tools[tool.name] = tool
        return tool

    def register_mcp_server(self, server: McpServer, agents: Iterable[str] = ()) -> McpServer:
        """A server agents may name in their ``mcp_servers``; ``agents``: attach it to these
        agents as well (how ``DAR_MCP_SERVERS`` gives an agent a server)."""
        if server.name in self._mcp_servers:
            raise AgentConfigError(f"two MCP servers are registered under the name {server.name!r}")
        self._mcp_servers[server.name] = server
        self._mcp_attach[server.name] = list(agents)
        return server

    def mcp_servers(self) -> list[McpServer]:
        """Every MCP server some registered agent uses (after :meth:`finalize`)."""
        found: dict[str, McpServer] = {}
        for agent in self._agents.values():
            for server in getattr(agent, "mcp_servers", ()):
                if isinstance(server, McpServer):
                    found.setdefault(server.name, server)
        return list(found.values())

    def _resolve_servers(self) -> None:
        for server, agent_names in self._mcp_attach.items():
            for agent_name in agent_names:
                agent = self._agents.get(agent_name)
                if agent is None:
                    raise AgentConfigError(
                        f"MCP server {server!r} is configured for agent {agent_name!r}, which "
                        "is not registered"
                    )
                declared = getattr(agent, "mcp_servers", ())
                names = {s if isinstance(s, str) else s.name for s in declared}
                if server not in names:
                    self._agents[agent_name] = replace(  # type: ignore[type-var]
                        agent, mcp_servers=(*declared, server)
                    )
        for name, agent in list(self._agents.items()):
            declared = getattr(agent, "mcp_servers", ())
            if not declared:
                continue
            resolved: list[McpServer] = []
            for s in declared:
                if isinstance(s, McpServer):
                    resolved.append(s)
                    continue
                if s not in self._mcp_servers:
                    known = ", ".join(sorted(self._mcp_servers)) or "none"
                    raise AgentConfigError(
                        f"agent {name!r} uses MCP server {s!r}, which is not configured "
                        f"(configured MCP servers: {known}; see DAR_MCP_SERVERS)"
                    )
                resolved.append(self._mcp_servers[s])
            self._agents[name] = replace(  # type: ignore[type-var]
                agent, mcp_servers=tuple(resolved)
            )

    def finalize(self) -> None:
        """Resolve tool and MCP server names; fail with a precise message on any that names
        nothing."""
        self._resolve_servers()
        for name, agent in list(self._agents.items()):
            if not isinstance(agent, Agent):
                continue
            for sub in agent.subagents_by_name.values():
                if sub.agent not in self._agents:
                    known = ", ".join(sorted(self._agents)) or "none"
                    raise AgentConfigError(
                        f"agent {name!r} offers sub-agent {sub.agent!r}, which is not "
                        f"registered (registered agents: {known})"
                    )
            refs = agent.tool_references
            if not refs:
                continue
            missing = [r for r in refs if r not in self._tools]
            if missing:
                known = ", ".join(sorted(self._tools)) or "none"
                raise AgentConfigError(
                    f"agent {name!r} uses tool {missing[0]!r}, which is not registered "
                    f"(registered tools: {known})"
                )
            resolved = tuple(self._tools[t] if isinstance(t, str) else t for t in agent.tools)
            self._agents[name] = replace(agent, tools=resolved)

    def register(self, agent: Any, *, upgrade: str | None = None, **options: Any) -> AnyAgent:
        """Add an agent: ours (:class:`Agent`, a durable function), or a framework's
        (a ``pydantic_ai.Agent``, an OpenAI Agents SDK ``agents.Agent``), which runs as the
        durable function :mod:`runtime.frameworks` makes of it (``options``: the adapter's,
        e.g. ``deps=`` for a Pydantic AI agent). ``upgrade``: its upgrade policy
        (:data:`UPGRADE_POLICIES`), in place of the one it was declared with."""
        from runtime.frameworks import adapt

        adapted = adapt(agent, **options)
        if adapted is not None:
            agent = adapted
        if upgrade is not None:
            agent = replace(agent, upgrade=check_upgrade_policy(agent.name, upgrade))
        if agent.name in self._agents:
            raise AgentConfigError(f"two agents are registered under the name {agent.name!r}")
        self._agents[agent.name] = agent
        registered: AnyAgent = agent
        return registered

    def replace(self, agent: AnyAgent) -> AnyAgent:
        """Swap the code behind a registered name (a deploy, in tests)."""
        if agent.name not in self._agents:
            raise UnknownAgent(f"unknown agent {agent.name!r}")
        self._agents[agent.name] = agent
        return agent

    def get(self, name: str) -> AnyAgent:
        try:
            return self._agents[name]
        except KeyError:
            raise UnknownAgent(
                f"unknown agent {name!r}; known agents: {', '.join(sorted(self._agents)) or 'none'}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._agents)

    def run_defaults(self, name: str) -> tuple[str | None, int | None]:
        """The model and step cap a run of ``name`` gets when its submitter names neither
        (``None``: the agent sets none): a child run starts with its own agent's."""
        chosen = self._agents.get(name)
        if chosen is None:
            return None, None
        return (chosen.model if isinstance(chosen, Agent) else None), chosen.max_steps

    def approval_roles(self) -> set[str]:
        """Every role a registered durable function may ask to approve."""
        return {
            role
            for a in self._agents.values()
            if not isinstance(a, Agent)
            for role in getattr(a, "approval_roles", ())
        }

    def __contains__(self, name: object) -> bool:
        return name in self._agents
