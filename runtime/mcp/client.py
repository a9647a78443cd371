"""MCP sessions of one worker process, on the official SDK.

The SDK is asynchronous; the engine's steps run on worker threads. Each process gets one
event-loop thread (started on first use, and again in a forked child) that owns every
session; a step calls into it and waits for its answer with a deadline. A session is opened
lazily per server, kept, and opened again when its server went away (a restarted stdio
server, a restarted HTTP server): before each call a ping proves the session alive, so a call
that then fails with the connection closed was really sent, and is in doubt.

A stdio server's stderr goes to the worker log, line by line, with the id of the run whose
call is in flight. Header values (``headers_from_env``) and env values are never logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, TextIO, TypeVar, cast

from runtime import native
from runtime.mcp.errors import McpError, McpInDoubt, McpRemoteError, McpUnavailable
from runtime.mcp.servers import McpServer, ToolPolicy

if TYPE_CHECKING:  # the SDK is imported where it is used: processes without MCP skip it
    import mcp_types
    from mcp import ClientSession
    from mcp.shared.exceptions import MCPError

log = logging.getLogger(__name__)

T = TypeVar("T")

META_KEY = "dar/idempotency_key"
"""Where a call's idempotency key travels in the request's ``_meta``."""
META_RUN = "dar/run_id"

PING_TIMEOUT_SECONDS = 5.0
HTTP_CLIENT_FAILURE = "Server returned an error response"
"""What the SDK says when an HTTP server answered a POST with a status of 400 or more."""


@dataclass(frozen=True)
class CallResult:
    text: str
    is_error: bool
    structured: Any = None


def result_text(result: mcp_types.CallToolResult) -> str:
    """A tool result as text for the model: text blocks as they are, other blocks named."""
    import mcp_types

    parts: list[str] = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
            kind = "image" if isinstance(block, mcp_types.ImageContent) else "audio"
            parts.append(f"[{kind} {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource {block.uri}]")
        elif isinstance(block, mcp_types.EmbeddedResource):
            resource = block.resource
            if isinstance(resource, mcp_types.TextResourceContents):
                parts.append(resource.text)
            else:
                parts.append(f"[resource {resource.uri}, {resource.mime_type or 'binary'}]")
        else:  # pragma: no cover - a content type of a later protocol revision
            parts.append(block.model_dump_json(by_alias=True, exclude_none=True))
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


def _first_line(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup) and e.exceptions:
        return _first_line(e.exceptions[0])
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


STDERR_GRACE_SECONDS = 1.0
"""A server's stderr line read this soon after its last call ended is logged with that call's
run (the pump is a thread of its own and may read it after the call returned)."""


class _StderrPump:
    """Reads a stdio server's stderr on a thread and logs each line."""

    def __init__(self, server: str, connection: _Connection) -> None:
        read_fd, write_fd = os.pipe()
        self.writer: IO[str] = os.fdopen(write_fd, "w")
        self._reader = os.fdopen(read_fd, "r", errors="replace")
        self._server = server
        self._connection = connection
        self.tail: list[str] = []
        if native.gevent_patched():
            # Under gevent a thread is a greenlet, and this blocking read of a pipe would stop
            # every greenlet of the worker (the MCP loop's included): read on a native thread.
            native.submit(self._pump)
        else:
            thread = threading.Thread(target=self._pump, name=f"mcp-stderr-{server}", daemon=True)
            thread.start()

    def close_writer(self) -> None:
        with contextlib.suppress(OSError):
            self.writer.close()

    def _pump(self) -> None:
        with self._reader:
            for line in self._reader:
                text = line.rstrip()
                if not text:
                    continue
                self.tail = [*self.tail[-4:], text]
                run = self._connection.current_run
                log.info(
                    "run=%s mcp=%s stderr: %s",
                    run[:8] if run != "-" else "-",
                    self._server,
                    text,
                    extra={"run_id": run, "mcp_server": self._server},
                )


class _Connection:
    """One session to one server: opened, kept and closed on the loop thread."""

    def __init__(self, server: McpServer) -> None:
        self.server = server
        self.session: ClientSession | None = None
        self.tools: list[mcp_types.Tool] = []
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.last_http_status: int | None = None
        self.runs: list[str] = []
        self.last_run = "-"
        self.last_ended = -STDERR_GRACE_SECONDS
        self.stderr: _StderrPump | None = None
        self.broken = False

    @property
    def current_run(self) -> str:
        """The run whose call the server is serving; just after a call, still that run: the
        pump reads a line the server wrote during the call after the call returned."""
        if self.runs:
            return self.runs[-1]
        if time.monotonic() - self.last_ended < STDERR_GRACE_SECONDS:
            return self.last_run
        return "-"

    async def open(self, timeout: float) -> None:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task = asyncio.get_running_loop().create_task(self._serve(ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout)
        except TimeoutError:
            self.stop.set()
            raise McpUnavailable(
                f"{self.server.where} did not answer initialize within {timeout:g}s"
                + self._stderr_hint()
            ) from None
        except McpError:
            raise
        except Exception as e:
            raise McpUnavailable(
                f"{self.server.where} could not be started: {self._explain(e)}"
                + self._stderr_hint()
            ) from None

    def _stderr_hint(self) -> str:
        if self.stderr is None:
            return ""
        time.sleep(0.05)  # the pump's last lines, when the process just died
        tail = self.stderr.tail
        return f" (its stderr said: {tail[-1]})" if tail else ""

    def _explain(self, e: BaseException) -> str:
        import httpx2
        import mcp_types
        from mcp.shared.exceptions import MCPError

        if isinstance(e, BaseExceptionGroup) and e.exceptions:
            return self._explain(e.exceptions[0])
        if isinstance(e, FileNotFoundError):
            return f"command not found: {self.server.command[0]!r}"
        if isinstance(e, MCPError) and e.message == HTTP_CLIENT_FAILURE:
            return self._http_status_text()
        if isinstance(e, MCPError) and e.code == mcp_types.CONNECTION_CLOSED:
            return "it exited during startup"
        if isinstance(e, httpx2.ConnectError):
            return f"connection refused ({_first_line(e)})"
        return _first_line(e)

    def _http_status_text(self) -> str:
        status = self.last_http_status
        if status in (401, 403):
            env = ", ".join(sorted(self.server.headers_from_env.values()))
            hint = f" (check the credentials in {env})" if env else " (check its credentials)"
            return f"it answered HTTP {status}{hint}"
        return f"it answered HTTP {status}" if status else "it answered an HTTP error"

    async def _serve(self, ready: asyncio.Future[None]) -> None:
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await self._transport(stack)
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                self.tools = await _list_all(session)
                self.session = session
                if not ready.done():
                    ready.set_result(None)
                await self.stop.wait()
        except BaseException as e:
            self.broken = True
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else McpUnavailable(str(e)))
            elif not isinstance(e, asyncio.CancelledError):
                log.warning("%s: session ended: %s", self.server.where, _first_line(e))
        finally:
            self.broken = True
            if self.stderr is not None:
                self.stderr.close_writer()

    async def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        import httpx2
        from mcp import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client

        server = self.server
        if server.transport == "stdio":
            self.stderr = _StderrPump(server.name, self)
            params = StdioServerParameters(
                command=server.command[0],
                args=list(server.command[1:]),
                env=dict(server.env) or None,
                cwd=server.cwd,
            )
            streams = await stack.enter_async_context(
                stdio_client(params, errlog=cast(TextIO, self.stderr.writer))
            )
            # The child holds its own copy now: EOF reaches the pump when it exits.
            self.stderr.close_writer()
            return streams
        headers = dict(server.headers)
        for header, variable in server.headers_from_env.items():
            value = os.environ.get(variable)
            if value is None:
                raise McpUnavailable(
                    f"{server.where}: header {header!r} comes from the environment variable "
                    f"{variable}, which is not set"
                )
            headers[header] = value

        async def on_response(response: httpx2.Response) -> None:
            if response.request.method == "POST":
                self.last_http_status = response.status_code

        client = httpx2.AsyncClient(
            headers=headers,
            timeout=httpx2.Timeout(30.0, read=300.0),
            event_hooks={"response": [on_response]},
        )
        await stack.enter_async_context(client)
        assert server.url is not None
        return await stack.enter_async_context(
            streamable_http_client(server.url, http_client=client)
        )

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self.task), 10)


async def _list_all(session: ClientSession) -> list[mcp_types.Tool]:
    import mcp_types

    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    while True:
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


class McpClients:
    """The MCP sessions of this process. Build one per worker process (``Runtime``); it
    starts its thread and its sessions only when a run first needs them."""

    def __init__(
        self,
        *,
        connect_timeout_seconds: float = 30.0,
        tool_overrides: Mapping[str, ToolPolicy] | None = None,
    ) -> None:
        self.connect_timeout_seconds = connect_timeout_seconds
        self.tool_overrides: Mapping[str, ToolPolicy] = dict(tool_overrides or {})
        """``DAR_MCP_TOOLS``: the operator's word per ``<server>__<tool>``."""
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._connections: dict[str, _Connection] = {}
        self._opening: dict[str, asyncio.Lock] = {}

    # -- the loop thread --------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None and self._pid == os.getpid():
                return self._loop
            # First use, or a forked child: the parent's thread and sessions are not ours.
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                loop.run_forever()

            self._thread = threading.Thread(target=run, name="dar-mcp", daemon=True)
            self._thread.start()
            started.wait()
            self._loop, self._pid = loop, os.getpid()
            self._connections, self._opening = {}, {}
            return loop

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    # -- sessions ----------------------------------------------------------------------------

    async def _connection(self, server: McpServer) -> _Connection:
        lock = self._opening.setdefault(server.name, asyncio.Lock())
        async with lock:
            current = self._connections.get(server.name)
            if current is not None and current.server != server:
                await current.close()  # redeclared (a test, a reload): start afresh
                current = None
            if current is not None and not current.broken:
                return current
            if current is not None:
                log.info("%s: its session ended; opening a new one", server.where)
                await current.close()
            connection = _Connection(server)
            self._connections[server.name] = connection
            try:
                await connection.open(self.connect_timeout_seconds)
            except BaseException:
                self._connections.pop(server.name, None)
                await connection.close()
                raise
            log.info(
                "%s: session open, %d tools (%s)",
                server.where,
                len(connection.tools),
                connection.session.protocol_version if connection.session else "?",
            )
            return connection

    async def _alive(self, server: McpServer) -> _Connection:
        """A session proven alive by a ping: a fresh one when the old one's server went."""
        connection = await self._connection(server)
        assert connection.session is not None
        try:
            await asyncio.wait_for(connection.session.send_ping(), PING_TIMEOUT_SECONDS)
        except Exception:
            connection.broken = True
            connection = await self._connection(server)
        return connection

    def tools(self, server: McpServer) -> list[mcp_types.Tool]:
        """The server's tools, as listed when its session opened (opening it if needed)."""

        async def listing() -> list[mcp_types.Tool]:
            return list((await self._connection(server)).tools)

        return self._run(listing(), self.connect_timeout_seconds + 15)

    def check(self, server: McpServer) -> list[mcp_types.Tool]:
        """Start (or reach) the server, list its tools and close again: the startup check."""

        async def probe() -> list[mcp_types.Tool]:
            connection = _Connection(server)
            try:
                await connection.open(self.connect_timeout_seconds)
                return list(connection.tools)
            finally:
                await connection.close()

        return self._run(probe(), self.connect_timeout_seconds + 15)

    def call(
        self,
        server: McpServer,
        tool: str,
        arguments: dict[str, Any],
        *,
        key: str,
        run_id: uuid.UUID,
        timeout_seconds: float,
    ) -> CallResult:
        """Call ``tool`` once. Raises :class:`McpUnavailable` (not sent),
        :class:`McpRemoteError` (refused) or :class:`McpInDoubt` (sent, no answer)."""
        import mcp_types
        from mcp.shared.exceptions import MCPError

        run = str(run_id)

        async def call() -> CallResult:
            connection = await self._alive(server)
            session = connection.session
            assert session is not None
            connection.runs.append(run)
            try:
                result = await session.call_tool(
                    tool,
                    arguments,
                    read_timeout_seconds=timeout_seconds,
                    meta=cast(mcp_types.RequestParamsMeta, {META_KEY: key, META_RUN: run}),
                )
            except MCPError as e:
                raise self._classify(connection, tool, e, timeout_seconds) from None
            except Exception as e:
                connection.broken = True
                raise McpInDoubt(
                    f"{server.where}: the call to {tool!r} failed after it was sent "
                    f"({_first_line(e)})"
                ) from None
            finally:
                connection.runs.remove(run)
                connection.last_run, connection.last_ended = run, time.monotonic()
            return CallResult(result_text(result), bool(result.is_error), result.structured_content)

        try:
            return self._run(call(), timeout_seconds + self.connect_timeout_seconds + 15)
        except concurrent.futures.TimeoutError:
            raise McpInDoubt(
                f"{server.where}: the call to {tool!r} did not return within {timeout_seconds:g}s",
                timed_out=True,
            ) from None

    def _classify(
        self, connection: _Connection, tool: str, e: MCPError, timeout: float
    ) -> McpError:
        import mcp_types

        where = connection.server.where
        if e.code == mcp_types.CONNECTION_CLOSED:
            connection.broken = True
            return McpInDoubt(f"{where} went away during the call to {tool!r} (connection closed)")
        if e.code == mcp_types.REQUEST_TIMEOUT:
            return McpInDoubt(
                f"{where}: the call to {tool!r} did not return within {timeout:g}s (cancelled)",
                timed_out=True,
            )
        if e.message == HTTP_CLIENT_FAILURE:
            status = connection.last_http_status
            if status is not None and status >= 500:
                return McpInDoubt(f"{where} answered HTTP {status} to the call to {tool!r}")
            return McpRemoteError(
                f"{where} refused the call to {tool!r}: {connection._http_status_text()}",
                e.code,
            )
        return McpRemoteError(f"{where} answered with error {e.code}: {e.message}", e.code)

    def close(self) -> None:
        loop = self._loop
        if loop is None or self._pid != os.getpid():
            return
        connections = list(self._connections.values())

        async def close_all() -> None:
            for connection in connections:
                await connection.close()

        with contextlib.suppress(Exception):
            self._run(close_all(), 20)

        async def cancel_rest() -> None:
            current = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not current]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._run(cancel_rest(), 10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        if not loop.is_running():
            loop.close()
        self._loop, self._thread = None, None
        self._connections = {}
