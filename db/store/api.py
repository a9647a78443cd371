"""The API's statements: submits, reads and the control verbs of the REST API."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import RowMapping

from db.errors import InvalidTransition, QuotaExceeded, RunNotFound
from db.queries import QUERIES as Q
from db.records import (
    ApprovalStatus,
    AuditEvent,
    Dispatch,
    HourCost,
    HourCount,
    HourLatency,
    NewAudit,
    NewFork,
    NewRun,
    NewSchedule,
    Run,
    RunStatus,
    Schedule,
    ScheduleTick,
    Stats,
    Step,
    StepEdit,
    StepStatus,
)
from db.store.base import (
    _COMPENSABLE,
    MESSAGE_SIGNAL,
    SendLimits,
    StoreBase,
    SubmitQuota,
    _audit_event,
    _cancel_children,
    _check_pending,
    _check_quota,
    _check_send_rate,
    _end_children,
    _gaps,
    _id_range,
    _insert_signal,
    _json,
    _new_run_params,
    _NotWaiting,
    _record_audit,
    _run,
    _same_request,
    _schedule,
    _seen_signal,
    _step,
    _wake,
)


class ApiStore(StoreBase):
    """What the API asks and requests: submits, reads for the REST API and the console,
    decisions, cancels, resumes, resolutions, forks, messages, signals and schedules."""

    def create_run(
        self, new: NewRun, quota: SubmitQuota | None = None, *, audit: NewAudit | None = None
    ) -> tuple[Run, bool]:
        """Insert a QUEUED run. Returns ``(run, created)``; with an idempotency key seen
        before, the existing run and ``False`` (or :class:`IdempotencyConflict` when the
        earlier request differed). With ``quota`` and a submitter, the submitter's quota is
        checked atomically with the insert (:class:`QuotaExceeded`); a retry of an accepted
        idempotent submit gets its run, whatever the quota says."""
        params = _new_run_params(new, self.run_ids(), self.deployment)
        with self.engine.begin() as conn:
            if quota is not None and new.submitted_by is not None:
                conn.execute(Q["lock_submitter"], {"submitted_by": new.submitted_by})
                seen = (
                    conn.execute(
                        Q["get_run_by_idempotency_key"],
                        {"idempotency_key": new.idempotency_key, "tenant": new.tenant},
                    )
                    .mappings()
                    .first()
                    if new.idempotency_key is not None
                    else None
                )
                if seen is None:
                    _check_quota(conn, new.submitted_by, quota)
            row = conn.execute(Q["create_run"], params).mappings().first()
            if row is not None:
                if audit is not None:  # the submit, in its own transaction
                    _record_audit(conn, row["id"], audit)
                return _run(row), True
            existing = (
                conn.execute(
                    Q["get_run_by_idempotency_key"],
                    {"idempotency_key": new.idempotency_key, "tenant": new.tenant},
                )
                .mappings()
                .one()
            )
        return _same_request(existing, new.idempotency_key, new.request_hash), False

    # -- reading ------------------------------------------------------------------------

    def list_runs(
        self,
        *,
        status: str | None = None,
        limit: int = 50,
        before: tuple[datetime, uuid.UUID] | None = None,
        tenant: str | None = None,
        agent: str | None = None,
        id_prefix: str | None = None,
    ) -> list[Run]:
        """Newest first; only ``tenant``'s runs when given, only ``agent``'s, only ids that
        start with ``id_prefix`` (lower-case hex and dashes)."""
        params = {
            "status": status,
            "tenant": tenant,
            "agent": agent,
            **_id_range(id_prefix),
            "limit": limit,
            "before_created": before[0] if before else None,
            "before_id": before[1] if before else None,
        }
        with self._statement() as conn:
            rows = conn.execute(Q["list_runs"], params).mappings().all()
        return [_run(r) for r in rows]

    def count_runs(self, *, tenant: str | None = None, agent: str | None = None) -> dict[str, int]:
        """Runs by status, for one tenant and agent (``None``: all)."""
        with self.engine.connect() as conn:
            rows = conn.execute(Q["count_runs_for_console"], {"tenant": tenant, "agent": agent})
            return {r.status: int(r.n) for r in rows}

    def step_counts(self, run_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, int]:
        """How many step rows each of these runs has (absent: none)."""
        ids = list(run_ids)
        if not ids:
            return {}
        with self.engine.connect() as conn:
            return {
                r.run_id: int(r.n) for r in conn.execute(Q["count_steps_of_runs"], {"ids": ids})
            }

    def stats(
        self, *, window_seconds: float, tenant: str | None = None, rolled: bool = True
    ) -> Stats:
        """The overview over the last ``window_seconds``, per UTC hour: the hours the
        roll-up holds (:meth:`roll_up_stats`) read from it, the rest of the window from the
        step and run rows, in one snapshot (the same answer as aggregating every row of the
        window, which ``rolled=False`` does)."""
        with self.engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            window = conn.execute(
                Q["stats_window"], {"window_seconds": window_seconds, "rolled": rolled}
            ).one()
            since: datetime = window.since
            hours: list[datetime] = list(window.hours)
            gap_lo, gap_hi = _gaps(since, hours)
            params = {"gap_lo": gap_lo, "gap_hi": gap_hi, "hours": hours, "tenant": tenant}
            finished = [
                HourCount(r.bucket, r.key, int(r.n))
                for r in conn.execute(Q["stats_runs_finished"], params)
            ]
            cost = [
                HourCost(r.bucket, r.key, Decimal(r.usd))
                for r in conn.execute(Q["stats_cost_by_model"], params)
            ]
            latency = [
                HourLatency(r.bucket, r.key, float(r.p50), float(r.p95), int(r.n))
                for r in conn.execute(Q["stats_step_latency"], params)
            ]
            conn.rollback()
        return Stats(finished, cost, latency)

    def decide_approval(
        self,
        approval_id: uuid.UUID,
        status: ApprovalStatus,
        *,
        decided_by: str,
        comment: str | None = None,
        payload_hash: str | None = None,
        step_status: StepStatus | None = None,
        step_error: str | None = None,
        audit: NewAudit | None = None,
    ) -> Dispatch | None:
        """Decide a PENDING approval and wake its run, in one transaction (with ``audit``
        recorded in it). ``None`` when the approval is no longer PENDING, the payload hash
        differs, or the run is not waiting (cancelled meanwhile): then nothing changed."""
        token = uuid.uuid4()
        try:
            return self._decide(
                approval_id,
                status,
                decided_by,
                comment,
                payload_hash,
                step_status,
                step_error,
                token,
                audit=audit,
            )
        except _NotWaiting:
            return None

    def _decide(
        self,
        approval_id: uuid.UUID,
        status: ApprovalStatus,
        decided_by: str,
        comment: str | None,
        payload_hash: str | None,
        step_status: StepStatus | None,
        step_error: str | None,
        token: uuid.UUID,
        *,
        audit: NewAudit | None = None,
    ) -> Dispatch | None:
        with self.engine.begin() as conn:
            conn.execute(Q["lock_run_of_approval"], {"approval_id": approval_id})
            row = conn.execute(
                Q["decide_approval"],
                {
                    "approval_id": approval_id,
                    "status": str(status),
                    "decided_by": decided_by,
                    "comment": comment,
                    "payload_hash": payload_hash,
                },
            ).first()
            if row is None:
                return None
            woke = conn.execute(
                Q["wake_waiting_run"], {"id": row.run_id, "next_token": token}
            ).first()
            if woke is None:
                raise _NotWaiting  # rolls the decision back: the run was cancelled meanwhile
            conn.execute(
                Q["set_step_status"],
                {
                    "id": row.run_id,
                    "step_key": row.step_key,
                    "status": str(step_status or StepStatus(str(status))),
                    "error": step_error,
                },
            )
            if audit is not None:
                _record_audit(conn, row.run_id, audit)
        return Dispatch(row.run_id, token)

    def resume_failed(
        self,
        run_id: uuid.UUID,
        *,
        token_budget: int | None = None,
        timeout_seconds: int | None = None,
        default_timeout_seconds: int | None = None,
        audit: NewAudit | None = None,
        quota: SubmitQuota | None = None,
    ) -> Dispatch:
        """Retry a FAILED or TIMED_OUT run from its first step without a result; a deadline
        already past (by the database's clock) is replaced by ``default_timeout_seconds``
        from now. Raises
        :class:`InvalidTransition` when the run is in another state or compensations ran."""
        token = uuid.uuid4()
        with self.engine.begin() as conn:
            if quota is not None and audit is not None:  # a resume is a submit
                conn.execute(Q["lock_submitter"], {"submitted_by": audit.actor})
                _check_quota(conn, audit.actor, quota)
            if conn.execute(Q["count_compensations"], {"id": run_id}).scalar_one():
                raise InvalidTransition(
                    f"run {run_id} was compensated (its completed steps were undone); "
                    "resuming it would build on undone effects: submit a new run instead"
                )
            row = conn.execute(
                Q["resume_failed_run"],
                {
                    "id": run_id,
                    "token_budget": token_budget,
                    "timeout_seconds": timeout_seconds,
                    "default_timeout_seconds": default_timeout_seconds,
                    "next_token": token,
                },
            ).first()
            if row is None:
                raise InvalidTransition(f"run {run_id} is not FAILED or TIMED_OUT")
            conn.execute(Q["retry_failed_steps"], {"id": run_id})
            if audit is not None:
                _record_audit(conn, run_id, audit)
        return Dispatch(run_id, token)

    def cancel(
        self,
        run_id: uuid.UUID,
        *,
        audit: NewAudit | None = None,
        wakes: list[Dispatch] | None = None,
    ) -> RunStatus | None:
        """Request cancellation. Returns the status after the request, or ``None`` when the
        run does not exist or has already finished. A child run that ends here wakes its
        parent (waiting for it) in the same transaction: the parent's message is appended to
        ``wakes`` to send (else the reaper's next sweep sends it)."""
        with self.engine.begin() as conn:
            row = conn.execute(Q["cancel_run"], {"id": run_id, **_COMPENSABLE}).first()
            if row is not None:  # a run with a pending approval holds no lease
                conn.execute(Q["cancel_pending_approvals"], {"id": run_id})
            if row is not None and audit is not None:
                _record_audit(conn, run_id, audit)
            if row is not None:  # cancelling a parent cancels its children, down the tree
                _cancel_children(conn, run_id)
            if row is not None and RunStatus(row.status).terminal and row.parent_run_id:
                woken = _wake(conn, row.parent_run_id, send=wakes is not None)
                if woken is not None and wakes is not None:
                    wakes.append(woken)
        return RunStatus(row.status) if row else None

    def children(self, run_id: uuid.UUID) -> list[dict[str, Any]]:
        """A parent's child runs, oldest first: id, agent, status, tokens, cost."""
        with self._statement() as conn:
            return [dict(r) for r in conn.execute(Q["list_children"], {"id": run_id}).mappings()]

    def run_tree(
        self, run_id: uuid.UUID, tenant: str, *, max_nodes: int, max_depth: int
    ) -> list[dict[str, Any]]:
        """The runs of the tree ``run_id`` belongs to, in ``tenant``, in one bounded statement:
        the run and its ancestors (up to ``max_depth`` of them), and from the topmost one
        down, breadth-first with each run's children oldest first, the first
        ``max_nodes + 1`` runs at most ``max_depth`` levels deep (``n``: the place in that
        walk, ``None`` for a run not walked). Each row: id, parent_run_id, agent, status,
        tokens_used, cost_usd, created_at, n, is_top, on_path, child_count (counted up to
        ``max_nodes + 1``). Empty when there is no such run in ``tenant``."""
        params = {"id": run_id, "tenant": tenant, "max_nodes": max_nodes, "max_depth": max_depth}
        with self.engine.begin() as conn:
            conn.execute(Q["run_tree_plan"])  # index scans only: see queries.sql
            return [dict(r) for r in conn.execute(Q["run_tree"], params).mappings()]

    def resolve(
        self,
        run_id: uuid.UUID,
        action: str,
        *,
        output: Any = None,
        is_error: bool = False,
        reason: str | None = None,
        operator: str = "operator",
        audit: NewAudit | None = None,
    ) -> Dispatch | None:
        """An operator's decision on a NEEDS_ATTENTION run: ``supply_result`` (record the
        STARTED step's result and continue), ``retry`` (run the step once more), or
        ``fail`` (the engine's stop: its children cancelled, and a durable function that may
        have compensations left handed to a worker that runs them, then ends it FAILED).
        Returns the message to send (``None``: a fail that ended the run here). Raises
        :class:`InvalidTransition` when the run is not NEEDS_ATTENTION (someone else resolved
        or cancelled it first)."""
        token = uuid.uuid4()
        stopping = False
        with self.engine.begin() as conn:
            if action == "fail":
                row = conn.execute(
                    Q["resolve_fail_run"],
                    {
                        "id": run_id,
                        "error": f"failed by {operator}: {reason or 'no reason'}",
                        "next_token": token,
                        **_COMPENSABLE,
                    },
                ).first()
                if row is not None:  # its children end with it, down the tree
                    _end_children(conn, run_id)
                    stopping = row.status == RunStatus.RUNNING
            else:
                row = conn.execute(
                    Q["resolve_reopen_run"], {"id": run_id, "next_token": token}
                ).first()
                if row is not None and action == "supply_result":
                    conn.execute(
                        Q["resolve_supply_result"],
                        {
                            "id": run_id,
                            "status": str(StepStatus.ERROR if is_error else StepStatus.DONE),
                            "response": _json(output),
                            "operator": operator,
                        },
                    )
                elif row is not None:
                    conn.execute(Q["resolve_retry_step"], {"id": run_id})
            if row is None:
                raise InvalidTransition(f"run {run_id} is not waiting for an operator")
            if audit is not None:
                _record_audit(conn, run_id, audit)
        if action == "fail" and not stopping:
            return None
        return Dispatch(run_id, token)

    # -- dispatch bookkeeping -----------------------------------------------------------

    def make_due_now(self, run_id: uuid.UUID) -> None:
        """Fast-forward a run's timer and lease (test kits; an operator's "wake it now")."""
        with self._statement() as conn:
            conn.execute(Q["make_due_now"], {"id": run_id})

    def audit_events(self, run_id: uuid.UUID) -> list[AuditEvent]:
        """The run's audit trail, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(Q["list_audit_events"], {"run_id": run_id}).mappings().all()
        return [_audit_event(r) for r in rows]

    # -- forks ----------------------------------------------------------------------------

    def fork_run(
        self,
        new: NewFork,
        check: Callable[[Run, list[Step]], Sequence[StepEdit]],
        *,
        quota: SubmitQuota | None = None,
    ) -> tuple[Run, bool]:
        """Create a fork of ``new.source`` in one transaction: the source is held (shared)
        while ``check`` judges it and its steps and returns the edits to make (raising
        refuses the fork); its steps before ``new.from_seq`` and their decided approvals are
        copied, the edits applied, and the fork queued. Returns ``(run, created)``: with an
        idempotency key seen before in the source's tenant, the run made then and ``False``
        (neither ``check`` nor the quota is asked again, as for a submit), or
        :class:`IdempotencyConflict` when that request differed. Raises
        :class:`RunNotFound` for no source."""
        fork_id = self.run_ids()
        with self.engine.begin() as conn:
            if quota is not None and new.submitted_by is not None:  # a fork is a submit
                conn.execute(Q["lock_submitter"], {"submitted_by": new.submitted_by})
            row = conn.execute(Q["lock_run_for_fork"], {"id": new.source}).mappings().first()
            if row is None:
                raise RunNotFound(f"no run with id {new.source}")
            by_key = {"idempotency_key": new.idempotency_key, "tenant": row["tenant"]}
            if new.idempotency_key is not None:
                seen = conn.execute(Q["get_run_by_idempotency_key"], by_key).mappings().first()
                if seen is not None:
                    return _same_request(seen, new.idempotency_key, new.request_hash), False
            if quota is not None and new.submitted_by is not None:
                _check_quota(conn, new.submitted_by, quota)
            steps = [_step(r) for r in conn.execute(Q["list_steps"], {"id": new.source}).mappings()]
            edits = check(_run(row), steps)
            created = (
                conn.execute(
                    Q["create_fork_run"],
                    {
                        "id": fork_id,
                        "source": new.source,
                        "input": _json(new.input),
                        "model": new.model,
                        "token_budget": new.token_budget,
                        "timeout_seconds": new.timeout_seconds,
                        "token": uuid.uuid4(),
                        "submitted_by": new.submitted_by,
                        "from_seq": new.from_seq,
                        "deployment": self.deployment,
                        "replay_model": new.replay_model,
                        "idempotency_key": new.idempotency_key,
                        "request_hash": new.request_hash,
                    },
                )
                .mappings()
                .first()
            )
            if created is None:  # a retry with the same key committed meanwhile
                seen = conn.execute(Q["get_run_by_idempotency_key"], by_key).mappings().one()
                return _same_request(seen, new.idempotency_key, new.request_hash), False
            copy = {"fork": fork_id, "source": new.source, "from_seq": new.from_seq}
            conn.execute(Q["copy_steps_to_fork"], copy)
            copied = conn.execute(
                Q["copy_approvals_to_fork"], {**copy, "reuse": new.reuse_approval}
            ).all()
            if not new.reuse_approval:
                conn.execute(Q["ask_copied_approvals_again"], {"fork": fork_id})
            elif not conn.execute(Q["carry_approval_to_fork"], copy).first() and not any(
                r.status == ApprovalStatus.APPROVED for r in copied
            ):
                raise InvalidTransition(
                    f"run {new.source} has no approved approval at step {new.from_seq} or "
                    "before it: there is no decision to reuse"
                )
            for edit in edits:
                edited = conn.execute(
                    Q["edit_fork_step"],
                    {
                        "fork": fork_id,
                        "seq": edit.seq,
                        "response": _json(edit.response),
                        "status": str(edit.status),
                        "error": edit.error,
                    },
                ).rowcount
                if edited != 1:
                    raise InvalidTransition(f"step {edit.seq} is not a copied step of the fork")
            if new.audit is not None:  # on the source: who forked it, from where, into what
                detail = {"fork": str(fork_id), **(new.audit.detail or {})}
                _record_audit(conn, new.source, replace(new.audit, detail=detail))
        return _run(created), True

    def run_events_after(
        self, run_id: uuid.UUID, after: int, *, limit: int = 500
    ) -> list[RowMapping]:
        """Durable events numbered above ``after``, in order (see migration 0010); each row
        carries its step's or approval's columns. The API shapes them (:mod:`api.events`)."""
        with self._statement() as conn:
            return list(
                conn.execute(Q["run_events_after"], {"id": run_id, "after": after, "limit": limit})
                .mappings()
                .all()
            )

    def run_event_seqs(self, run_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, int]:
        """The last durable event number of each run that exists, in one statement."""
        if not run_ids:
            return {}
        with self._statement() as conn:
            rows = conn.execute(Q["run_event_seqs"], {"ids": list(run_ids)}).all()
        return {r.id: int(r.event_seq) for r in rows}

    def post_signal(
        self,
        run_id: uuid.UUID,
        name: str,
        payload: Any,
        *,
        idempotency_key: str | None = None,
        sent_by: str | None = None,
        limits: SendLimits | None = None,
        audit: NewAudit | None = None,
    ) -> tuple[int, bool, Dispatch | None]:
        """Keep a signal for the run until a step of it consumes it, and wake the run in the
        same transaction if it is parked (a poster that dies after the commit leaves no run
        asleep on a signal it has). Returns its id, whether it is new (a retried request
        with the same idempotency key: the first) and the run's message to send (``None``:
        not parked).
        Raises :class:`RunNotFound`, :class:`InvalidTransition` when the run ended,
        :class:`IdempotencyConflict` for a key used before with another name or payload, and
        past ``limits`` :class:`QuotaExceeded` or :class:`TooManyPending`. A new signal is
        written to ``audit`` in the same transaction."""
        with self.engine.begin() as conn:
            if audit is not None:
                _check_send_rate(conn, audit.actor, limits)
            signal_id, created = _insert_signal(
                conn,
                run_id,
                name,
                payload,
                idempotency_key,
                sent_by,
                None,
                limits=limits or SendLimits(),
            )
            if created and audit is not None:
                _record_audit(conn, run_id, audit)
            woken = _wake(conn, run_id, send=True) if created else None
        return signal_id, created, woken

    def post_message(
        self,
        run_id: uuid.UUID,
        content: Any,
        *,
        idempotency_key: str | None = None,
        sent_by: str | None = None,
        limits: SendLimits | None = None,
        audit: NewAudit | None = None,
        resume_quota: SubmitQuota | None = None,
    ) -> tuple[int, bool, Dispatch | None]:
        """Keep a message for an agent-loop run until a step boundary delivers it. A
        SUCCEEDED run is queued again (its next turn): a resume by the sender, within
        ``resume_quota`` and audited as one. Returns the message's id, whether it is new (a
        retried request with the same key: the first, nothing counted again) and the
        drive_run message of a run queued again or woken from its parking (in the same
        transaction). :class:`RunNotFound`;
        :class:`InvalidTransition` for a run ended otherwise than SUCCEEDED;
        :class:`IdempotencyConflict` for a key used before with other content; past
        ``limits`` :class:`QuotaExceeded` or :class:`TooManyPending`. A new message is
        written to ``audit`` in the same transaction."""
        with self.engine.begin() as conn:
            if audit is not None:
                _check_send_rate(conn, audit.actor, limits)
                if resume_quota is not None:  # before the run's row, as a resume takes them
                    conn.execute(Q["lock_submitter"], {"submitted_by": audit.actor})
            run = conn.execute(Q["lock_run_row"], {"id": run_id}).first()
            if run is None:
                raise RunNotFound(f"no run with id {run_id}")
            if RunStatus(run.status).terminal and run.status != RunStatus.SUCCEEDED:
                raise InvalidTransition(
                    f"run {run_id} ended {run.status}: only a running or SUCCEEDED run takes "
                    "a message (resume a FAILED or TIMED_OUT run first)"
                )
            params = {
                "run_id": run_id,
                "name": MESSAGE_SIGNAL,
                "payload": _json(content),
                "idempotency_key": idempotency_key,
                "sent_by": sent_by,
            }
            seen = _seen_signal(conn, params)
            if seen is not None:
                return seen, False, None
            _check_pending(conn, run_id, limits)
            reopens = run.status == RunStatus.SUCCEEDED
            if reopens and audit is not None and resume_quota is not None:
                _check_quota(conn, audit.actor, resume_quota)
            row = conn.execute(Q["insert_signal"], params).first()
            if row is None:  # the same key committed meanwhile
                seen = _seen_signal(conn, params)
                return int(seen or 0), False, None
            if audit is not None:
                _record_audit(conn, run_id, audit)
                if reopens:  # a message that reopens a run is a resume by its sender
                    _record_audit(
                        conn, run_id, replace(audit, action="resume", detail={"by": "message"})
                    )
            after = conn.execute(Q["message_arrived"], {"id": run_id}).one()
            reopened = run.status == RunStatus.SUCCEEDED
            # a run parked (a wait, a timer) is woken with the message's commit, not after it
            woken = None if reopened else _wake(conn, run_id, send=True)
        dispatch = Dispatch(after.id, after.dispatch_token) if reopened else woken
        return int(row.id), True, dispatch

    def create_schedule(
        self,
        new: NewSchedule,
        *,
        quota: SubmitQuota | None = None,
        max_schedules: int = 0,
        audit: NewAudit | None = None,
    ) -> Schedule:
        """Create a schedule. A schedule is a standing submit: with ``quota`` its creator must
        be within it now (:class:`QuotaExceeded`), and have fewer than ``max_schedules``
        schedules (``0``: no cap), checked under the creator's lock; ``audit`` is written on
        the schedule in the same transaction."""
        params = {
            "id": uuid.uuid4(),
            "tenant": new.tenant,
            "agent": new.agent,
            "input": _json(new.input),
            "model": new.model,
            "max_steps": new.max_steps,
            "token_budget": new.token_budget,
            "timeout_seconds": new.timeout_seconds,
            "cost_budget_usd": new.cost_budget_usd,
            "priority": new.priority,
            "cron": new.cron,
            "timezone": new.timezone,
            "overlap": new.overlap,
            "catch_up": new.catch_up,
            "next_tick_at": new.first_tick_at,
            "created_by": new.created_by,
        }
        with self.engine.begin() as conn:
            if new.created_by is not None and (quota is not None or max_schedules):
                conn.execute(Q["lock_submitter"], {"submitted_by": new.created_by})
                if quota is not None:
                    _check_quota(conn, new.created_by, quota)
                held = conn.execute(
                    Q["count_schedules_of"], {"created_by": new.created_by}
                ).scalar_one()
                if max_schedules and held >= max_schedules:
                    raise QuotaExceeded(
                        f"token {new.created_by!r} has {held} schedules; the limit is "
                        f"{max_schedules} (DAR_TOKEN_MAX_SCHEDULES): delete one first",
                        retry_after=60,
                        limit="DAR_TOKEN_MAX_SCHEDULES",
                    )
            created = _schedule(conn.execute(Q["insert_schedule"], params).mappings().one())
            if audit is not None:
                _record_audit(conn, None, audit, schedule_id=created.id)
            return created

    def get_schedule(self, schedule_id: uuid.UUID) -> Schedule | None:
        with self._statement() as conn:
            row = conn.execute(Q["get_schedule"], {"id": schedule_id}).mappings().first()
        return None if row is None else _schedule(row)

    def list_schedules(self, *, tenant: str | None = None, limit: int = 1000) -> list[Schedule]:
        with self._statement() as conn:
            rows = conn.execute(Q["list_schedules"], {"tenant": tenant, "limit": limit})
            return [_schedule(r) for r in rows.mappings()]

    def delete_schedule(self, schedule_id: uuid.UUID, *, audit: NewAudit | None = None) -> bool:
        """Delete a schedule (its ticks go with it, its runs stay), with ``audit`` written on
        it in the same transaction. ``False``: no such schedule."""
        with self.engine.begin() as conn:
            deleted = conn.execute(Q["delete_schedule"], {"id": schedule_id}).first() is not None
            if deleted and audit is not None:
                _record_audit(conn, None, audit, schedule_id=schedule_id)
            return deleted

    def schedule_audit_events(self, schedule_id: uuid.UUID) -> list[AuditEvent]:
        """The schedule's own audit trail (its create, its delete), oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                Q["list_schedule_audit_events"], {"schedule_id": schedule_id}
            ).mappings()
            return [_audit_event(r) for r in rows]

    def schedule_ticks(self, schedule_id: uuid.UUID, *, limit: int = 20) -> list[ScheduleTick]:
        """The schedule's latest ticks, newest first."""
        with self._statement() as conn:
            rows = conn.execute(
                Q["list_schedule_ticks"], {"schedule_id": schedule_id, "limit": limit}
            ).mappings()
            return [
                ScheduleTick(
                    r["schedule_id"],
                    r["tick_at"],
                    r["status"],
                    r["run_id"],
                    r["created_at"],
                    r["reason"],
                )
                for r in rows
            ]
