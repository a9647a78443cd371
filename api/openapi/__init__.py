"""The OpenAPI 3.1 document served at ``/api/openapi.json``, one module per resource.

Request bodies are the JSON Schemas of :mod:`api.schemas`, the very objects the validators
check requests against; enums come from the records' enums. Nothing here restates a rule.
Each part (:mod:`~api.openapi.runs`, ``forks``, ``approvals``, ``messages`` for messages and
signals, ``schedules``, ``tokens``, ``service``) gives its paths and its component schemas;
this module puts them together in one order and adds what every operation may answer.
"""

from __future__ import annotations

from api.openapi import approvals, forks, messages, runs, schedules, service, tokens, versions
from api.openapi.common import Context, JsonObj, error
from api.schemas import MAX_JSON_DEPTH, TEXT_RULE
from runtime.config import Settings

__all__ = ["openapi_document"]

PARTS = (runs, forks, approvals, messages, schedules, tokens, service, versions)

PATH_ORDER = (
    "/api/runs",
    "/api/runs/counts",
    "/api/runs/{run_id}/conversation",
    "/api/stats",
    "/api/whoami",
    "/api/runs/{run_id}",
    "/api/runs/{run_id}/tree",
    "/api/runs/{run_id}/timeline",
    "/api/runs/{run_id}/events",
    "/api/runs/{run_id}/resolve",
    "/api/runs/{run_id}/resume",
    "/api/runs/{run_id}/fork",
    "/api/runs/{run_id}/diff/{other_id}",
    "/api/approvals",
    "/api/approvals/{approval_id}",
    "/api/approvals/{approval_id}/approve",
    "/api/approvals/{approval_id}/reject",
    "/api/runs/{run_id}/signals/{name}",
    "/api/runs/{run_id}/messages",
    "/api/runs/{run_id}/cancel",
    "/api/schedules",
    "/api/schedules/{schedule_id}",
    "/api/versions",
    "/api/versions/{deployment}/upgrade",
    "/api/openapi.json",
    "/healthz",
    "/readyz",
)
"""The paths in the order the document has always listed them."""

SCHEMA_ORDER = (
    "RunSubmission",
    "Resolution",
    "Resume",
    "Fork",
    "Signal",
    "Message",
    "ScheduleRequest",
    "Schedule",
    "ForkedFrom",
    "ForkAccepted",
    "RunDiff",
    "Decision",
    "Approval",
    "RunAccepted",
    "CancelAccepted",
    "Run",
    "RunTree",
    "RunPage",
    "Step",
    "Conversation",
    "Stats",
    "WhoAmI",
    "AuditEvent",
    "Versions",
    "RunCheck",
    "UpgradeReport",
    "Error",
)


def openapi_document(
    settings: Settings | None = None,
    agents: list[str] | None = None,
    *,
    any_json_input: bool = False,
    auth: bool = False,
) -> JsonObj:
    """The document for an app with these limits and agents (the defaults when omitted), so
    that what it promises is exactly what the validation accepts."""
    c = Context(settings or Settings(), agents, any_json_input)
    paths: JsonObj = {}
    schemas: JsonObj = {}
    for part in PARTS:
        paths.update(part.paths(c))
        schemas.update(part.schemas(c))
    schemas["Run"]["properties"]["deployment"] = versions.RUN_DEPLOYMENT  # a run's version
    document: JsonObj = {
        "openapi": "3.1.0",
        "info": {
            "title": "Durable Agent Runtime",
            "version": "0.1.0",
            "description": "Submit, inspect and cancel durable agent runs.",
        },
        "paths": _ordered(paths, PATH_ORDER),
        "components": {
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a token from DAR_API_TOKENS (when set; else the API is open)",
                }
            },
            "schemas": _ordered(schemas, SCHEMA_ORDER),
        },
    }
    _common_responses(document, auth)
    return document


def _ordered(items: JsonObj, order: tuple[str, ...]) -> JsonObj:
    """``items`` in ``order``, then any not named there (a new one goes last)."""
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(items.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def _common_responses(document: JsonObj, auth: bool) -> None:
    """What every /api operation may answer besides its own responses: the token errors, and
    for a body the size, media type and text rules."""
    for path, item in document["paths"].items():
        for operation in item.values():
            responses = operation["responses"]
            if auth and path.startswith("/api/") and path != "/api/openapi.json":
                operation["security"] = [{"bearer": []}]
                responses.setdefault("401", error("No valid token (when tokens are configured)"))
                responses.setdefault("403", error("The token lacks the role this needs"))
            # gunicorn's own answer to a request line over --limit-request-line (4094 bytes):
            # before the app, for any operation (an over-long id or query string).
            responses.setdefault(
                "414",
                {
                    "description": "Request line longer than the server accepts (gunicorn's "
                    "own page, before the app: not JSON)",
                    "content": {"text/html": {"schema": {"type": "string"}}},
                },
            )
            if "requestBody" in operation:
                responses.setdefault("400", error("Invalid field; the message names it"))
                responses.setdefault("408", error("The body did not arrive in time"))
                responses.setdefault(
                    "503",
                    error(
                        "Too many chunked bodies being received at once "
                        "(DAR_HTTP_BUFFER_BYTES); retry after Retry-After seconds"
                    ),
                )
                responses.setdefault("413", error("Body larger than DAR_MAX_BODY_BYTES"))
                responses.setdefault("415", error("Body is not JSON"))
            # Every string in a query or body is refused (400) when it is not text PostgreSQL
            # can store, and JSON is refused when nested too deep.
            if "requestBody" in operation or operation.get("parameters"):
                responses.setdefault(
                    "400",
                    error(f"Invalid parameter: {TEXT_RULE}, at most {MAX_JSON_DEPTH} deep"),
                )
