"""The OpenAPI document, part: approvals: list, inspect, approve, reject."""

from __future__ import annotations

from api.openapi.common import (
    APPROVAL_ID,
    NULLABLE_STR,
    NULLABLE_TIME,
    Context,
    JsonObj,
    error,
    ref,
    response,
)
from api.schemas import (
    decision_schema,
)


def _decision(verb: str) -> JsonObj:
    return {
        "post": {
            "summary": f"{verb.capitalize()} (needs a token with the approval's role; "
            "repeating the same decision is harmless)",
            "operationId": f"{verb}Approval",
            "parameters": [APPROVAL_ID],
            "requestBody": {
                "required": False,
                "content": {"application/json": {"schema": ref("Decision")}},
            },
            "responses": {
                "200": response(ref("Approval"), "Decided"),
                "400": error("Invalid field"),
                "401": error("No valid token"),
                "403": error("The token lacks the approval's role"),
                "404": error("No such approval (or another tenant's)"),
                "409": error("Decided otherwise already, run cancelled, or payload changed"),
                "413": error("Body larger than DAR_MAX_BODY_BYTES"),
                "415": error("Body is not JSON"),
            },
        }
    }


def paths(c: Context) -> JsonObj:
    """The paths of approvals: list, inspect, approve, reject."""
    approval_statuses = c.approval_statuses
    return {
        "/api/approvals": {
            "get": {
                "summary": "Approvals, oldest first (PENDING unless status says otherwise)",
                "operationId": "listApprovals",
                "parameters": [
                    {
                        "name": "status",
                        "in": "query",
                        "schema": {"enum": [*approval_statuses, "ANY"]},
                    },
                    {"name": "role", "in": "query", "schema": {"type": "string"}},
                    {
                        "name": "runId",
                        "in": "query",
                        "description": "only this run's approvals",
                        "schema": {"type": "string", "format": "uuid"},
                    },
                ],
                "responses": {
                    "200": response(
                        {
                            "type": "object",
                            "properties": {"items": {"type": "array", "items": ref("Approval")}},
                        },
                        "Approvals",
                    ),
                    "400": error("Invalid query parameter"),
                },
            }
        },
        "/api/approvals/{approval_id}": {
            "get": {
                "summary": "An approval: what is to be approved and its hash",
                "operationId": "getApproval",
                "parameters": [APPROVAL_ID],
                "responses": {
                    "200": response(ref("Approval"), "The approval"),
                    "404": error("No such approval"),
                },
            }
        },
        "/api/approvals/{approval_id}/approve": _decision("approve"),
        "/api/approvals/{approval_id}/reject": _decision("reject"),
    }


def schemas(c: Context) -> JsonObj:
    """The component schemas of approvals: list, inspect, approve, reject."""
    approval_statuses = c.approval_statuses
    return {
        "Decision": decision_schema(),
        "Approval": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "runId": {"type": "string", "format": "uuid"},
                "stepKey": {"type": "string"},
                "role": {"type": "string"},
                "status": {"enum": approval_statuses},
                "payload": {},
                "payloadHash": {"type": "string"},
                "timeoutPolicy": {"enum": ["FAIL", "REJECT", "APPROVE"]},
                "requestedAt": {"type": "string", "format": "date-time"},
                "expiresAt": {"type": "string", "format": "date-time"},
                "decidedBy": NULLABLE_STR,
                "decidedAt": NULLABLE_TIME,
                "comment": NULLABLE_STR,
                "copiedFrom": {
                    "type": ["string", "null"],
                    "format": "uuid",
                    "description": "a fork's copy of a decision: the run that made it "
                    "(decidedBy decided for that run, not for this one); null: decided "
                    "for this run",
                },
            },
        },
    }
