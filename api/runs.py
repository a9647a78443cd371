"""``/api/runs``: submit, list, inspect, timeline, cancel."""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from datetime import datetime

from flask import Blueprint, Response, jsonify, request, url_for

from api.auth import current_principal, requires
from api.errors import ApiError, invalid
from api.serialize import run_json, step_json
from api.state import state
from api.validation import json_body, parse_submission
from db.errors import IdempotencyConflict, InvalidTransition, RunNotFound
from db.records import Dispatch, NewRun, RunStatus
from tasks.dispatch import send_drive

bp = Blueprint("runs", __name__)


def parse_run_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise ApiError(
            404, f"no run with id {raw!r} (run ids are UUIDs)", code="not_found"
        ) from None


def _cursor(created: datetime, run_id: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(f"{created.isoformat()}|{run_id}".encode()).decode()


def _parse_cursor(raw: str) -> tuple[datetime, uuid.UUID]:
    try:
        created, rid = base64.urlsafe_b64decode(raw.encode()).decode().split("|")
        return datetime.fromisoformat(created), uuid.UUID(rid)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise invalid("cursor", "is not a cursor this API returned (use nextCursor)") from None


@bp.post("/runs")
@requires("submit")
def submit() -> tuple[Response, int, dict[str, str]]:
    s = state()
    settings = s.runtime.settings
    body = json_body(request)
    sub = parse_submission(body, settings, s.runtime.agents)
    principal = current_principal()
    if principal is not None and settings.submit_rate_per_minute:
        recent, oldest_age = s.runtime.store.recent_submits(principal.name, 60)
        if recent >= settings.submit_rate_per_minute:
            wait = max(1, int(60 - oldest_age) + 1)
            raise ApiError(
                429,
                f"token {principal.name!r} submitted {recent} runs in the last minute; the "
                f"limit is {settings.submit_rate_per_minute} (DAR_SUBMIT_RATE_PER_MINUTE)",
                code="rate_limited",
                headers={"Retry-After": str(wait)},
            )
    key = request.headers.get("Idempotency-Key")
    if key is not None and not (0 < len(key) <= 200):
        raise invalid("Idempotency-Key", "must be 1 to 200 characters")
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
            )
        )
    except IdempotencyConflict as e:
        raise ApiError(422, str(e), code="idempotency_key_reused") from None
    if created:
        # After the commit: a broker outage leaves the run stored and marked for the reaper.
        send_drive(s.celery, s.runtime.store, Dispatch(run.id, run.dispatch_token))
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
    before = _parse_cursor(raw_cursor) if raw_cursor else None
    runs = s.runtime.store.list_runs(status=status, limit=limit + 1, before=before)
    page = runs[:limit]
    next_cursor = _cursor(page[-1].created_at, page[-1].id) if len(runs) > limit else None
    return jsonify({"items": [run_json(r) for r in page], "nextCursor": next_cursor})


@bp.get("/runs/<run_id>")
@requires("read")
def get_run(run_id: str) -> Response:
    try:
        return jsonify(run_json(state().runtime.store.get_run(parse_run_id(run_id))))
    except RunNotFound as e:
        raise ApiError(404, str(e), code="not_found") from None


@bp.get("/runs/<run_id>/timeline")
@requires("read")
def timeline(run_id: str) -> Response:
    store = state().runtime.store
    rid = parse_run_id(run_id)
    try:
        store.get_run(rid)
    except RunNotFound as e:
        raise ApiError(404, str(e), code="not_found") from None
    return jsonify([step_json(s) for s in store.steps(rid)])


RESOLVE_ACTIONS = ("supply_result", "retry", "fail")


@bp.post("/runs/<run_id>/resolve")
@requires("admin")
def resolve(run_id: str) -> tuple[Response, int]:
    """An operator's decision on a run that stopped NEEDS_ATTENTION."""
    s = state()
    rid = parse_run_id(run_id)
    body = json_body(request)
    unknown = sorted(set(body) - {"action", "output", "isError", "reason"})
    if unknown:
        raise invalid(unknown[0], "unknown field; allowed: action, output, isError, reason")
    action = body.get("action")
    if action not in RESOLVE_ACTIONS:
        raise invalid("action", f"must be one of {', '.join(RESOLVE_ACTIONS)}")
    if action == "supply_result" and "output" not in body:
        raise invalid("output", "is required with supply_result: the tool's result")
    is_error = body.get("isError", False)
    if not isinstance(is_error, bool):
        raise invalid("isError", "must be true or false")
    reason = body.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise invalid("reason", "must be a string")
    output = body.get("output")
    try:
        dispatch = s.runtime.store.resolve(
            rid,
            action,
            output=output if isinstance(output, str) or output is None else json.dumps(output),
            is_error=is_error,
            reason=reason,
        )
    except InvalidTransition:
        try:
            run = s.runtime.store.get_run(rid)
        except RunNotFound as e:
            raise ApiError(404, str(e), code="not_found") from None
        raise ApiError(
            409,
            f"run {rid} is {run.status}, not NEEDS_ATTENTION: there is nothing to resolve",
            code="not_waiting_for_operator",
        ) from None
    if dispatch is not None:
        send_drive(s.celery, s.runtime.store, dispatch)
    run = s.runtime.store.get_run(rid)
    return jsonify({"id": str(rid), "status": str(run.status)}), 200


@bp.post("/runs/<run_id>/resume")
@requires("submit")
def resume(run_id: str) -> tuple[Response, int]:
    """Retry a FAILED or TIMED_OUT run from its first step without a result."""
    s = state()
    rid = parse_run_id(run_id)
    body = json_body(request) if request.get_data() else {}
    unknown = sorted(set(body) - {"tokenBudget", "timeoutSeconds"})
    if unknown:
        raise invalid(unknown[0], "unknown field; allowed: tokenBudget, timeoutSeconds")
    settings = s.runtime.settings
    budget = body.get("tokenBudget")
    if budget is not None and (
        isinstance(budget, bool)
        or not isinstance(budget, int)
        or not 1 <= budget <= settings.max_token_budget
    ):
        raise invalid(
            "tokenBudget", f"must be a whole number from 1 to {settings.max_token_budget}"
        )
    timeout = body.get("timeoutSeconds")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int)
        or not 1 <= timeout <= settings.max_timeout_seconds
    ):
        raise invalid(
            "timeoutSeconds", f"must be a whole number from 1 to {settings.max_timeout_seconds}"
        )
    try:
        s.runtime.store.get_run(rid)  # 404 for an unknown run
    except RunNotFound as e:
        raise ApiError(404, str(e), code="not_found") from None
    try:
        dispatch = s.runtime.store.resume_failed(
            rid,
            token_budget=budget,
            timeout_seconds=timeout,
            default_timeout_seconds=settings.default_timeout_seconds,
        )
    except InvalidTransition as e:
        raise ApiError(409, str(e), code="not_resumable") from None
    send_drive(s.celery, s.runtime.store, dispatch)
    return jsonify({"id": str(rid), "status": "RUNNING"}), 202


@bp.post("/runs/<run_id>/cancel")
@requires("cancel")
def cancel(run_id: str) -> tuple[Response, int]:
    store = state().runtime.store
    rid = parse_run_id(run_id)
    status = store.cancel(rid)
    if status is None:
        try:
            run = store.get_run(rid)
        except RunNotFound as e:
            raise ApiError(404, str(e), code="not_found") from None
        raise ApiError(
            409,
            f"run {rid} has already finished ({run.status}); only QUEUED, RUNNING or "
            "NEEDS_ATTENTION runs can be cancelled",
            code="already_finished",
        )
    return jsonify({"id": str(rid), "status": str(status), "cancelRequested": True}), 202
