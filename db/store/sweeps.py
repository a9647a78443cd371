"""The sweeps' statements (the beat: re-dispatch, approvals' timeouts, retention, schedules'
ticks, the statistics roll-up) and the metrics' counts."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime

from db.queries import QUERIES as Q
from db.records import Dispatch, NewAudit, ReadyRuns, Schedule
from db.store.base import (
    STATS_ROLLUP_GRACE_SECONDS,
    STATS_ROLLUP_HORIZON_SECONDS,
    StoreBase,
    SubmitQuota,
    _record_audit,
    _refused_tick,
    _schedule,
    _start_scheduled_run,
)


class SweepStore(StoreBase):
    """What the beat's sweeps and the gauges ask: due runs, approvals and schedules,
    retention, the statistics roll-up, and the counts behind the metrics."""

    def count_runs_by_status(self) -> dict[str, int]:
        with self._statement() as conn:
            return {r.status: r.n for r in conn.execute(Q["count_runs_by_status"])}

    def count_key_waiters_by_tenant(self, top: int) -> tuple[list[tuple[str, int]], int]:
        """The ``top`` tenants with the most runs waiting for a slot of a concurrency key,
        and the total waiting over every tenant."""
        with self._statement() as conn:
            rows = conn.execute(Q["count_key_waiters_by_tenant"], {"top": top}).all()
        return [(r.key, int(r.n)) for r in rows], int(rows[0].total) if rows else 0

    def roll_up_stats(
        self,
        *,
        grace_seconds: float = STATS_ROLLUP_GRACE_SECONDS,
        horizon_seconds: float = STATS_ROLLUP_HORIZON_SECONDS,
        limit: int = 500,
    ) -> int:
        """Roll up the closed hours the stats roll-up lacks or a late write touched (the
        beat's ``dar.stats_rollup``), newest first, each hour its own short transaction; prune
        hours past the horizon. An hour is closed ``grace_seconds`` after it ends (a
        transaction that recorded a step just before the hour ended has committed by then).
        Returns how many hours were rolled up; 0 when another roller holds the lock."""
        with self._statement() as conn:
            due = list(
                conn.execute(
                    Q["stats_hours_to_roll"],
                    {
                        "grace_seconds": grace_seconds,
                        "horizon_seconds": horizon_seconds,
                        "limit": limit,
                    },
                ).scalars()
            )
        rolled = 0
        for bucket in due:
            with self.engine.begin() as conn:
                if not conn.execute(Q["stats_rollup_lock"]).scalar_one():
                    return rolled
                conn.execute(Q["stats_no_jit"])
                key = {"bucket": bucket}
                if not conn.execute(Q["stats_hour_needs_roll"], key).scalar_one():
                    continue  # another roller did it meanwhile
                conn.execute(Q["stats_hour_clean"], key)
                for name in ("stats_rollup_finished", "stats_rollup_cost", "stats_rollup_latency"):
                    conn.execute(Q[name], key)
                conn.execute(Q["stats_hour_rolled"], key)
            rolled += 1
        with self.engine.begin() as conn:
            if conn.execute(Q["stats_rollup_lock"]).scalar_one():
                conn.execute(Q["stats_rollup_prune"], {"horizon_seconds": horizon_seconds})
        return rolled

    def count_stale_leases(self) -> int:
        with self._statement() as conn:
            return int(conn.execute(Q["count_stale_leases"]).scalar_one())

    def count_ready_runs(self) -> ReadyRuns:
        """Runs ready for a worker, the oldest one's wait, runs in a step (the fleet's
        scaling signal)."""
        with self._statement() as conn:
            row = conn.execute(Q["count_ready_runs"]).one()
        return ReadyRuns(int(row.ready), float(row.oldest_seconds), int(row.in_step))

    # -- claiming and the lease ---------------------------------------------------------

    def due_approvals(self, limit: int = 100) -> list[tuple[uuid.UUID, str]]:
        with self._statement() as conn:
            rows = conn.execute(Q["due_approvals"], {"limit": limit}).all()
        return [(r.id, r.timeout_policy) for r in rows]

    def count_pending_approvals(self) -> dict[str, int]:
        with self._statement() as conn:
            return {r.role: r.n for r in conn.execute(Q["count_pending_approvals"])}

    def redispatch_due(self, *, redispatch_after: float, limit: int = 500) -> list[Dispatch]:
        """Give a fresh dispatch token to every run whose message is presumed lost, whose
        lease lapsed, or whose timer came due. The caller sends one message for each."""
        with self.engine.begin() as conn:
            rows = conn.execute(
                Q["redispatch_due"], {"redispatch_after": redispatch_after, "limit": limit}
            ).all()
            for r in rows:
                if r.lost_by is not None:  # its holder's lease lapsed: a recovery, on the record
                    lapsed = r.lease_lapsed_at.isoformat() if r.lease_lapsed_at else None
                    detail = {"leaseHolder": r.lost_by, "leaseLapsedAt": lapsed}
                    _record_audit(
                        conn,
                        r.id,
                        NewAudit(
                            actor="reaper",
                            action="recovery.redispatched",
                            tenant=r.tenant,
                            detail=detail,
                        ),
                    )
        return [Dispatch(r.id, r.dispatch_token) for r in rows]

    def delete_finished_runs(self, *, older_than_seconds: float, batch: int) -> int:
        """Delete one batch of finished runs older than the cut-off; returns how many."""
        with self.engine.begin() as conn:
            rows = conn.execute(
                Q["delete_finished_runs"],
                {"older_than_seconds": older_than_seconds, "batch": batch},
            ).all()
        return len(rows)

    def mark_undispatched(self, dispatch: Dispatch) -> None:
        with self._statement() as conn:
            conn.execute(Q["mark_undispatched"], {"id": dispatch.run_id, "token": dispatch.token})

    # -- signals --------------------------------------------------------------------------

    def delete_old_schedule_ticks(self, *, older_than_seconds: float, batch: int) -> int:
        """Retention for tick rows, as for runs: one batch of ticks older than the cut-off
        (a schedule's next ticks are decided by ``next_tick_at``, never by old rows; a
        QUEUED tick waits for its run, and stays). Returns how many were deleted."""
        with self.engine.begin() as conn:
            rows = conn.execute(
                Q["delete_old_schedule_ticks"],
                {"older_than_seconds": older_than_seconds, "batch": batch},
            ).all()
        return len(rows)

    def due_schedules(self, *, limit: int = 100) -> list[uuid.UUID]:
        with self._statement() as conn:
            return [r.id for r in conn.execute(Q["due_schedules"], {"limit": limit})]

    def claim_schedule_ticks(
        self,
        schedule_id: uuid.UUID,
        plan: Callable[[Schedule, datetime], tuple[Sequence[datetime], datetime]],
        *,
        quota: SubmitQuota | None = None,
        creator_ok: Callable[[str], bool] | None = None,
    ) -> list[Dispatch]:
        """One pass over one due schedule, in one transaction: start its oldest queued tick
        when no run of it is live, then claim the ticks ``plan`` returns for the database's
        ``now`` (a unique row each: a tick another beat claimed is passed over) and apply
        the overlap policy to each, then move ``next_tick_at`` on. Returns the drive_run
        messages of the runs started, to send after the commit.

        Each run a tick starts is a submit by the schedule's creator: audited, and only
        while ``creator_ok`` says the creator's token is still configured and unexpired and
        the creator is within ``quota`` (its rate and runs in flight, its scheduled runs
        included); otherwise the tick is SKIPPED with the reason (a queued tick stays
        queued)."""
        started: list[Dispatch] = []
        with self.engine.begin() as conn:
            row = conn.execute(Q["lock_due_schedule"], {"id": schedule_id}).mappings().first()
            if row is None:  # not due any more, deleted, or another beat has it
                return []
            schedule = _schedule(row)
            live = bool(conn.execute(Q["schedule_live_run"], {"schedule_id": schedule.id}).scalar())
            key = {"schedule_id": schedule.id}
            if not live and schedule.overlap == "queue":
                queued = conn.execute(Q["oldest_queued_tick"], key).scalar()
                if queued is not None and _refused_tick(conn, schedule, quota, creator_ok) is None:
                    run_id = self.run_ids()
                    conn.execute(
                        Q["start_queued_tick"], {**key, "tick_at": queued, "run_id": run_id}
                    )
                    started.append(
                        _start_scheduled_run(conn, schedule, run_id, queued, self.deployment)
                    )
                    live = True
            ticks, next_tick_at = plan(schedule, row["db_now"])
            for tick_at in ticks:
                start = schedule.overlap == "allow" or not live
                reason = _refused_tick(conn, schedule, quota, creator_ok) if start else None
                if reason is not None:
                    start = False
                status = (
                    "STARTED"
                    if start
                    else "QUEUED"
                    if schedule.overlap == "queue" and reason is None
                    else "SKIPPED"
                )
                new_id = self.run_ids() if start else None
                claimed = conn.execute(
                    Q["insert_schedule_tick"],
                    {
                        **key,
                        "tick_at": tick_at,
                        "status": status,
                        "run_id": new_id,
                        "reason": reason,
                    },
                ).first()
                if claimed is not None and new_id is not None:
                    started.append(
                        _start_scheduled_run(conn, schedule, new_id, tick_at, self.deployment)
                    )
                    live = True
            if next_tick_at != schedule.next_tick_at:
                conn.execute(
                    Q["advance_schedule"], {"id": schedule.id, "next_tick_at": next_tick_at}
                )
        return started
