"""The store: the only code that executes SQL against the run tables.

Every method is one named statement from ``queries.sql`` (or a few in one transaction).
Writes made by a worker after claiming are fenced on (holder, lease epoch) and raise
:class:`LeaseLost`, rolling the transaction back, when the worker no longer holds the run.
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import Connection, Engine, RowMapping
from sqlalchemy.exc import DataError

from db import jsontext
from db.errors import (
    DatabaseUnavailable,
    IdempotencyConflict,
    InvalidTransition,
    LeaseLost,
    QuotaExceeded,
    RunNotFound,
    ValueRefused,
    database_unavailable,
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
    HourCost,
    HourCount,
    HourLatency,
    NewAudit,
    NewFork,
    NewRun,
    NewSchedule,
    NewStep,
    ReadyRuns,
    Run,
    RunStatus,
    Schedule,
    ScheduleTick,
    Stats,
    Step,
    StepEdit,
    StepKind,
    StepOrigin,
    StepStatus,
    TreeSpend,
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


def _record_audit(conn: Connection, run_id: uuid.UUID, audit: NewAudit) -> None:
    conn.execute(
        Q["insert_audit_event"],
        {
            "run_id": run_id,
            "approval_id": audit.approval_id,
            "tenant": audit.tenant,
            "actor": audit.actor,
            "action": audit.action,
            "detail": _json(audit.detail),
        },
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


class RunStore:
    """All reads and writes of runs and steps."""

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

    def count_runs_by_status(self) -> dict[str, int]:
        with self._statement() as conn:
            return {r.status: r.n for r in conn.execute(Q["count_runs_by_status"])}

    def count_key_waiters_by_tenant(self, top: int) -> tuple[list[tuple[str, int]], int]:
        """The ``top`` tenants with the most runs waiting for a slot of a concurrency key,
        and the total waiting over every tenant."""
        with self._statement() as conn:
            rows = conn.execute(Q["count_key_waiters_by_tenant"], {"top": top}).all()
        return [(r.key, int(r.n)) for r in rows], int(rows[0].total) if rows else 0

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

    def _claimed(self, row: Mapping[Any, Any] | None, worker: str) -> Claim | None:
        if row is None:
            return None
        run = _run(row)
        return Claim(
            run=run,
            worker=worker,
            epoch=run.lease_epoch,
            db_now=row["db_now"],
            status_changes=row["status_changes"],
        )

    def claim(
        self, run_id: uuid.UUID, token: uuid.UUID, worker: str, lease_s: float
    ) -> Claim | None:
        """Claim the run for the message carrying ``token``; ``None`` when the message is
        stale or duplicated, the lease is live, or the run is not due."""
        row = self._fast.one(
            "claim_run",
            {
                "id": run_id,
                "token": token,
                "worker": worker,
                "lease_seconds": lease_s,
                "deployment": self.deployment,
            },
        )
        return self._claimed(row, worker)

    def claim_to_end(
        self, run_id: uuid.UUID, token: uuid.UUID, worker: str, lease_s: float
    ) -> Claim | None:
        """:meth:`claim`, by the worker that handed the run on with ``token`` after a step
        that ended its conversation, to end it without a message; ``None`` also when a
        message was posted to the run meanwhile (its delivery is a step: send ``token``)."""
        row = self._fast.one(
            "claim_run_to_end",
            {
                "id": run_id,
                "token": token,
                "worker": worker,
                "lease_seconds": lease_s,
                "deployment": self.deployment,
            },
        )
        return self._claimed(row, worker)

    def claim_next(self, worker: str, lease_s: float) -> Claim | None:
        """Claim any due run (QUEUED, or RUNNING with a lapsed lease)."""
        with self._statement() as conn:
            row = (
                conn.execute(
                    Q["claim_next_run"],
                    {"worker": worker, "lease_seconds": lease_s, "deployment": self.deployment},
                )
                .mappings()
                .first()
            )
        return self._claimed(row, worker)

    def renew_leases(
        self, worker: str, held: Iterable[tuple[uuid.UUID, int]], lease_seconds: float
    ) -> set[uuid.UUID]:
        """Extend the leases this worker holds; returns the run ids taken over by another
        claim since (a lease this worker released itself is not reported)."""
        pairs = list(held)
        if not pairs:
            return set()
        epochs = dict(pairs)
        with self._statement() as conn:
            rows = conn.execute(
                Q["renew_leases"],
                {
                    "worker": worker,
                    "lease_seconds": lease_seconds,
                    "ids": [p[0] for p in pairs],
                    "epochs": [p[1] for p in pairs],
                },
            ).all()
        return {r.id for r in rows if not r.renewed and r.lease_epoch != epochs[r.id]}

    # -- checkpoints (fenced) -----------------------------------------------------------

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

    def checkpoint_model(self, claim: Claim, step: NewStep) -> Dispatch:
        """A model call's row, token counters and lease hand-over in one statement."""
        token = uuid.uuid4()
        written = self._record(None, claim, step, token)
        self.step_logs.wrote(claim.run_id, claim.epoch, [written], token)
        return Dispatch(claim.run_id, token)

    def schedule(
        self,
        claim: Claim,
        delay_seconds: float,
        *,
        reason: str,
        model_attempts: int = 0,
        admission: bool = False,
        wakeable: bool = False,
    ) -> Dispatch:
        """Park the run on a durable timer and release the lease; nothing recorded, so it
        is not progress. ``model_attempts`` persists the attempts of the model step in flight.
        ``admission``: the step was refused capacity before it began, so this claim does not
        count as one without progress either. ``wakeable``: a wake (:meth:`wake`, a freed
        concurrency-key slot) may bring it forward; otherwise the timer is a floor (a
        server's retry-after, a backoff). Fenced."""
        token = uuid.uuid4()
        try:
            self._schedule(
                None,
                claim,
                delay_seconds,
                token,
                reason,
                False,
                model_attempts,
                admission,
                wakeable=wakeable,
            )
        except LeaseLost:
            self.step_logs.forget(claim.run_id)
            raise
        self.step_logs.wrote(claim.run_id, claim.epoch, [], token)
        return Dispatch(claim.run_id, token, delay_seconds)

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

    def record_unrecorded_usage(
        self,
        run_id: uuid.UUID,
        usage: Usage,
        cost: Decimal,
        *,
        unless_step: tuple[str, int] | None = None,
        estimated_tokens: int = 0,
        then: Callable[[], None] | None = None,
    ) -> bool:
        """Count a billed model call whose checkpoint was refused against the run; with
        ``unless_step`` (key, epoch) only when no such step row was written. With the
        database away the count is kept in this process and written when it answers again
        (:class:`db.owed.OwedUsage`): returns ``False`` then. ``estimated_tokens`` of it are
        an estimate (a call lost with its worker; negative when the API's count replaces
        an estimate). ``then`` runs once it is written, now or later."""
        key, epoch = unless_step if unless_step is not None else (None, None)
        params = {
            "id": run_id,
            "total_tokens": usage.total,
            "cost_usd": cost,
            "step_key": key,
            "epoch": epoch,
            "estimated_tokens": estimated_tokens,
        }
        return self.owed.write_or_owe(params, then)

    def _write_unrecorded(self, params: Mapping[str, Any]) -> None:
        with self._statement() as conn:
            conn.execute(Q["record_unrecorded_usage"], dict(params))

    def record_steps(
        self,
        claim: Claim,
        steps: list[NewStep],
        *,
        delay_seconds: float | None = None,
        reason: str | None = None,
        model_attempts: int = 0,
    ) -> Dispatch:
        """Checkpoint steps: the rows, the token counters and the lease hand-over (or a
        durable timer, with ``delay_seconds``) in one transaction. Fenced."""
        token = uuid.uuid4()
        if delay_seconds is None and len(steps) == 1:  # the common case: one statement
            written = [self._record(None, claim, steps[0], token)]
            self.step_logs.wrote(claim.run_id, claim.epoch, written, token)
            return Dispatch(claim.run_id, token)
        try:
            with self.engine.begin() as conn:
                written = [self._record(conn, claim, step) for step in steps]
                self._hand_over(
                    conn, claim, token, delay_seconds, reason, bool(steps), model_attempts
                )
        except LeaseLost:
            self.step_logs.forget(claim.run_id)
            raise
        self.step_logs.wrote(claim.run_id, claim.epoch, written, token)
        return Dispatch(claim.run_id, token, delay_seconds or 0.0)

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

    def suspend_for_approval(
        self,
        claim: Claim,
        step: NewStep,
        *,
        role: str,
        payload: Any,
        timeout_seconds: float,
        timeout_policy: str,
        discard_copied: bool = False,
    ) -> uuid.UUID:
        """Record the PENDING approval and suspend the run (no lease). Fenced. With
        ``discard_copied``, a fork asks again for an approval it copied: the row becomes its
        own and the copied rows nested in it are dropped, in the same transaction."""
        self.step_logs.forget(claim.run_id)  # a decision gives the run a new token anyway
        with self.engine.begin() as conn:
            if discard_copied:
                conn.execute(
                    Q["discard_copied_step"], {"id": claim.run_id, "step_key": step.step_key}
                )
            self._record(conn, claim, step)
            suspended = conn.execute(
                Q["suspend_run"],
                {
                    **_fence(claim),
                    "next_token": uuid.uuid4(),
                    "reason": f"waiting for approval by {role} ({step.step_key})",
                },
            ).first()
            if suspended is None:
                raise LeaseLost(claim.run_id, "suspend refused by the fence")
            approval_id: uuid.UUID = conn.execute(
                Q["insert_approval"],
                {
                    "approval_id": uuid.uuid4(),
                    "id": claim.run_id,
                    "step_key": step.step_key,
                    "role": role,
                    "payload": _json(payload),
                    "payload_hash": step.input_hash,
                    "timeout_policy": timeout_policy,
                    "timeout_seconds": timeout_seconds,
                },
            ).scalar_one()
            if suspended.status == RunStatus.CANCELLED:  # cancelled while the step ran
                conn.execute(Q["cancel_pending_approvals"], {"id": claim.run_id})
        return approval_id

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

    def due_approvals(self, limit: int = 100) -> list[tuple[uuid.UUID, str]]:
        with self._statement() as conn:
            rows = conn.execute(Q["due_approvals"], {"limit": limit}).all()
        return [(r.id, r.timeout_policy) for r in rows]

    def count_pending_approvals(self) -> dict[str, int]:
        with self._statement() as conn:
            return {r.role: r.n for r in conn.execute(Q["count_pending_approvals"])}

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

    def start_step(self, claim: Claim, step: NewStep) -> None:
        """Record a step with an effect STARTED before its code runs (or again, when it is
        entered once more). Fenced."""
        row = self._fast.one(
            "start_step",
            {
                **_fence(claim),
                "seq": step.seq,
                "step_key": step.step_key,
                "kind": str(step.kind),
                "tool_name": step.tool_name,
                "tool_use_id": step.tool_use_id,
                "attempt": step.attempt,
                "input_hash": step.input_hash,
            },
        )
        if row is None:
            self.step_logs.forget(claim.run_id)
            raise LeaseLost(claim.run_id, "step start refused by the fence")
        self.step_logs.wrote(claim.run_id, claim.epoch, [_step(row)])

    def record_child(self, claim: Claim, step: NewStep) -> None:
        """Record a step inside a step that is still running (a model call inside
        ``steps.llm``, a nested step) and add its tokens to the run, without handing the
        lease on. Fenced."""
        with self._statement() as conn:
            written = self._record(conn, claim, step)
        self.step_logs.wrote(claim.run_id, claim.epoch, [written])

    def begin_stop(self, claim: Claim, reason: str) -> None:
        """Mark the run as stopping for ``reason`` while its compensations run. Fenced."""
        with self._statement() as conn:
            row = conn.execute(Q["begin_stop"], {**_fence(claim), "error": reason}).first()
        if row is None:
            raise LeaseLost(claim.run_id, "stop refused by the fence")

    def finish(
        self,
        claim: Claim,
        status: RunStatus,
        *,
        result: Any = None,
        error: str | None = None,
    ) -> Run:
        """End the run (or park it NEEDS_ATTENTION) and release the lease; the run as it
        ends. Fenced."""
        self.step_logs.forget(claim.run_id)
        row = self._fast.one(
            "finish_run",
            {
                **_fence(claim),
                "status": str(status),
                "result": _json(result),
                "error": jsontext.text(error),
            },
        )
        if row is None:
            raise LeaseLost(claim.run_id, "finish refused by the fence")
        return _run(row)

    # -- control ------------------------------------------------------------------------

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

    def park_for_child(
        self, claim: Claim, child_id: uuid.UUID, delay_seconds: float, reason: str
    ) -> Dispatch | None:
        """Park the parent until its child ends (a timer of ``delay_seconds`` as a fallback),
        unless the child has ended already (``None``: read its result now). Under the
        parent's row lock, as :meth:`wait_for_signal`: a child that ends meanwhile finds the
        parent parked and wakes it. Fenced."""
        token = uuid.uuid4()
        with self.engine.begin() as conn:
            conn.execute(Q["lock_run_row"], {"id": claim.run_id})
            child = conn.execute(Q["get_run"], {"id": child_id}).first()
            if child is None or RunStatus(child.status).terminal:
                return None
            # a wait is progress; woken when the child ends
            self._schedule(conn, claim, delay_seconds, token, reason, True, 0, wakeable=True)
        return Dispatch(claim.run_id, token, delay_seconds)

    def hold_tree_budget(
        self,
        claim: Claim,
        step_key: str,
        tokens: int,
        cost: Decimal,
        admit: Callable[[TreeSpend], bool],
    ) -> tuple[TreeSpend, bool]:
        """For a model call of a child run: under the tree's lock, what the tree has spent
        and holds; when ``admit`` says the call may start, hold its worst case (``tokens``,
        ``cost``) against the root's budget until :meth:`release_tree_budget`. Returns the
        spend read and whether the hold was written. Holds of ended runs are swept."""
        params = {"id": claim.run_id, "epoch": claim.epoch}
        with self.engine.begin() as conn:
            root = conn.execute(Q["tree_root"], params).scalar_one()
            conn.execute(Q["lock_tree_budget"], {"root": root})
            conn.execute(Q["sweep_tree_holds"], {"root": root})
            row = conn.execute(Q["tree_spend"], {**params, "root": root}).mappings().one()
            spend = TreeSpend(
                root=root,
                token_budget=row["token_budget"],
                cost_budget_usd=row["cost_budget_usd"],
                spent=int(row["spent"]),
                cost=Decimal(row["cost"]),
                held=int(row["held"]),
                held_cost=Decimal(row["held_cost"]),
                in_flight=int(row["in_flight"]),
            )
            admitted = admit(spend)
            if admitted:
                conn.execute(
                    Q["hold_tree_budget"],
                    {
                        **params,
                        "root": root,
                        "step_key": step_key,
                        "tokens": tokens,
                        "cost_usd": cost,
                    },
                )
        return spend, admitted

    def release_tree_budget(self, run_id: uuid.UUID, epoch: int) -> None:
        """The model call's tokens are counted on its run: its hold (and those of the run's
        earlier leases) go."""
        with self._statement() as conn:
            conn.execute(Q["release_tree_budget"], {"id": run_id, "epoch": epoch})

    def cancel_children(self, run_id: uuid.UUID) -> None:
        """Cancel a run's live children, down the tree (the run itself ended early)."""
        with self.engine.begin() as conn:
            _cancel_children(conn, run_id)

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

    def start_children(
        self,
        claim: Claim,
        started: list[tuple[NewStep, NewRun, uuid.UUID]],
        recheck: float,
        reason: str,
    ) -> list[Dispatch]:
        """Insert each child run with its parent's ``PENDING`` step, and park the parent (a
        timer of ``recheck`` seconds, woken sooner when a child ends), in one transaction:
        a child exists exactly when its step does. Returns the children's first drive_run
        messages. Fenced."""
        token = uuid.uuid4()
        created: list[Dispatch] = []
        try:
            with self.engine.begin() as conn:
                written = []
                for step, child, child_id in started:
                    params = _new_run_params(child, child_id, self.deployment)
                    row = conn.execute(Q["create_run"], params).mappings().one()
                    created.append(Dispatch(row["id"], row["dispatch_token"]))
                    written.append(self._record(conn, claim, step))
                self._hand_over(conn, claim, token, recheck, reason, True, 0, wakeable=True)
        except LeaseLost:
            self.step_logs.forget(claim.run_id)
            raise
        self.step_logs.wrote(claim.run_id, claim.epoch, written, token)
        return created

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
                    _cancel_children(conn, run_id)
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

    def record_recovery(
        self, run_id: uuid.UUID, *, tenant: str, actor: str, action: str, detail: Any
    ) -> None:
        """One entry of a run's recovery trail (``recovery.*``): an audit event, and through
        the trigger of migration 0019 a ``run.recovery`` event of its live stream."""
        with self.engine.begin() as conn:
            _record_audit(
                conn, run_id, NewAudit(actor=actor, action=action, tenant=tenant, detail=detail)
            )

    def delete_finished_runs(self, *, older_than_seconds: float, batch: int) -> int:
        """Delete one batch of finished runs older than the cut-off; returns how many."""
        with self.engine.begin() as conn:
            rows = conn.execute(
                Q["delete_finished_runs"],
                {"older_than_seconds": older_than_seconds, "batch": batch},
            ).all()
        return len(rows)

    def submitter_usage(self, submitted_by: str) -> tuple[int, float, int]:
        """``(submits and resumes in the last minute, age of the oldest, runs in flight)``."""
        with self._statement() as conn:
            row = conn.execute(
                Q["submitter_usage"], {"submitted_by": submitted_by, "window_seconds": 60}
            ).one()
        return int(row.n), float(row.oldest_age or 0), int(row.active)

    def make_due_now(self, run_id: uuid.UUID) -> None:
        """Fast-forward a run's timer and lease (test kits; an operator's "wake it now")."""
        with self._statement() as conn:
            conn.execute(Q["make_due_now"], {"id": run_id})

    def audit_events(self, run_id: uuid.UUID) -> list[AuditEvent]:
        """The run's audit trail, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(Q["list_audit_events"], {"run_id": run_id}).mappings().all()
        return [
            AuditEvent(
                id=r["id"],
                at=r["at"],
                run_id=r["run_id"],
                approval_id=r["approval_id"],
                tenant=r["tenant"],
                actor=r["actor"],
                action=r["action"],
                detail=jsontext.loads(r["detail"]),
            )
            for r in rows
        ]

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
            conn.execute(Q["copy_approvals_to_fork"], copy)
            if new.reuse_approval and not conn.execute(Q["carry_approval_to_fork"], copy).first():
                raise InvalidTransition(
                    f"step {new.from_seq} of run {new.source} is not an approved approval: "
                    "there is no decision to reuse"
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

    def step_by_key(self, run_id: uuid.UUID, step_key: str) -> Step | None:
        with self.engine.connect() as conn:
            row = (
                conn.execute(Q["get_step_by_key"], {"id": run_id, "step_key": step_key})
                .mappings()
                .first()
            )
        return _step(row) if row else None

    def record_replayed(
        self, claim: Claim, step: NewStep, original: Step, *, hand_over: bool
    ) -> Dispatch | None:
        """Record a model step a fork answered from ``original`` (the source run's row) without
        calling the model: no tokens billed, what the original paid kept apart. With
        ``hand_over`` it is the task's step (the lease is handed on, as a checkpoint does);
        else a child step of a running durable step. Fenced."""
        token = uuid.uuid4() if hand_over else None
        with self.engine.begin() as conn:
            self._record(conn, claim, step, token)
            marked = (
                conn.execute(
                    Q["mark_step_origin"],
                    {
                        "id": claim.run_id,
                        "step_key": step.step_key,
                        "origin": str(StepOrigin.REPLAYED),
                        "original_tokens": (original.original_tokens or 0) + original.usage.total,
                        "original_cost_usd": (original.original_cost_usd or 0) + original.cost_usd,
                    },
                )
                .mappings()
                .one()
            )
        self.step_logs.wrote(claim.run_id, claim.epoch, [_step(marked)], token)
        return Dispatch(claim.run_id, token) if token is not None else None

    # -- the live stream's durable events -------------------------------------------------

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

    def run_event_seq(self, run_id: uuid.UUID) -> int | None:
        """The number of the run's last durable event; ``None`` when there is no such run."""
        with self._statement() as conn:
            value = conn.execute(Q["run_event_seq"], {"id": run_id}).scalar()
        return None if value is None else int(value)

    def run_event_seqs(self, run_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, int]:
        """The last durable event number of each run that exists, in one statement."""
        if not run_ids:
            return {}
        with self._statement() as conn:
            rows = conn.execute(Q["run_event_seqs"], {"ids": list(run_ids)}).all()
        return {r.id: int(r.event_seq) for r in rows}

    def wake(self, run_id: uuid.UUID, *, send: bool = True) -> Dispatch | None:
        """A run parked on something that has come (a concurrency-key slot, its child's end)
        goes now: the message to send, or ``None`` when it is not parked any more. With
        ``send`` false the reaper's next sweep sends it (the message returned is for
        information only)."""
        with self._statement() as conn:
            return _wake(conn, run_id, send=send)

    def mark_undispatched(self, dispatch: Dispatch) -> None:
        with self._statement() as conn:
            conn.execute(Q["mark_undispatched"], {"id": dispatch.run_id, "token": dispatch.token})

    # -- signals --------------------------------------------------------------------------

    def post_signal(
        self,
        run_id: uuid.UUID,
        name: str,
        payload: Any,
        *,
        idempotency_key: str | None = None,
        sent_by: str | None = None,
    ) -> tuple[int, bool, Dispatch | None]:
        """Keep a signal for the run until a step of it consumes it, and wake the run in the
        same transaction if it is parked (a poster that dies after the commit leaves no run
        asleep on a signal it has). Returns its id, whether it is new (a retried request
        with the same idempotency key: the first) and the run's message to send (``None``:
        not parked). Raises :class:`RunNotFound`, or :class:`InvalidTransition` when the run
        ended."""
        with self.engine.begin() as conn:
            signal_id, created = _insert_signal(
                conn, run_id, name, payload, idempotency_key, sent_by, None
            )
            woken = _wake(conn, run_id, send=True) if created else None
        return signal_id, created, woken

    def post_message(
        self,
        run_id: uuid.UUID,
        content: Any,
        *,
        idempotency_key: str | None = None,
        sent_by: str | None = None,
    ) -> tuple[int, bool, Dispatch | None]:
        """Keep a message for an agent-loop run until a step boundary delivers it. A
        SUCCEEDED run is queued again (its next turn). Returns the message's id, whether it
        is new (a retried request with the same key: the first, nothing counted again) and
        the drive_run message of a run queued again or woken from its parking (in the same
        transaction). :class:`RunNotFound`;
        :class:`InvalidTransition` for a run ended otherwise than SUCCEEDED."""
        with self.engine.begin() as conn:
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
            row = conn.execute(Q["insert_signal"], params).first()
            if row is None:
                seen = conn.execute(
                    Q["get_signal_by_key"], {"run_id": run_id, "idempotency_key": idempotency_key}
                ).one()
                return int(seen.id), False, None
            after = conn.execute(Q["message_arrived"], {"id": run_id}).one()
            reopened = run.status == RunStatus.SUCCEEDED
            # a run parked (a wait, a timer) is woken with the message's commit, not after it
            woken = None if reopened else _wake(conn, run_id, send=True)
        dispatch = Dispatch(after.id, after.dispatch_token) if reopened else woken
        return int(row.id), True, dispatch

    def deliver_message(self, claim: Claim, row_for: Callable[[Any], NewStep]) -> Dispatch | None:
        """Deliver the oldest pending message: consume it, count it delivered and record the
        step ``row_for(content)`` in one transaction, handing the lease on (never lost,
        never twice). ``None`` when there is none. Fenced."""
        token = uuid.uuid4()
        try:
            with self.engine.begin() as conn:
                params = {"run_id": claim.run_id, "name": MESSAGE_SIGNAL}
                found = conn.execute(Q["pending_signal"], params).first()
                if found is None:
                    return None
                step = row_for(found.payload)
                conn.execute(Q["consume_signal"], {"id": found.id, "step_key": step.step_key})
                conn.execute(Q["message_delivered"], {"id": claim.run_id})
                written = [self._record(conn, claim, step, token)]
        except LeaseLost:
            self.step_logs.forget(claim.run_id)
            raise
        self.step_logs.wrote(claim.run_id, claim.epoch, written, token)
        return Dispatch(claim.run_id, token)

    def wait_for_signal(
        self,
        claim: Claim,
        rows: list[NewStep],
        *,
        signal: str | None,
        delay_seconds: float,
        reason: str,
    ) -> Dispatch | None:
        """Record ``rows`` and park the run on a durable timer, unless a signal named
        ``signal`` is already there (then nothing is written and ``None`` returned: consume
        it). The check and the parking hold the run's row lock, so a signal that commits
        meanwhile either is seen here or finds the run parked and wakes it. Fenced."""
        token = uuid.uuid4()
        try:
            with self.engine.begin() as conn:
                if signal is not None:
                    conn.execute(Q["lock_run_row"], {"id": claim.run_id})
                    params = {"run_id": claim.run_id, "name": signal}
                    if conn.execute(Q["pending_signal"], params).first() is not None:
                        return None
                written = [self._record(conn, claim, step) for step in rows]
                # A wait is progress: a run that waits long is not a run that keeps killing
                # workers. A wait for a signal is woken by it; a sleep's timer is a floor.
                self._schedule(
                    conn, claim, delay_seconds, token, reason, True, 0, wakeable=signal is not None
                )
        except LeaseLost:
            self.step_logs.forget(claim.run_id)
            raise
        self.step_logs.wrote(claim.run_id, claim.epoch, written, token)
        return Dispatch(claim.run_id, token, delay_seconds)

    def consume_signal(
        self, claim: Claim, name: str, row_for: Callable[[Any], NewStep]
    ) -> tuple[Any, Dispatch] | None:
        """Consume the oldest pending signal ``name`` and record the step ``row_for(payload)``
        in one transaction, handing the lease on: the signal is delivered once. ``None``
        when there is none. Fenced."""
        token = uuid.uuid4()
        try:
            with self.engine.begin() as conn:
                params = {"run_id": claim.run_id, "name": name}
                found = conn.execute(Q["pending_signal"], params).first()
                if found is None:
                    return None
                step = row_for(found.payload)
                conn.execute(Q["consume_signal"], {"id": found.id, "step_key": step.step_key})
                written = [self._record(conn, claim, step, token)]
        except LeaseLost:
            self.step_logs.forget(claim.run_id)
            raise
        self.step_logs.wrote(claim.run_id, claim.epoch, written, token)
        return found.payload, Dispatch(claim.run_id, token)

    def send_signal(
        self,
        claim: Claim,
        step: NewStep,
        *,
        target: uuid.UUID,
        name: str,
        payload: Any,
        idempotency_key: str,
    ) -> tuple[Dispatch, Dispatch | None]:
        """``steps.send``: the signal for ``target``, the sender's step row and the wake of
        the target in one transaction (the key makes a second insert a no-op): exactly once,
        and a sender that dies after it never leaves the target asleep on a signal it has.
        Returns the sender's next message and the target's (``None``: it was not parked).
        Raises :class:`RunNotFound` (no such run in the sender's tenant) or
        :class:`InvalidTransition` (it ended), writing nothing. Fenced."""
        token = uuid.uuid4()
        try:
            with self.engine.begin() as conn:
                # Both rows locked in one order: two runs sending to each other at once
                # queue instead of deadlocking.
                conn.execute(Q["lock_runs_in_order"], {"ids": [claim.run_id, target]})
                _insert_signal(
                    conn, target, name, payload, idempotency_key, f"run:{claim.run_id}",
                    claim.run.tenant,
                )  # fmt: skip
                written = [self._record(conn, claim, step, token)]
                woken = _wake(conn, target, send=True)
        except LeaseLost:
            self.step_logs.forget(claim.run_id)
            raise
        self.step_logs.wrote(claim.run_id, claim.epoch, written, token)
        return Dispatch(claim.run_id, token), woken

    # -- schedules ------------------------------------------------------------------------

    def create_schedule(self, new: NewSchedule) -> Schedule:
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
            return _schedule(conn.execute(Q["insert_schedule"], params).mappings().one())

    def get_schedule(self, schedule_id: uuid.UUID) -> Schedule | None:
        with self._statement() as conn:
            row = conn.execute(Q["get_schedule"], {"id": schedule_id}).mappings().first()
        return None if row is None else _schedule(row)

    def list_schedules(self, *, tenant: str | None = None, limit: int = 1000) -> list[Schedule]:
        with self._statement() as conn:
            rows = conn.execute(Q["list_schedules"], {"tenant": tenant, "limit": limit})
            return [_schedule(r) for r in rows.mappings()]

    def delete_schedule(self, schedule_id: uuid.UUID) -> bool:
        with self.engine.begin() as conn:
            return conn.execute(Q["delete_schedule"], {"id": schedule_id}).first() is not None

    def schedule_ticks(self, schedule_id: uuid.UUID, *, limit: int = 20) -> list[ScheduleTick]:
        """The schedule's latest ticks, newest first."""
        with self._statement() as conn:
            rows = conn.execute(
                Q["list_schedule_ticks"], {"schedule_id": schedule_id, "limit": limit}
            ).mappings()
            return [
                ScheduleTick(
                    r["schedule_id"], r["tick_at"], r["status"], r["run_id"], r["created_at"]
                )
                for r in rows
            ]

    def due_schedules(self, *, limit: int = 100) -> list[uuid.UUID]:
        with self._statement() as conn:
            return [r.id for r in conn.execute(Q["due_schedules"], {"limit": limit})]

    def claim_schedule_ticks(
        self,
        schedule_id: uuid.UUID,
        plan: Callable[[Schedule, datetime], tuple[Sequence[datetime], datetime]],
    ) -> list[Dispatch]:
        """One pass over one due schedule, in one transaction: start its oldest queued tick
        when no run of it is live, then claim the ticks ``plan`` returns for the database's
        ``now`` (a unique row each: a tick another beat claimed is passed over) and apply
        the overlap policy to each, then move ``next_tick_at`` on. Returns the drive_run
        messages of the runs started, to send after the commit."""
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
                if queued is not None:
                    run_id = self.run_ids()
                    conn.execute(
                        Q["start_queued_tick"], {**key, "tick_at": queued, "run_id": run_id}
                    )
                    started.append(_start_scheduled_run(conn, schedule, run_id, self.deployment))
                    live = True
            ticks, next_tick_at = plan(schedule, row["db_now"])
            for tick_at in ticks:
                start = schedule.overlap == "allow" or not live
                status = (
                    "STARTED" if start else "QUEUED" if schedule.overlap == "queue" else "SKIPPED"
                )
                new_id = self.run_ids() if start else None
                claimed = conn.execute(
                    Q["insert_schedule_tick"],
                    {**key, "tick_at": tick_at, "status": status, "run_id": new_id},
                ).first()
                if claimed is not None and new_id is not None:
                    started.append(_start_scheduled_run(conn, schedule, new_id, self.deployment))
                    live = True
            if next_tick_at != schedule.next_tick_at:
                conn.execute(
                    Q["advance_schedule"], {"id": schedule.id, "next_tick_at": next_tick_at}
                )
        return started


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


def _start_scheduled_run(
    conn: Connection, schedule: Schedule, run_id: uuid.UUID, deployment: str | None
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
    return Dispatch(row["id"], row["dispatch_token"])


def _insert_signal(
    conn: Connection,
    run_id: uuid.UUID,
    name: str,
    payload: Any,
    idempotency_key: str | None,
    sent_by: str | None,
    tenant: str | None,
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
    row = conn.execute(Q["insert_signal"], params).first()
    if row is not None:
        return int(row.id), True
    seen = conn.execute(
        Q["get_signal_by_key"], {"run_id": run_id, "idempotency_key": idempotency_key}
    ).one()
    return int(seen.id), False


def _wake(conn: Connection, run_id: uuid.UUID, *, send: bool) -> Dispatch | None:
    row = conn.execute(Q["wake_run"], {"id": run_id, "send": send}).first()
    return None if row is None else Dispatch(row.id, row.dispatch_token)


def _cancel_children(conn: Connection, run_id: uuid.UUID) -> None:
    for child in conn.execute(Q["live_children"], {"id": run_id}).scalars().all():
        if conn.execute(Q["cancel_run"], {"id": child, **_COMPENSABLE}).first() is not None:
            conn.execute(Q["cancel_pending_approvals"], {"id": child})
            _cancel_children(conn, child)


P = ParamSpec("P")
R = TypeVar("R")


def _translating(method: Callable[P, R]) -> Callable[P, R]:
    """``method`` raising :class:`DatabaseUnavailable` (from the driver's error) when the
    database is away, :class:`ValueRefused` when it refused a value; every other error as
    it is."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except (DatabaseUnavailable, ValueRefused):
            raise
        except DataError as e:  # bad data, refused every time: not worth a retry
            raise ValueRefused.from_error(e) from e
        except Exception as e:
            if database_unavailable(e):
                raise DatabaseUnavailable.from_error(e) from e
            raise

    return call


# Database errors are translated once, here: every public method of the store raises
# DatabaseUnavailable when the database is away and ValueRefused when it refused a value, so
# the engine and the API above never classify a driver's exception.
for _name, _member in list(vars(RunStore).items()):
    if not _name.startswith("_") and inspect.isfunction(_member):
        setattr(RunStore, _name, _translating(_member))
