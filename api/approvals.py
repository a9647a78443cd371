"""``/api/approvals``: the decisions durable functions wait for."""

from __future__ import annotations

import uuid

from flask import Blueprint, Response, jsonify, request

from api.auth import current_principal, requires, tenant_scope
from api.errors import ApiError, invalid
from api.runs import audit
from api.schemas import check_text, decision_schema, validate
from api.serialize import approval_json
from api.state import state
from api.validation import optional_json_body
from db.records import Approval, ApprovalStatus
from tasks.dispatch import send_drive

bp = Blueprint("approvals", __name__)


def _approval_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise ApiError(404, f"no approval with id {raw!r}", code="not_found") from None


def _load(approval_id: uuid.UUID) -> Approval:
    """The approval, if the request's tenant may see its run; 404 otherwise, by the same
    single statement whether the id is another tenant's or nobody's (no timing tells)."""
    approval = state().runtime.store.get_approval(approval_id, tenant=tenant_scope())
    if approval is None:
        raise ApiError(404, f"no approval with id {approval_id}", code="not_found")
    return approval


def _may_decide(approval: Approval) -> str:
    """The decider's name; 403 unless the token names the approval's role itself (``admin``
    does not imply approval roles: who may approve a refund is a business decision)."""
    principal = current_principal()
    if principal is None:  # authentication is off (development)
        return "anonymous"
    if not principal.holds(approval.role):
        raise ApiError(
            403,
            f"token {principal.name!r} lacks the role {approval.role!r} this approval needs"
            + (" (admin does not imply approval roles)" if principal.admin else ""),
            code="forbidden",
        )
    return principal.name


@bp.get("/approvals")
@requires("read")
def list_approvals() -> Response:
    status = request.args.get("status", "PENDING")
    if status not in ApprovalStatus.__members__ and status != "ANY":
        raise invalid("status", f"must be one of {', '.join(ApprovalStatus)} or ANY")
    role = request.args.get("role")
    if role is not None:
        check_text(role, "role")
    raw_run = request.args.get("runId")
    try:
        run_id = uuid.UUID(raw_run) if raw_run is not None else None
    except ValueError:
        raise invalid("runId", "must be a run id (a UUID)") from None
    approvals = state().runtime.store.list_approvals(
        status=None if status == "ANY" else status,
        role=role,
        run_id=run_id,
        limit=200,
        tenant=tenant_scope(),
    )
    return jsonify({"items": [approval_json(a) for a in approvals]})


@bp.get("/approvals/<approval_id>")
@requires("read")
def get_approval(approval_id: str) -> Response:
    return jsonify(approval_json(_load(_approval_id(approval_id))))


def _decide(approval_id: str, decision: ApprovalStatus) -> tuple[Response, int]:
    s = state()
    aid = _approval_id(approval_id)
    body = optional_json_body(request)
    validate(body, decision_schema())
    approval = _load(aid)
    decider = _may_decide(approval)
    comment = body.get("comment")
    payload_hash = body.get("payloadHash")
    if payload_hash is not None and payload_hash != approval.payload_hash:
        raise ApiError(
            409,
            "the approval's payload is not the one you were shown (payloadHash differs); "
            "reload it and decide again",
            code="payload_changed",
        )
    verb = "approve" if decision is ApprovalStatus.APPROVED else "reject"
    dispatch = s.runtime.store.decide_approval(
        aid,
        decision,
        decided_by=decider,
        comment=comment,
        payload_hash=approval.payload_hash,
        audit=audit(
            verb,
            {
                "stepKey": approval.step_key,
                "role": approval.role,
                "payloadHash": approval.payload_hash,
                **({"comment": comment} if comment else {}),
            },
            aid,
        ),
    )
    if dispatch is None:
        current = _load(aid)
        if current.status is decision:  # the same decision again: idempotent
            return jsonify(approval_json(current)), 200
        run = s.runtime.store.get_run(current.run_id)
        raise ApiError(
            409,
            f"approval is {current.status} and its run is {run.status}: it can no longer be "
            f"{decision.lower()}",
            code="already_decided",
        )
    send_drive(s.celery, s.runtime.store, dispatch)
    return jsonify(approval_json(_load(aid))), 200


@bp.post("/approvals/<approval_id>/approve")
@requires("approve")
def approve(approval_id: str) -> tuple[Response, int]:
    return _decide(approval_id, ApprovalStatus.APPROVED)


@bp.post("/approvals/<approval_id>/reject")
@requires("approve")
def reject(approval_id: str) -> tuple[Response, int]:
    return _decide(approval_id, ApprovalStatus.REJECTED)
