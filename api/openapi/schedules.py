"""The OpenAPI document, part: schedules: create, list, inspect, delete."""

from __future__ import annotations

from api.openapi.common import NULLABLE_STR, SCHEDULE_ID, Context, JsonObj, error, ref, response
from api.schemas import (
    schedule_schema,
)
from runtime.engine.schedules import CATCH_UPS, OVERLAPS


def paths(c: Context) -> JsonObj:
    """The paths of schedules: create, list, inspect, delete."""
    return {
        "/api/schedules": {
            "post": {
                "summary": "Create a schedule: the agent and input each run gets, a cron "
                "expression in a time zone, an overlap and a catch-up policy. Each tick "
                "starts exactly one run, however many beats run.",
                "operationId": "createSchedule",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": ref("ScheduleRequest")}},
                },
                "responses": {
                    "201": response(ref("Schedule"), "Created"),
                    "400": error(
                        "Invalid field; the message names it (a cron ticking more often "
                        "than DAR_SCHEDULE_MIN_INTERVAL_SECONDS, without admin)"
                    ),
                    "403": error("A priority above DAR_TOKEN_MAX_PRIORITY, without admin"),
                    "422": error("A cron expression that never fires, or an unknown time zone"),
                    "429": error(
                        "The token is over its quota (DAR_SUBMIT_RATE_PER_MINUTE, "
                        "DAR_TOKEN_MAX_ACTIVE_RUNS) or has DAR_TOKEN_MAX_SCHEDULES "
                        "schedules; Retry-After says when to try again"
                    ),
                },
            },
            "get": {
                "summary": "Schedules, oldest first",
                "operationId": "listSchedules",
                "responses": {
                    "200": response(
                        {
                            "type": "object",
                            "properties": {"items": {"type": "array", "items": ref("Schedule")}},
                        },
                        "Schedules",
                    )
                },
            },
        },
        "/api/schedules/{schedule_id}": {
            "get": {
                "summary": "A schedule and its latest ticks (the run each started)",
                "operationId": "getSchedule",
                "parameters": [SCHEDULE_ID],
                "responses": {
                    "200": response(ref("Schedule"), "The schedule"),
                    "404": error("No such schedule"),
                },
            },
            "delete": {
                "summary": "Delete a schedule (the runs it started stay); audited. It "
                "needs what creating it needed: admin for a priority above "
                "DAR_TOKEN_MAX_PRIORITY",
                "operationId": "deleteSchedule",
                "parameters": [SCHEDULE_ID],
                "responses": {
                    "200": response({"type": "object"}, "Deleted"),
                    "403": error("Its priority is above DAR_TOKEN_MAX_PRIORITY, without admin"),
                    "404": error("No such schedule"),
                },
            },
        },
    }


def schemas(c: Context) -> JsonObj:
    """The component schemas of schedules: create, list, inspect, delete."""
    s, agents, any_json_input = c.s, c.agents, c.any_json_input
    return {
        "ScheduleRequest": schedule_schema(s, agents, any_json_input=any_json_input),
        "Schedule": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "agent": {"type": "string"},
                "input": {},
                "cron": {"type": "string"},
                "timezone": {"type": "string"},
                "overlap": {"enum": list(OVERLAPS)},
                "catchUp": {"enum": list(CATCH_UPS)},
                "nextTickAt": {"type": "string", "format": "date-time"},
                "model": {"type": "string"},
                "maxSteps": {"type": "integer"},
                "tokenBudget": {"type": "integer"},
                "timeoutSeconds": {"type": "integer"},
                "costBudgetUsd": {"type": ["number", "null"]},
                "priority": {"type": "integer"},
                "tenant": {"type": "string"},
                "createdBy": NULLABLE_STR,
                "createdAt": {"type": "string", "format": "date-time"},
                "recentTicks": {
                    "type": "array",
                    "description": "GET of one schedule: its latest ticks, newest first",
                    "items": {
                        "type": "object",
                        "properties": {
                            "tickAt": {"type": "string", "format": "date-time"},
                            "status": {"enum": ["STARTED", "SKIPPED", "QUEUED"]},
                            "runId": {"type": ["string", "null"], "format": "uuid"},
                            "reason": {
                                "type": ["string", "null"],
                                "description": "why a SKIPPED tick started no run "
                                "when its overlap policy would have: the creator over "
                                "a limit, or its token revoked or expired",
                            },
                        },
                    },
                },
                "audit": {
                    "type": "array",
                    "description": "GET of one schedule: who created it (and deleted "
                    "it), oldest first",
                    "items": ref("AuditEvent"),
                },
            },
        },
    }
