"""What every part of the OpenAPI document shares: how a schema, a response and an error are
written, the path parameters, and the :class:`Context` a part is built for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from api.schemas import MAX_AGENT_CHARS, SAFE_TEXT
from db.records import ApprovalStatus, RunStatus
from runtime.config import Settings

JsonObj = dict[str, Any]

# An event id of GET /api/runs/{id}/events (api/events.py).
EVENT_ID_PATTERN = r"^[0-9a-f]{8}\.[0-9]{1,18}(\.[0-9]{1,18}-[0-9]{1,18})?$"


@dataclass(frozen=True)
class Context:
    """What the document is built for: an app's limits and agents."""

    s: Settings
    agents: list[str] | None = None
    any_json_input: bool = False
    statuses: list[str] = field(default_factory=lambda: [str(st) for st in RunStatus])
    approval_statuses: list[str] = field(default_factory=lambda: [str(st) for st in ApprovalStatus])


def ref(name: str) -> JsonObj:
    return {"$ref": f"#/components/schemas/{name}"}


def response(schema: JsonObj, description: str) -> JsonObj:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def error(description: str) -> JsonObj:
    return response(ref("Error"), description)


RUN_ID = {
    "name": "run_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "format": "uuid"},
}

APPROVAL_ID = {
    "name": "approval_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "format": "uuid"},
}

NULLABLE_STR = {"type": ["string", "null"]}

SCHEDULE_ID = {
    "name": "schedule_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "format": "uuid"},
}

OTHER_ID = {
    "name": "other_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "format": "uuid"},
}


NULLABLE_TIME = {"type": ["string", "null"], "format": "date-time"}

AGENT_FILTER = {
    "name": "agent",
    "in": "query",
    "description": "only this agent's runs",
    "schema": {"type": "string", "maxLength": MAX_AGENT_CHARS, "pattern": SAFE_TEXT},
}
