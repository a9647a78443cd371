"""The ``dar`` command: migrate, run the development stack, run the demo, and every call of
the REST API (runs, timeline, cancel, resume, resolve, fork, diff, approvals)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from cli.versions import add_version_commands
from db.errors import DarError
from db.records import TERMINAL, RunStatus
from runtime.client import ApiUnreachable, Client

DEMO_QUESTION = "Which acme tickets are overdue?"
RUN_ID_PREFIX = re.compile(r"^[0-9a-f-]{1,36}$")
T = TypeVar("T")


class CliError(DarError):
    """The command could not do what was asked."""


class _Interrupted(BaseException):
    """A stop signal arrived while the stack was starting."""


def version() -> str:
    """The version, written in one place: ``pyproject.toml``. From a checkout (an editable
    install included, whose installed metadata keeps the version of its install) it is read
    there; from an installed package, from the package's metadata."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        try:
            return str(tomllib.loads(pyproject.read_text())["project"]["version"])
        except (OSError, ValueError, KeyError):
            pass
    try:
        return metadata.version("durable-agent-runtime")
    except metadata.PackageNotFoundError:  # pragma: no cover - not installed, no checkout
        return "unknown"


# -- the stack ------------------------------------------------------------------------------


def _migrate(_: argparse.Namespace) -> int:
    from db.engine import make_engine
    from db.migrate import current_revision, upgrade
    from runtime.config import Settings
    from runtime.engine.preflight import check_database_url

    url = check_database_url(Settings.from_env().require_database_url())
    engine = make_engine(url, pool_size=1)
    try:
        upgrade(engine)
        print(f"dar: database at migration {current_revision(engine)}")
    finally:
        engine.dispose()
    return 0


def _stack(args: argparse.Namespace, **extra: Any) -> Any:
    from cli.devstack import DevStack, RestartPolicy

    return DevStack(
        data_dir=Path(args.data_dir),
        port=args.port,
        workers=args.workers,
        **({"concurrency": args.concurrency} if args.concurrency else {}),
        metrics_port_base=args.metrics_port,
        flower_port=args.flower_port if getattr(args, "flower", False) else 0,
        restart=RestartPolicy(limit=getattr(args, "restart_limit", 5)),
        access_log=os.environ.get("DAR_LOG_LEVEL", "INFO").upper() == "DEBUG",
        **extra,
    )


def _banner(stack: Any) -> str:
    pids = ", ".join(f"{name} (pid {proc.pid})" for name, proc in stack.processes.items())
    port = stack.port
    flower = f"\n  Flower:     http://127.0.0.1:{stack.flower_port}" if stack.flower_port else ""
    calls, bound = stack.model_calls_per_worker()
    return f"""
dar: the stack is up: API on http://127.0.0.1:{port}; {pids}.
  Console:    http://127.0.0.1:{port}/   (runs, timelines, approvals, operator actions)
  Submit a run:
    curl -s -X POST localhost:{port}/api/runs -H 'Content-Type: application/json' \\
      -d '{{"input":"{DEMO_QUESTION}","tokenBudget":50000,"timeoutSeconds":300}}'
  Watch it:   dar timeline <id>      (or: curl -s localhost:{port}/api/runs/<id>/timeline)
  Workers:    {stack.workers} x celery worker --pool {stack.pool} --concurrency {stack.concurrency}
  Capacity:   {calls:,} model calls in flight per worker ({bound}), {calls * stack.workers:,} in all
  Processes:  dar ps                 (kill -9 <pid> of a worker: it is restarted){flower}
  Stop:       Ctrl-C stops every process this command started.
"""


def _install_stop_handlers() -> dict[str, bool]:
    """SIGINT, SIGTERM and SIGHUP all stop the stack; during start-up they interrupt it."""
    flags = {"stop": False, "started": False}

    def _on_signal(signum: int, _frame: object) -> None:
        flags["stop"] = True
        if not flags["started"]:
            raise _Interrupted(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    return flags


def _dev(args: argparse.Namespace) -> int:
    stack = _stack(args)
    flags = _install_stop_handlers()
    try:
        stack.start()
        flags["started"] = True
        print(_banner(stack), flush=True)
        stack.supervise(lambda: flags["stop"])
        return 0
    except _Interrupted:
        return 0
    finally:
        flags["started"] = True  # a second signal while stopping must not interrupt stop()
        if stack.processes:
            print("dar: stopping", flush=True)
        stack.stop()


def _ps(args: argparse.Namespace) -> int:
    from cli.devstack import pid_alive, running_stack

    state = running_stack(Path(args.data_dir))
    if state is None:
        print(f"dar: no `dar dev` is running on {args.data_dir}", file=sys.stderr)
        return 1
    held = _runs_held(str(state["api"]))
    rows = [["dar dev", state["pid"], "running", ""]]
    for name, pid in state["processes"].items():
        alive = "running" if pid and pid_alive(int(pid)) else "restarting"
        rows.append([name, pid, alive, " ".join(held.get(name, []))])
    print(_table(["PROCESS", "PID", "STATE", "HOLDS RUN"], rows))
    print(f"API: {state['api']}")
    return 0


def _runs_held(api: str) -> dict[str, list[str]]:
    """Which worker holds which running run (id prefixes), so `kill -9` can pick its victim;
    empty when the API does not answer (a token is needed, or it is restarting)."""
    held: dict[str, list[str]] = {}
    try:
        page = api_call(api, "GET", "/api/runs?status=RUNNING&limit=100")
    except CliError:
        return held
    for run in page.get("items", []):
        if run.get("lockedBy"):
            held.setdefault(str(run["lockedBy"]), []).append(str(run["id"])[:8])
    return held


def _wait_for(stack: Any, run_id: str, timeout: float, seen: set[int | str]) -> dict[str, Any]:
    """Poll the run until it ends or waits, printing each step once it has finished."""
    deadline = time.monotonic() + timeout
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _, steps = stack.request("GET", f"/api/runs/{run_id}/timeline")
        for s in steps:
            key = s["stepKey"] if s["seq"] is None else s["seq"]  # an audit entry has no seq
            if key not in seen and s["status"] not in ("STARTED", "PENDING"):
                seen.add(key)
                print(f"  {_step_line(s)}", flush=True)
        _, run = stack.request("GET", f"/api/runs/{run_id}")
        if RunStatus(run["status"]) in TERMINAL or run["status"] in ("NEEDS_ATTENTION", "WAITING"):
            return run
        time.sleep(0.3)
    raise CliError(f"run {run_id} did not finish within {timeout:.0f}s (--timeout)")


def _step_line(s: dict[str, Any]) -> str:
    if s["seq"] is None:  # an operator's or the runtime's action between steps: no seq
        detail = s.get("detail")
        if isinstance(detail, dict | list):
            detail = json.dumps(detail, separators=(",", ":"))
        by = f" by {s['actor']}" if s.get("actor") else ""
        return f"{s['kind']} {s.get('action') or s['stepKey']}{by}" + (
            f": {detail}" if detail else ""
        )
    what = s["toolName"] or s["stopReason"] or s["stepKey"]
    tokens = f" in={s['inputTokens']} out={s['outputTokens']}" if s["kind"] == "MODEL" else ""
    latency = f" {s['latencyMs']}ms" if s["latencyMs"] is not None else ""
    worker = f" ({s['worker']})" if s.get("worker") else ""
    return f"seq={s['seq']} {s['kind']} {what} {s['status']}{tokens}{latency}{worker}"


def _demo(args: argparse.Namespace) -> int:
    """Start the stack, submit the demo question, show each step as it finishes, stop."""
    try:
        run_input = json.loads(args.input) if args.input else args.question
    except ValueError as e:
        raise CliError(f"--input is not JSON: {e}") from None
    log_dir = Path(args.data_dir) / "logs"
    stack = _stack(args, log_dir=log_dir, agent=args.agent)
    flags = _install_stop_handlers()
    try:
        print(f"dar: starting the stack (process logs in {log_dir}/)", flush=True)
        stack.start()
        flags["started"] = True
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
            raise CliError(f"submit failed: {status} {_error_message(accepted)}")
        print(f"dar: submitted run {accepted['id']}", flush=True)
        seen: set[int | str] = set()
        run = _wait_for(stack, accepted["id"], args.timeout, seen)
        while run["status"] == "WAITING" and (args.approve or args.reject):
            _, page = stack.request("GET", "/api/approvals")
            pending = [a for a in page["items"] if a["runId"] == accepted["id"]]
            verb = "approve" if args.approve else "reject"
            for a in pending:
                print(f"dar: {verb} {a['stepKey']} (role {a['role']}): {a['payload']}")
                stack.request("POST", f"/api/approvals/{a['id']}/{verb}", {"comment": "dar demo"})
            time.sleep(0.3)
            run = _wait_for(stack, accepted["id"], args.timeout, seen)
        _, steps = stack.request("GET", f"/api/runs/{accepted['id']}/timeline")
        print()
        print(_timeline_table(steps))
        print(
            f"\nstatus={run['status']} model={run['model']} tokens={run['tokensUsed']} "
            f"cost=${run['costUsd']:.4f}"
        )
        if run.get("result"):
            print(f"\n{run['result']}")
        if run.get("error"):
            print(f"\nerror: {run['error']}")
        return 0 if run["status"] == "SUCCEEDED" else 1
    except _Interrupted:
        return 130
    finally:
        flags["started"] = True
        stack.stop()


# -- the REST API ---------------------------------------------------------------------------


def _error_message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body))
    return str(body)


def client(base: str) -> Client:
    """The Python client the CLI is built on (``DAR_API_TOKEN`` as its token)."""
    return Client(base, token=os.environ.get("DAR_API_TOKEN"))


def _call(do: Callable[[], T]) -> T:
    try:
        return do()
    except ApiUnreachable as e:
        raise CliError(
            f"{e} (is `dar dev` running? --api or DAR_API_URL points elsewhere)"
        ) from None


def api_call(base: str, method: str, path: str, body: Any = None) -> Any:
    """One REST call through :class:`~runtime.client.Client`; an unreachable API is one line
    naming the likely fix, an error answer its status and message."""
    return _call(lambda: client(base).request(method, path, body))


def resolve_run_id(base: str, raw: str, *, max_pages: int = 50) -> str:
    """A full run id from a full one or a prefix (the 8 characters the logs print), matched
    against the runs the API lists, newest first."""
    raw = raw.strip().lower()
    if len(raw) == 36:
        return raw
    if not RUN_ID_PREFIX.match(raw):
        raise CliError(f"{raw!r} is not a run id or a prefix of one (hex characters)")
    matches: list[str] = []
    cursor: str | None = None
    for _ in range(max_pages):
        query = "?limit=100" + (f"&cursor={urllib.parse.quote(cursor)}" if cursor else "")
        page = api_call(base, "GET", f"/api/runs{query}")
        matches += [r["id"] for r in page["items"] if r["id"].startswith(raw)]
        if len(matches) > 1:
            raise CliError(
                f"run id prefix {raw!r} is ambiguous ({', '.join(matches)}); give more of it"
            )
        cursor = page.get("nextCursor")
        if not cursor:
            break
    if not matches:
        raise CliError(f"no run whose id starts with {raw!r}")
    return matches[0]


def resolve_approval_id(base: str, raw: str) -> str:
    raw = raw.strip().lower()
    if len(raw) == 36:
        return raw
    items = api_call(base, "GET", "/api/approvals?status=ANY")["items"]
    matches = [a["id"] for a in items if a["id"].startswith(raw)]
    if len(matches) != 1:
        what = "no approval" if not matches else "more than one approval"
        raise CliError(f"{what} whose id starts with {raw!r} (dar approvals lists them)")
    return str(matches[0])


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
                s["status"] + (f" ({s['origin']})" if s.get("origin") else ""),
                s["toolName"] or s["stopReason"] or s["stepKey"],
                s["inputTokens"],
                s["outputTokens"],
                f"{s['latencyMs']}ms" if s["latencyMs"] is not None else "",
                s["worker"],
            ]
            if s["seq"] is not None
            # an audit entry (an operator's action, a recovery): what, and by whom
            else [None, s["kind"], s["status"], s.get("action"), None, None, None, s.get("actor")]
            for s in steps
        ],
    )


def _runs(args: argparse.Namespace) -> int:
    if args.waiting:
        return _waiting(args)
    query = f"?limit={args.limit}" + (f"&status={args.status}" if args.status else "")
    page = api_call(args.api, "GET", f"/api/runs{query}")
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


def _waiting(args: argparse.Namespace) -> int:
    """Runs parked on a timer (a rate limit, a concurrency key's slots, a retry backoff),
    with what they wait for, their key and priority."""
    rows = []
    for status in ("QUEUED", "RUNNING"):
        page = api_call(args.api, "GET", f"/api/runs?limit={args.limit}&status={status}")
        rows += [r for r in page["items"] if r.get("waitReason")]
    print(
        _table(
            ["ID", "STATUS", "AGENT", "MODEL", "KEY", "PRIO", "WAITING FOR", "UNTIL"],
            [
                [
                    r["id"],
                    r["status"],
                    r["agent"],
                    r.get("model") or "",
                    (r.get("concurrencyKey") or "-")[:30],
                    r.get("priority", 0),
                    r["waitReason"][:70],
                    (r.get("runAt") or "")[:19],
                ]
                for r in rows[: args.limit]
            ],
        )
    )
    return 0


def _show(args: argparse.Namespace) -> int:
    run_id = resolve_run_id(args.api, args.run_id)
    print(json.dumps(api_call(args.api, "GET", f"/api/runs/{run_id}"), indent=2))
    return 0


def _submit(args: argparse.Namespace) -> int:
    try:
        run_input = json.loads(args.input) if args.json else args.input
    except ValueError as e:
        raise CliError(f"--json was given but the input is not JSON: {e}") from None
    accepted = _call(
        lambda: client(args.api).submit(
            run_input,
            agent=args.agent,
            model=args.model,
            token_budget=args.token_budget,
            timeout_seconds=args.timeout_seconds,
            max_steps=args.max_steps,
            concurrency_key=args.key,
            priority=args.priority,
        )
    )
    print(accepted.id)
    return 0


def _timeline(args: argparse.Namespace) -> int:
    run_id = resolve_run_id(args.api, args.run_id)
    print(_timeline_table(api_call(args.api, "GET", f"/api/runs/{run_id}/timeline")))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    run_id = resolve_run_id(args.api, args.run_id)
    accepted = _call(lambda: client(args.api).cancel(run_id))
    print(f"dar: run {run_id} {accepted.status}: cancel requested")
    return 0


FOLLOW_EXIT = {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 3, "TIMED_OUT": 4}
"""``dar follow``'s exit status by the run's final status (2 is a usage or API error)."""


def _follow(args: argparse.Namespace) -> int:
    """Print a run live from GET /api/runs/{id}/events until it ends."""
    run_id = resolve_run_id(args.api, args.run_id)
    print(f"dar: following run {run_id}", flush=True)
    typing: str | None = None  # the step key whose text is being printed

    def end_text() -> None:
        nonlocal typing
        if typing is not None:
            print(flush=True)
            typing = None

    try:
        for ev in client(args.api).events(run_id):
            d = ev.data
            if ev.name == "text.delta":
                if typing != d["key"]:
                    end_text()
                    print(f"  {d['key']} (attempt {d['attempt']}): ", end="", flush=True)
                    typing = d["key"]
                print(d["text"], end="", flush=True)
            elif ev.name == "text.retract":
                end_text()
                print(f"  {d['key']}: attempt {d['attempt']} cut off; the model call is retried")
            elif ev.name == "step.finished":
                end_text()
                tokens = d.get("tokens") or {}
                cost = f" in={tokens.get('input', 0)} out={tokens.get('output', 0)}"
                latency = f" {d['latencyMs']}ms" if d.get("latencyMs") is not None else ""
                what = d.get("tool") or d["key"]
                print(f"  seq={d['seq']} {d['kind']} {what} {d['status']}{cost}{latency}")
            elif ev.name == "run.status":
                end_text()
                print(f"  run {d['status']}", flush=True)
            elif ev.name.startswith("approval."):
                end_text()
                print(f"  {ev.name} {d['key']} role={d['role']} {d['status']}", flush=True)
            elif ev.name == "run.finished":
                end_text()
                error = f": {d['error']}" if d.get("error") else ""
                print(f"dar: run {run_id} {d['status']}{error}", flush=True)
                return FOLLOW_EXIT.get(d["status"], 1)
    except KeyboardInterrupt:
        end_text()
        return 130
    return 1


def _resume(args: argparse.Namespace) -> int:
    run_id = resolve_run_id(args.api, args.run_id)
    accepted = _call(
        lambda: client(args.api).resume(
            run_id, token_budget=args.token_budget, timeout_seconds=args.timeout_seconds
        )
    )
    print(f"dar: run {run_id} resumed: {accepted.status}")
    return 0


def _resolve(args: argparse.Namespace) -> int:
    run_id = resolve_run_id(args.api, args.run_id)
    edits: dict[str, Any] = {}
    if args.action == "supply_result":
        if args.output is None:
            raise CliError("--action supply_result needs --output (the tool's result)")
        edits = {"output": args.output, "is_error": bool(args.is_error)}
    elif args.action == "fail" and args.reason:
        edits = {"reason": args.reason}
    accepted = _call(lambda: client(args.api).resolve(run_id, args.action, **edits))
    print(f"dar: run {run_id} resolved ({args.action}): {accepted.status}")
    return 0


def _fork(args: argparse.Namespace) -> int:
    run_id = resolve_run_id(args.api, args.run_id)
    edits: dict[str, Any] = {}
    if args.input is not None:
        try:
            edits["input"] = json.loads(args.input) if args.json else args.input
        except ValueError as e:
            raise CliError(f"--json was given but --input is not JSON: {e}") from None
    if args.tool_result is not None:
        seq, output = args.tool_result
        if not seq.isdigit():
            raise CliError(f"--tool-result SEQ OUTPUT: SEQ must be a step's seq, not {seq!r}")
        try:
            value: Any = json.loads(output) if args.json else output
        except ValueError as e:
            raise CliError(f"--json was given but the tool result is not JSON: {e}") from None
        edits["tool_result"] = (int(seq), value)
    accepted = _call(
        lambda: client(args.api).fork(
            run_id,
            args.from_seq,
            model=args.model,
            token_budget=args.token_budget,
            timeout_seconds=args.timeout_seconds,
            replay_model=bool(args.replay_model),
            reuse_approvals=bool(args.reuse_approvals),
            **edits,
        )
    )
    print(accepted.id)
    return 0


def _diff_cell(side: dict[str, Any] | None) -> str:
    if side is None:
        return "-"
    what = side["toolName"] or side["stepKey"]
    origin = f" ({side['origin']})" if side["origin"] else ""
    return f"{side['kind']} {what} {side['status']}{origin} tokens={side['tokens']}"


def _diff(args: argparse.Namespace) -> int:
    a = resolve_run_id(args.api, args.a)
    b = resolve_run_id(args.api, args.b)
    diff = _call(lambda: client(args.api).diff(a, b))
    for name in ("a", "b"):
        r = diff[name]
        fork = r["forkedFrom"]
        lineage = f" forked from {fork['runId']} at seq {fork['seq']}" if fork else ""
        print(
            f"{name}: {r['id']} {r['status']} model={r['model']} tokens={r['tokensUsed']} "
            f"cost=${r['costUsd']:.4f}{lineage}"
        )
    if diff["runDifferences"]:
        print(f"runs differ in: {', '.join(diff['runDifferences'])}")
    first = diff["firstDifferentSeq"]
    print("the steps are the same" if first is None else f"first difference at seq {first}")
    print(
        _table(
            ["SEQ", "A", "B", "DIFFERS IN"],
            [
                [
                    row["seq"],
                    _diff_cell(row["a"]),
                    _diff_cell(row["b"]),
                    ", ".join(row["differences"]),
                ]
                for row in diff["steps"]
            ],
        )
    )
    return 0


def _tree(args: argparse.Namespace) -> int:
    """``dar tree RUN``: the run tree it belongs to, from the root, indented by level."""
    run_id = resolve_run_id(args.api, args.run_id)
    tree = _call(lambda: client(args.api).tree(run_id))
    shown: dict[str, int] = {}
    for n in tree["nodes"]:
        if n["parentRunId"]:
            shown[n["parentRunId"]] = shown.get(n["parentRunId"], 0) + 1
    rows = []
    for n in tree["nodes"]:
        mark = "  <- this run" if n["id"] == run_id else ""
        missing = n["childCount"] - shown.get(n["id"], 0)
        more = ""
        if missing > 0:
            more = f" (+{missing}{'+' if n['childCount'] > tree['maxNodes'] else ''} not shown)"
        rows.append(
            [
                "  " * n["depth"] + n["id"][:8],
                n["agent"],
                n["status"],
                n["tokensUsed"],
                f"${n['costUsd']:.4f}",
                f"{n['childCount']}{more}{mark}",
            ]
        )
    if tree["nodes"][0]["parentRunId"]:
        print(f"(the tree goes further up: {tree['nodes'][0]['parentRunId']} is above)")
    print(_table(["RUN", "AGENT", "STATUS", "TOKENS", "COST", "CHILDREN"], rows))
    if tree["truncated"]:
        print(
            f"a large tree: the first {tree['maxNodes']} runs breadth-first from the root "
            f"(at most {tree['maxDepth']} levels) and this run's line"
        )
    return 0


def _approvals(args: argparse.Namespace) -> int:
    items = [
        a.raw for a in _call(lambda: client(args.api).approvals(status=args.status, role=args.role))
    ]
    print(
        _table(
            ["ID", "RUN", "STEP", "ROLE", "STATUS", "HASH", "PAYLOAD"],
            [
                [
                    a["id"],
                    a["runId"][:8],
                    a["stepKey"],
                    a["role"],
                    a["status"],
                    a["payloadHash"][:12],
                    json.dumps(a["payload"])[:60],
                ]
                for a in items
            ],
        )
    )
    return 0


def _decide(args: argparse.Namespace) -> int:
    approval_id = resolve_approval_id(args.api, args.approval_id)
    api = client(args.api)
    decide = api.approve if args.decision == "approve" else api.reject
    a = _call(lambda: decide(approval_id, comment=args.comment, payload_hash=args.hash))
    print(f"dar: approval {approval_id} {a.status} by {a.decided_by or '-'}")
    return 0


def _send(args: argparse.Namespace) -> int:
    """``dar send RUN TEXT``: a message into an agent-loop run (or the next turn of a
    finished one)."""
    run_id = resolve_run_id(args.api, args.run_id)
    sent = _call(lambda: client(args.api).send_message(run_id, args.text, policy=args.policy))
    how = (
        "the model call in flight, if any, is interrupted and made again with it"
        if args.policy == "interrupt"
        else "delivered at its next step boundary"
    )
    print(f"dar: message {sent.message_id} for run {run_id} ({sent.status}): {how}")
    return 0


def _schedules(args: argparse.Namespace) -> int:
    """``dar schedules`` (list), ``dar schedules add``, ``dar schedules delete``."""
    action = getattr(args, "schedule_command", None) or "list"
    args.api = getattr(args, "sub_api", None) or args.api
    if action == "add":
        try:
            run_input = json.loads(args.input) if args.json else args.input
        except ValueError as e:
            raise CliError(f"--json was given but the input is not JSON: {e}") from None
        body: dict[str, Any] = {"input": run_input, "cron": args.cron}
        for key, value in (
            ("agent", args.agent),
            ("timezone", args.timezone),
            ("overlap", args.overlap),
            ("catchUp", args.catch_up),
            ("tokenBudget", args.token_budget),
        ):
            if value is not None:
                body[key] = value
        made = api_call(args.api, "POST", "/api/schedules", body)
        print(made["id"])
        return 0
    if action == "delete":
        api_call(args.api, "DELETE", f"/api/schedules/{urllib.parse.quote(args.schedule_id)}")
        print(f"dar: schedule {args.schedule_id} deleted")
        return 0
    items = api_call(args.api, "GET", "/api/schedules")["items"]
    print(
        _table(
            ["ID", "AGENT", "CRON", "TIMEZONE", "OVERLAP", "CATCH-UP", "NEXT TICK"],
            [
                [
                    sc["id"],
                    sc["agent"],
                    sc["cron"],
                    sc["timezone"],
                    sc["overlap"],
                    sc["catchUp"],
                    sc["nextTickAt"],
                ]
                for sc in items
            ],
        )
    )
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
    expires = ""
    if args.expires:
        when = _expiry(args.expires)
        if when is None:
            print(
                f"dar: --expires {args.expires!r}: a date (2027-01-31) or a duration (30d, 12h)",
                file=sys.stderr,
            )
            return 2
        expires = f":expires={when}"
    token = new_token()
    tenant = f":{args.tenant}" if args.tenant else ""
    print(f"token (give it to the client; it is not stored anywhere):\n  {token}")
    print("DAR_API_TOKENS entry (the server keeps only the hash):")
    print(f"  {args.name}:{'+'.join(roles)}:{hash_token(token)}{tenant}{expires}")
    return 0


def _expiry(raw: str) -> str | None:
    """``--expires``: a date as given, or a duration from now as Unix seconds."""
    import re
    import time

    raw = raw.strip()
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", raw):
        return raw
    m = re.fullmatch(r"(\d+)([dhm])", raw)
    if m is None:
        return None
    seconds = int(m.group(1)) * {"d": 86400, "h": 3600, "m": 60}[m.group(2)]
    return str(int(time.time()) + seconds)


# -- the parser -----------------------------------------------------------------------------


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return action.help
        return super()._get_help_string(action)


def _status(raw: str) -> str:
    value = raw.upper()
    if value not in RunStatus.__members__:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(RunStatus)}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dar", description="Durable Agent Runtime", formatter_class=_Help
    )
    parser.add_argument("--version", action="version", version=f"dar {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Any, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Help)
        p.set_defaults(func=func)
        return p

    command("migrate", _migrate, "migrate DATABASE_URL to the current schema")

    data_dir_help = "where the embedded PostgreSQL keeps its data, and the process logs"
    for name, func, help_text in (
        ("dev", _dev, "run web, workers and beat, supervised (embedded PostgreSQL/Redis if unset)"),
        ("demo", _demo, "start the stack, run the demo question, show its steps, stop"),
    ):
        p = command(name, func, help_text)
        p.add_argument(
            "--port", type=int, default=int(os.environ.get("PORT", "8080")),
            help="the API's port on 127.0.0.1 ($PORT)",
        )  # fmt: skip
        p.add_argument("--workers", type=int, default=2, help="worker processes")
        p.add_argument(
            "--concurrency",
            type=int,
            default=None,
            help="steps per worker process (default: $DAR_WORKER_CONCURRENCY, else 2000)",
        )
        p.add_argument("--data-dir", default=".dar", help=data_dir_help)
        p.add_argument(
            "--metrics-port",
            type=int,
            default=int(os.environ.get("DAR_METRICS_PORT", "9808")),
            help="worker-A serves /metrics on this port, worker-B on the next (0: off)",
        )
        if name == "dev":
            p.add_argument(
                "--flower", action="store_true", help="also run Flower (task monitoring)"
            )
            p.add_argument(
                "--flower-port", type=int, default=int(os.environ.get("FLOWER_PORT", "5555")),
                help="Flower's port on 127.0.0.1 ($FLOWER_PORT)",
            )  # fmt: skip
            p.add_argument(
                "--restart-limit", type=int, default=5,
                help="a process that exits more often than this within 60 s stops the stack",
            )  # fmt: skip
        if name == "demo":
            p.add_argument("--question", default=DEMO_QUESTION, help="the question to ask")
            p.add_argument("--agent", help="agent to run (default: DAR_DEFAULT_AGENT)")
            p.add_argument("--input", help="JSON input (durable functions) instead of --question")
            decide = p.add_mutually_exclusive_group()
            decide.add_argument("--approve", action="store_true", help="approve what it asks")
            decide.add_argument("--reject", action="store_true", help="reject what it asks")
            p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for it")

    p = command("ps", _ps, "list the processes of the `dar dev` running here, with their pids")
    p.add_argument("--data-dir", default=".dar", help="the data directory of that `dar dev`")

    api_default = os.environ.get("DAR_API_URL", "http://127.0.0.1:8080")
    run_help = "run id, or a prefix of it (the 8 characters the logs print)"

    def api_command(name: str, func: Any, help_text: str) -> argparse.ArgumentParser:
        p = command(name, func, help_text)
        p.add_argument("--api", default=api_default, help="API base URL ($DAR_API_URL)")
        return p

    add_version_commands(command, api_command, api_call, _table)

    p = api_command("runs", _runs, "list runs, newest first")
    p.add_argument("--status", type=_status, help="only runs in this status (e.g. FAILED)")
    p.add_argument("--limit", type=int, default=20, help="how many runs")
    p.add_argument(
        "--waiting",
        action="store_true",
        help="only runs parked on a timer (rate limit, concurrency key, retry), with their "
        "wait reason, key and priority",
    )

    p = api_command("submit", _submit, "submit a run; prints its id")
    p.add_argument("input", help="the question or task (JSON with --json)")
    p.add_argument("--json", action="store_true", help="the input is JSON (durable functions)")
    p.add_argument("--agent", help="agent to run (default: the server's DAR_DEFAULT_AGENT)")
    p.add_argument("--model", help="model (default: the agent's, else DAR_DEFAULT_MODEL)")
    p.add_argument(
        "--key", help="concurrency key (at most DAR_KEY_CONCURRENCY of its runs in steps)"
    )
    p.add_argument("--priority", type=int, help="higher first among waiting runs (default 0)")
    p.add_argument("--token-budget", type=int, help="tokens (default: DAR_DEFAULT_TOKEN_BUDGET)")
    p.add_argument(
        "--timeout-seconds", type=int, help="run deadline in seconds (default: server's)"
    )
    p.add_argument("--max-steps", type=int, help="step cap (default: DAR_DEFAULT_MAX_STEPS)")

    p = api_command("show", _show, "show one run as JSON")
    p.add_argument("run_id", help=run_help)

    p = api_command("timeline", _timeline, "show a run's steps")
    p.add_argument("run_id", help=run_help)

    p = api_command("cancel", _cancel, "cancel a run (a model call in flight stops at once)")
    p.add_argument("run_id", help=run_help)

    p = api_command(
        "follow",
        _follow,
        "print a run live (steps as they finish, the model's text as it streams); exits 0 "
        "SUCCEEDED, 1 FAILED, 3 CANCELLED, 4 TIMED_OUT",
    )
    p.add_argument("run_id", help=run_help)

    p = api_command("resume", _resume, "retry a FAILED or TIMED_OUT run from its first open step")
    p.add_argument("run_id", help=run_help)
    p.add_argument("--token-budget", type=int, help="new token budget (default: unchanged)")
    p.add_argument("--timeout-seconds", type=int, help="new deadline from now, in seconds")

    p = api_command("resolve", _resolve, "decide a NEEDS_ATTENTION run's tool step (admin)")
    p.add_argument("run_id", help=run_help)
    p.add_argument(
        "--action", required=True, choices=("supply_result", "retry", "fail"),
        help="supply the tool's result, run the tool again, or fail the run",
    )  # fmt: skip
    p.add_argument("--output", help="with supply_result: the tool's result")
    p.add_argument("--is-error", action="store_true", help="with supply_result: it is an error")
    p.add_argument("--reason", help="with fail: why")

    p = api_command("fork", _fork, "fork a run from a step, with edits; prints the new run's id")
    p.add_argument("run_id", help=run_help)
    p.add_argument(
        "--from-seq", type=int, required=True,
        help="the first step the fork executes itself (steps before it are copied)",
    )  # fmt: skip
    p.add_argument("--input", help="the fork's input instead of the run's (JSON with --json)")
    p.add_argument("--json", action="store_true", help="--input and the tool result are JSON")
    p.add_argument("--model", help="another model for the fork's model steps")
    p.add_argument(
        "--tool-result", nargs=2, metavar=("SEQ", "OUTPUT"),
        help="replace the result of the copied step SEQ (a tool or a durable step) by OUTPUT",
    )  # fmt: skip
    p.add_argument("--token-budget", type=int, help="tokens (default: the run's budget)")
    p.add_argument("--timeout-seconds", type=int, help="deadline from now (default: the run's)")
    p.add_argument(
        "--replay-model", action="store_true",
        help="answer model steps from the run's recorded responses while the request is "
        "unchanged; call the model from the first request that differs",
    )  # fmt: skip
    p.add_argument(
        "--reuse-approvals", action="store_true",
        help="keep the run's decisions on the approval at --from-seq and the approved ones "
        "before it (the token needs approve and each approval's role): the fork runs what they "
        "authorise without asking; default: it asks again for each",
    )  # fmt: skip

    p = api_command("diff", _diff, "compare two runs step by step (a fork and its original)")
    p.add_argument("a", help=run_help)
    p.add_argument("b", help=run_help)

    p = api_command("tree", _tree, "the run tree a run belongs to, from its root (child runs)")
    p.add_argument("run_id", help=run_help)

    p = api_command("approvals", _approvals, "list approvals")
    p.add_argument(
        "--status", default="PENDING", type=str.upper,
        help="PENDING, APPROVED, REJECTED, EXPIRED or ANY",
    )  # fmt: skip
    p.add_argument("--role", help="only approvals for this role")

    for decision in ("approve", "reject"):
        p = api_command(decision, _decide, f"{decision} a pending approval")
        p.add_argument("approval_id", help="approval id, or a prefix of it (dar approvals)")
        p.add_argument("--comment", help="kept with the decision")
        p.add_argument(
            "--hash",
            help="the payloadHash you were shown: refused if what is to be approved changed",
        )
        p.set_defaults(decision=decision)

    p = api_command(
        "send",
        _send,
        "send a message to an agent-loop run (delivered at its next step boundary); a "
        "SUCCEEDED run continues as the next turn",
    )
    p.add_argument("run_id", help=run_help)
    p.add_argument("text", help="the message")
    p.add_argument(
        "--policy", default="enqueue", choices=("enqueue", "interrupt", "reject"),
        help="enqueue: delivered at the next step boundary; interrupt: the model call in "
        "flight is aborted and made again with the message; reject: refused while the run "
        "is inside a step",
    )  # fmt: skip

    p = api_command("schedules", _schedules, "list schedules; `add` or `delete` one")
    sched_sub = p.add_subparsers(dest="schedule_command", metavar="COMMAND")
    a = sched_sub.add_parser(
        "add", help="start an agent on a cron schedule; prints its id", formatter_class=_Help
    )
    a.add_argument("cron", help="cron expression, e.g. '0 9 * * 1-5' (6 fields: seconds first)")
    a.add_argument("input", help="each run's question or task (JSON with --json)")
    a.add_argument("--json", action="store_true", help="the input is JSON (durable functions)")
    a.add_argument("--agent", help="agent to run (default: the server's DAR_DEFAULT_AGENT)")
    a.add_argument("--timezone", help="IANA time zone the expression is read in (default UTC)")
    a.add_argument(
        "--overlap", choices=("skip", "queue", "allow"),
        help="a tick while the last run is live: skip it (default), queue it, or allow it",
    )  # fmt: skip
    a.add_argument(
        "--catch-up", choices=("none", "latest", "all"),
        help="ticks missed while nothing ran: none (default), the latest, or all",
    )  # fmt: skip
    a.add_argument("--token-budget", type=int, help="tokens per run")
    d = sched_sub.add_parser("delete", help="delete a schedule", formatter_class=_Help)
    d.add_argument("schedule_id", help="the schedule's id (dar schedules lists them)")
    for sp in (a, d):
        sp.add_argument(
            "--api", dest="sub_api", help=f"API base URL ($DAR_API_URL, else {api_default})"
        )

    p = command("token", None, "API tokens")
    token_sub = p.add_subparsers(dest="token_command", required=True, metavar="COMMAND")
    t = token_sub.add_parser(
        "new", help="make a token and print its DAR_API_TOKENS entry", formatter_class=_Help
    )
    t.add_argument("name", help="the token's name (recorded as submittedBy)")
    t.add_argument(
        "--roles",
        required=True,
        help="comma-separated: read,submit,cancel,approve,admin and approval roles",
    )
    t.add_argument("--tenant", help="the tenant whose runs it sees (default: its name)")
    t.add_argument(
        "--expires",
        help="when the token stops working: a date (2027-01-31, UTC) or a duration from now "
        "(30d, 12h); default: never",
    )
    t.set_defaults(func=_token_new)
    return parser


def _working_directory_importable() -> None:
    """Put the working directory on ``sys.path`` (after our own packages), as the workers,
    gunicorn and ``python -m`` have it: ``DAR_AGENT_MODULES=examples.orders_agent`` or a
    ``my_agent.py`` beside the user imports in ``dar``'s own checks exactly as it will in the
    workers. (A console script's ``sys.path[0]`` is the script's folder, not the cwd.)"""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def main(argv: Sequence[str] | None = None) -> int:
    _working_directory_importable()
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except DarError as e:  # configuration and API errors: one line that names the fix
        print(f"dar: {e}", file=sys.stderr, flush=True)
        return 1
    return result


if __name__ == "__main__":
    raise SystemExit(main())
