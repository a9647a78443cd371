"""A real MCP server, built with the SDK, whose tools count their side effects.

Every call appends one JSON line to the ledger file (``--ledger``): the tool, the
idempotency key the client sent in ``_meta`` and the arguments. Tests read the ledger to
see how many times a tool really ran. Run it over stdio (the default) or streamable HTTP
(``--http PORT``); ``--token`` makes the HTTP server demand ``Authorization: Bearer
<token>`` (401 otherwise), ``--fail-calls`` makes it answer every ``tools/call`` with HTTP 500,
``--delay-once`` makes a slow tool slow on the first call with a key only (a call made again
after a crash, its key already in the ledger, answers at once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import ToolAnnotations

READ_ONLY = ToolAnnotations(read_only_hint=True)
IDEMPOTENT = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True)
DESTRUCTIVE = ToolAnnotations(read_only_hint=False, destructive_hint=True)


def build(ledger: Path, extra_tool: bool = False, delay_once: bool = False) -> MCPServer:
    server = MCPServer("counting")

    def slow_for(tool: str, ctx: Context, delay: float) -> float:
        """How long this call takes after its effect: ``delay``, or under ``delay_once``
        nothing when the ledger has this tool's key already (call it before ``record``)."""
        if not delay or not delay_once:
            return delay
        meta = ctx.request_context.meta or {}
        key = meta.get("dar/idempotency_key") if isinstance(meta, dict) else None
        lines = ledger.read_text(encoding="utf-8").splitlines() if ledger.exists() else []
        for line in lines:
            entry = json.loads(line)
            if entry["tool"] == tool and entry["key"] == key:
                return 0.0
        return delay

    def record(tool: str, ctx: Context, **arguments: Any) -> int:
        meta = ctx.request_context.meta or {}
        key = meta.get("dar/idempotency_key") if isinstance(meta, dict) else None
        print(f"calling {tool} key={key}", file=sys.stderr, flush=True)
        line = json.dumps({"tool": tool, "key": key, "args": arguments, "pid": os.getpid()})
        with ledger.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        return sum(1 for _ in ledger.open(encoding="utf-8"))

    @server.tool(annotations=DESTRUCTIVE)
    def add_note(text: str, ctx: Context, delay: float = 0.0) -> str:
        """Append a note (a side effect that must not happen twice)."""
        delay = slow_for("add_note", ctx, delay)
        n = record("add_note", ctx, text=text)
        if delay:  # the effect happened; the answer takes a while
            marker = ledger.with_suffix(".calling")
            marker.write_text(json.dumps({"tool": "add_note", "pid": os.getpid()}))
            time.sleep(delay)
        return f"note {n} added: {text}"

    @server.tool(annotations=READ_ONLY)
    def count_notes(ctx: Context, delay: float = 0.0) -> str:
        """How many notes there are (read only)."""
        delay = slow_for("count_notes", ctx, delay)
        record("count_notes", ctx)
        if delay:
            marker = ledger.with_suffix(".calling")
            marker.write_text(json.dumps({"tool": "count_notes", "pid": os.getpid()}))
            time.sleep(delay)
        notes = [line for line in ledger.read_text().splitlines() if '"tool": "add_note"' in line]
        return f"{len(notes)} notes"

    @server.tool(annotations=IDEMPOTENT)
    def set_flag(name: str, value: bool, ctx: Context) -> str:
        """Set a flag (idempotent: setting it twice is setting it once)."""
        record("set_flag", ctx, name=name, value=value)
        return f"{name}={value}"

    @server.tool()
    def unannotated(x: int, ctx: Context) -> str:
        """A tool that says nothing about its effects."""
        record("unannotated", ctx, x=x)
        return str(x * 2)

    @server.tool(annotations=READ_ONLY)
    def fail(message: str, ctx: Context) -> str:
        """Fail as a tool does: the result carries isError."""
        record("fail", ctx, message=message)
        raise ToolError(message)

    @server.tool(annotations=READ_ONLY)
    def rpc_error(ctx: Context) -> str:
        """Answer with a JSON-RPC error instead of a result."""
        record("rpc_error", ctx)
        raise MCPError(code=-32099, message="the ledger is locked")

    @server.tool(annotations=READ_ONLY)
    def hang(ctx: Context) -> str:
        """Never return."""
        record("hang", ctx)
        time.sleep(3600)
        return "unreachable"

    @server.tool(annotations=READ_ONLY)
    def huge(size: int, ctx: Context) -> str:
        """A result of ``size`` characters."""
        record("huge", ctx, size=size)
        return "x" * size

    @server.tool(annotations=DESTRUCTIVE)
    def crash(ctx: Context) -> str:
        """Die in the middle of the call (after the effect)."""
        record("crash", ctx)
        os._exit(3)

    @server.tool(annotations=READ_ONLY)
    def structured(ctx: Context) -> dict[str, int]:
        """A structured result."""
        record("structured", ctx)
        return {"a": 1, "b": 2}

    if extra_tool:

        @server.tool(annotations=READ_ONLY)
        def added_later(ctx: Context) -> str:
            """A tool that appears only after a restart."""
            return "new"

    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--http", type=int, default=0)
    parser.add_argument("--token", default="")
    parser.add_argument("--fail-calls", action="store_true")
    parser.add_argument("--extra-tool", action="store_true")
    parser.add_argument("--crash-at-start", action="store_true")
    parser.add_argument("--delay-once", action="store_true")
    args = parser.parse_args()
    print(f"counting server starting pid={os.getpid()}", file=sys.stderr, flush=True)
    if args.crash_at_start:
        print("counting server: cannot open the ledger, exiting", file=sys.stderr, flush=True)
        sys.exit(2)
    server = build(Path(args.ledger), args.extra_tool, args.delay_once)
    if not args.http:
        server.run()
        return
    import uvicorn

    app = server.streamable_http_app()
    token = args.token
    fail_calls = args.fail_calls

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            if token and headers.get(b"authorization") != f"Bearer {token}".encode():
                await _answer(send, 401, b'{"error": "unauthorized"}')
                return
            if fail_calls and scope.get("method") == "POST":
                body, more = b"", True
                while more:
                    message = await receive()
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                if b'"tools/call"' in body:
                    await _answer(send, 500, b'{"error": "internal"}')
                    return
                replayed = False

                async def receive_again() -> Any:
                    nonlocal replayed
                    if replayed:
                        return await receive()
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}

                await app(scope, receive_again, send)
                return
        await app(scope, receive, send)

    uvicorn.run(guarded, host="127.0.0.1", port=args.http, log_level="warning")


async def _answer(send: Any, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    main()
