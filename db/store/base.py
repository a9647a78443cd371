"""The store: the only code that executes SQL against the run tables.

Every method is one named statement from ``queries.sql`` (or a few in one transaction).
Writes made by a worker after claiming are fenced on (holder, lease epoch) and raise
:class:`LeaseLost`, rolling the transaction back, when the worker no longer holds the run.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, Engine, RowMapping

from db import jsontext
from db.errors import (
    IdempotencyConflict,
    InvalidTransition,
    LeaseLost,
    QuotaExceeded,
    RunNotFound,
    TooManyPending,
)
from db.fastpath import FastStatements
from db.owed import OwedUsage
from db.queries import QUERIES as Q
from db.records import (
    Approval,
    ApprovalStatus,
    AuditEvent,
    Claim,
    Dispatch,
    NewAudit,
    NewRun,
    NewStep,
    Run,
    RunStatus,
    Schedule,
    Step,
    StepKind,
    StepOrigin,
    StepStatus,
    Usage,
)
from db.steplog import StepLogCache

_HOT = (
    "claim_run",
    "claim_run_to_end",
    "list_steps",
    "list_steps_since",
    "record_step",
    "start_step",
    "finish_run",
    "schedule_run",
)
"""The statements of a step, run through :mod:`db.fastpath`."""


MESSAGE_SIGNAL = "$message"
"""The run_signal name of a message (no signal name can be it: they are [A-Za-z0-9_.-])."""


class _NotWaiting(Exception):
    """Internal: abort a decision's transaction."""


def _json(value: Any) -> str | None:
    """A value for a ``jsonb`` column; NUL and lone surrogates in it survive (db.jsontext)."""
    return None if value is None else jsontext.dumps(value)


def _usage(row: Mapping[Any, Any]) -> Usage:
    return Usage(
        row["input_tokens"],
        row["output_tokens"],
        row["cache_creation_input_tokens"],
        row["cache_read_input_tokens"],
    )


def _run(row: Mapping[Any, Any]) -> Run:
    return Run(
        id=row["id"],
        agent=row["agent"],
        status=RunStatus(row["status"]),
        input=jsontext.loads(row["input"]),
        model=row["model"],
        max_steps=row["max_steps"],
        token_budget=row["token_budget"],
        tokens_used=row["tokens_used"],
        usage=_usage(row),
        cost_usd=row["cost_usd"],
        cost_budget_usd=row["cost_budget_usd"],
        unrecorded_tokens=row["unrecorded_tokens"],
        unrecorded_cost_usd=row["unrecorded_cost_usd"],
        deadline_at=row["deadline_at"],
        run_at=row["run_at"],
        wait_reason=row["wait_reason"],
        locked_by=row["locked_by"],
        locked_until=row["locked_until"],
        lease_epoch=row["lease_epoch"],
        dispatch_token=row["dispatch_token"],
        claims_without_progress=row["claims_without_progress"],
        cancel_requested=row["cancel_requested"],
        result=jsontext.loads(row["result"]),
        error=row["error"],
        submitted_by=row["submitted_by"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        finished_at=row["finished_at"],
        model_attempts=row["model_attempts"],
        tenant=row["tenant"],
        timeout_seconds=row["timeout_seconds"],
        forked_from_run=row["forked_from_run"],
        forked_from_seq=row["forked_from_seq"],
        replay_model=row["replay_model"],
        concurrency_key=row["concurrency_key"],
        priority=row["priority"],
        schedule_id=row.get("schedule_id"),
        parent_run_id=row.get("parent_run_id"),
        unrecorded_estimated_tokens=row.get("unrecorded_estimated_tokens", 0),
        messages_pending=row.get("messages_pending") or 0,
        deployment=row.get("deployment"),
    )


def _schedule(row: Mapping[Any, Any]) -> Schedule:
    return Schedule(
        id=row["id"],
        tenant=row["tenant"],
        agent=row["agent"],
        input=row["input"],
        model=row["model"],
        max_steps=row["max_steps"],
        token_budget=row["token_budget"],
        timeout_seconds=row["timeout_seconds"],
        cost_budget_usd=row["cost_budget_usd"],
        priority=row["priority"],
        cron=row["cron"],
        timezone=row["timezone"],
        overlap=row["overlap"],
        catch_up=row["catch_up"],
        next_tick_at=row["next_tick_at"],
        created_by=row["created_by"],
        created_at=row["created_at"],
    )


_UUID_DASHES = (8, 13, 18, 23)


def _id_range(prefix: str | None) -> dict[str, str | None]:
    """The ids that start with ``prefix`` (lower-case hex and dashes) as a range of uuids:
    ``{"id_low", "id_high"}``, both ``None`` without a prefix. A prefix that no uuid's text
    can start with (a dash out of place) gives an empty range."""
    if prefix is None:
        return {"id_low": None, "id_high": None}
    if any((c == "-") != (i in _UUID_DASHES) for i, c in enumerate(prefix)):
        empty = "ffffffff-ffff-ffff-ffff-ffffffffffff"
        return {"id_low": empty, "id_high": "00000000-0000-0000-0000-000000000000"}
    digits = prefix.replace("-", "")
    return {"id_low": digits.ljust(32, "0"), "id_high": digits.ljust(32, "f")}


def _step(row: Mapping[Any, Any]) -> Step:
    return Step(
        run_id=row["run_id"],
        seq=row["seq"],
        step_key=row["step_key"],
        kind=StepKind(row["kind"]),
        status=StepStatus(row["status"]),
        tool_name=row["tool_name"],
        tool_use_id=row["tool_use_id"],
        model=row["model"],
        prompt_hash=row["prompt_hash"],
        response=jsontext.loads(row["response"]),
        stop_reason=row["stop_reason"],
        usage=_usage(row),
        cost_usd=row["cost_usd"],
        latency_ms=row["latency_ms"],
        request_id=row["request_id"],
        error=row["error"],
        resolution=row["resolution"],
        attempt=row["attempt"],
        input_hash=row["input_hash"],
        worker=row["worker"],
        lease_epoch=row["lease_epoch"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        compensation=row["compensation"],
        origin=StepOrigin(row["origin"]) if row["origin"] else None,
        original_tokens=row["original_tokens"],
        original_cost_usd=row["original_cost_usd"],
    )


def _approval(row: RowMapping) -> Approval:
    return Approval(
        id=row["id"],
        run_id=row["run_id"],
        step_key=row["step_key"],
        role=row["role"],
        status=ApprovalStatus(row["status"]),
        payload=jsontext.loads(row["payload"]),
        payload_hash=row["payload_hash"],
        timeout_policy=row["timeout_policy"],
        requested_at=row["requested_at"],
        expires_at=row["expires_at"],
        decided_by=row["decided_by"],
        decided_at=row["decided_at"],
        comment=row["comment"],
        copied_from=row.get("copied_from"),
    )


def _step_params(
    claim: Claim, step: NewStep, next_token: uuid.UUID | None = None
) -> dict[str, Any]:
    return {
        **_fence(claim),
        **_usage_params(step.usage, step.cost_usd),
        # a child run's tokens billed but not recorded count against its parent too
        "total_tokens": step.usage.total + step.unrecorded_tokens,
        "hand_over": next_token is not None,
        "next_token": next_token,
        "request": _json(step.request),
        "seq": step.seq,
        "step_key": step.step_key,
        "kind": str(step.kind),
        "status": str(step.status),
        "response": _json(step.response),
        "error": jsontext.text(step.error),
        "attempt": step.attempt,
        "input_hash": step.input_hash,
        "model": step.model,
        "prompt_hash": step.prompt_hash,
        "input_tokens": step.usage.input_tokens,
        "output_tokens": step.usage.output_tokens,
        "cache_creation_input_tokens": step.usage.cache_creation_input_tokens,
        "cache_read_input_tokens": step.usage.cache_read_input_tokens,
        "cost_usd": step.cost_usd,
        "latency_ms": step.latency_ms,
        "request_id": step.request_id,
        "tool_name": step.tool_name,
        "tool_use_id": step.tool_use_id,
        "compensation": step.compensation,
        "stop_reason": step.stop_reason,
    }


def _usage_params(usage: Usage, cost: Decimal) -> dict[str, Any]:
    return {
        "total_tokens": usage.total,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cache_creation_input_tokens": usage.cache_creation_input_tokens,
        "cache_read_input_tokens": usage.cache_read_input_tokens,
        "cost_usd": cost,
    }


def _record_audit(
    conn: Connection,
    run_id: uuid.UUID | None,
    audit: NewAudit,
    *,
    schedule_id: uuid.UUID | None = None,
) -> None:
    conn.execute(
        Q["insert_audit_event"],
        {
            "run_id": run_id,
            "schedule_id": schedule_id,
            "approval_id": audit.approval_id,
            "tenant": audit.tenant,
            "actor": audit.actor,
            "action": audit.action,
            "detail": _json(audit.detail),
        },
    )


def _audit_event(r: Mapping[Any, Any]) -> AuditEvent:
    return AuditEvent(
        id=r["id"],
        at=r["at"],
        run_id=r["run_id"],
        approval_id=r["approval_id"],
        tenant=r["tenant"],
        actor=r["actor"],
        action=r["action"],
        detail=jsontext.loads(r["detail"]),
        schedule_id=r["schedule_id"],
    )


def _same_request(existing: RowMapping, key: str | None, request_hash: str | None) -> Run:
    """The run an idempotency key made, for a retry of the same request; a different request
    with that key is :class:`IdempotencyConflict` (a submit's key reused by a fork, too)."""
    if existing["request_hash"] != request_hash:
        raise IdempotencyConflict(
            f"Idempotency-Key {key!r} was used for run {existing['id']} "
            "with a different request body; use a new key for a new request"
        )
    return _run(existing)


def _new_run_params(
    new: NewRun, run_id: uuid.UUID, deployment: str | None = None
) -> dict[str, Any]:
    return {
        "deployment": new.deployment or deployment,
        "id": run_id,
        "agent": new.agent,
        "input": _json(new.input),
        "model": new.model,
        "max_steps": new.max_steps,
        "token_budget": new.token_budget,
        "cost_budget_usd": new.cost_budget_usd,
        "timeout_seconds": new.timeout_seconds,
        "token": uuid.uuid4(),
        "idempotency_key": new.idempotency_key,
        "request_hash": new.request_hash,
        "submitted_by": new.submitted_by,
        "tenant": new.tenant,
        "concurrency_key": new.concurrency_key,
        "priority": new.priority,
        "schedule_id": new.schedule_id,
        "parent_run_id": new.parent_run_id,
    }


STATS_ROLLUP_GRACE_SECONDS = 600.0
"""An hour is rolled up this long after it ended: longer than any transaction that records a
step (its rows carry the transaction's start time and become visible at its commit)."""
STATS_ROLLUP_HORIZON_SECONDS = 7 * 86400 + 7200.0
"""How far back the roll-up keeps hours: the longest stats window, and an hour's slack. The
late-write triggers of migration 0023 look back 8 days, which must cover it."""
_HOUR = timedelta(hours=1)


def _gaps(
    since: datetime, hours: Sequence[datetime]
) -> tuple[list[datetime], list[datetime | None]]:
    """The ranges of ``[since, now]`` that the rolled-up ``hours`` (sorted, whole UTC hours
    from ``since`` on) do not cover, as (starts, ends); the last end is ``None``: no end,
    as the raw query (a row committed meanwhile may carry a later time than the window's
    now)."""
    lo: list[datetime] = []
    hi: list[datetime | None] = []
    at = since
    for hour in hours:
        if hour > at:
            lo.append(at)
            hi.append(hour)
        at = hour + _HOUR
    lo.append(at)
    hi.append(None)
    return lo, hi


COMPENSABLE_KINDS = (StepKind.STEP, StepKind.LLM, StepKind.SIDE_EFFECT, StepKind.APPROVAL)
"""The row kinds of the steps that may have a compensation (the pipeline's table declares
which kinds are compensable: ``tests/unit/test_crash_table.py`` keeps the two equal). A run
ended from outside (a cancel, an operator's fail) with a completed one of these is handed to
a worker, whose stop runs what its code declared."""
_COMPENSABLE = {"compensable": [str(k) for k in COMPENSABLE_KINDS]}


def _fence(claim: Claim) -> dict[str, Any]:
    return {"id": claim.run_id, "worker": claim.worker, "epoch": claim.epoch}


@dataclass
class Fenced:
    """One fenced transaction of a worker's records (:meth:`StoreBase._fenced`)."""

    token: uuid.UUID
    """The dispatch token the lease is handed on with, if the records hand it on."""
    connection: Connection | None = None
    written: list[Step] | None = None
    """The step rows written, for the step log's cache (``None``: nothing was written)."""

    @property
    def conn(self) -> Connection:
        assert self.connection is not None, "a fenced write without its transaction"
        return self.connection


class StoreBase:
    """What every part of the store shares: the engine, the statements, the step
    logs' cache, the reads every caller makes, and the one fenced write of a step row."""

    def __init__(
        self,
        engine: Engine,
        *,
        step_log_cache: int = 512,
        run_ids: Callable[[], uuid.UUID] = uuid.uuid4,
        deployment: str | None = None,
    ) -> None:
        self.engine = engine
        self.deployment = deployment
        """The version of the code of the process using this store: the runs it stores start
        on it (a child on its parent's), and its claims take only runs of it (or of none)."""
        self.run_ids = run_ids
        """Makes the id of each new run (submit, fork, schedule tick)."""
        self.step_logs = StepLogCache(step_log_cache)
        self.owed = OwedUsage(self._write_unrecorded)
        """Billed tokens owed to the database while it was away (db/owed.py)."""
        # One statement, one transaction, one round trip: no BEGIN and no COMMIT/ROLLBACK
        # of their own (psycopg sends each as a round trip). For every method below that is a
        # single statement; the others use engine.begin().
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        # A step's own statements skip SQLAlchemy's statement layer (see db.fastpath).
        self._fast = FastStatements(engine, {name: Q[name] for name in _HOT})

    def _statement(self) -> Connection:
        """A connection for one statement that is its own transaction."""
        return self._autocommit.connect()

    # -- submitting ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _fenced(
        self, claim: Claim, token: uuid.UUID | None = None, *, transaction: bool = True
    ) -> Iterator[Fenced]:
        """The one shape of a worker's fenced records: a transaction (``f.conn``; none with
        ``transaction`` false, for a single statement of its own), a dispatch token to hand
        the lease on with (``f.token``), and after the commit the rows the body wrote
        (``f.written``) told to the step log's cache under that token. When the fence refuses
        a write (``LeaseLost``) the transaction rolls back, the run's cached log is dropped
        and the refusal goes on; a body that wrote nothing (``f.written`` left ``None``)
        tells the cache nothing."""
        fenced = Fenced(token or uuid.uuid4())
        try:
            if transaction:
                with self.engine.begin() as conn:
                    fenced.connection = conn
                    yield fenced
            else:
                yield fenced
        except LeaseLost:
            self.step_logs.forget(claim.run_id)
            raise
        if fenced.written is not None:
            self.step_logs.wrote(claim.run_id, claim.epoch, fenced.written, fenced.token)

    def get_run(self, run_id: uuid.UUID) -> Run:
        with self._statement() as conn:
            row = conn.execute(Q["get_run"], {"id": run_id}).mappings().first()
        if row is None:
            raise RunNotFound(f"no run with id {run_id}")
        return _run(row)

    def steps(
        self,
        run_id: uuid.UUID,
        *,
        token: uuid.UUID | None = None,
        epoch: int | None = None,
        status_changes: int | None = None,
    ) -> list[Step]:
        """The run's steps in order. A worker passes the token its message carried, its
        lease epoch and the run's count of status changes (its claim's): when this process
        handed the run on with that token itself, nothing is read; when it has an older
        copy of the log, only the rows written since are (see :mod:`db.steplog`)."""
        if epoch is None:
            return self._all_steps(run_id)
        logs = self.step_logs
        cached = logs.get(run_id, token, epoch, status_changes)
        if cached is not None:
            return cached
        since = logs.since(run_id, status_changes)
        if since is not None:
            rows = self._fast.all("list_steps_since", {"id": run_id, "since": since})
            changed = [_step(r) for r in rows if r["seq"] is not None]
            total = rows[0]["total"] if rows else 0
            merged = logs.caught_up(run_id, since, epoch, changed, total)
            if merged is not None:
                return merged
        steps = self._all_steps(run_id)
        logs.loaded(run_id, epoch, steps, status_changes)
        return steps

    def _all_steps(self, run_id: uuid.UUID) -> list[Step]:
        return [_step(r) for r in self._fast.all("list_steps", {"id": run_id})]

    def _record(
        self,
        conn: Connection | None,
        claim: Claim,
        step: NewStep,
        next_token: uuid.UUID | None = None,
    ) -> Step:
        """One fenced row (``record_step``); with ``next_token`` the lease is handed on.
        Without ``conn``, the statement is its own transaction."""
        params = _step_params(claim, step, next_token)
        written: Mapping[Any, Any] | None
        if conn is None:
            written = self._fast.one("record_step", params)
        else:
            written = conn.execute(Q["record_step"], params).mappings().first()
        if written is None:
            self.step_logs.forget(claim.run_id)
            raise LeaseLost(claim.run_id, "checkpoint refused by the fence")
        return _step(written)

    def _schedule(
        self,
        conn: Connection | None,
        claim: Claim,
        delay_seconds: float,
        token: uuid.UUID,
        reason: str | None,
        progress: bool,
        model_attempts: int,
        admission: bool = False,
        *,
        wakeable: bool = False,
    ) -> None:
        """Park the run on a timer of ``delay_seconds``. ``wakeable``: it waits for what may
        come sooner (a signal, a child's end, a key slot), and :meth:`wake` brings it
        forward; otherwise the timer is a floor no wake crosses. Fenced."""
        params = {
            **_fence(claim),
            "delay_seconds": delay_seconds,
            "next_token": token,
            "reason": reason,
            "progress": progress,
            "admission": admission,
            "model_attempts": model_attempts,
            "wakeable": wakeable,
        }
        if conn is None:
            owned = self._fast.rowcount("schedule_run", params)
        else:
            owned = conn.execute(Q["schedule_run"], params).rowcount
        if owned == 0:
            raise LeaseLost(claim.run_id, "timer refused by the fence")

    def _write_unrecorded(self, params: Mapping[str, Any]) -> None:
        with self._statement() as conn:
            conn.execute(Q["record_unrecorded_usage"], dict(params))

    def _hand_over(
        self,
        conn: Connection,
        claim: Claim,
        token: uuid.UUID,
        delay_seconds: float | None,
        reason: str | None,
        progress: bool,
        model_attempts: int,
        *,
        wakeable: bool = False,
    ) -> None:
        """After rows recorded in the same transaction: the lease to the next message, or a
        durable timer. Fenced."""
        if delay_seconds is not None:
            self._schedule(
                conn,
                claim,
                delay_seconds,
                token,
                reason,
                progress,
                model_attempts,
                wakeable=wakeable,
            )
        elif not conn.execute(Q["hand_over_run"], {**_fence(claim), "next_token": token}).rowcount:
            raise LeaseLost(claim.run_id, "checkpoint refused by the fence")

    def get_approval(self, approval_id: uuid.UUID, *, tenant: str | None = None) -> Approval | None:
        """The approval, if its run belongs to ``tenant`` (``None``: any tenant)."""
        params = {"approval_id": approval_id, "tenant": tenant}
        with self._statement() as conn:
            row = conn.execute(Q["get_approval"], params).mappings().first()
        return _approval(row) if row else None

    def list_approvals(
        self,
        *,
        status: str | None = "PENDING",
        role: str | None = None,
        run_id: uuid.UUID | None = None,
        limit: int = 100,
        tenant: str | None = None,
    ) -> list[Approval]:
        params = {
            "status": status,
            "role": role,
            "run_id": run_id,
            "limit": limit,
            "tenant": tenant,
        }
        with self._statement() as conn:
            rows = conn.execute(Q["list_approvals"], params).mappings().all()
        return [_approval(r) for r in rows]

    def step_by_key(self, run_id: uuid.UUID, step_key: str) -> Step | None:
        with self.engine.connect() as conn:
            row = (
                conn.execute(Q["get_step_by_key"], {"id": run_id, "step_key": step_key})
                .mappings()
                .first()
            )
        return _step(row) if row else None

    def run_event_seq(self, run_id: uuid.UUID) -> int | None:
        """The number of the run's last durable event; ``None`` when there is no such run."""
        with self._statement() as conn:
            value = conn.execute(Q["run_event_seq"], {"id": run_id}).scalar()
        return None if value is None else int(value)


@dataclass(frozen=True)
class SubmitQuota:
    """One submitter's limits (``0``: none): submits (and resumes) per minute, runs in
    flight."""

    per_minute: int = 0
    max_active: int = 0


def _check_quota(conn: Connection, submitter: str, quota: SubmitQuota) -> None:
    """Under the submitter's advisory lock (:sql:`lock_submitter`): raise
    :class:`QuotaExceeded` when one more run would break ``quota``."""
    if not quota.per_minute and not quota.max_active:
        return
    row = conn.execute(
        Q["submitter_usage"], {"submitted_by": submitter, "window_seconds": 60}
    ).one()
    if quota.per_minute and row.n >= quota.per_minute:
        raise QuotaExceeded(
            f"token {submitter!r} submitted or resumed {row.n} runs in the last minute; the "
            f"limit is {quota.per_minute} (DAR_SUBMIT_RATE_PER_MINUTE)",
            retry_after=max(1, int(60 - float(row.oldest_age or 0)) + 1),
            limit="DAR_SUBMIT_RATE_PER_MINUTE",
        )
    if quota.max_active and row.active >= quota.max_active:
        raise QuotaExceeded(
            f"token {submitter!r} has {row.active} runs in flight (QUEUED or RUNNING); the "
            f"limit is {quota.max_active} (DAR_TOKEN_MAX_ACTIVE_RUNS)",
            retry_after=5,
            limit="DAR_TOKEN_MAX_ACTIVE_RUNS",
        )


def _refused_tick(
    conn: Connection,
    schedule: Schedule,
    quota: SubmitQuota | None,
    creator_ok: Callable[[str], bool] | None,
) -> str | None:
    """Why a tick of ``schedule`` may not start a run now (``None``: it may): its creator's
    token revoked or expired, or the creator over its quota (checked under its lock, as a
    submit is, so the runs this pass starts count)."""
    creator = schedule.created_by
    if creator is None:
        return None
    if creator_ok is not None and not creator_ok(creator):
        return f"token {creator!r} that created the schedule is revoked or expired"
    if quota is None:
        return None
    conn.execute(Q["lock_submitter"], {"submitted_by": creator})
    try:
        _check_quota(conn, creator, quota)
    except QuotaExceeded as e:
        return str(e)
    return None


def _start_scheduled_run(
    conn: Connection,
    schedule: Schedule,
    run_id: uuid.UUID,
    tick_at: datetime,
    deployment: str | None = None,
) -> Dispatch:
    new = NewRun(
        agent=schedule.agent,
        input=schedule.input,
        model=schedule.model,
        max_steps=schedule.max_steps,
        token_budget=schedule.token_budget,
        timeout_seconds=schedule.timeout_seconds,
        cost_budget_usd=schedule.cost_budget_usd,
        submitted_by=schedule.created_by,
        tenant=schedule.tenant,
        priority=schedule.priority,
        schedule_id=schedule.id,
    )
    row = conn.execute(Q["create_run"], _new_run_params(new, run_id, deployment)).mappings().one()
    _record_audit(
        conn,
        row["id"],
        NewAudit(
            actor=schedule.created_by or "schedule",
            action="submit",
            tenant=schedule.tenant,
            detail={
                "agent": schedule.agent,
                "model": schedule.model,
                "tokenBudget": schedule.token_budget,
                "schedule": str(schedule.id),
                "tickAt": tick_at.isoformat(),
            },
        ),
    )
    return Dispatch(row["id"], row["dispatch_token"])


@dataclass(frozen=True)
class SendLimits:
    """What a token's messages and signals may take (``0``: no limit): sends per minute, all
    runs together (``DAR_MESSAGE_RATE_PER_MINUTE``), and undelivered messages and signals one
    run holds (``DAR_MAX_PENDING_PER_RUN``)."""

    per_minute: int = 0
    max_pending: int = 0


def _check_send_rate(conn: Connection, actor: str, limits: SendLimits | None) -> None:
    """Under the sender's lock: :class:`QuotaExceeded` when one more message or signal would
    break its rate."""
    if limits is None or not limits.per_minute:
        return
    conn.execute(Q["lock_sender"], {"actor": actor})
    row = conn.execute(Q["sender_usage"], {"actor": actor, "window_seconds": 60}).one()
    if row.n >= limits.per_minute:
        raise QuotaExceeded(
            f"token {actor!r} sent {row.n} messages and signals in the last minute; the limit "
            f"is {limits.per_minute} (DAR_MESSAGE_RATE_PER_MINUTE)",
            retry_after=max(1, int(60 - float(row.oldest_age or 0)) + 1),
            limit="DAR_MESSAGE_RATE_PER_MINUTE",
        )


def _check_pending(conn: Connection, run_id: uuid.UUID, limits: SendLimits | None) -> None:
    if limits is None or not limits.max_pending:
        return
    held = conn.execute(Q["count_pending_signals"], {"run_id": run_id}).scalar_one()
    if held >= limits.max_pending:
        raise TooManyPending(
            f"run {run_id} holds {held} undelivered messages and signals; the limit is "
            f"{limits.max_pending} (DAR_MAX_PENDING_PER_RUN): send again once it has read some"
        )


def _seen_signal(conn: Connection, params: dict[str, Any]) -> int | None:
    """The id of the signal (or message) ``params``' key made before, if any: the same one
    again is a retry; another under that key is :class:`IdempotencyConflict`."""
    if params["idempotency_key"] is None:
        return None
    seen = conn.execute(Q["get_signal_by_key"], params).first()
    if seen is None:
        return None
    if not seen.same:
        raise IdempotencyConflict(
            f"Idempotency-Key {params['idempotency_key']!r} was used for another message or "
            f"signal to run {params['run_id']} (id {seen.id}); use a new key for a new one"
        )
    return int(seen.id)


def _insert_signal(
    conn: Connection,
    run_id: uuid.UUID,
    name: str,
    payload: Any,
    idempotency_key: str | None,
    sent_by: str | None,
    tenant: str | None,
    *,
    limits: SendLimits | None = None,
) -> tuple[int, bool]:
    # No lock on the target: its waiter holds its own row's lock while it checks and parks,
    # and the wake after this commit waits for that lock (see wait_for_signal).
    target = conn.execute(Q["get_run"], {"id": run_id}).first()
    if target is None or (tenant is not None and target.tenant != tenant):
        raise RunNotFound(f"no run with id {run_id}")
    if RunStatus(target.status).terminal:
        raise InvalidTransition(f"run {run_id} has ended ({target.status}): it takes no signal")
    params = {
        "run_id": run_id,
        "name": name,
        "payload": _json(payload),
        "idempotency_key": idempotency_key,
        "sent_by": sent_by,
    }
    if limits is not None:  # a client's signal: a retry, or a new one within the run's cap
        seen = _seen_signal(conn, params)
        if seen is not None:
            return seen, False
        _check_pending(conn, run_id, limits)
    row = conn.execute(Q["insert_signal"], params).first()
    if row is not None:
        return int(row.id), True
    seen_row = conn.execute(Q["get_signal_by_key"], params).one()
    return int(seen_row.id), False


def _wake(conn: Connection, run_id: uuid.UUID, *, send: bool) -> Dispatch | None:
    row = conn.execute(Q["wake_run"], {"id": run_id, "send": send}).first()
    return None if row is None else Dispatch(row.id, row.dispatch_token)


def _end_children(conn: Connection, run_id: uuid.UUID) -> None:
    """The run ended early: its live children are cancelled, down the tree, and its steps
    that waited for one are released (``steps.child`` RETRYING, a sub-agent's its tool's
    error), so a resume starts them again instead of reading the children it cancelled."""
    cancelled = _cancel_children(conn, run_id)
    if cancelled:
        conn.execute(
            Q["release_cancelled_child_steps"],
            {"id": run_id, "cancelled": [str(c) for c in cancelled]},
        )


def _cancel_children(conn: Connection, run_id: uuid.UUID) -> list[uuid.UUID]:
    """Cancel the run's live children, down the tree; the children (first level) whose
    cancel was taken."""
    cancelled = []
    for child in conn.execute(Q["live_children"], {"id": run_id}).scalars().all():
        if conn.execute(Q["cancel_run"], {"id": child, **_COMPENSABLE}).first() is not None:
            conn.execute(Q["cancel_pending_approvals"], {"id": child})
            _cancel_children(conn, child)
            cancelled.append(child)
    return cancelled
