"""Reads and writes of versions (runtime.engine.deployment): a run's version, the workers
that serve each one, and moving runs to another version. Every statement is in queries.sql
under "deployments"."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine

from db import jsontext
from db.queries import QUERIES as Q
from db.records import Deployment, DeploymentWorker, Dispatch, NewAudit, Run
from db.store.base import _record_audit, _run

WORKER_LIVE_SECONDS = 60.0
"""A worker not seen for this long (its heartbeat beats every few seconds) serves nothing."""


class DeploymentStore:
    """The versions of the runs and of the workers, on ``engine``."""

    def __init__(self, engine: Engine, *, live_seconds: float = WORKER_LIVE_SECONDS) -> None:
        self.engine = engine
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.live_seconds = live_seconds

    def run_deployment(self, run_id: uuid.UUID) -> str | None:
        """The version of the run (``None``: none, or no such run)."""
        with self._autocommit.connect() as conn:
            row = conn.execute(Q["get_run_deployment"], {"id": run_id}).first()
        return None if row is None else row.deployment

    def worker_seen(self, worker: str, deployment: str) -> None:
        with self._autocommit.connect() as conn:
            conn.execute(Q["worker_seen"], {"worker": worker, "deployment": deployment})

    def worker_gone(self, worker: str, deployment: str) -> None:
        with self._autocommit.connect() as conn:
            conn.execute(Q["worker_gone"], {"worker": worker, "deployment": deployment})
            conn.execute(Q["forget_old_workers"])

    def deployments(self) -> list[Deployment]:
        """Every version with a worker row or a run in flight, those with runs first."""
        with self._autocommit.connect() as conn:
            workers = [
                DeploymentWorker(**dict(r))
                for r in conn.execute(
                    Q["deployment_workers"], {"live_seconds": self.live_seconds}
                ).mappings()
            ]
            counts = conn.execute(Q["deployment_runs"]).all()
        runs: dict[str | None, dict[str, int]] = defaultdict(dict)
        for deployment, status, n in counts:
            runs[deployment][status] = int(n)
        by_version: dict[str | None, list[DeploymentWorker]] = defaultdict(list)
        for w in workers:
            by_version[w.deployment].append(w)
        names = set(runs) | set(by_version)
        found = [Deployment(d, tuple(by_version.get(d, ())), runs.get(d, {})) for d in names]
        return sorted(found, key=lambda d: (-d.in_flight, d.deployment or ""))

    def live_deployments(self) -> set[str]:
        """The versions some live worker serves."""
        with self._autocommit.connect() as conn:
            rows = conn.execute(Q["live_deployments"], {"live_seconds": self.live_seconds})
            return {r.deployment for r in rows}

    def newest_live(self) -> str | None:
        """The live version that appeared last (first recorded its agents' definitions
        latest): where an upgrade policy moves runs no live worker serves."""
        with self._autocommit.connect() as conn:
            row = conn.execute(
                Q["newest_live_deployment"], {"live_seconds": self.live_seconds}
            ).first()
        return None if row is None else str(row.deployment)

    def count_unserved_runs(self) -> int:
        """Runs in flight of a version no live worker serves."""
        with self._autocommit.connect() as conn:
            row = conn.execute(Q["count_unserved_runs"], {"live_seconds": self.live_seconds}).one()
        return int(row.n)

    def runs_of(self, deployment: str | None, *, limit: int = 1000) -> list[Run]:
        """The runs of ``deployment`` an upgrade considers (in flight, or failed)."""
        with self._autocommit.connect() as conn:
            rows = conn.execute(
                Q["runs_of_deployment"], {"deployment": deployment, "limit": limit}
            ).mappings()
            return [_run(r) for r in rows]

    def record_definitions(self, deployment: str, definitions: dict[str, Any]) -> None:
        """The agents' definitions in ``deployment`` (the first recorded stays)."""
        with self.engine.begin() as conn:
            for agent, definition in sorted(definitions.items()):
                conn.execute(
                    Q["record_agent_definition"],
                    {
                        "deployment": deployment,
                        "agent": agent,
                        "definition": json.dumps(definition, sort_keys=True, default=str),
                    },
                )

    def definitions(self, deployment: str | None) -> dict[str, Any]:
        """The agents' definitions recorded for ``deployment`` (none for no version)."""
        if deployment is None:
            return {}
        with self._autocommit.connect() as conn:
            rows = conn.execute(Q["agent_definitions"], {"deployment": deployment}).all()
        return {
            r.agent: jsontext.loads(r.definition) if isinstance(r.definition, str) else r.definition
            for r in rows
        }

    def sample(
        self,
        *,
        deployment: str | None = None,
        agent: str | None = None,
        in_flight: bool = False,
        limit: int = 200,
    ) -> list[Run]:
        """Recorded runs, newest first, for an offline replay check."""
        with self._autocommit.connect() as conn:
            rows = conn.execute(
                Q["sample_runs"],
                {"deployment": deployment, "agent": agent, "in_flight": in_flight, "limit": limit},
            ).mappings()
            return [_run(r) for r in rows]

    def upgrade(
        self, run_id: uuid.UUID, from_deployment: str | None, to: str, audit: NewAudit
    ) -> tuple[bool, Dispatch | None]:
        """Move the run to ``to`` with its audit entry, in one transaction, when it is still
        of ``from_deployment`` and no worker holds it. Returns (moved, the message to send
        to its new queue: ``None`` for a run that waits for a person)."""
        with self.engine.begin() as conn:
            row = (
                conn.execute(
                    Q["upgrade_run"],
                    {
                        "id": run_id,
                        "from_deployment": from_deployment,
                        "to_deployment": to,
                        "token": uuid.uuid4(),
                    },
                )
                .mappings()
                .first()
            )
            if row is None:
                return False, None
            _record_audit(conn, run_id, audit)
        if row["status"] not in ("QUEUED", "RUNNING"):
            return True, None
        return True, Dispatch(run_id, row["dispatch_token"], float(row["delay_seconds"] or 0))

    def upgrade_many(
        self, moves: Iterable[tuple[uuid.UUID, NewAudit]], from_deployment: str | None, to: str
    ) -> list[tuple[uuid.UUID, bool, Dispatch | None]]:
        return [(rid, *self.upgrade(rid, from_deployment, to, a)) for rid, a in moves]
