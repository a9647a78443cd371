"""Moving runs of one version to another, only after a clean replay check.

An operator (``POST /api/versions/{deployment}/upgrade``, ``dar upgrade``) moves the runs of
version A to the version of the process that handles the request (its code is what the
check replays against, so it can only vouch for itself). Each run's recorded history is
replayed (:mod:`runtime.engine.replaycheck`); a clean run moves, with an audit entry
(``upgrade``) in the same transaction, and its message goes to the new version's queue; a
run that diverges stays where it is, and the report shows its first divergence. A run a
worker holds right now is left for the next try (``busy``). Runs are checked one by one
against the history they have at that moment: a run that records a step between its check
and its move is still of version A (the move is conditional on the version, not the step),
so the worst case is a run checked one step early; the check of the agent loop and of a
durable function's completed steps is not changed by a later step.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from db.deployments import DeploymentStore
from db.records import Dispatch, NewAudit
from db.store import RunStore
from runtime.agents import AgentRegistry
from runtime.engine.replaycheck import RunCheck, check_run

log = logging.getLogger(__name__)

MAX_UPGRADE = 1000
"""Runs one upgrade considers; what is left waits for the next call."""


@dataclass
class UpgradeReport:
    from_deployment: str | None
    to: str
    dry_run: bool
    checks: list[RunCheck] = field(default_factory=list)
    moved: list[uuid.UUID] = field(default_factory=list)
    busy: list[uuid.UUID] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        moved = set(self.moved)
        busy = set(self.busy)
        return {
            "from": self.from_deployment,
            "to": self.to,
            "dryRun": self.dry_run,
            "checked": len(self.checks),
            "moved": [str(r) for r in self.moved],
            "busy": [str(r) for r in self.busy],
            "stayed": [c.json() for c in self.checks if not c.clean],
            "runs": [
                {
                    **c.json(),
                    "moved": c.run_id in moved,
                    "busy": c.run_id in busy,
                }
                for c in self.checks
            ],
        }


def upgrade_runs(
    store: RunStore,
    versions: DeploymentStore,
    registry: AgentRegistry,
    from_deployment: str | None,
    to: str,
    *,
    actor: str,
    send: Callable[[Dispatch], object],
    run_ids: Sequence[uuid.UUID] | None = None,
    dry_run: bool = False,
    limit: int = MAX_UPGRADE,
) -> UpgradeReport:
    """Check every run of ``from_deployment`` (those of ``run_ids`` only, when given) against
    ``registry`` and move the clean ones to ``to``; ``send`` their messages after each move
    has committed. ``dry_run``: check only."""
    report = UpgradeReport(from_deployment, to, dry_run)
    recorded = versions.definitions(from_deployment)
    wanted = set(run_ids) if run_ids is not None else None
    for run in versions.runs_of(from_deployment, limit=limit):
        if wanted is not None and run.id not in wanted:
            continue
        check = check_run(registry, run, store.steps(run.id), recorded.get(run.agent))
        report.checks.append(check)
        if not check.clean or dry_run:
            continue
        audit = NewAudit(
            actor=actor,
            action="upgrade",
            tenant=run.tenant,
            detail={
                "from": from_deployment,
                "to": to,
                "stepsReplayed": check.steps,
                "configurationChanges": list(check.configuration),
            },
        )
        moved, dispatch = versions.upgrade(run.id, from_deployment, to, audit)
        if not moved:
            report.busy.append(run.id)
            continue
        report.moved.append(run.id)
        log.info("run=%s upgraded from version %s to %s", str(run.id)[:8], from_deployment, to)
        if dispatch is not None:
            send(dispatch)
    return report
