"""``POST /api/runs/{id}/signals/{name}``: a signal for a durable function's
``steps.wait_for(name)``; kept until a wait consumes it, delivered once."""

from __future__ import annotations

import re

from flask import Blueprint, Response, jsonify, request

from api.auth import current_principal, requires
from api.errors import ApiError, invalid
from api.runs import (
    audit,
    key_reused,
    load_run,
    parse_run_id,
    rate_limited,
    send_limits,
)
from api.schemas import signal_schema, validate
from api.state import state
from api.validation import idempotency_key, input_size, optional_json_body
from db.errors import (
    IdempotencyConflict,
    InvalidTransition,
    QuotaExceeded,
    RunNotFound,
    TooManyPending,
)
from runtime.agents import Agent
from tasks.dispatch import send_drive

bp = Blueprint("signals", __name__)

SIGNAL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


@bp.post("/runs/<run_id>/signals/<name>")
@requires("submit")
def send_signal(run_id: str, name: str) -> tuple[Response, int]:
    s = state()
    run = load_run(parse_run_id(run_id))
    if not SIGNAL_NAME.match(name):
        raise invalid("name", "must be 1 to 100 letters, digits, '_', '.' or '-'")
    body = optional_json_body(request)
    validate(body, signal_schema())
    agent = s.runtime.agents.get(run.agent) if run.agent in s.runtime.agents else None
    if isinstance(agent, Agent):
        raise ApiError(
            409,
            f"run {run.id} is an agent-loop run: it takes messages (POST "
            f"/api/runs/{run.id}/messages), not signals",
            code="not_a_durable_function",
        )
    principal = current_principal()
    settings = s.runtime.settings
    payload = body.get("payload")
    size = input_size(payload)
    if size > settings.max_input_chars:
        raise invalid(
            "payload",
            f"is {size} characters as JSON; the limit is {settings.max_input_chars} "
            "(DAR_MAX_INPUT_CHARS)",
        )
    key = idempotency_key(request)
    try:
        signal_id, created, woken = s.runtime.store.post_signal(
            run.id,
            name,
            payload,
            idempotency_key=key,
            sent_by=principal.name if principal else None,
            limits=send_limits(settings, principal is not None),
            audit=audit(
                "signal",
                {"name": name, "chars": size, **({"idempotencyKey": key} if key else {})},
            ),
        )
    except RunNotFound as e:
        raise ApiError(404, str(e), code="not_found") from None
    except InvalidTransition as e:
        raise ApiError(409, str(e), code="run_finished") from None
    except TooManyPending as e:
        raise ApiError(409, str(e), code="too_many_pending") from None
    except QuotaExceeded as e:
        raise rate_limited(e) from None
    except IdempotencyConflict as e:
        raise key_reused(e) from None
    if woken is not None:  # woken with the signal's commit: a run parked on its wait goes now
        send_drive(s.celery, s.runtime.store, woken)
    return (
        jsonify({"runId": str(run.id), "name": name, "signalId": signal_id, "new": created}),
        202,
    )
