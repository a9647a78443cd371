"""Runs and steps as the REST API shows them (camelCase, ISO times, no request bodies)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from db.records import (
    Approval,
    AuditEvent,
    Run,
    Schedule,
    ScheduleTick,
    Stats,
    Step,
    StepKind,
)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def run_json(run: Run, *, with_input: bool = True) -> dict[str, Any]:
    return {
        "id": str(run.id),
        "agent": run.agent,
        "status": str(run.status),
        **({"input": run.input} if with_input else {}),
        "model": run.model,
        "maxSteps": run.max_steps,
        "tokenBudget": run.token_budget,
        "tokensUsed": run.tokens_used,
        "inputTokens": run.usage.input_tokens,
        "outputTokens": run.usage.output_tokens,
        "cacheCreationInputTokens": run.usage.cache_creation_input_tokens,
        "cacheReadInputTokens": run.usage.cache_read_input_tokens,
        "costUsd": float(run.cost_usd),
        "costBudgetUsd": float(run.cost_budget_usd) if run.cost_budget_usd is not None else None,
        "unrecordedTokens": run.unrecorded_tokens,
        "unrecordedEstimatedTokens": run.unrecorded_estimated_tokens,
        "unrecordedCostUsd": float(run.unrecorded_cost_usd),
        "waitReason": run.wait_reason,
        "concurrencyKey": run.concurrency_key,
        "priority": run.priority,
        "cancelRequested": run.cancel_requested,
        "result": run.result,
        "error": run.error,
        "submittedBy": run.submitted_by,
        "tenant": run.tenant,
        "deadlineAt": _iso(run.deadline_at),
        "runAt": _iso(run.run_at),
        "lockedBy": run.locked_by,
        "leaseExpiresAt": _iso(run.locked_until),
        "createdAt": _iso(run.created_at),
        "updatedAt": _iso(run.updated_at),
        "finishedAt": _iso(run.finished_at),
        "forkedFrom": forked_from_json(run),
        "scheduleId": str(run.schedule_id) if run.schedule_id else None,
        "parentRunId": str(run.parent_run_id) if run.parent_run_id else None,
        "deployment": run.deployment,
    }


def schedule_json(schedule: Schedule) -> dict[str, Any]:
    return {
        "id": str(schedule.id),
        "agent": schedule.agent,
        "input": schedule.input,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "overlap": schedule.overlap,
        "catchUp": schedule.catch_up,
        "nextTickAt": _iso(schedule.next_tick_at),
        "model": schedule.model,
        "maxSteps": schedule.max_steps,
        "tokenBudget": schedule.token_budget,
        "timeoutSeconds": schedule.timeout_seconds,
        "costBudgetUsd": (
            float(schedule.cost_budget_usd) if schedule.cost_budget_usd is not None else None
        ),
        "priority": schedule.priority,
        "tenant": schedule.tenant,
        "createdBy": schedule.created_by,
        "createdAt": _iso(schedule.created_at),
    }


def tick_json(tick: ScheduleTick) -> dict[str, Any]:
    return {
        "tickAt": _iso(tick.tick_at),
        "status": tick.status,
        "runId": str(tick.run_id) if tick.run_id else None,
        "reason": tick.reason,
    }


def forked_from_json(run: Run) -> dict[str, Any] | None:
    if run.forked_from_seq is None:
        return None
    return {
        "runId": str(run.forked_from_run) if run.forked_from_run else None,
        "seq": run.forked_from_seq,
        "replayModel": run.replay_model,
    }


def step_json(step: Step) -> dict[str, Any]:
    return {
        "seq": step.seq,
        "stepKey": step.step_key,
        "kind": str(step.kind),
        "status": str(step.status),
        "toolName": step.tool_name,
        "toolUseId": step.tool_use_id,
        "model": step.model,
        "stopReason": step.stop_reason,
        "inputTokens": step.usage.input_tokens,
        "outputTokens": step.usage.output_tokens,
        "cacheCreationInputTokens": step.usage.cache_creation_input_tokens,
        "cacheReadInputTokens": step.usage.cache_read_input_tokens,
        "costUsd": float(step.cost_usd),
        "latencyMs": step.latency_ms,
        "requestId": step.request_id,
        "error": step.error,
        "resolution": step.resolution,
        "attempt": step.attempt,
        "worker": step.worker,
        "startedAt": _iso(step.started_at),
        "finishedAt": _iso(step.finished_at),
        # A fork's step it did not execute (copied, edited, replayed): it billed nothing,
        # and what the original paid for it is shown apart.
        "origin": str(step.origin) if step.origin else None,
        "originalTokens": step.original_tokens if step.origin else None,
        "originalCostUsd": (
            float(step.original_cost_usd)
            if step.origin and step.original_cost_usd is not None
            else None
        ),
    }


def approval_json(a: Approval) -> dict[str, Any]:
    return {
        "id": str(a.id),
        "runId": str(a.run_id),
        "stepKey": a.step_key,
        "role": a.role,
        "status": str(a.status),
        "payload": a.payload,
        "payloadHash": a.payload_hash,
        "timeoutPolicy": a.timeout_policy,
        "requestedAt": _iso(a.requested_at),
        "expiresAt": _iso(a.expires_at),
        "decidedBy": a.decided_by,
        "decidedAt": _iso(a.decided_at),
        "comment": a.comment,
        "copiedFrom": str(a.copied_from) if a.copied_from else None,
    }


def audit_json(e: AuditEvent) -> dict[str, Any]:
    return {
        "at": _iso(e.at),
        "actor": e.actor,
        "action": e.action,
        "approvalId": str(e.approval_id) if e.approval_id else None,
        "detail": e.detail,
    }


def _audit_entry(e: AuditEvent) -> dict[str, Any]:
    """An audit event as a timeline entry: a step's fields (so readers of steps keep working)
    with kind ``AUDIT``, no seq, and who did what."""
    at = _iso(e.at)
    return {
        "seq": None,
        "stepKey": f"audit:{e.action}",
        "kind": "AUDIT",
        "status": "DONE",
        "toolName": None,
        "toolUseId": None,
        "model": None,
        "stopReason": None,
        "inputTokens": 0,
        "outputTokens": 0,
        "cacheCreationInputTokens": 0,
        "cacheReadInputTokens": 0,
        "costUsd": 0.0,
        "latencyMs": None,
        "requestId": None,
        "error": None,
        "resolution": None,
        "attempt": 0,
        "worker": None,
        "startedAt": at,
        "finishedAt": at,
        "origin": None,
        "originalTokens": None,
        "originalCostUsd": None,
        "actor": e.actor,
        "action": e.action,
        "detail": e.detail,
    }


def timeline_json(
    steps: list[Step],
    events: list[AuditEvent],
    children: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Steps in seq order; each audit event goes before the first step that started after
    it. The submit is not repeated here: the run's ``createdAt`` and ``submittedBy`` say it
    (``GET /api/runs/{id}``'s ``audit`` has it). ``children``: the child run each step key
    started (``steps.child``, a sub-agent), shown as the step's ``childRunId``."""
    out: list[dict[str, Any]] = []
    pending = sorted((e for e in events if e.action != "submit"), key=lambda e: (e.at, e.id))
    children = children or {}
    for step in steps:
        while pending and pending[0].at < step.started_at:
            out.append(_audit_entry(pending.pop(0)))
        entry = step_json(step)
        if step.kind is StepKind.CHILD:
            entry["childRunId"] = children.get(step.step_key)
        out.append(entry)
    out.extend(_audit_entry(e) for e in pending)
    return out


def stats_json(stats: Stats) -> dict[str, Any]:
    return {
        "finished": [{"at": _iso(c.at), "status": c.status, "count": c.n} for c in stats.finished],
        "cost": [{"at": _iso(c.at), "model": c.model, "usd": float(c.usd)} for c in stats.cost],
        "latency": [
            {"at": _iso(c.at), "kind": c.kind, "p50Ms": c.p50_ms, "p95Ms": c.p95_ms, "count": c.n}
            for c in stats.latency
        ],
    }
