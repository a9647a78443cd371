"""The OpenAPI 3.1 document served at ``/api/openapi.json``.

Request bodies are the JSON Schemas of :mod:`api.schemas`, the very objects the validators
check requests against; enums come from the records' enums. Nothing here restates a rule.
"""

from __future__ import annotations

from typing import Any

from api.openapi_versions import add_versions
from api.schemas import (
    CURSOR_PATTERN,
    ID_PREFIX_PATTERN,
    MAX_AGENT_CHARS,
    MAX_JSON_DEPTH,
    MESSAGE_POLICIES,
    SAFE_TEXT,
    STATS_WINDOWS,
    TEXT_RULE,
    TREE_MAX_DEPTH,
    TREE_MAX_NODES,
    decision_schema,
    fork_schema,
    message_schema,
    resolution_schema,
    resume_schema,
    schedule_schema,
    signal_schema,
    submission_schema,
)
from db.records import ApprovalStatus, RunStatus, StepKind, StepOrigin, StepStatus
from db.schema import AUDIT_ACTIONS
from runtime.config import Settings
from runtime.engine.schedules import CATCH_UPS, OVERLAPS

JsonObj = dict[str, Any]

# An event id of GET /api/runs/{id}/events (api/events.py).
EVENT_ID_PATTERN = r"^[0-9a-f]{8}\.[0-9]{1,18}(\.[0-9]{1,18}-[0-9]{1,18})?$"


def _ref(name: str) -> JsonObj:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: JsonObj, description: str) -> JsonObj:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> JsonObj:
    return _json(_ref("Error"), description)


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


def _decision(verb: str) -> JsonObj:
    return {
        "post": {
            "summary": f"{verb.capitalize()} (needs a token with the approval's role; "
            "repeating the same decision is harmless)",
            "operationId": f"{verb}Approval",
            "parameters": [APPROVAL_ID],
            "requestBody": {
                "required": False,
                "content": {"application/json": {"schema": _ref("Decision")}},
            },
            "responses": {
                "200": _json(_ref("Approval"), "Decided"),
                "400": _error("Invalid field"),
                "401": _error("No valid token"),
                "403": _error("The token lacks the approval's role"),
                "404": _error("No such approval (or another tenant's)"),
                "409": _error("Decided otherwise already, run cancelled, or payload changed"),
                "413": _error("Body larger than DAR_MAX_BODY_BYTES"),
                "415": _error("Body is not JSON"),
            },
        }
    }


NULLABLE_TIME = {"type": ["string", "null"], "format": "date-time"}

AGENT_FILTER = {
    "name": "agent",
    "in": "query",
    "description": "only this agent's runs",
    "schema": {"type": "string", "maxLength": MAX_AGENT_CHARS, "pattern": SAFE_TEXT},
}


def openapi_document(
    settings: Settings | None = None,
    agents: list[str] | None = None,
    *,
    any_json_input: bool = False,
    auth: bool = False,
) -> JsonObj:
    """The document for an app with these limits and agents (the defaults when omitted), so
    that what it promises is exactly what the validation accepts."""
    s = settings or Settings()
    statuses = [str(st) for st in RunStatus]
    approval_statuses = [str(st) for st in ApprovalStatus]
    document = {
        "openapi": "3.1.0",
        "info": {
            "title": "Durable Agent Runtime",
            "version": "0.1.0",
            "description": "Submit, inspect and cancel durable agent runs.",
        },
        "paths": {
            "/api/runs": {
                "post": {
                    "summary": "Submit a run",
                    "operationId": "submitRun",
                    "parameters": [
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "required": False,
                            "description": "A retried submit with the same key returns the "
                            "same run (200) instead of creating another.",
                            "schema": {"type": "string", "minLength": 1, "maxLength": 200},
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("RunSubmission")}},
                    },
                    "responses": {
                        "201": _json(_ref("RunAccepted"), "Run stored and queued"),
                        "200": _json(_ref("RunAccepted"), "Idempotent replay: the earlier run"),
                        "400": _error("Invalid field; the message names it"),
                        "413": _error("Body larger than DAR_MAX_BODY_BYTES"),
                        "415": _error("Body is not JSON"),
                        "422": _error("Idempotency-Key reused with a different body"),
                    },
                },
                "get": {
                    "summary": "List runs, newest first",
                    "operationId": "listRuns",
                    "parameters": [
                        {"name": "status", "in": "query", "schema": {"enum": statuses}},
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {
                                "type": "integer",
                                "minimum": 1,
                                "maximum": s.max_page_size,
                            },
                        },
                        {
                            "name": "cursor",
                            "in": "query",
                            "description": "nextCursor of the previous page",
                            "schema": {"type": "string", "pattern": CURSOR_PATTERN},
                        },
                        AGENT_FILTER,
                        {
                            "name": "idPrefix",
                            "in": "query",
                            "description": "only runs whose id starts with this (any case)",
                            "schema": {"type": "string", "pattern": ID_PREFIX_PATTERN},
                        },
                    ],
                    "responses": {
                        "200": _json(_ref("RunPage"), "A page of runs"),
                        "400": _error("Invalid query parameter"),
                    },
                },
            },
            "/api/runs/counts": {
                "get": {
                    "summary": "How many runs are in each status (optionally of one agent)",
                    "operationId": "countRuns",
                    "parameters": [AGENT_FILTER],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["counts"],
                                "properties": {
                                    "counts": {
                                        "type": "object",
                                        "properties": {st: {"type": "integer"} for st in statuses},
                                        "additionalProperties": False,
                                    }
                                },
                            },
                            "Runs by status",
                        ),
                        "400": _error("Invalid query parameter"),
                    },
                }
            },
            "/api/runs/{run_id}/conversation": {
                "get": {
                    "summary": "The run as a conversation: input, assistant text, tool calls "
                    "with input and result, durable steps' results, errors",
                    "operationId": "getConversation",
                    "parameters": [RUN_ID],
                    "responses": {
                        "200": _json(_ref("Conversation"), "The conversation"),
                        "404": _error("No such run"),
                    },
                }
            },
            "/api/stats": {
                "get": {
                    "summary": "The overview: runs finished per hour by status, recorded cost "
                    "per hour by model, step latency p50/p95 per hour by kind",
                    "operationId": "getStats",
                    "parameters": [
                        {
                            "name": "window",
                            "in": "query",
                            "description": "how far back (default 24h)",
                            "schema": {"enum": list(STATS_WINDOWS)},
                        }
                    ],
                    "responses": {
                        "200": _json(_ref("Stats"), "Hourly aggregates"),
                        "400": _error("Invalid query parameter"),
                    },
                }
            },
            "/api/whoami": {
                "get": {
                    "summary": "The token: its name, tenant, roles, and the actions it may take "
                    "(all of them when authentication is off)",
                    "operationId": "whoami",
                    "responses": {"200": _json(_ref("WhoAmI"), "The token")},
                }
            },
            "/api/runs/{run_id}": {
                "get": {
                    "summary": "Get a run",
                    "operationId": "getRun",
                    "parameters": [RUN_ID],
                    "responses": {
                        "200": _json(_ref("Run"), "The run"),
                        "404": _error("No such run"),
                    },
                }
            },
            "/api/runs/{run_id}/tree": {
                "get": {
                    "summary": "The tree of child runs the run belongs to, from its root down "
                    f"(at most {TREE_MAX_NODES} runs breadth-first from the root and "
                    f"{TREE_MAX_DEPTH} levels, plus the run and its ancestors)",
                    "operationId": "getRunTree",
                    "parameters": [RUN_ID],
                    "responses": {
                        "200": _json(_ref("RunTree"), "The tree"),
                        "404": _error("No such run"),
                    },
                }
            },
            "/api/runs/{run_id}/timeline": {
                "get": {
                    "summary": "The run's steps, in order, without request bodies",
                    "operationId": "getTimeline",
                    "parameters": [RUN_ID],
                    "responses": {
                        "200": _json({"type": "array", "items": _ref("Step")}, "The steps"),
                        "404": _error("No such run"),
                    },
                }
            },
            "/api/runs/{run_id}/events": {
                "get": {
                    "summary": "The run as Server-Sent Events: run.status, step.started, "
                    "step.finished, approval.requested, approval.decided, text.delta, "
                    "text.retract, run.finished, a framework agent's agent.updated, "
                    "agent.tool_called, agent.tool_output, agent.handoff, and what a durable "
                    "function publishes with steps.live_event. Every event has an id; send "
                    "the last one seen as Last-Event-ID (or ?after=) to resume exactly after "
                    "it. A comment line every DAR_EVENTS_HEARTBEAT_SECONDS keeps proxies "
                    "open; the server closes after DAR_EVENTS_IDLE_SECONDS without an event "
                    "or DAR_EVENTS_MAX_SECONDS in all (reconnect with Last-Event-ID)",
                    "operationId": "runEvents",
                    "parameters": [
                        RUN_ID,
                        {
                            "name": "after",
                            "in": "query",
                            "required": False,
                            "description": "An event id: resume after it (as Last-Event-ID)",
                            "schema": {"type": "string", "pattern": EVENT_ID_PATTERN},
                        },
                        {
                            "name": "Last-Event-ID",
                            "in": "header",
                            "required": False,
                            "description": "The id of the last event received",
                            "schema": {"type": "string", "pattern": EVENT_ID_PATTERN},
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "The event stream",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
                        },
                        "400": _error("Malformed Last-Event-ID, or one of another run"),
                        "404": _error("No such run"),
                        "429": _error(
                            "Too many open streams: this token's (DAR_EVENTS_STREAMS_PER_TOKEN), "
                            "its tenant's (DAR_EVENTS_STREAMS_PER_TENANT) or this server's "
                            "(DAR_EVENTS_STREAMS_MAX); retry after Retry-After seconds"
                        ),
                    },
                }
            },
            "/api/runs/{run_id}/resolve": {
                "post": {
                    "summary": "Resolve a NEEDS_ATTENTION run: supply the tool's result, "
                    "authorise a retry of the tool, or fail the run",
                    "operationId": "resolveRun",
                    "parameters": [RUN_ID],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("Resolution")}},
                    },
                    "responses": {
                        "200": _json(_ref("RunAccepted"), "Resolved"),
                        "400": _error("Invalid field"),
                        "404": _error("No such run"),
                        "409": _error("The run is not NEEDS_ATTENTION"),
                        "415": _error("Body is not JSON"),
                    },
                }
            },
            "/api/runs/{run_id}/resume": {
                "post": {
                    "summary": "Retry a FAILED or TIMED_OUT run from its first step without a "
                    "result (optionally with a new token budget or deadline)",
                    "operationId": "resumeRun",
                    "parameters": [RUN_ID],
                    "requestBody": {
                        "required": False,
                        "content": {"application/json": {"schema": _ref("Resume")}},
                    },
                    "responses": {
                        "202": _json(_ref("RunAccepted"), "Resumed"),
                        "400": _error("Invalid field"),
                        "404": _error("No such run"),
                        "409": _error("Not FAILED or TIMED_OUT, or already compensated"),
                        "415": _error("Body is not JSON"),
                        "429": _error(
                            "The token has DAR_TOKEN_MAX_ACTIVE_RUNS runs in flight (a resumed "
                            "run is in flight again); Retry-After says when to try again"
                        ),
                    },
                }
            },
            "/api/runs/{run_id}/fork": {
                "post": {
                    "summary": "Fork a run: a new run whose history is the run's steps before "
                    "fromSeq (copied, never executed again; with the edits), continuing from "
                    "fromSeq. Needs submit and the run's tenant.",
                    "operationId": "forkRun",
                    "parameters": [
                        RUN_ID,
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "required": False,
                            "description": "As for a submit (and in the same namespace, the "
                            "run's tenant): a retried fork of the same run with the same key "
                            "and body returns the same fork (200) instead of making another.",
                            "schema": {"type": "string", "minLength": 1, "maxLength": 200},
                        },
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("Fork")}},
                    },
                    "responses": {
                        "201": _json(_ref("ForkAccepted"), "The fork, stored and queued"),
                        "200": _json(_ref("ForkAccepted"), "Idempotent replay: the earlier fork"),
                        "400": _error("Invalid field; the message names it"),
                        "404": _error("No such run"),
                        "409": _error(
                            "The run's state refuses the fork (a step before fromSeq has not "
                            "completed, or its agent is not registered)"
                        ),
                        "422": _error(
                            "Idempotency-Key reused with a different body, another run, or by "
                            "a submit"
                        ),
                        "429": _error("Too many submits by this token (a fork is a submit)"),
                    },
                }
            },
            "/api/runs/{run_id}/diff/{other_id}": {
                "get": {
                    "summary": "Compare two runs step by step: the first seq where they differ "
                    "and each step's kind, key, tool, input, output, tokens and cost",
                    "operationId": "diffRuns",
                    "parameters": [RUN_ID, OTHER_ID],
                    "responses": {
                        "200": _json(_ref("RunDiff"), "The comparison"),
                        "404": _error("No such run (either)"),
                    },
                }
            },
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
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "items": {"type": "array", "items": _ref("Approval")}
                                },
                            },
                            "Approvals",
                        ),
                        "400": _error("Invalid query parameter"),
                    },
                }
            },
            "/api/approvals/{approval_id}": {
                "get": {
                    "summary": "An approval: what is to be approved and its hash",
                    "operationId": "getApproval",
                    "parameters": [APPROVAL_ID],
                    "responses": {
                        "200": _json(_ref("Approval"), "The approval"),
                        "404": _error("No such approval"),
                    },
                }
            },
            "/api/approvals/{approval_id}/approve": _decision("approve"),
            "/api/approvals/{approval_id}/reject": _decision("reject"),
            "/api/runs/{run_id}/signals/{name}": {
                "post": {
                    "summary": "Send a signal to a durable function's run: kept until its "
                    "steps.wait_for(name) consumes it (delivered once; one sent before the "
                    "wait is kept for it); wakes the run if it waits for it",
                    "operationId": "sendSignal",
                    "parameters": [
                        RUN_ID,
                        {
                            "name": "name",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,100}$"},
                        },
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "required": False,
                            "description": "a retried request with the same key is one signal",
                            "schema": {"type": "string", "minLength": 1, "maxLength": 200},
                        },
                    ],
                    "requestBody": {
                        "required": False,
                        "content": {"application/json": {"schema": _ref("Signal")}},
                    },
                    "responses": {
                        "202": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "runId": {"type": "string", "format": "uuid"},
                                    "name": {"type": "string"},
                                    "signalId": {"type": "integer"},
                                    "new": {"type": "boolean"},
                                },
                            },
                            "Kept for the run",
                        ),
                        "404": _error("No such run"),
                        "409": _error("The run has ended, or is an agent-loop run"),
                    },
                }
            },
            "/api/runs/{run_id}/messages": {
                "post": {
                    "summary": "Send a message to an agent-loop run: delivered at its next "
                    "step boundary as a user turn (after the pending tool results), never "
                    "lost, never twice; a SUCCEEDED run continues as the next turn",
                    "operationId": "postMessage",
                    "parameters": [
                        RUN_ID,
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "required": False,
                            "description": "a retried request with the same key is one message",
                            "schema": {"type": "string", "minLength": 1, "maxLength": 200},
                        },
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("Message")}},
                    },
                    "responses": {
                        "202": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "runId": {"type": "string", "format": "uuid"},
                                    "messageId": {"type": "integer"},
                                    "new": {"type": "boolean"},
                                    "status": {"enum": statuses},
                                    "policy": {"enum": list(MESSAGE_POLICIES)},
                                },
                            },
                            "Kept; delivered at the next step boundary (interrupt: the model "
                            "call in flight is aborted and made again with it)",
                        ),
                        "404": _error("No such run"),
                        "409": _error(
                            "The run ended otherwise than SUCCEEDED, is not an agent-loop run, "
                            "or (policy reject) is inside a step"
                        ),
                    },
                }
            },
            "/api/runs/{run_id}/cancel": {
                "post": {
                    "summary": "Cancel a run (a model call in flight is aborted within about a "
                    "second; other steps complete first)",
                    "operationId": "cancelRun",
                    "parameters": [RUN_ID],
                    "responses": {
                        "202": _json(_ref("CancelAccepted"), "Cancellation recorded"),
                        "404": _error("No such run"),
                        "409": _error("The run has already finished"),
                    },
                }
            },
            "/api/schedules": {
                "post": {
                    "summary": "Create a schedule: the agent and input each run gets, a cron "
                    "expression in a time zone, an overlap and a catch-up policy. Each tick "
                    "starts exactly one run, however many beats run.",
                    "operationId": "createSchedule",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("ScheduleRequest")}},
                    },
                    "responses": {
                        "201": _json(_ref("Schedule"), "Created"),
                        "400": _error("Invalid field; the message names it"),
                        "422": _error(
                            "A cron expression that never fires, or an unknown time zone"
                        ),
                    },
                },
                "get": {
                    "summary": "Schedules, oldest first",
                    "operationId": "listSchedules",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "items": {"type": "array", "items": _ref("Schedule")}
                                },
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
                        "200": _json(_ref("Schedule"), "The schedule"),
                        "404": _error("No such schedule"),
                    },
                },
                "delete": {
                    "summary": "Delete a schedule (the runs it started stay)",
                    "operationId": "deleteSchedule",
                    "parameters": [SCHEDULE_ID],
                    "responses": {
                        "200": _json({"type": "object"}, "Deleted"),
                        "404": _error("No such schedule"),
                    },
                },
            },
            "/api/openapi.json": {
                "get": {
                    "summary": "This document",
                    "operationId": "openapi",
                    "responses": {"200": _json({"type": "object"}, "OpenAPI document")},
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Liveness: the process answers",
                    "operationId": "healthz",
                    "responses": {"200": _json({"type": "object"}, "Alive")},
                }
            },
            "/readyz": {
                "get": {
                    "summary": "Readiness: PostgreSQL and Redis answer, migrations current",
                    "operationId": "readyz",
                    "responses": {
                        "200": _json({"type": "object"}, "Ready"),
                        "503": _json({"type": "object"}, "Not ready, with the reasons"),
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a token from DAR_API_TOKENS (when set; else the API is open)",
                }
            },
            "schemas": {
                "RunSubmission": submission_schema(s, agents, any_json_input=any_json_input),
                "Resolution": resolution_schema(),
                "Resume": resume_schema(s),
                "Fork": fork_schema(s, any_json_input=any_json_input),
                "Signal": signal_schema(),
                "Message": message_schema(s),
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
                                },
                            },
                        },
                    },
                },
                "ForkedFrom": {
                    "type": ["object", "null"],
                    "description": "a fork's original run and the seq it forked from",
                    "properties": {
                        "runId": {"type": ["string", "null"], "format": "uuid"},
                        "seq": {"type": "integer"},
                        "replayModel": {"type": "boolean"},
                    },
                },
                "ForkAccepted": {
                    "type": "object",
                    "required": ["id", "status", "forkedFrom"],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "status": {"enum": statuses},
                        "forkedFrom": _ref("ForkedFrom"),
                    },
                },
                "RunDiff": {
                    "type": "object",
                    "required": ["a", "b", "runDifferences", "firstDifferentSeq", "steps"],
                    "properties": {
                        "a": {"type": "object"},
                        "b": {"type": "object"},
                        "runDifferences": {"type": "array", "items": {"type": "string"}},
                        "firstDifferentSeq": {
                            "type": ["integer", "null"],
                            "description": "null when the two runs have the same steps",
                        },
                        "steps": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "seq": {"type": "integer"},
                                    "same": {"type": "boolean"},
                                    "differences": {
                                        "type": "array",
                                        "items": {"type": "string"},
                                    },
                                    "a": {"type": ["object", "null"]},
                                    "b": {"type": ["object", "null"]},
                                },
                            },
                        },
                    },
                },
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
                "RunAccepted": {
                    "type": "object",
                    "required": ["id", "status"],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "status": {"enum": statuses},
                    },
                },
                "CancelAccepted": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "status": {"enum": statuses},
                        "cancelRequested": {"type": "boolean"},
                    },
                },
                "Run": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "agent": {"type": "string"},
                        "status": {"enum": statuses},
                        "input": {},
                        "model": {"type": "string"},
                        "maxSteps": {"type": "integer"},
                        "tokenBudget": {"type": "integer"},
                        "tokensUsed": {"type": "integer"},
                        "inputTokens": {"type": "integer"},
                        "outputTokens": {"type": "integer"},
                        "cacheCreationInputTokens": {"type": "integer"},
                        "cacheReadInputTokens": {"type": "integer"},
                        "costUsd": {"type": "number"},
                        "costBudgetUsd": {"type": ["number", "null"]},
                        "unrecordedTokens": {"type": "integer"},
                        "unrecordedEstimatedTokens": {"type": "integer"},
                        "unrecordedCostUsd": {"type": "number"},
                        "waitReason": NULLABLE_STR,
                        "concurrencyKey": NULLABLE_STR,
                        "priority": {"type": "integer"},
                        "cancelRequested": {"type": "boolean"},
                        "result": {},
                        "error": NULLABLE_STR,
                        "submittedBy": NULLABLE_STR,
                        "tenant": {"type": "string"},
                        "deadlineAt": {"type": "string", "format": "date-time"},
                        "runAt": {"type": "string", "format": "date-time"},
                        "lockedBy": NULLABLE_STR,
                        "leaseExpiresAt": NULLABLE_TIME,
                        "createdAt": {"type": "string", "format": "date-time"},
                        "updatedAt": {"type": "string", "format": "date-time"},
                        "finishedAt": NULLABLE_TIME,
                        "forkedFrom": _ref("ForkedFrom"),
                        "scheduleId": {
                            "type": ["string", "null"],
                            "format": "uuid",
                            "description": "the schedule whose tick started it",
                        },
                        "parentRunId": {
                            "type": ["string", "null"],
                            "format": "uuid",
                            "description": "the run whose steps.child started it",
                        },
                        "children": {
                            "type": "array",
                            "description": "GET of one run: the child runs it started "
                            "(steps.child), oldest first",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "id": {"type": "string", "format": "uuid"},
                                    "agent": {"type": "string"},
                                    "status": {"enum": statuses},
                                    "tokensUsed": {"type": "integer"},
                                    "costUsd": {"type": "number"},
                                },
                            },
                        },
                        "audit": {
                            "type": "array",
                            "items": _ref("AuditEvent"),
                            "description": "who cancelled, resumed, resolved or decided what "
                            "(GET /api/runs/{run_id} only)",
                        },
                    },
                },
                "RunTree": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["runId", "rootId", "nodes", "truncated", "maxNodes", "maxDepth"],
                    "properties": {
                        "runId": {"type": "string", "format": "uuid"},
                        "rootId": {
                            "type": "string",
                            "format": "uuid",
                            "description": "the topmost run shown: the tree's root, or the "
                            "run maxDepth parents up when the tree goes higher",
                        },
                        "nodes": {
                            "type": "array",
                            "description": "the root first, each run followed by its "
                            "children's subtrees, oldest first",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": [
                                    "id",
                                    "parentRunId",
                                    "agent",
                                    "status",
                                    "tokensUsed",
                                    "costUsd",
                                    "createdAt",
                                    "depth",
                                    "childCount",
                                ],
                                "properties": {
                                    "id": {"type": "string", "format": "uuid"},
                                    "parentRunId": {"type": ["string", "null"], "format": "uuid"},
                                    "agent": {"type": "string"},
                                    "status": {"enum": statuses},
                                    "tokensUsed": {
                                        "type": "integer",
                                        "description": "as the run's own: its finished "
                                        "children's included",
                                    },
                                    "costUsd": {"type": "number"},
                                    "createdAt": {"type": "string", "format": "date-time"},
                                    "depth": {
                                        "type": "integer",
                                        "minimum": 0,
                                        "description": "levels below rootId",
                                    },
                                    "childCount": {
                                        "type": "integer",
                                        "minimum": 0,
                                        "description": "its child runs, counted up to "
                                        "maxNodes + 1; more than the nodes listed under it: "
                                        "some were left out",
                                    },
                                },
                            },
                        },
                        "truncated": {
                            "type": "boolean",
                            "description": "some runs of the tree are not listed (past "
                            "maxNodes or maxDepth)",
                        },
                        "maxNodes": {"type": "integer"},
                        "maxDepth": {"type": "integer"},
                    },
                },
                "RunPage": {
                    "type": "object",
                    "properties": {
                        "items": {
                            "type": "array",
                            "description": "runs without their input (GET /api/runs/{run_id} "
                            "has it)",
                            "items": {
                                "allOf": [
                                    _ref("Run"),
                                    {
                                        "type": "object",
                                        "properties": {
                                            "stepCount": {
                                                "type": "integer",
                                                "description": "step rows recorded so far",
                                            }
                                        },
                                    },
                                ]
                            },
                        },
                        "nextCursor": NULLABLE_STR,
                    },
                },
                "Step": {
                    "type": "object",
                    "properties": {
                        "seq": {
                            "type": ["integer", "null"],
                            "description": "null for an AUDIT entry",
                        },
                        "stepKey": {"type": "string"},
                        "kind": {"enum": [*map(str, StepKind), "AUDIT"]},
                        "status": {"enum": [str(st) for st in StepStatus]},
                        "toolName": NULLABLE_STR,
                        "toolUseId": NULLABLE_STR,
                        "childRunId": {
                            "type": ["string", "null"],
                            "description": "a CHILD step: the child run it started",
                        },
                        "model": NULLABLE_STR,
                        "stopReason": NULLABLE_STR,
                        "inputTokens": {"type": "integer"},
                        "outputTokens": {"type": "integer"},
                        "cacheCreationInputTokens": {"type": "integer"},
                        "cacheReadInputTokens": {"type": "integer"},
                        "costUsd": {"type": "number"},
                        "latencyMs": {"type": ["integer", "null"]},
                        "requestId": NULLABLE_STR,
                        "error": NULLABLE_STR,
                        "resolution": NULLABLE_STR,
                        "attempt": {
                            "type": "integer",
                            "description": "executions of the step so far (1 the "
                            "first; above 1 a retry; 0 where not counted)",
                        },
                        "worker": NULLABLE_STR,
                        "startedAt": {"type": "string", "format": "date-time"},
                        "finishedAt": NULLABLE_TIME,
                        "origin": {
                            "enum": [*map(str, StepOrigin), None],
                            "description": "a fork's step it did not execute: copied from the "
                            "original, edited, or a model answer replayed; null: executed",
                        },
                        "originalTokens": {
                            "type": ["integer", "null"],
                            "description": "what the original paid for a copied or replayed "
                            "step, apart from this run's own tokens",
                        },
                        "originalCostUsd": {"type": ["number", "null"]},
                        "actor": {"type": "string", "description": "AUDIT entries: the token"},
                        "action": {"enum": list(AUDIT_ACTIONS)},
                        "detail": {},
                    },
                },
                "Conversation": {
                    "type": "object",
                    "required": ["id", "status", "entries"],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "status": {"enum": statuses},
                        "entries": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["type"],
                                "properties": {
                                    "type": {
                                        "enum": [
                                            "input",
                                            "text",
                                            "tool_call",
                                            "tool_result",
                                            "block",
                                            "step",
                                            "message",
                                            "result",
                                            "error",
                                        ]
                                    },
                                    "seq": {"type": "integer"},
                                    "stepKey": {"type": "string"},
                                    "kind": {"enum": [str(k) for k in StepKind]},
                                    "status": {"enum": [str(st) for st in StepStatus]},
                                    "text": {"type": "string"},
                                    "content": {},
                                    "toolUseId": NULLABLE_STR,
                                    "name": NULLABLE_STR,
                                    "input": {},
                                    "output": {},
                                    "isError": {"type": "boolean"},
                                    "inDoubt": {"type": "boolean"},
                                    "error": NULLABLE_STR,
                                    "result": {},
                                    "block": {},
                                },
                            },
                        },
                    },
                },
                "Stats": {
                    "type": "object",
                    "required": ["window", "bucketSeconds", "finished", "cost", "latency"],
                    "properties": {
                        "window": {"enum": list(STATS_WINDOWS)},
                        "bucketSeconds": {"type": "integer"},
                        "since": {"type": "string", "format": "date-time"},
                        "until": {"type": "string", "format": "date-time"},
                        "finished": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "at": {"type": "string", "format": "date-time"},
                                    "status": {"enum": statuses},
                                    "count": {"type": "integer"},
                                },
                            },
                        },
                        "cost": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "at": {"type": "string", "format": "date-time"},
                                    "model": {"type": "string"},
                                    "usd": {"type": "number"},
                                },
                            },
                        },
                        "latency": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "at": {"type": "string", "format": "date-time"},
                                    "kind": {"enum": [str(k) for k in StepKind]},
                                    "p50Ms": {"type": "number"},
                                    "p95Ms": {"type": "number"},
                                    "count": {"type": "integer"},
                                },
                            },
                        },
                    },
                },
                "WhoAmI": {
                    "type": "object",
                    "required": ["auth", "roles", "approvalRoles", "can"],
                    "properties": {
                        "auth": {"type": "boolean"},
                        "name": NULLABLE_STR,
                        "tenant": NULLABLE_STR,
                        "roles": {"type": "array", "items": {"type": "string"}},
                        "approvalRoles": {
                            "type": "array",
                            "items": {"type": "string"},
                            "description": "approval roles this token may decide",
                        },
                        "can": {
                            "type": "object",
                            "properties": {
                                a: {"type": "boolean"}
                                for a in ("submit", "cancel", "resume", "resolve", "approve")
                            },
                        },
                    },
                },
                "AuditEvent": {
                    "type": "object",
                    "required": ["at", "actor", "action"],
                    "properties": {
                        "at": {"type": "string", "format": "date-time"},
                        "actor": {"type": "string"},
                        "action": {"enum": list(AUDIT_ACTIONS)},
                        "approvalId": {"type": ["string", "null"], "format": "uuid"},
                        "detail": {},
                    },
                },
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["code", "message"],
                            "properties": {
                                "code": {"type": "string"},
                                "message": {"type": "string"},
                                "field": {"type": "string"},
                            },
                        }
                    },
                },
            },
        },
    }
    add_versions(document)
    _common_responses(document, auth)
    return document


def _common_responses(document: JsonObj, auth: bool) -> None:
    """What every /api operation may answer besides its own responses: the token errors, and
    for a body the size, media type and text rules."""
    for path, item in document["paths"].items():
        for operation in item.values():
            responses = operation["responses"]
            if auth and path.startswith("/api/") and path != "/api/openapi.json":
                operation["security"] = [{"bearer": []}]
                responses.setdefault("401", _error("No valid token (when tokens are configured)"))
                responses.setdefault("403", _error("The token lacks the role this needs"))
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
                responses.setdefault("400", _error("Invalid field; the message names it"))
                responses.setdefault("408", _error("The body did not arrive in time"))
                responses.setdefault(
                    "503",
                    _error(
                        "Too many chunked bodies being received at once "
                        "(DAR_HTTP_BUFFER_BYTES); retry after Retry-After seconds"
                    ),
                )
                responses.setdefault("413", _error("Body larger than DAR_MAX_BODY_BYTES"))
                responses.setdefault("415", _error("Body is not JSON"))
            # Every string in a query or body is refused (400) when it is not text PostgreSQL
            # can store, and JSON is refused when nested too deep.
            if "requestBody" in operation or operation.get("parameters"):
                responses.setdefault(
                    "400",
                    _error(f"Invalid parameter: {TEXT_RULE}, at most {MAX_JSON_DEPTH} deep"),
                )
