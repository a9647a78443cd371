"""The OpenAPI document, part: runs (submit, list, inspect, resolve, resume, cancel)."""

from __future__ import annotations

from api.openapi.common import (
    AGENT_FILTER,
    EVENT_ID_PATTERN,
    NULLABLE_STR,
    NULLABLE_TIME,
    RUN_ID,
    Context,
    JsonObj,
    error,
    ref,
    response,
)
from api.schemas import (
    CURSOR_PATTERN,
    ID_PREFIX_PATTERN,
    TREE_MAX_DEPTH,
    TREE_MAX_NODES,
    resolution_schema,
    resume_schema,
    submission_schema,
)
from db.records import StepKind, StepOrigin, StepStatus
from db.schema import AUDIT_ACTIONS


def paths(c: Context) -> JsonObj:
    """The paths of runs."""
    s, statuses = c.s, c.statuses
    return {
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
                    "content": {"application/json": {"schema": ref("RunSubmission")}},
                },
                "responses": {
                    "201": response(ref("RunAccepted"), "Run stored and queued"),
                    "200": response(ref("RunAccepted"), "Idempotent replay: the earlier run"),
                    "400": error("Invalid field; the message names it"),
                    "413": error("Body larger than DAR_MAX_BODY_BYTES"),
                    "415": error("Body is not JSON"),
                    "422": error("Idempotency-Key reused with a different body"),
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
                    "200": response(ref("RunPage"), "A page of runs"),
                    "400": error("Invalid query parameter"),
                },
            },
        },
        "/api/runs/counts": {
            "get": {
                "summary": "How many runs are in each status (optionally of one agent)",
                "operationId": "countRuns",
                "parameters": [AGENT_FILTER],
                "responses": {
                    "200": response(
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
                    "400": error("Invalid query parameter"),
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
                    "200": response(ref("Conversation"), "The conversation"),
                    "404": error("No such run"),
                },
            }
        },
        "/api/runs/{run_id}": {
            "get": {
                "summary": "Get a run",
                "operationId": "getRun",
                "parameters": [RUN_ID],
                "responses": {
                    "200": response(ref("Run"), "The run"),
                    "404": error("No such run"),
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
                    "200": response(ref("RunTree"), "The tree"),
                    "404": error("No such run"),
                },
            }
        },
        "/api/runs/{run_id}/timeline": {
            "get": {
                "summary": "The run's steps, in order, without request bodies",
                "operationId": "getTimeline",
                "parameters": [RUN_ID],
                "responses": {
                    "200": response({"type": "array", "items": ref("Step")}, "The steps"),
                    "404": error("No such run"),
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
                    "400": error("Malformed Last-Event-ID, or one of another run"),
                    "404": error("No such run"),
                    "429": error(
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
                    "content": {"application/json": {"schema": ref("Resolution")}},
                },
                "responses": {
                    "200": response(ref("RunAccepted"), "Resolved"),
                    "400": error("Invalid field"),
                    "404": error("No such run"),
                    "409": error("The run is not NEEDS_ATTENTION"),
                    "415": error("Body is not JSON"),
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
                    "content": {"application/json": {"schema": ref("Resume")}},
                },
                "responses": {
                    "202": response(ref("RunAccepted"), "Resumed"),
                    "400": error("Invalid field"),
                    "404": error("No such run"),
                    "409": error("Not FAILED or TIMED_OUT, or already compensated"),
                    "415": error("Body is not JSON"),
                    "429": error(
                        "The token has DAR_TOKEN_MAX_ACTIVE_RUNS runs in flight (a resumed "
                        "run is in flight again); Retry-After says when to try again"
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
                    "202": response(ref("CancelAccepted"), "Cancellation recorded"),
                    "404": error("No such run"),
                    "409": error("The run has already finished"),
                },
            }
        },
    }


def schemas(c: Context) -> JsonObj:
    """The component schemas of runs."""
    s, agents, any_json_input, statuses = c.s, c.agents, c.any_json_input, c.statuses
    return {
        "RunSubmission": submission_schema(s, agents, any_json_input=any_json_input),
        "Resolution": resolution_schema(),
        "Resume": resume_schema(s),
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
                "forkedFrom": ref("ForkedFrom"),
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
                    "items": ref("AuditEvent"),
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
                                "description": "as the run's own: its finished children's included",
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
                    "description": "runs without their input (GET /api/runs/{run_id} has it)",
                    "items": {
                        "allOf": [
                            ref("Run"),
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
    }
