"""``/api/schedules``: start an agent on a cron expression; list, inspect, delete."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from flask import Blueprint, Response, jsonify, request, url_for

from api.auth import Principal, current_principal, requires, tenant_scope
from api.errors import ApiError
from api.runs import audit, check_priority, rate_limited, submit_quota
from api.schemas import schedule_schema, validate
from api.serialize import audit_json, schedule_json, tick_json
from api.state import ApiState, state
from api.validation import Submission, json_body, parse_submission
from db.errors import QuotaExceeded
from db.records import NewSchedule, Schedule
from runtime.agents import Agent
from runtime.config import Settings
from runtime.engine.schedules import Cron, ScheduleError, parse_cron, shortest_gap

bp = Blueprint("schedules", __name__)

SCHEDULE_FIELDS = ("cron", "timezone", "overlap", "catchUp")
RECENT_TICKS = 20


def _load(raw: str) -> Schedule:
    try:
        schedule_id = uuid.UUID(raw)
    except ValueError:
        raise ApiError(
            404, f"no schedule with id {raw!r} (schedule ids are UUIDs)", code="not_found"
        ) from None
    schedule = state().runtime.store.get_schedule(schedule_id)
    scope = tenant_scope()
    if schedule is None or (scope is not None and schedule.tenant != scope):
        raise ApiError(404, f"no schedule with id {schedule_id}", code="not_found")
    return schedule


@bp.post("/schedules")
@requires("submit")
def create_schedule() -> tuple[Response, int, dict[str, str]]:
    s = state()
    settings = s.runtime.settings
    body: dict[str, Any] = json_body(request, limit_input=settings.max_input_chars)
    agents = s.runtime.agents
    names = agents.names()
    durable = any(not isinstance(agents.get(n), Agent) for n in names)
    validate(body, schedule_schema(settings, names, any_json_input=durable))
    timezone = body.get("timezone", "UTC")
    try:
        cron = parse_cron(body["cron"], timezone)
    except ScheduleError as e:  # the right shape, but no zone or no tick: 422
        field = "timezone" if str(e).startswith("timezone") else "cron"
        raise ApiError(422, str(e), code="invalid_schedule", field=field) from None
    sub = parse_submission(
        {k: v for k, v in body.items() if k not in SCHEDULE_FIELDS}, settings, agents
    )
    principal = current_principal()
    # A schedule is a standing submit: its creator's priority cap, frequency cap, quota and
    # number of schedules, checked now; each of its runs is checked again at its tick.
    check_priority(sub.priority, settings)
    if principal is not None and not principal.admin:
        gap = shortest_gap(cron, datetime.now(UTC))
        least = settings.schedule_min_interval_seconds
        if least and gap.total_seconds() < least:
            raise ApiError(
                400,
                f"cron {cron.expression!r} ticks {gap.total_seconds():g} s apart; a token "
                f"without the admin role may tick at most every {least} s "
                "(DAR_SCHEDULE_MIN_INTERVAL_SECONDS)",
                code="invalid_field",
                field="cron",
            )
    try:
        schedule = _create(s, settings, body, sub, cron, principal)
    except QuotaExceeded as e:
        raise rate_limited(e) from None
    location = url_for("schedules.get_schedule", schedule_id=str(schedule.id))
    return jsonify(schedule_json(schedule)), 201, {"Location": location}


def _create(
    s: ApiState,
    settings: Settings,
    body: dict[str, Any],
    sub: Submission,
    cron: Cron,
    principal: Principal | None,
) -> Schedule:
    return s.runtime.store.create_schedule(
        NewSchedule(
            agent=sub.agent,
            input=sub.input,
            model=sub.model,
            max_steps=sub.max_steps,
            token_budget=sub.token_budget,
            timeout_seconds=sub.timeout_seconds,
            cost_budget_usd=sub.cost_budget_usd,
            priority=sub.priority,
            cron=cron.expression,
            timezone=cron.timezone,
            overlap=body.get("overlap", "skip"),
            catch_up=body.get("catchUp", "none"),
            first_tick_at=cron.next_after(datetime.now(UTC)),
            tenant=principal.tenant if principal else "",
            created_by=principal.name if principal else None,
        ),
        quota=submit_quota(settings) if principal is not None else None,
        max_schedules=settings.token_max_schedules if principal is not None else 0,
        audit=audit(
            "schedule.create",
            {
                "agent": sub.agent,
                "cron": cron.expression,
                "timezone": cron.timezone,
                "overlap": body.get("overlap", "skip"),
                "priority": sub.priority,
            },
        ),
    )


@bp.get("/schedules")
@requires("read")
def list_schedules() -> Response:
    found = state().runtime.store.list_schedules(tenant=tenant_scope())
    return jsonify({"items": [schedule_json(sc) for sc in found]})


@bp.get("/schedules/<schedule_id>")
@requires("read")
def get_schedule(schedule_id: str) -> Response:
    schedule = _load(schedule_id)
    store = state().runtime.store
    ticks = store.schedule_ticks(schedule.id, limit=RECENT_TICKS)
    events = store.schedule_audit_events(schedule.id)
    return jsonify(
        {
            **schedule_json(schedule),
            "recentTicks": [tick_json(t) for t in ticks],
            "audit": [audit_json(e) for e in events],
        }
    )


@bp.delete("/schedules/<schedule_id>")
@requires("submit")
def delete_schedule(schedule_id: str) -> Response:
    """Deleting needs what creating needed: ``submit`` in the tenant, and ``admin`` for a
    schedule whose priority is above ``DAR_TOKEN_MAX_PRIORITY``. Audited."""
    schedule = _load(schedule_id)
    check_priority(schedule.priority, state().runtime.settings)
    deleted = state().runtime.store.delete_schedule(
        schedule.id,
        audit=audit(
            "schedule.delete",
            {"agent": schedule.agent, "cron": schedule.cron, "createdBy": schedule.created_by},
        ),
    )
    if not deleted:
        raise ApiError(404, f"no schedule with id {schedule.id}", code="not_found")
    return jsonify({"id": str(schedule.id), "deleted": True})
