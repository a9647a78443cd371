"""The OpenAPI document, part: deployment versions (``/api/versions``, api/versions.py) and a
run's version (:data:`RUN_DEPLOYMENT` is the ``Run`` schema's ``deployment`` property)."""

from __future__ import annotations

from typing import Any

JsonObj = dict[str, Any]

_NULLABLE_STR = {"type": ["string", "null"]}


def _ref(name: str) -> JsonObj:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: JsonObj, description: str) -> JsonObj:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


RUN_DEPLOYMENT: JsonObj = {
    **_NULLABLE_STR,
    "description": "the version of the code the run started on; only workers of that "
    "version drive it (null: stored before versions, any worker)",
}


def paths(c: object = None) -> JsonObj:
    """The paths of deployment versions."""
    error = _json(_ref("Error"), "")
    found: JsonObj = {}
    found["/api/versions"] = {
        "get": {
            "summary": "The deployment versions: the workers that serve each one and its runs "
            "in flight; runs of a version no live worker serves wait for one (or an upgrade)",
            "operationId": "listVersions",
            "responses": {"200": _json(_ref("Versions"), "Every version seen")},
        }
    }
    found["/api/versions/{deployment}/upgrade"] = {
        "post": {
            "summary": "Move the runs of a version to this process's version, each only after "
            "its recorded history replays clean against this process's code (no model call, "
            "no tool effect); the others stay, with their first divergence",
            "operationId": "upgradeVersion",
            "parameters": [
                {
                    "name": "deployment",
                    "in": "path",
                    "required": True,
                    "description": "the version whose runs move",
                    "schema": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"},
                }
            ],
            "requestBody": {
                "required": False,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "runIds": {
                                    "type": "array",
                                    "maxItems": 1000,
                                    "items": {"type": "string", "format": "uuid"},
                                    "description": "only these runs (default: every run of "
                                    "the version in flight, and its failed runs)",
                                },
                                "dryRun": {
                                    "type": "boolean",
                                    "description": "check only, move nothing",
                                },
                            },
                        }
                    }
                },
            },
            "responses": {
                "200": _json(_ref("UpgradeReport"), "What moved and what stayed, and why"),
                "400": {**error, "description": "Invalid field or version name"},
                "409": {**error, "description": "The version is this process's own"},
            },
        }
    }
    return found


def schemas(c: object = None) -> JsonObj:
    """The component schemas of deployment versions."""
    found: JsonObj = {}
    found["Versions"] = {
        "type": "object",
        "required": ["current", "unservedRuns", "versions"],
        "properties": {
            "current": {**_NULLABLE_STR, "description": "this web process's version"},
            "unservedRuns": {
                "type": "integer",
                "description": "runs in flight of versions no live worker serves",
            },
            "upgradePolicies": {
                "type": "object",
                "description": "each agent of this web process's version, with its upgrade "
                "policy: pinned (an operator upgrades its runs) or replay (the newest live "
                "version's workers upgrade the runs of a version no live worker serves, after "
                "the same replay check, audited with the actor policy)",
                "additionalProperties": {"type": "string", "enum": ["pinned", "replay"]},
            },
            "versions": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["deployment", "workers", "liveWorkers", "runs", "inFlight"],
                    "properties": {
                        "deployment": _NULLABLE_STR,
                        "served": {"type": "boolean"},
                        "liveWorkers": {"type": "integer"},
                        "inFlight": {"type": "integer"},
                        "runs": {
                            "type": "object",
                            "description": "runs in flight by status",
                            "additionalProperties": {"type": "integer"},
                        },
                        "workers": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "worker": {"type": "string"},
                                    "live": {"type": "boolean"},
                                    "startedAt": {"type": "string", "format": "date-time"},
                                    "lastSeen": {"type": "string", "format": "date-time"},
                                },
                            },
                        },
                    },
                },
            },
        },
    }
    found["RunCheck"] = {
        "type": "object",
        "properties": {
            "runId": {"type": "string", "format": "uuid"},
            "agent": {"type": "string"},
            "deployment": _NULLABLE_STR,
            "clean": {"type": "boolean"},
            "steps": {"type": "integer", "description": "recorded steps replayed"},
            "moved": {"type": "boolean"},
            "busy": {"type": "boolean", "description": "a worker held it: try again"},
            "divergence": {
                "type": ["object", "null"],
                "properties": {
                    "seq": {"type": ["integer", "null"]},
                    "recorded": {"type": "string"},
                    "asked": {"type": "string", "description": "what the new code asked for"},
                },
            },
            "configurationChanges": {"type": "array", "items": {"type": "string"}},
        },
    }
    found["UpgradeReport"] = {
        "type": "object",
        "properties": {
            "from": _NULLABLE_STR,
            "to": {"type": "string"},
            "dryRun": {"type": "boolean"},
            "checked": {"type": "integer"},
            "moved": {"type": "array", "items": {"type": "string", "format": "uuid"}},
            "busy": {"type": "array", "items": {"type": "string", "format": "uuid"}},
            "stayed": {"type": "array", "items": _ref("RunCheck")},
            "runs": {"type": "array", "items": _ref("RunCheck")},
        },
    }
    return found
