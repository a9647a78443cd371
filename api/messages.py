"""``POST /api/runs/{id}/messages``: talk to a running agent-loop run, or continue a finished
one. The message is kept and delivered at the run's next step boundary as a user turn; with
``policy: "interrupt"`` the model call in flight is aborted first (the worker then delivers
the message as its step and makes the call again, with it)."""

from __future__ import annotations

from typing import Any

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
    submit_quota,
)
from api.schemas import message_schema, validate
from api.state import state
from api.validation import idempotency_key, input_size, json_body
from db.errors import (
    IdempotencyConflict,
    InvalidTransition,
    QuotaExceeded,
    RunNotFound,
    TooManyPending,
)
from db.records import RunStatus
from runtime.agents import Agent
from tasks.dispatch import send_drive

bp = Blueprint("messages", __name__)


@bp.post("/runs/<run_id>/messages")
@requires("submit")
def post_message(run_id: str) -> tuple[Response, int]:
    s = state()
    run = load_run(parse_run_id(run_id))
    body = json_body(request, limit_input=None)
    validate(body, message_schema(s.runtime.settings))
    policy = body.get("policy", "enqueue")
    agent = s.runtime.agents.get(run.agent) if run.agent in s.runtime.agents else None
    if not isinstance(agent, Agent):
        raise ApiError(
            409,
            f"run {run.id} is not an agent-loop run: a durable function takes signals (POST "
            f"/api/runs/{run.id}/signals/{{name}}), not messages",
            code="not_an_agent_loop",
        )
    if policy == "reject" and run.locked_by is not None and not run.status.terminal:
        raise ApiError(
            409,
            f"run {run.id} is inside a step (held by {run.locked_by}); send with policy "
            "'enqueue' to have it delivered at the next step boundary",
            code="inside_a_step",
        )
    content: Any = body["text"] if "text" in body else body["content"]
    settings = s.runtime.settings
    size = input_size(content)
    if size > settings.max_input_chars:  # the whole message, whatever its blocks
        raise invalid(
            "text" if "text" in body else "content",
            f"is {size} characters; the limit is {settings.max_input_chars} (DAR_MAX_INPUT_CHARS)",
        )
    principal = current_principal()
    key = idempotency_key(request)
    try:
        message_id, created, dispatch = s.runtime.store.post_message(
            run.id,
            content,
            idempotency_key=key,
            sent_by=principal.name if principal else None,
            limits=send_limits(settings, principal is not None),
            audit=audit(
                "message",
                {"policy": policy, "chars": size, **({"idempotencyKey": key} if key else {})},
            ),
            resume_quota=submit_quota(settings) if principal is not None else None,
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
    live = s.runtime.live
    reopened = dispatch is not None and run.status is RunStatus.SUCCEEDED
    if policy == "interrupt" and created and live is not None and not reopened:
        # After the commit: the model call in flight is aborted and made again with the
        # message (a tool in flight is not: the message follows its result, as enqueued).
        live.request_interrupt(run.id)
    if dispatch is not None:  # queued again, or woken from its parking, with the commit
        send_drive(s.celery, s.runtime.store, dispatch)
    after = load_run(run.id)
    return (
        jsonify(
            {
                "runId": str(run.id),
                "messageId": message_id,
                "new": created,
                "status": str(after.status),
                "policy": policy,
            }
        ),
        202,
    )
