"""``/api/runs``: submit, list, inspect, timeline, cancel."""

from __future__ import annotations

import json
import math
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from flask import Blueprint, Response, jsonify, request, url_for

from api.auth import actor, current_principal, requires, tenant_scope
from api.conversation import conversation_json
from api.errors import ApiError, invalid
from api.schemas import (
    CURSOR_PATTERN,
    ID_PREFIX_PATTERN,
    MAX_AGENT_CHARS,
    TREE_MAX_DEPTH,
    TREE_MAX_NODES,
    resolution_schema,
    resume_schema,
    validate,
)
from api.serialize import audit_json, run_json, timeline_json
from api.state import state
from api.validation import (
    idempotency_key,
    json_body,
    optional_json_body,
    parse_submission,
    whole,
)
from db.errors import IdempotencyConflict, InvalidTransition, QuotaExceeded, RunNotFound
from db.records import Dispatch, NewAudit, NewRun, Run, RunStatus
from db.store import SendLimits, SubmitQuota
from runtime.config import Settings
from tasks.dispatch import send_drive

bp = Blueprint("runs", __name__)


def parse_run_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise ApiError(
            404, f"no run with id {raw!r} (run ids are UUIDs)", code="not_found"
        ) from None


def load_run(run_id: uuid.UUID) -> Run:
    """The run, if the request's tenant may see it; 404 otherwise (another tenant's run is
    indistinguishable from no run)."""
    try:
        run = state().runtime.store.get_run(run_id)
    except RunNotFound as e:
        raise ApiError(404, str(e), code="not_found") from None
    scope = tenant_scope()
    if scope is not None and run.tenant != scope:
        raise ApiError(404, f"no run with id {run_id}", code="not_found")
    return run


def audit(action: str, detail: object = None, approval_id: uuid.UUID | None = None) -> NewAudit:
    name, tenant = actor()
    return NewAudit(
        actor=name, action=action, tenant=tenant, detail=detail, approval_id=approval_id
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _cursor(created: datetime, run_id: uuid.UUID) -> str:
    return f"{(created - _EPOCH) // timedelta(microseconds=1)}.{run_id.hex}"


def _parse_cursor(raw: str) -> tuple[datetime, uuid.UUID]:
    if not re.fullmatch(CURSOR_PATTERN, raw):
        raise invalid("cursor", "is not a cursor this API returned (use nextCursor)")
    micros, rid = raw.split(".")
    return _EPOCH + timedelta(microseconds=int(micros)), uuid.UUID(hex=rid)


def submit_quota(settings: Settings) -> SubmitQuota:
    return SubmitQuota(settings.submit_rate_per_minute, settings.token_max_active_runs)


def send_limits(settings: Settings, authenticated: bool) -> SendLimits:
    """A token's messages and signals: its rate (with tokens configured) and each run's cap
    on what it holds undelivered (always)."""
    return SendLimits(
        settings.message_rate_per_minute if authenticated else 0, settings.max_pending_per_run
    )


def check_priority(priority: int, settings: Settings) -> None:
    """403 when a token without ``admin`` gives (or, for a schedule, deletes) a priority
    above ``DAR_TOKEN_MAX_PRIORITY``."""
    principal = current_principal()
    if principal is not None and not principal.admin and priority > settings.token_max_priority:
        raise ApiError(
            403,
            f"priority: {priority} is above {settings.token_max_priority}, the highest a "
            "token without the admin role may give (DAR_TOKEN_MAX_PRIORITY)",
            code="forbidden",
            field="priority",
        )


def rate_limited(e: QuotaExceeded) -> ApiError:
    return ApiError(
        429, str(e), code="rate_limited", headers={"Retry-After": str(math.ceil(e.retry_after))}
    )


def key_reused(e: IdempotencyConflict) -> ApiError:
    return ApiError(422, str(e), code="idempotency_key_reused")


@bp.post("/runs")
@requires("submit")
def submit() -> tuple[Response, int, dict[str, str]]:
    s = state()
    settings = s.runtime.settings
    body = json_body(request, limit_input=settings.max_input_chars)
    sub = parse_submission(body, settings, s.runtime.agents)
    principal = current_principal()
    check_priority(sub.priority, settings)
    key = idempotency_key(request)
    try:
        run, created = s.runtime.store.create_run(
            NewRun(
                agent=sub.agent,
                input=sub.input,
                model=sub.model,
                max_steps=sub.max_steps,
                token_budget=sub.token_budget,
                timeout_seconds=sub.timeout_seconds,
                cost_budget_usd=sub.cost_budget_usd,
                idempotency_key=key,
                request_hash=sub.request_hash,
                submitted_by=principal.name if principal else None,
                tenant=principal.tenant if principal else "",
                concurrency_key=sub.concurrency_key,
                priority=sub.priority,
            ),
            quota=submit_quota(settings) if principal is not None else None,
            audit=audit(
                "submit",
                {
                    "agent": sub.agent,
                    "model": sub.model,
                    "tokenBudget": sub.token_budget,
                    **({"idempotencyKey": key} if key else {}),
                },
            ),
        )
    except QuotaExceeded as e:
        raise rate_limited(e) from None
    except IdempotencyConflict as e:
        raise key_reused(e) from None
    if created:
        # After the commit: a broker outage leaves the run stored and marked for the reaper.
        dispatch = Dispatch(run.id, run.dispatch_token)
        send_drive(s.celery, s.runtime.store, dispatch, deployment=run.deployment)
    location = url_for("runs.get_run", run_id=str(run.id))
    return (
        jsonify({"id": str(run.id), "status": str(run.status)}),
        201 if created else 200,
        {"Location": location},
    )


@bp.get("/runs")
@requires("read")
def list_runs() -> Response:
    s = state()
    status = request.args.get("status")
    if status is not None and status not in RunStatus.__members__:
        raise invalid("status", f"must be one of {', '.join(RunStatus)}; got {status!r}")
    raw_limit = request.args.get("limit", "50")
    max_page = s.runtime.settings.max_page_size
    if not (raw_limit.isascii() and raw_limit.isdigit()) or not 1 <= int(raw_limit) <= max_page:
        raise invalid("limit", f"must be a whole number from 1 to {max_page} (DAR_MAX_PAGE_SIZE)")
    limit = int(raw_limit)
    raw_cursor = request.args.get("cursor")
    before = _parse_cursor(raw_cursor) if raw_cursor is not None else None
    id_prefix = request.args.get("idPrefix")
    if id_prefix is not None and not re.fullmatch(ID_PREFIX_PATTERN, id_prefix):
        raise invalid("idPrefix", "must be 1 to 36 hex digits or dashes: the start of a run id")
    runs = s.runtime.store.list_runs(
        status=status,
        limit=limit + 1,
        before=before,
        tenant=tenant_scope(),
        agent=_agent_filter(),
        id_prefix=id_prefix.lower() if id_prefix else None,
    )
    page = runs[:limit]
    next_cursor = _cursor(page[-1].created_at, page[-1].id) if len(runs) > limit else None
    steps = s.runtime.store.step_counts(r.id for r in page)
    return jsonify(
        {
            # No input: a page of 200 runs' inputs could be 20 MB; GET /api/runs/{id} has it.
            "items": [
                {**run_json(r, with_input=False), "stepCount": steps.get(r.id, 0)} for r in page
            ],
            "nextCursor": next_cursor,
        }
    )


def _agent_filter() -> str | None:
    agent = request.args.get("agent")
    if agent is not None and len(agent) > MAX_AGENT_CHARS:
        raise invalid("agent", f"must be at most {MAX_AGENT_CHARS} characters")
    return agent


@bp.get("/runs/counts")
@requires("read")
def counts() -> Response:
    """Runs by status (every status, zeros included), for the request's tenant and
    optionally one agent."""
    found = state().runtime.store.count_runs(tenant=tenant_scope(), agent=_agent_filter())
    return jsonify({"counts": {str(st): found.get(str(st), 0) for st in RunStatus}})


@bp.get("/runs/<run_id>")
@requires("read")
def get_run(run_id: str) -> Response:
    run = load_run(parse_run_id(run_id))
    store = state().runtime.store
    events = store.audit_events(run.id)
    children = [
        {
            "id": str(c["id"]),
            "agent": c["agent"],
            "status": c["status"],
            "tokensUsed": c["tokens_used"],
            "costUsd": float(c["cost_usd"]),
        }
        for c in store.children(run.id)
    ]
    return jsonify(
        {**run_json(run), "children": children, "audit": [audit_json(e) for e in events]}
    )


@bp.get("/runs/<run_id>/tree")
@requires("read")
def tree(run_id: str) -> Response:
    """The whole tree of child runs the run belongs to, from its root down: each run with its
    agent, status, tokens and cost, in order (a run, then its children's subtrees, oldest
    first). Bounded: the first ``TREE_MAX_NODES`` runs breadth-first from the root, at most
    ``TREE_MAX_DEPTH`` levels, plus the run itself and its ancestors whatever the cap;
    ``truncated`` says whether anything was left out (each run's ``childCount`` against the
    children listed says where)."""
    run = load_run(parse_run_id(run_id))
    rows = state().runtime.store.run_tree(
        run.id, run.tenant, max_nodes=TREE_MAX_NODES, max_depth=TREE_MAX_DEPTH
    )
    if not rows:  # removed since (retention)
        raise ApiError(404, f"no run with id {run.id}", code="not_found")
    return jsonify(tree_json(run.id, rows))


def tree_json(run_id: uuid.UUID, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``GET /api/runs/{id}/tree``'s answer from :meth:`RunStore.run_tree`'s rows: the walk
    cut at ``TREE_MAX_NODES`` (the run and its ancestors kept), in depth-first order."""
    kept = [r for r in rows if r["on_path"] or r["n"] <= TREE_MAX_NODES]
    cut = len(kept) < len(rows)
    ids = {r["id"] for r in kept}
    top = next(r for r in kept if r["is_top"])
    by_parent: dict[uuid.UUID, list[dict[str, Any]]] = {}
    for r in kept:
        if r is not top and r["parent_run_id"] in ids:
            by_parent.setdefault(r["parent_run_id"], []).append(r)
    nodes: list[dict[str, Any]] = []
    stack = [(top, 0)]
    while stack:
        r, depth = stack.pop()
        kids = sorted(by_parent.get(r["id"], []), key=lambda k: (k["created_at"], k["id"]))
        cut = cut or r["child_count"] > len(kids)
        nodes.append(
            {
                "id": str(r["id"]),
                "parentRunId": str(r["parent_run_id"]) if r["parent_run_id"] else None,
                "agent": r["agent"],
                "status": r["status"],
                "tokensUsed": r["tokens_used"],
                "costUsd": float(r["cost_usd"]),
                "createdAt": r["created_at"].isoformat(),
                "depth": depth,
                "childCount": r["child_count"],
            }
        )
        stack.extend((k, depth + 1) for k in reversed(kids))
    return {
        "runId": str(run_id),
        "rootId": str(top["id"]),
        "nodes": nodes,
        # a root with a parent: the tree goes up further than TREE_MAX_DEPTH parents
        "truncated": cut or top["parent_run_id"] is not None,
        "maxNodes": TREE_MAX_NODES,
        "maxDepth": TREE_MAX_DEPTH,
    }


@bp.get("/runs/<run_id>/timeline")
@requires("read")
def timeline(run_id: str) -> Response:
    """The steps in order, with the audit trail's entries (kind ``AUDIT``) placed by time."""
    store = state().runtime.store
    run = load_run(parse_run_id(run_id))
    children: dict[str, str] = {}
    # A fork's copied child steps point at the children its original started.
    for parent in (run.forked_from_run, run.id):
        if parent is None:
            continue
        prefix = f"child:{parent}/"
        for c in store.children(parent):
            key = c.get("idempotency_key") or ""
            if key.startswith(prefix):  # a step's child started again: "<key>#<attempt>"
                children[key.removeprefix(prefix).split("#", 1)[0]] = str(c["id"])
    return jsonify(timeline_json(store.steps(run.id), store.audit_events(run.id), children))


@bp.get("/runs/<run_id>/conversation")
@requires("read")
def conversation(run_id: str) -> Response:
    """What was said and done, readably: input, assistant text, tool calls and results,
    durable steps' results, errors."""
    store = state().runtime.store
    run = load_run(parse_run_id(run_id))
    return jsonify(conversation_json(run, store.steps(run.id)))


@bp.post("/runs/<run_id>/resolve")
@requires("admin")
def resolve(run_id: str) -> tuple[Response, int]:
    """An operator's decision on a run that stopped NEEDS_ATTENTION."""
    s = state()
    rid = parse_run_id(run_id)
    body = json_body(request)
    validate(body, resolution_schema())
    action = body["action"]
    is_error = bool(body.get("isError", False))
    reason = body.get("reason")
    output = body.get("output")
    load_run(rid)
    try:
        dispatch = s.runtime.store.resolve(
            rid,
            action,
            output=output if isinstance(output, str) or output is None else json.dumps(output),
            is_error=is_error,
            reason=reason,
            operator=principal.name if (principal := current_principal()) else "operator",
            audit=audit(
                "resolve",
                {"action": action, "isError": is_error, **({"reason": reason} if reason else {})},
            ),
        )
    except InvalidTransition:
        run = load_run(rid)
        raise ApiError(
            409,
            f"run {rid} is {run.status}, not NEEDS_ATTENTION: there is nothing to resolve",
            code="not_waiting_for_operator",
        ) from None
    if dispatch is not None:
        send_drive(s.celery, s.runtime.store, dispatch)
    run = s.runtime.store.get_run(rid)
    return jsonify({"id": str(rid), "status": str(run.status)}), 200


def check_run_limits(run: Run, budget: int | None, timeout: int | None, doing: str) -> int:
    """A token without ``admin`` stays within the run's own limits when it resumes or forks
    it: no larger token budget, no longer timeout (403 naming the field). Returns the
    timeout the run was given, in seconds."""
    principal = current_principal()
    admin = principal is None or principal.admin
    granted = run.timeout_seconds or max(
        1, math.ceil((run.deadline_at - run.created_at).total_seconds())
    )
    if not admin and budget is not None and budget > run.token_budget:
        raise ApiError(
            403,
            f"tokenBudget: {doing} a run with a token budget above its own "
            f"({run.token_budget}; asked {budget}) needs the admin role",
            code="forbidden",
            field="tokenBudget",
        )
    if not admin and timeout is not None and timeout > granted:
        raise ApiError(
            403,
            f"timeoutSeconds: {doing} a run with a timeout longer than it was given "
            f"({granted} s) needs the admin role",
            code="forbidden",
            field="timeoutSeconds",
        )
    return granted


@bp.post("/runs/<run_id>/resume")
@requires("submit")
def resume(run_id: str) -> tuple[Response, int]:
    """Retry a FAILED or TIMED_OUT run from its first step without a result.

    Within the run's own limits (a token budget no larger than it has, a timeout no longer
    than it was given) its tenant's ``submit`` tokens may resume it; more needs ``admin``.
    """
    s = state()
    rid = parse_run_id(run_id)
    body = optional_json_body(request)
    validate(body, resume_schema(s.runtime.settings))
    settings = s.runtime.settings
    budget = whole(body.get("tokenBudget"))
    timeout = whole(body.get("timeoutSeconds"))
    run = load_run(rid)
    principal = current_principal()
    admin = principal is None or principal.admin
    granted = check_run_limits(run, budget, timeout, "resuming")
    # A deadline already past (by the database's clock) would stop it at once: the store
    # gives it the default again, within the run's own limit.
    fresh_timeout = (
        settings.default_timeout_seconds
        if admin
        else min(settings.default_timeout_seconds, granted)
    )
    detail = {k: v for k, v in (("tokenBudget", budget), ("timeoutSeconds", timeout)) if v}
    try:
        dispatch = s.runtime.store.resume_failed(
            rid,
            token_budget=budget,
            timeout_seconds=timeout,
            default_timeout_seconds=fresh_timeout,
            audit=audit("resume", detail or None),
            quota=submit_quota(settings) if principal is not None else None,
        )
    except QuotaExceeded as e:
        raise rate_limited(e) from None
    except InvalidTransition as e:
        raise ApiError(409, str(e), code="not_resumable") from None
    send_drive(s.celery, s.runtime.store, dispatch)
    return jsonify({"id": str(rid), "status": "RUNNING"}), 202


@bp.post("/runs/<run_id>/cancel")
@requires("cancel")
def cancel(run_id: str) -> tuple[Response, int]:
    store = state().runtime.store
    rid = parse_run_id(run_id)
    load_run(rid)
    wakes: list[Dispatch] = []  # a parent waiting for the run, woken with the cancel
    status = store.cancel(rid, audit=audit("cancel"), wakes=wakes)
    for woken in wakes:
        send_drive(state().celery, store, woken)
    live = state().runtime.live
    if status is not None and live is not None:  # a model call in flight stops within ~1 s
        live.request_cancel(rid)
    if status is None:
        run = load_run(rid)
        raise ApiError(
            409,
            f"run {rid} has already finished ({run.status}); only QUEUED, RUNNING or "
            "NEEDS_ATTENTION runs can be cancelled",
            code="already_finished",
        )
    return jsonify({"id": str(rid), "status": str(status), "cancelRequested": True}), 202
