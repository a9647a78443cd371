"""``/api/versions``: the deployment versions (runtime.engine.deployment), the workers that
serve each one and its runs in flight; upgrading a version's runs to this process's version
after a replay check (runtime.engine.upgrade)."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from flask import Blueprint, Response, jsonify, request
from flask.blueprints import BlueprintSetupState

from api.auth import actor, requires
from api.errors import ApiError, invalid
from api.state import state
from api.validation import json_body
from db.records import Deployment
from runtime.agents import upgrade_policy
from runtime.engine.deployment import agent_definition
from runtime.engine.upgrade import MAX_UPGRADE, upgrade_runs
from tasks.dispatch import send_drive

log = logging.getLogger(__name__)

bp = Blueprint("versions", __name__)

DEPLOYMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
UPGRADE_FIELDS = ("runIds", "dryRun")


@bp.record_once
def _record_definitions(setup: BlueprintSetupState) -> None:
    """This version's agent definitions, for the replay check of a later upgrade: recorded
    by the web process too, since its runs are of its version before any worker of it runs."""
    runtime = setup.app.extensions["dar"].runtime
    if runtime.deployment is None:
        return
    try:
        runtime.deployments.record_definitions(
            runtime.deployment,
            {n: agent_definition(runtime.agents.get(n)) for n in runtime.agents.names()},
        )
    except Exception as e:  # the database away at start: a worker of the version records them
        log.warning("could not record this version's agent definitions: %s", e)


def deployment_json(d: Deployment) -> dict[str, Any]:
    return {
        "deployment": d.deployment,
        "workers": [
            {
                "worker": w.worker,
                "live": w.live,
                "startedAt": w.started_at.isoformat(),
                "lastSeen": w.last_seen.isoformat(),
            }
            for w in d.workers
        ],
        "liveWorkers": d.live_workers,
        "runs": d.runs,
        "inFlight": d.in_flight,
    }


@bp.get("/versions")
@requires("metrics")
def versions() -> Response:
    """Every version with a worker seen in the last day or a run in flight; ``served``:
    some live worker drives its runs (a run with no version: any live worker)."""
    runtime = state().runtime
    found = runtime.deployments.deployments()
    any_live = any(d.live_workers for d in found)
    body = []
    for d in found:
        body.append({**deployment_json(d), "served": _served(d, any_live)})
    return jsonify(
        {
            "current": runtime.deployment,
            "unservedRuns": sum(d.in_flight for d in found if not _served(d, any_live)),
            "versions": body,
            "upgradePolicies": {
                n: upgrade_policy(runtime.agents.get(n)) for n in runtime.agents.names()
            },
        }
    )


def _served(d: Deployment, any_live: bool) -> bool:
    return d.live_workers > 0 or (d.deployment is None and any_live)


@bp.post("/versions/<deployment>/upgrade")
@requires("admin")
def upgrade(deployment: str) -> tuple[Response, int]:
    """Move the runs of ``deployment`` to this process's version, each only after its
    recorded history replays clean against this process's code (runtime.engine.upgrade)."""
    runtime = state().runtime
    if not DEPLOYMENT.fullmatch(deployment):
        raise invalid("deployment", "must be a version's name (letters, digits, '.', '_', '-')")
    body = json_body(request) if request.content_length or request.data else {}
    unknown = sorted(set(body) - set(UPGRADE_FIELDS))
    if unknown:
        raise invalid(unknown[0], f"unknown field; allowed fields: {', '.join(UPGRADE_FIELDS)}")
    dry_run = body.get("dryRun", False)
    if not isinstance(dry_run, bool):
        raise invalid("dryRun", "must be true or false")
    raw_ids = body.get("runIds")
    run_ids: list[uuid.UUID] | None = None
    if "runIds" in body:  # absent means every run; null is not a list (nor "every run")
        if not isinstance(raw_ids, list) or len(raw_ids) > MAX_UPGRADE:
            raise invalid("runIds", f"must be a list of at most {MAX_UPGRADE} run ids")
        try:
            run_ids = [uuid.UUID(str(r)) for r in raw_ids]
        except ValueError:
            raise invalid("runIds", "must hold run ids (UUIDs)") from None
    current = runtime.deployment
    if current is None or deployment == current:
        raise ApiError(
            409,
            f"this process runs version {current}: the runs of {deployment} are already on it "
            "(an upgrade moves runs to the version of the process that checks them)",
            code="same_version",
        )
    name, _ = actor()
    celery = state().celery
    report = upgrade_runs(
        runtime.store,
        runtime.deployments,
        runtime.agents,
        deployment,
        current,
        actor=name,
        send=lambda d: send_drive(celery, runtime.store, d, deployment=current),
        run_ids=run_ids,
        dry_run=dry_run,
    )
    return jsonify(report.json()), 200
