"""The OpenAPI document, part: messages to agent-loop runs and signals to durable functions."""

from __future__ import annotations

from api.openapi.common import RUN_ID, Context, JsonObj, error, ref, response
from api.schemas import (
    MESSAGE_POLICIES,
    message_schema,
    signal_schema,
)


def paths(c: Context) -> JsonObj:
    """The paths of messages to agent-loop runs and signals to durable functions."""
    statuses = c.statuses
    return {
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
                    "content": {"application/json": {"schema": ref("Signal")}},
                },
                "responses": {
                    "202": response(
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
                    "400": error(
                        "Invalid name or payload (over DAR_MAX_INPUT_CHARS as JSON), or an "
                        "Idempotency-Key in the runtime's own namespace"
                    ),
                    "404": error("No such run"),
                    "409": error(
                        "The run has ended, is an agent-loop run, or holds "
                        "DAR_MAX_PENDING_PER_RUN undelivered messages and signals"
                    ),
                    "422": error("The Idempotency-Key was used for another signal"),
                    "429": error(
                        "The token sent DAR_MESSAGE_RATE_PER_MINUTE messages and signals "
                        "in the last minute; Retry-After says when to try again"
                    ),
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
                    "content": {"application/json": {"schema": ref("Message")}},
                },
                "responses": {
                    "202": response(
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
                    "400": error(
                        "Invalid field (the whole content over DAR_MAX_INPUT_CHARS, a "
                        "block type a user may not send), or an Idempotency-Key in the "
                        "runtime's own namespace"
                    ),
                    "404": error("No such run"),
                    "409": error(
                        "The run ended otherwise than SUCCEEDED, is not an agent-loop run, "
                        "(policy reject) is inside a step, or holds DAR_MAX_PENDING_PER_RUN "
                        "undelivered messages and signals"
                    ),
                    "422": error("The Idempotency-Key was used for another message"),
                    "429": error(
                        "The token sent DAR_MESSAGE_RATE_PER_MINUTE messages and signals "
                        "in the last minute, or (a message reopening a SUCCEEDED run is a "
                        "resume) is over its submit quota"
                    ),
                },
            }
        },
    }


def schemas(c: Context) -> JsonObj:
    """The component schemas of messages to agent-loop runs and signals to durable functions."""
    s = c.s
    return {
        "Signal": signal_schema(),
        "Message": message_schema(s),
    }
