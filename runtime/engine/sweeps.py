"""The engine's periodic work, written once: the reaper (re-send what no worker holds, apply
expired approvals' timeout policies), retention (delete old finished runs) and the schedule
loop (start the runs of due schedule ticks).

They know no Celery: ``tasks`` runs them on Celery beat's schedule and passes the sender of
the messages (:func:`tasks.dispatch.send_drive`); a test or a plain loop can pass another.
Every message is sent after the transaction that made it has committed.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from db.records import ApprovalStatus, Dispatch, NewAudit, StepStatus
from db.store import RunStore, SubmitQuota
from runtime.config import Settings
from runtime.engine.schedules import tick_schedules

log = logging.getLogger(__name__)

Send = Callable[[Dispatch], object]
"""Sends the drive_run message of a committed dispatch (never raises: a message it cannot
send is left for the reaper's next sweep)."""

MAX_RETENTION_BATCHES = 20
"""Per sweep; what is left waits for the next sweep, so one sweep stays short."""


def reap(store: RunStore, settings: Settings, send: Send) -> int:
    """Re-send drive_run for runs whose message was lost, whose lease lapsed, or whose timer
    is due; apply the timeout policy of every approval past its deadline and send the run it
    wakes. Safe to run from two beats at once. Returns how many runs were re-sent."""
    due = store.redispatch_due(redispatch_after=settings.redispatch_after_seconds)
    for d in due:
        log.info(
            "run=%s re-dispatched by the reaper",
            str(d.run_id)[:8],
            extra={"run_id": str(d.run_id)},
        )
        send(d)
    for approval_id, policy in store.due_approvals():
        woke = expire_approval(store, approval_id, policy)
        if woke is not None:
            log.info(
                "run=%s approval timed out (%s)",
                str(woke.run_id)[:8],
                policy,
                extra={"run_id": str(woke.run_id)},
            )
            send(woke)
    return len(due)


def expire_approval(store: RunStore, approval_id: uuid.UUID, policy: str) -> Dispatch | None:
    """Apply an expired approval's timeout policy: APPROVE, REJECT, or FAIL the step, and
    write it to the audit trail (action ``timeout``) in the same transaction."""
    approval = store.get_approval(approval_id)
    tenant = store.get_run(approval.run_id).tenant if approval is not None else ""
    audit = NewAudit(
        actor="timeout-policy",
        action="timeout",
        tenant=tenant,
        detail={
            "policy": policy,
            **(
                {
                    "stepKey": approval.step_key,
                    "role": approval.role,
                    "payloadHash": approval.payload_hash,
                }
                if approval is not None
                else {}
            ),
        },
        approval_id=approval_id,
    )
    if policy == "APPROVE":
        return store.decide_approval(
            approval_id, ApprovalStatus.APPROVED, decided_by="timeout-policy", audit=audit
        )
    if policy == "REJECT":
        return store.decide_approval(
            approval_id,
            ApprovalStatus.REJECTED,
            decided_by="timeout-policy",
            comment="no decision before the deadline",
            audit=audit,
        )
    return store.decide_approval(
        approval_id,
        ApprovalStatus.EXPIRED,
        decided_by="timeout-policy",
        comment="no decision before the deadline",
        audit=audit,
        step_status=StepStatus.ERROR,
        step_error="ApprovalExpired: no decision before the deadline",
    )


def delete_expired(store: RunStore, settings: Settings) -> int:
    """Delete finished runs older than ``DAR_RETENTION_DAYS``, in bounded batches (at most
    :data:`MAX_RETENTION_BATCHES` per sweep). Returns how many were deleted."""
    if settings.retention_days <= 0:
        return 0
    deleted = 0
    for _ in range(MAX_RETENTION_BATCHES):
        n = store.delete_finished_runs(
            older_than_seconds=settings.retention_days * 86400,
            batch=settings.retention_batch,
        )
        deleted += n
        if n < settings.retention_batch:
            break
    ticks = 0
    for _ in range(MAX_RETENTION_BATCHES):  # a schedule's tick rows are kept like runs
        n = store.delete_old_schedule_ticks(
            older_than_seconds=settings.retention_days * 86400,
            batch=settings.retention_batch,
        )
        ticks += n
        if n < settings.retention_batch:
            break
    if deleted or ticks:
        log.info(
            "retention: deleted %d finished runs and %d schedule ticks older than %g days",
            deleted,
            ticks,
            settings.retention_days,
        )
    return deleted


def roll_up_stats(store: RunStore) -> int:
    """Roll up the closed hours of the console's stats that the roll-up lacks or that a late
    write changed (``GET /api/stats`` reads them from there; :meth:`RunStore.roll_up_stats`).
    Safe from two beats. Returns how many hours were rolled up."""
    rolled = store.roll_up_stats()
    if rolled:
        log.info("stats: rolled up %d hours", rolled)
    return rolled


class ScheduleLoop:
    """Every ``DAR_SCHEDULE_POLL_SECONDS``: one pass over the due schedules
    (:func:`~runtime.engine.schedules.tick_schedules`), then the messages of the runs it
    started (after their commit). A thread of each beat process; two beats start exactly one
    run per tick (each tick is a unique row)."""

    def __init__(
        self,
        store: RunStore,
        interval_seconds: float,
        send: Send,
        *,
        quota: SubmitQuota | None = None,
        creator_ok: Callable[[str], bool] | None = None,
    ) -> None:
        self.store = store
        self.interval_seconds = interval_seconds
        self.send = send
        self.quota = quota
        """Each schedule's creator's quota: a tick's run is a submit in its name."""
        self.creator_ok = creator_ok
        """Whether a creator's token is still configured and unexpired (``None``: always)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dar-schedules", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("schedule loop started (every %gs)", self.interval_seconds)

    def stop(self) -> None:
        self._stop.set()

    def pass_once(self) -> int:
        started = tick_schedules(self.store, quota=self.quota, creator_ok=self.creator_ok)
        for dispatch in started:
            log.info(
                "run=%s started by its schedule's tick",
                str(dispatch.run_id)[:8],
                extra={"run_id": str(dispatch.run_id)},
            )
            self.send(dispatch)
        return len(started)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                self.pass_once()
            except Exception as e:  # the database away for a moment: try again next pass
                log.warning(
                    "schedule pass failed (%s: %s); next pass in %gs",
                    type(e).__name__,
                    e,
                    self.interval_seconds,
                )
