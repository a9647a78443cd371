"""Checks a process runs before it starts work, each failing with one line that names the
setting and the fix (``dar dev``, ``dar migrate`` and the Celery worker call them).

A process that cannot work must not start: a worker whose agents do not load would say
``ready.``, take every message and fail it, while its runs sit queued.
"""

from __future__ import annotations

import logging

from sqlalchemy import text
from sqlalchemy.engine import make_url

from db.engine import make_engine, normalize_url
from runtime.agents import AgentRegistry
from runtime.config import ConfigError, Settings

log = logging.getLogger(__name__)

DATABASE_URL_FORM = "postgresql://user:password@host:5432/dbname"


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def check_database_url(url: str | None, *, connect: bool = True, timeout: int = 5) -> str:
    """The normalised URL, or a :class:`ConfigError` saying why it does not parse or connect.
    The password never appears in the message."""
    if not url:
        raise ConfigError(
            f"DATABASE_URL is not set: expected {DATABASE_URL_FORM} "
            "(or leave it unset under `dar dev`, which starts an embedded PostgreSQL)"
        )
    try:
        normalized = normalize_url(url)
        parsed = make_url(normalized)
    except Exception:
        raise ConfigError(
            f"DATABASE_URL does not parse as a PostgreSQL URL: expected {DATABASE_URL_FORM}"
        ) from None
    if not connect:
        return normalized
    where = f"{parsed.host or 'localhost'}:{parsed.port or 5432}/{parsed.database or ''}"
    engine = make_engine(normalized, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:
        reason = _first_line(getattr(e, "orig", None) or e)
        raise ConfigError(
            f"DATABASE_URL does not connect to {where} ({reason}): expected "
            f"{DATABASE_URL_FORM} of a running PostgreSQL"
        ) from None
    finally:
        engine.dispose()
    return normalized


def check_agents(settings: Settings) -> AgentRegistry:
    """Load the agents as a worker would (DAR_AGENT_MODULES, DAR_DEFAULT_AGENT)."""
    from db.demo import TicketStore
    from runtime.engine.bootstrap import load_agents

    engine = make_engine(
        settings.require_database_url(), pool_size=1, max_overflow=0, prepare=settings.db_prepare
    )
    try:
        registry = load_agents(settings, TicketStore(engine), engine)
    except ConfigError:
        raise
    except Exception as e:
        message = _first_line(e)
        if "fails to import" in message:
            message += (
                " (start the process in the directory that holds it, or add it to PYTHONPATH)"
            )
        elif message.startswith("DAR_DEFAULT_AGENT"):
            message += "; register it with DAR_AGENT_MODULES=your.module"
        elif "DAR_" not in message:
            message = f"{message} (check DAR_AGENT_MODULES and DAR_DEFAULT_AGENT)"
        raise ConfigError(message) from None
    finally:
        engine.dispose()
    return registry


def check_mcp_servers(settings: Settings, registry: AgentRegistry) -> None:
    """Start (or reach) every MCP server an agent uses and list its tools, so a missing
    command, a server that dies at startup or a refused credential names the server now,
    not in the middle of a run. ``DAR_MCP_STARTUP_CHECK``: ``strict`` (fail), ``warn`` (log
    and start anyway), ``off``."""
    if settings.mcp_startup_check == "off":
        return
    servers = registry.mcp_servers()
    if not servers:
        return
    from runtime.mcp.client import McpClients
    from runtime.mcp.errors import McpError
    from runtime.mcp.servers import parse_tool_overrides

    parse_tool_overrides(settings.mcp_tools_json)  # a bad DAR_MCP_TOOLS fails here too
    clients = McpClients(connect_timeout_seconds=settings.mcp_connect_timeout_seconds)
    try:
        for server in servers:
            try:
                tools = clients.check(server)
            except McpError as e:
                if settings.mcp_startup_check == "strict":
                    raise ConfigError(
                        f"{e} (DAR_MCP_STARTUP_CHECK=warn starts the worker anyway)"
                    ) from None
                log.warning("MCP startup check: %s", e)
                continue
            log.info("MCP startup check: %s offers %d tools", server.where, len(tools))
    finally:
        clients.close()


def check_startup(settings: Settings) -> AgentRegistry:
    """What a worker needs before it takes a message: a DATABASE_URL that parses, agents
    that load, and the MCP servers they use answering. A database that does not answer *yet*
    is not a configuration error (a worker restarted during a PostgreSQL restart waits for
    it, as the chaos suite requires); `dar dev` and `dar migrate` check that it connects."""
    check_database_url(settings.database_url, connect=False)
    registry = check_agents(settings)
    check_mcp_servers(settings, registry)
    return registry


def unknown_agent_message(name: str, registry: AgentRegistry) -> str:
    return (
        f"unknown agent {name!r}; known agents: {', '.join(registry.names())}. "
        "Register your own with DAR_AGENT_MODULES=your.module (a module with register(registry))"
    )
