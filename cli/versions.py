"""``dar versions``, ``dar upgrade`` and ``dar replay-check``: deployment versions
(runtime.engine.deployment) from the command line. The first two ask the API; the replay
check runs here, against the code installed where it runs and the database of
``DATABASE_URL``, so a CI job can run it before a deploy."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

Command = Callable[[str, Any, str], argparse.ArgumentParser]


def add_version_commands(
    command: Command,
    api_command: Command,
    api_call: Callable[..., Any],
    table: Callable[[list[str], list[list[Any]]], str],
) -> None:
    """The three commands, on ``dar``'s parser (``build_parser`` calls this once, with its
    REST call and its table printer)."""
    p = api_command(
        "versions",
        _versions,
        "deployment versions: their workers, their runs in flight, and runs no worker serves",
    )
    p.set_defaults(api_call=api_call, table=table)
    p = api_command(
        "upgrade",
        _upgrade,
        "move the runs of VERSION to the API's version, each after a clean replay check",
    )
    p.add_argument("deployment", metavar="VERSION", help="the version whose runs move")
    p.add_argument(
        "--run", action="append", dest="runs", metavar="RUN_ID", help="only this run (repeat)"
    )
    p.add_argument("--dry-run", action="store_true", help="check only, move nothing")
    p.set_defaults(api_call=api_call, table=table)
    p = command(
        "replay-check",
        _replay_check,
        "replay recorded runs (DATABASE_URL) against the agents installed here, with no model "
        "call and no tool effect; exit 1 when one diverges",
    )
    p.add_argument("--deployment", metavar="VERSION", help="only runs of this version")
    p.add_argument("--agent", help="only runs of this agent")
    p.add_argument("--sample", type=int, default=200, help="how many runs, newest first")
    p.add_argument("--in-flight", action="store_true", help="only runs not ended")
    p.add_argument(
        "--strict-config",
        action="store_true",
        help="a configuration change (prompt, model, tool schemas) fails the check too",
    )
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.set_defaults(table=table)


def _versions(args: argparse.Namespace) -> int:
    body = args.api_call(args.api, "GET", "/api/versions")
    rows = []
    for v in body["versions"]:
        name = v["deployment"] or "(none)"
        live = v["liveWorkers"]
        runs = ", ".join(f"{k} {n}" for k, n in sorted(v["runs"].items()))
        rows.append(
            [
                name + (" *" if v["deployment"] == body["current"] else ""),
                f"{live}/{len(v['workers'])}",
                v["inFlight"],
                "yes" if v["served"] else "NO",
                runs,
            ]
        )
    print(args.table(["VERSION", "WORKERS", "IN FLIGHT", "SERVED", "RUNS"], rows))
    print(f"* the API's version ({body['current']})")
    if body["unservedRuns"]:
        print(
            f"{body['unservedRuns']} runs in flight belong to a version no worker serves: "
            "start a worker of it, or `dar upgrade VERSION`"
        )
    replay = sorted(a for a, p in body.get("upgradePolicies", {}).items() if p == "replay")
    if replay:
        print(
            f"upgraded by policy once their version is served no more: {', '.join(replay)} "
            '(upgrade="replay")'
        )
    return 0


def _divergence_cell(d: dict[str, Any] | None) -> list[Any]:
    if d is None:
        return ["", "", ""]
    return [d["seq"] if d["seq"] is not None else "-", d["recorded"][:50], d["asked"][:60]]


def _report_table(
    table: Callable[[list[str], list[list[Any]]], str], runs: list[dict[str, Any]], *, moved: bool
) -> str:
    headers = ["RUN", "AGENT", "VERSION", "STEPS", "RESULT", "SEQ", "RECORDED", "NEW CODE ASKED"]
    headers.append("CONFIGURATION CHANGES")
    rows = []
    for r in runs:
        result = "clean" if r["clean"] else "DIVERGES"
        if moved:
            result = "moved" if r.get("moved") else ("busy" if r.get("busy") else result)
        rows.append(
            [
                r["runId"][:8],
                r["agent"],
                r["deployment"] or "(none)",
                r["steps"],
                result,
                *_divergence_cell(r["divergence"]),
                "; ".join(r["configurationChanges"])[:80],
            ]
        )
    return table(headers, rows)


def _upgrade(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"dryRun": bool(args.dry_run)}
    if args.runs:
        body["runIds"] = args.runs
    report = args.api_call(args.api, "POST", f"/api/versions/{args.deployment}/upgrade", body)
    print(_report_table(args.table, report["runs"], moved=True))
    print(
        f"{report['checked']} runs of {report['from']} checked against {report['to']}: "
        f"{len(report['moved'])} moved, {len(report['stayed'])} stayed, "
        f"{len(report['busy'])} busy (try again)" + (" (dry run)" if report["dryRun"] else "")
    )
    return 1 if report["stayed"] else 0


def _replay_check(args: argparse.Namespace) -> int:
    from db.deployments import DeploymentStore
    from db.engine import make_engine
    from db.store import RunStore
    from runtime.config import Settings
    from runtime.engine.deployment import deployment_version
    from runtime.engine.preflight import check_agents, check_database_url
    from runtime.engine.replaycheck import check_run

    settings = Settings.from_env()
    url = check_database_url(settings.require_database_url())
    registry = check_agents(settings)
    here = deployment_version(registry, settings)
    engine = make_engine(url, pool_size=2)
    try:
        store, versions = RunStore(engine), DeploymentStore(engine)
        runs = versions.sample(
            deployment=args.deployment,
            agent=args.agent,
            in_flight=args.in_flight,
            limit=args.sample,
        )
        recorded: dict[str | None, dict[str, Any]] = {}
        checks = []
        for run in runs:
            if run.deployment not in recorded:
                recorded[run.deployment] = versions.definitions(run.deployment)
            definition = recorded[run.deployment].get(run.agent)
            checks.append(check_run(registry, run, store.steps(run.id), definition))
    finally:
        engine.dispose()
    diverged = [c for c in checks if not c.clean]
    changed = [c for c in checks if c.configuration]
    failed = bool(diverged) or (args.strict_config and bool(changed))
    if args.json:
        print(
            json.dumps(
                {"deployment": here, "failed": failed, "runs": [c.json() for c in checks]},
                indent=2,
            )
        )
        return 1 if failed else 0
    if checks:
        print(_report_table(args.table, [c.json() for c in checks], moved=False))
    print(
        f"{len(checks)} recorded runs replayed against this code (version {here}): "
        f"{len(checks) - len(diverged)} clean, {len(diverged)} diverge; "
        f"{len(changed)} with configuration changes"
    )
    return 1 if failed else 0
