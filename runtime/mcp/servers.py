"""MCP servers as an agent declares them, in Python or in configuration.

``McpServer.stdio("git", [...])`` starts a server as a subprocess of each worker process;
``McpServer.http("crm", url, headers_from_env={...})`` talks streamable HTTP to a running one.
``DAR_MCP_SERVERS`` declares the same in JSON, ``DAR_MCP_TOOLS`` lets an operator override
what a tool's annotations say about running it again after a crash (docs/agents/mcp.md).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from db.errors import DarError
from runtime.tools import Reconciled, ToolContext

Reconcile = Callable[[ToolContext], Reconciled | None]

SEPARATOR = "__"
"""Between the server's name and its tool's: ``git__git_status``."""

SERVER_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]|_(?!_)){0,29}$")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""The Messages API's rule for a tool's name."""

DEFAULT_TIMEOUT_SECONDS = 60.0


class McpConfigError(DarError):
    """An MCP server or tool policy is misconfigured."""


@dataclass(frozen=True)
class ToolPolicy:
    """What the operator says about one MCP tool, over what its annotations say.

    ``idempotent``: ``True`` runs it again after a crash left it in doubt, ``False`` stops the
    run for a person (or asks ``reconcile``); ``None`` follows the annotations
    (``readOnlyHint`` or ``idempotentHint`` true: run again; otherwise stop).
    """

    idempotent: bool | None = None
    reconcile: Reconcile | None = None
    timeout_seconds: float | None = None

    def merged(self, over: ToolPolicy | None) -> ToolPolicy:
        if over is None:
            return self
        return ToolPolicy(
            idempotent=self.idempotent if over.idempotent is None else over.idempotent,
            reconcile=over.reconcile or self.reconcile,
            timeout_seconds=over.timeout_seconds or self.timeout_seconds,
        )


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class McpServer:
    name: str
    transport: Literal["stdio", "http"]
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Extra environment for a stdio server (values are never logged)."""
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    headers_from_env: Mapping[str, str] = field(default_factory=dict)
    """HTTP header -> the environment variable holding its value, read when connecting."""
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    """Per call, unless a tool's policy says otherwise."""
    tools: Mapping[str, ToolPolicy] = field(default_factory=dict)
    """Per tool (the server's own name for it): overrides of its annotations."""
    allow: tuple[str, ...] | None = None
    """Offer only these of the server's tools (``None``: all of them)."""

    def __post_init__(self) -> None:
        if not SERVER_NAME.match(self.name):
            raise McpConfigError(
                f"MCP server name {self.name!r} must be 1-30 letters, digits, '-' or single "
                "'_' (its tools are offered as <server>__<tool>)"
            )
        if self.transport == "stdio" and not self.command:
            raise McpConfigError(f"MCP server {self.name!r}: a stdio server needs a command")
        if self.transport == "http" and not (
            self.url and self.url.startswith(("http://", "https://"))
        ):
            raise McpConfigError(
                f"MCP server {self.name!r}: an http server needs an http:// or https:// url"
            )
        if self.timeout_seconds <= 0:
            raise McpConfigError(f"MCP server {self.name!r}: timeout_seconds must be positive")
        for attr in ("env", "headers", "headers_from_env", "tools"):
            object.__setattr__(self, attr, _frozen(getattr(self, attr)))

    @classmethod
    def stdio(
        cls,
        name: str,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        tools: Mapping[str, ToolPolicy] | None = None,
        allow: Sequence[str] | None = None,
    ) -> McpServer:
        """A server each worker process starts as its own subprocess (stdio transport)."""
        return cls(
            name=name,
            transport="stdio",
            command=tuple(command),
            env=dict(env or {}),
            cwd=cwd,
            timeout_seconds=timeout_seconds,
            tools=dict(tools or {}),
            allow=tuple(allow) if allow is not None else None,
        )

    @classmethod
    def http(
        cls,
        name: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        headers_from_env: Mapping[str, str] | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        tools: Mapping[str, ToolPolicy] | None = None,
        allow: Sequence[str] | None = None,
    ) -> McpServer:
        """A running server reached over streamable HTTP."""
        return cls(
            name=name,
            transport="http",
            url=url,
            headers=dict(headers or {}),
            headers_from_env=dict(headers_from_env or {}),
            timeout_seconds=timeout_seconds,
            tools=dict(tools or {}),
            allow=tuple(allow) if allow is not None else None,
        )

    @property
    def where(self) -> str:
        """How messages name the server: never a header value or an env value."""
        if self.transport == "stdio":
            return f"MCP server {self.name!r} (stdio: {' '.join(self.command)})"
        return f"MCP server {self.name!r} ({self.url})"

    def policy(self, tool: str) -> ToolPolicy | None:
        return self.tools.get(tool)


def namespaced(server: str, tool: str) -> str:
    """The name the model sees: ``<server>__<tool>``, any character the API refuses
    replaced by ``_``, cut to 64 characters."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", tool)
    return f"{server}{SEPARATOR}{safe}"[:64]


# -- configuration --------------------------------------------------------------------------


def import_reconcile(ref: str, setting: str) -> Reconcile:
    module_name, _, attr = ref.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise McpConfigError(
            f"{setting}: reconcile {ref!r} does not name a function (module:function): {e}"
        ) from None
    if not callable(target):
        raise McpConfigError(f"{setting}: reconcile {ref!r} is not callable")
    fn: Reconcile = target
    return fn


def _policy(raw: Any, setting: str) -> ToolPolicy:
    if not isinstance(raw, dict):
        raise McpConfigError(f"{setting} must be an object")
    unknown = set(raw) - {"idempotent", "reconcile", "timeout_seconds"}
    if unknown:
        raise McpConfigError(
            f"{setting}: unknown key {sorted(unknown)[0]!r} "
            "(expected idempotent, reconcile, timeout_seconds)"
        )
    idempotent = raw.get("idempotent")
    if idempotent is not None and not isinstance(idempotent, bool):
        raise McpConfigError(f"{setting}.idempotent must be true or false")
    timeout = raw.get("timeout_seconds")
    if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
        raise McpConfigError(f"{setting}.timeout_seconds must be a positive number")
    reconcile = raw.get("reconcile")
    if reconcile is not None and not isinstance(reconcile, str):
        raise McpConfigError(f"{setting}.reconcile must be 'module:function'")
    return ToolPolicy(
        idempotent=idempotent,
        reconcile=import_reconcile(reconcile, f"{setting}.reconcile") if reconcile else None,
        timeout_seconds=float(timeout) if timeout is not None else None,
    )


def _strings(raw: Any, setting: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise McpConfigError(f"{setting} must be an object of strings")
    return dict(raw)


@dataclass(frozen=True)
class ConfiguredServer:
    server: McpServer
    agents: tuple[str, ...] = ()
    """Agents the configuration attaches the server to (besides any that name it)."""


SERVER_KEYS = {
    "command",
    "env",
    "cwd",
    "url",
    "headers",
    "headers_from_env",
    "timeout_seconds",
    "tools",
    "allow",
    "agents",
}


def parse_servers(text: str | None) -> list[ConfiguredServer]:
    """``DAR_MCP_SERVERS``: ``{"<name>": {"command": [...]} | {"url": ...}, ...}``."""
    if not text:
        return []
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise McpConfigError(f"DAR_MCP_SERVERS is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise McpConfigError('DAR_MCP_SERVERS must be a JSON object {"<name>": {...}}')
    out: list[ConfiguredServer] = []
    for name, spec in raw.items():
        where = f"DAR_MCP_SERVERS[{name!r}]"
        if not isinstance(spec, dict):
            raise McpConfigError(f"{where} must be an object")
        unknown = set(spec) - SERVER_KEYS
        if unknown:
            raise McpConfigError(
                f"{where}: unknown key {sorted(unknown)[0]!r} "
                f"(expected {', '.join(sorted(SERVER_KEYS))})"
            )
        if ("command" in spec) == ("url" in spec):
            raise McpConfigError(f"{where} needs exactly one of command (stdio) or url (http)")
        tools_raw = spec.get("tools") or {}
        if not isinstance(tools_raw, dict):
            raise McpConfigError(f"{where}.tools must be an object")
        tools = {t: _policy(p, f"{where}.tools[{t!r}]") for t, p in tools_raw.items()}
        timeout = spec.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS)
        if not isinstance(timeout, int | float):
            raise McpConfigError(f"{where}.timeout_seconds must be a number")
        allow = spec.get("allow")
        if allow is not None and (
            not isinstance(allow, list) or not all(isinstance(a, str) for a in allow)
        ):
            raise McpConfigError(f"{where}.allow must be a list of tool names")
        agents = spec.get("agents") or []
        if not isinstance(agents, list) or not all(isinstance(a, str) for a in agents):
            raise McpConfigError(f"{where}.agents must be a list of agent names")
        if "command" in spec:
            command = spec["command"]
            if isinstance(command, str):
                command = command.split()
            if (
                not isinstance(command, list)
                or not command
                or not all(isinstance(c, str) for c in command)
            ):
                raise McpConfigError(f"{where}.command must be a non-empty list of strings")
            cwd = spec.get("cwd")
            if cwd is not None and not isinstance(cwd, str):
                raise McpConfigError(f"{where}.cwd must be a string")
            server = McpServer.stdio(
                name,
                command,
                env=_strings(spec.get("env"), f"{where}.env"),
                cwd=cwd,
                timeout_seconds=float(timeout),
                tools=tools,
                allow=allow,
            )
        else:
            if not isinstance(spec["url"], str):
                raise McpConfigError(f"{where}.url must be a string")
            server = McpServer.http(
                name,
                spec["url"],
                headers=_strings(spec.get("headers"), f"{where}.headers"),
                headers_from_env=_strings(
                    spec.get("headers_from_env"), f"{where}.headers_from_env"
                ),
                timeout_seconds=float(timeout),
                tools=tools,
                allow=allow,
            )
        out.append(ConfiguredServer(server, tuple(agents)))
    return out


def parse_tool_overrides(text: str | None) -> dict[str, ToolPolicy]:
    """``DAR_MCP_TOOLS``: ``{"<server>__<tool>": {"idempotent": true, ...}}``: the operator's
    word on a tool, over its annotations and over what the code declares."""
    if not text:
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise McpConfigError(f"DAR_MCP_TOOLS is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise McpConfigError('DAR_MCP_TOOLS must be a JSON object {"<server>__<tool>": {...}}')
    out: dict[str, ToolPolicy] = {}
    for name, spec in raw.items():
        if SEPARATOR not in name:
            raise McpConfigError(f"DAR_MCP_TOOLS key {name!r} must name a tool as <server>__<tool>")
        out[name] = _policy(spec, f"DAR_MCP_TOOLS[{name!r}]")
    return out
