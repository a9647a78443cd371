"""The OpenAPI document, part: the token a request carries: whoami."""

from __future__ import annotations

from api.openapi.common import NULLABLE_STR, Context, JsonObj, ref, response


def paths(c: Context) -> JsonObj:
    """The paths of the token a request carries: whoami."""
    return {
        "/api/whoami": {
            "get": {
                "summary": "The token: its name, tenant, roles, and the actions it may take "
                "(all of them when authentication is off)",
                "operationId": "whoami",
                "responses": {"200": response(ref("WhoAmI"), "The token")},
            }
        },
    }


def schemas(c: Context) -> JsonObj:
    """The component schemas of the token a request carries: whoami."""
    return {
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
                    "description": "what the console may offer this token (versions: read "
                    "GET /api/versions, the metrics role; upgrade: POST an upgrade, admin)",
                    "properties": {
                        a: {"type": "boolean"}
                        for a in (
                            "submit",
                            "fork",
                            "cancel",
                            "resume",
                            "resolve",
                            "approve",
                            "versions",
                            "upgrade",
                        )
                    },
                },
            },
        },
    }
