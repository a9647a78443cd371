"""The OpenAPI document, part: the service itself (stats, this document, health, errors)."""

from __future__ import annotations

from api.openapi.common import Context, JsonObj, error, ref, response
from api.schemas import (
    STATS_WINDOWS,
)
from db.records import StepKind


def paths(c: Context) -> JsonObj:
    """The paths of the service itself."""
    return {
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
                    "200": response(ref("Stats"), "Hourly aggregates"),
                    "400": error("Invalid query parameter"),
                },
            }
        },
        "/api/openapi.json": {
            "get": {
                "summary": "This document",
                "operationId": "openapi",
                "responses": {"200": response({"type": "object"}, "OpenAPI document")},
            }
        },
        "/healthz": {
            "get": {
                "summary": "Liveness: the process answers",
                "operationId": "healthz",
                "responses": {"200": response({"type": "object"}, "Alive")},
            }
        },
        "/readyz": {
            "get": {
                "summary": "Readiness: PostgreSQL and Redis answer, migrations current",
                "operationId": "readyz",
                "responses": {
                    "200": response({"type": "object"}, "Ready"),
                    "503": response({"type": "object"}, "Not ready, with the reasons"),
                },
            }
        },
    }


def schemas(c: Context) -> JsonObj:
    """The component schemas of the service itself."""
    statuses = c.statuses
    return {
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
    }
