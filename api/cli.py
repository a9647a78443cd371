"""The ``dar`` command: migrate, run the development stack, run the demo, look at runs."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from db.records import TERMINAL, RunStatus

DEMO_QUESTION = "Which acme tickets are overdue?"


def _migrate(_: argparse.Namespace) -> int:
    from db.engine import make_engine
    from db.migrate import current_revision, upgrade
    from runtime.config import Settings

    engine = make_engine(Settings.from_env().require_database_url(), pool_size=1)
    try:
        upgrade(engine)
        print(f"dar: database at migration {current_revision(engine)}")
    finally:
        engine.dispose()
    return 0


def _stack(args: argparse.Namespace) -> Any:
    from api.devstack import DevStack

    return DevStack(
        data_dir=Path(args.data_dir),
        port=args.port,
        workers=args.workers,
        concurrency=args.concurrency,
        metrics_port_base=args.metrics_port,
    )


def _banner(port: int, workers: int) -> str:
    names = ", ".join(f"worker-{chr(65 + i)}" for i in range(workers))
    return f"""
dar: the stack is up: API on http://127.0.0.1:{port}, {names}, beat.
  Submit a run:
    curl -s -X POST localhost:{port}/api/runs -H 'Content-Type: application/json' \\
      -d '{{"input":"{DEMO_QUESTION}","tokenBudget":50000,"timeoutSeconds":300}}'
  Watch it:   dar timeline <id>      (or: curl -s localhost:{port}/api/runs/<id>/timeline)
  Stop:       Ctrl-C stops every process this command started.
"""


def _dev(args: argparse.Namespace) -> int:
    stack = _stack(args)
    stop = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        stack.start()
        print(_banner(args.port, args.workers), flush=True)
        while not stop:
            for name, proc in stack.processes.items():
                if proc.poll() is not None:
                    print(f"dar: {name} exited with status {proc.returncode}", flush=True)
                    stop = True
            time.sleep(0.5)
    finally:
        print("dar: stopping", flush=True)
        stack.stop()
    return 0


def _wait_for(stack: Any, run_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _, run = stack.request("GET", f"/api/runs/{run_id}")
        if RunStatus(run["status"]) in TERMINAL or run["status"] in ("NEEDS_ATTENTION", "WAITING"):
            return run
        time.sleep(0.5)
    raise TimeoutError(f"run {run_id} did not finish within {timeout:.0f}s")


def _demo(args: argparse.Namespace) -> int:
    """Start the stack, submit the demo question, print the timeline, stop."""
    stack = _stack(args)
    try:
        stack.start()
        try:
            run_input = json.loads(args.input) if args.input else args.question
        except ValueError as e:
            print(f"dar: --input is not JSON: {e}", file=sys.stderr)
            return 2
        status, accepted = stack.request(
            "POST",
            "/api/runs",
            {
                "input": run_input,
                "tokenBudget": 50000,
                "timeoutSeconds": 300,
                **({"agent": args.agent} if args.agent else {}),
            },
        )
        if status != 201:
            print(f"dar: submit failed: {status} {accepted}", file=sys.stderr)
            return 1
        print(f"dar: submitted run {accepted['id']}", flush=True)
        run = _wait_for(stack, accepted["id"], args.timeout)
        while run["status"] == "WAITING" and (args.approve or args.reject):
            _, page = stack.request("GET", "/api/approvals")
            pending = [a for a in page["items"] if a["runId"] == accepted["id"]]
            verb = "approve" if args.approve else "reject"
            for a in pending:
                print(f"dar: {verb} {a['stepKey']} (role {a['role']}): {a['payload']}")
                stack.request("POST", f"/api/approvals/{a['id']}/{verb}", {"comment": "dar demo"})
            time.sleep(0.5)
            run = _wait_for(stack, accepted["id"], args.timeout)
        _, steps = stack.request("GET", f"/api/runs/{accepted['id']}/timeline")
        print()
        print(_timeline_table(steps))
        print(f"\nstatus={run['status']} tokens={run['tokensUsed']}")
        if run.get("result"):
            print(f"\n{run['result']}")
        if run.get("error"):
            print(f"\nerror: {run['error']}")
        return 0 if run["status"] == "SUCCEEDED" else 1
    finally:
        stack.stop()


def _api_get(base: str, path: str) -> Any:
    token = os.environ.get("DAR_API_TOKEN")
    req = urllib.request.Request(base.rstrip("/") + path)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = json.loads(e.read() or b"{}")
        msg = body.get("error", {}).get("message", e.reason)
        raise SystemExit(f"dar: {e.code} {msg}") from None
    except urllib.error.URLError as e:
        raise SystemExit(f"dar: cannot reach the API at {base}: {e.reason}") from None


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _timeline_table(steps: list[dict[str, Any]]) -> str:
    return _table(
        ["SEQ", "KIND", "STATUS", "TOOL/STOP", "IN", "OUT", "LATENCY", "WORKER"],
        [
            [
                s["seq"],
                s["kind"],
                s["status"],
                s["toolName"] or s["stopReason"] or s["stepKey"],
                s["inputTokens"],
                s["outputTokens"],
                f"{s['latencyMs']}ms" if s["latencyMs"] is not None else "",
                s["worker"],
            ]
            for s in steps
        ],
    )


def _runs(args: argparse.Namespace) -> int:
    query = f"?limit={args.limit}" + (f"&status={args.status}" if args.status else "")
    page = _api_get(args.api, f"/api/runs{query}")
    print(
        _table(
            ["ID", "STATUS", "AGENT", "TOKENS", "COST", "CREATED", "ERROR"],
            [
                [
                    r["id"],
                    r["status"],
                    r["agent"],
                    r["tokensUsed"],
                    f"${r['costUsd']:.4f}",
                    r["createdAt"][:19],
                    (r["error"] or "")[:60],
                ]
                for r in page["items"]
            ],
        )
    )
    return 0


def _timeline(args: argparse.Namespace) -> int:
    print(_timeline_table(_api_get(args.api, f"/api/runs/{args.run_id}/timeline")))
    return 0


def _token_new(args: argparse.Namespace) -> int:
    from api.auth import NAME, ROLE, ROLES, hash_token, new_token

    for what, value in (("name", args.name), ("--tenant", args.tenant)):
        if value is not None and not NAME.match(value):
            print(
                f"dar: {what} {value!r}: use letters, digits and _ . @ - (no ':' or ',')",
                file=sys.stderr,
            )
            return 2
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    bad = [r for r in roles if not ROLE.match(r)]
    if not roles or bad:
        print(
            f"dar: --roles takes some of {', '.join(ROLES)} and approval roles of your durable "
            "functions (letters, digits, _ . -)"
            + (f"; not a role: {', '.join(bad)}" if bad else ""),
            file=sys.stderr,
        )
        return 2
    custom = [r for r in roles if r not in ROLES]
    if custom:
        print(
            f"dar: note: {', '.join(custom)} must be approval roles a durable function declares, "
            "or the server refuses the entry at start",
            file=sys.stderr,
        )
    token = new_token()
    tenant = f":{args.tenant}" if args.tenant else ""
    print(f"token (give it to the client; it is not stored anywhere):\n  {token}")
    print("DAR_API_TOKENS entry (the server keeps only the hash):")
    print(f"  {args.name}:{'+'.join(roles)}:{hash_token(token)}{tenant}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dar", description="Durable Agent Runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("migrate", help="migrate DATABASE_URL to the current schema").set_defaults(
        func=_migrate
    )

    for name, func, help_text in (
        ("dev", _dev, "run web, workers and beat (embedded PostgreSQL/Redis if unset)"),
        ("demo", _demo, "start the stack, run the demo question, print its timeline, stop"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8080")))
        p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
        p.add_argument("--concurrency", type=int, default=16, help="threads per worker")
        p.add_argument("--data-dir", default=".dar", help="embedded PostgreSQL data (.dar)")
        p.add_argument(
            "--metrics-port",
            type=int,
            default=int(os.environ.get("DAR_METRICS_PORT", "9808")),
            help="worker-A serves metrics here, worker-B on the next port (0: off)",
        )
        p.set_defaults(func=func)
        if name == "demo":
            p.add_argument("--question", default=DEMO_QUESTION)
            p.add_argument("--agent", help="agent to run (default DAR_DEFAULT_AGENT)")
            p.add_argument("--input", help="JSON input (durable functions) instead of --question")
            decide = p.add_mutually_exclusive_group()
            decide.add_argument("--approve", action="store_true", help="approve what it asks")
            decide.add_argument("--reject", action="store_true", help="reject what it asks")
            p.add_argument("--timeout", type=float, default=120.0)

    api_default = os.environ.get("DAR_API_URL", "http://127.0.0.1:8080")
    p = sub.add_parser("runs", help="list runs")
    p.add_argument("--status", choices=[str(s) for s in RunStatus])
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--api", default=api_default, help="API base URL (DAR_API_URL)")
    p.set_defaults(func=_runs)

    p = sub.add_parser("token", help="API tokens")
    token_sub = p.add_subparsers(dest="token_command", required=True)
    t = token_sub.add_parser("new", help="make a token and print its DAR_API_TOKENS entry")
    t.add_argument("name")
    t.add_argument(
        "--roles",
        required=True,
        help="comma-separated: read,submit,cancel,approve,admin and approval roles",
    )
    t.add_argument("--tenant", help="the tenant whose runs it sees (default: its name)")
    t.set_defaults(func=_token_new)

    p = sub.add_parser("timeline", help="show a run's steps")
    p.add_argument("run_id")
    p.add_argument("--api", default=api_default, help="API base URL (DAR_API_URL)")
    p.set_defaults(func=_timeline)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
