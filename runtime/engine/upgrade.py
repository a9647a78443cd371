"""Moving runs of one version to another, only after a clean replay check.

An operator (``POST /api/versions/{deployment}/upgrade``, ``dar upgrade``) moves the runs of
version A to the version of the process that handles the request (its code is what the check
replays against, so it can only vouch for itself); the runs of an agent declared with
``upgrade="replay"`` are moved without one (:func:`upgrade_by_policy`). Each run's recorded
history is replayed (:mod:`runtime.engine.replaycheck`); a clean run moves, with an audit
entry (``upgrade``) in the same transaction, and its message goes to the new version's
queue; a run that diverges stays where it is, and the report shows its first divergence. A
run a worker holds right now is left for the next try (``busy``). Runs are checked one by
one against the history they have at that moment: a run that records a step between its
check and its move is still of version A (the move is conditional on the version, not the
step), so the worst case is a run checked one step early; the check of the agent loop and of
a durable function's completed steps is not changed by a later step.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from db.deployments import DeploymentStore
from db.records import Dispatch, NewAudit, Run
from db.store import RunStore
from runtime.agents import AgentRegistry, upgrade_policy
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
    where: Callable[[Run], bool] | None = None,
) -> UpgradeReport:
    """Check every run of ``from_deployment`` (those of ``run_ids`` only, when given; those
    ``where`` accepts, when given) against ``registry`` and move the clean ones to ``to``;
    ``send`` their messages after each move has committed. ``dry_run``: check only."""
    report = UpgradeReport(from_deployment, to, dry_run)
    recorded = versions.definitions(from_deployment)
    wanted = set(run_ids) if run_ids is not None else None
    for run in versions.runs_of(from_deployment, limit=limit):
        if wanted is not None and run.id not in wanted:
            continue
        if where is not None and not where(run):
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


POLICY_ACTOR = "policy"
"""The audit trail's actor of an upgrade made by an agent's ``upgrade="replay"`` policy."""


class PolicyMemo:
    """The runs a policy's check found divergent, so the sweeps after it neither replay them
    again nor log them again (a run whose version nobody serves records no step: its check
    cannot change) until the version to move to changes. Bounded: forgets all past ``size``."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._diverged: set[tuple[uuid.UUID, str]] = set()

    def seen(self, run_id: uuid.UUID, to: str) -> bool:
        return (run_id, to) in self._diverged

    def diverged(self, run_id: uuid.UUID, to: str) -> None:
        if len(self._diverged) >= self.size:
            self._diverged.clear()
        self._diverged.add((run_id, to))


def upgrade_by_policy(
    store: RunStore,
    versions: DeploymentStore,
    registry: AgentRegistry,
    here: str | None,
    *,
    send: Callable[[Dispatch], object],
    memo: PolicyMemo | None = None,
    limit: int = MAX_UPGRADE,
) -> list[UpgradeReport]:
    """The upgrade policy of the agents declared ``upgrade="replay"`` in ``registry`` (this
    process's code, version ``here``): their runs in flight whose version no live worker
    serves move to ``here``, each through the same check and audit as an operator's upgrade
    (actor ``policy``). Only the newest live version moves them (two live versions do not
    take turns), and never the runs of a version a live worker still serves: those drain on
    it. A run that diverges stays, its divergence logged once. Returns a report per version
    it looked at."""
    if here is None:
        return []
    agents = {n for n in registry.names() if upgrade_policy(registry.get(n)) == "replay"}
    if not agents:
        return []
    found = versions.deployments()
    unserved = [
        d.deployment
        for d in found
        if d.deployment is not None and d.deployment != here and d.in_flight and not d.live_workers
    ]
    if not unserved or versions.newest_live() != here:
        return []
    memo = memo if memo is not None else PolicyMemo()

    def wanted(run: Run) -> bool:
        return run.agent in agents and not run.status.terminal and not memo.seen(run.id, here)

    reports = []
    for deployment in unserved:
        report = upgrade_runs(
            store,
            versions,
            registry,
            deployment,
            here,
            actor=POLICY_ACTOR,
            send=send,
            limit=limit,
            where=wanted,
        )
        for check in report.checks:
            if check.divergence is None:
                continue
            memo.diverged(check.run_id, here)
            log.warning(
                "run=%s stays on version %s (no live worker serves it): its history does not "
                "replay on version %s, %s",
                str(check.run_id)[:8],
                deployment,
                here,
                check.divergence.text(),
                extra={"run_id": str(check.run_id)},
            )
        reports.append(report)
    return reports
