"""The OpenAPI document, part: forks and the diff of two runs."""

from __future__ import annotations

from api.openapi.common import OTHER_ID, RUN_ID, Context, JsonObj, error, ref, response
from api.schemas import (
    fork_schema,
)


def paths(c: Context) -> JsonObj:
    """The paths of forks and the diff of two runs."""
    return {
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
                    "content": {"application/json": {"schema": ref("Fork")}},
                },
                "responses": {
                    "201": response(ref("ForkAccepted"), "The fork, stored and queued"),
                    "200": response(ref("ForkAccepted"), "Idempotent replay: the earlier fork"),
                    "400": error("Invalid field; the message names it"),
                    "404": error("No such run"),
                    "409": error(
                        "The run's state refuses the fork (a step before fromSeq has not "
                        "completed, or its agent is not registered)"
                    ),
                    "422": error(
                        "Idempotency-Key reused with a different body, another run, or by a submit"
                    ),
                    "429": error("Too many submits by this token (a fork is a submit)"),
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
                    "200": response(ref("RunDiff"), "The comparison"),
                    "404": error("No such run (either)"),
                },
            }
        },
    }


def schemas(c: Context) -> JsonObj:
    """The component schemas of forks and the diff of two runs."""
    s, any_json_input, statuses = c.s, c.any_json_input, c.statuses
    return {
        "Fork": fork_schema(s, any_json_input=any_json_input),
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
                "forkedFrom": ref("ForkedFrom"),
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
    }
