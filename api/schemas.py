"""The JSON Schemas of request bodies: the validators check requests against exactly these,
and the OpenAPI document publishes exactly these, so the two cannot drift.

Each property's ``description`` is the message a caller gets when the property is wrong
(after the field's name), so it says what to send and names the setting behind a limit.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from api.errors import ApiError, invalid
from runtime.admission.concurrency_keys import MAX_KEY_CHARS, PRIORITY_RANGE
from runtime.config import Settings
from runtime.engine.schedules import CATCH_UPS, MAX_CRON_CHARS, OVERLAPS

JsonObj = dict[str, Any]

MAX_JSON_DEPTH = 64
"""Arrays and objects nested deeper than this are refused (400), never parsed into a 500."""

# Text PostgreSQL cannot store (NUL) or UTF-8 cannot encode (lone surrogates) is refused with
# a 400 naming the field. The same rule, as a regular expression, for the document.
_UNSAFE = re.compile("[\x00\ud800-\udfff]")
_SAFE_CHAR = r"[^\u0000\ud800-\udfff]"
SAFE_TEXT = f"^{_SAFE_CHAR}*$"
NON_BLANK_TEXT = rf"^{_SAFE_CHAR}*[^\s\u0000\ud800-\udfff]{_SAFE_CHAR}*$"
TEXT_RULE = "text without NUL characters or unpaired surrogates"

CURSOR_PATTERN = r"^[0-9]{1,16}\.[0-9a-f]{32}$"
"""A page cursor, ``<microseconds since 1970>.<run id hex>``: every string of this form is a
valid position, so the document's pattern is exactly what the API accepts."""

ID_PREFIX_PATTERN = r"^[0-9a-fA-F-]{1,36}$"
"""The start of a run id, as the logs print it (8 hex digits) or longer."""
MAX_AGENT_CHARS = 200
STATS_WINDOWS = {"24h": 86_400, "7d": 7 * 86_400}
"""The overview's windows, by the name the console and ``GET /api/stats`` use."""

MIN_COST_BUDGET = 0.0001
MAX_COST_BUDGET = 100_000
MAX_STEPS = 10_000
MAX_MODEL_CHARS = 200
MAX_COMMENT_CHARS = 4000
MAX_REASON_CHARS = 4000
RESOLVE_ACTIONS = ("supply_result", "retry", "fail")
MAX_SEQ = 2_147_483_647
"""A step's seq is a PostgreSQL integer."""
# GET /api/runs/{id}/tree: the runs it shows at most (breadth-first from the root; the run
# itself and its ancestors come on top of these) and the levels below the root it goes down.
TREE_MAX_NODES = 200
TREE_MAX_DEPTH = 16


def _text(description: str, *, max_length: int, non_blank: bool = False) -> JsonObj:
    return {
        "type": "string",
        "minLength": 1 if non_blank else 0,
        "maxLength": max_length,
        "pattern": NON_BLANK_TEXT if non_blank else SAFE_TEXT,
        "description": description,
    }


def _whole(low: int, high: int, setting: str) -> JsonObj:
    return {
        "type": ["integer", "null"],
        "minimum": low,
        "maximum": high,
        "description": f"must be a whole number between {low} and {high} ({setting}); "
        "null or absent for the default",
    }


def submission_schema(
    settings: Settings, agents: list[str] | None = None, *, any_json_input: bool = False
) -> JsonObj:
    limit = settings.max_input_chars
    text_input = _text(
        f"must be a non-empty string of {TEXT_RULE}, at most {limit} characters "
        "(DAR_MAX_INPUT_CHARS)",
        max_length=limit,
        non_blank=True,
    )
    input_schema: JsonObj = text_input
    if any_json_input:
        input_schema = {
            "anyOf": [text_input, {"type": ["object", "array", "number", "boolean"]}],
            "description": "must be a non-empty string (agent-loop agents) or any JSON but "
            f"null (durable functions), of {TEXT_RULE}, at most {limit} characters "
            f"(DAR_MAX_INPUT_CHARS), nested at most {MAX_JSON_DEPTH} deep",
        }
    agent: JsonObj = {
        "type": "string",
        "description": "must be the name of a registered agent"
        + (f"; known agents: {', '.join(agents)}" if agents else ""),
    }
    if agents:
        agent["enum"] = agents
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["input"],
        "properties": {
            "input": input_schema,
            "tokenBudget": _whole(1, settings.max_token_budget, "DAR_MAX_TOKEN_BUDGET"),
            "costBudgetUsd": {
                "type": ["number", "null"],
                "minimum": MIN_COST_BUDGET,
                "maximum": MAX_COST_BUDGET,
                "description": f"must be a number of US dollars from {MIN_COST_BUDGET} to "
                f"{MAX_COST_BUDGET}; null or absent for none",
            },
            "timeoutSeconds": _whole(1, settings.max_timeout_seconds, "DAR_MAX_TIMEOUT_SECONDS"),
            "model": {
                **_text(
                    f"must be a model name such as claude-sonnet-4-5 ({TEXT_RULE}, at most "
                    f"{MAX_MODEL_CHARS} characters); null, empty or absent for the default",
                    max_length=MAX_MODEL_CHARS,
                ),
                "type": ["string", "null"],
            },
            "maxSteps": _whole(1, MAX_STEPS, f"at most {MAX_STEPS}"),
            "agent": agent,
            "concurrencyKey": {
                **_text(
                    "must be a non-blank string naming who the run counts against (a tenant, "
                    f"a customer, a repository; {TEXT_RULE}, at most {MAX_KEY_CHARS} "
                    "characters): at most DAR_KEY_CONCURRENCY runs of one key are inside a "
                    "step at once; null or absent for none",
                    max_length=MAX_KEY_CHARS,
                    non_blank=True,
                ),
                "type": ["string", "null"],
            },
            "priority": {
                "type": ["integer", "null"],
                "minimum": PRIORITY_RANGE[0],
                "maximum": PRIORITY_RANGE[1],
                "description": f"must be a whole number from {PRIORITY_RANGE[0]} to "
                f"{PRIORITY_RANGE[1]}: higher goes first among runs waiting for a key slot or "
                "a model's rate limit; null or absent for 0",
            },
        },
    }


_CRON_FIELD = r"[0-9A-Za-z*?#,/-]+"
CRON_PATTERN = rf"^\s*{_CRON_FIELD}(\s+{_CRON_FIELD}){{4,5}}\s*$"
"""The shape of a cron expression (5 or 6 fields); whether it ever fires is checked apart
(422)."""
ZONE_PATTERN = r"^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+)*$"


def schedule_schema(
    settings: Settings, agents: list[str] | None = None, *, any_json_input: bool = False
) -> JsonObj:
    """``POST /api/schedules``: a run's submission (what each tick's run gets) and when."""
    submission = submission_schema(settings, agents, any_json_input=any_json_input)
    properties = {k: v for k, v in submission["properties"].items() if k != "concurrencyKey"}
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["input", "cron"],
        "properties": {
            **properties,
            "cron": {
                "type": "string",
                "maxLength": MAX_CRON_CHARS,
                "pattern": CRON_PATTERN,
                "description": "must be a cron expression: 5 fields (minute hour day month "
                "weekday, e.g. '0 9 * * 1-5') or 6 (seconds first, e.g. '*/10 * * * * *': "
                f"every ten seconds), at most {MAX_CRON_CHARS} characters",
            },
            "timezone": {
                "type": "string",
                "maxLength": 64,
                "pattern": ZONE_PATTERN,
                "description": "must be an IANA time zone name such as 'UTC' or "
                "'Europe/Paris' (the cron expression is read in it); absent for UTC",
            },
            "overlap": {
                "enum": list(OVERLAPS),
                "description": "must be skip (a tick while the schedule's last run is live "
                "starts nothing), queue (it starts when that run ends) or allow (it starts "
                "at once); absent for skip",
            },
            "catchUp": {
                "enum": list(CATCH_UPS),
                "description": "must be none (ticks missed while nothing ran are dropped), "
                "latest (the newest missed tick runs) or all (every missed tick runs); "
                "absent for none",
            },
        },
    }


MESSAGE_POLICIES = ("enqueue", "interrupt", "reject")


MESSAGE_BLOCK_TYPES = ("text", "image", "document")
"""The content blocks a message may carry: what a user says. Never a tool_result, tool_use or
thinking block: those are the run's own history, and one forged would be read as a tool's
output."""


def message_schema(settings: Settings) -> JsonObj:
    """``POST /api/runs/{id}/messages``: text or content blocks, and what to do while the
    run is inside a step."""
    limit = settings.max_input_chars
    return {
        "type": "object",
        "additionalProperties": False,
        "oneOf": [{"required": ["text"]}, {"required": ["content"]}],
        "properties": {
            "text": _text(
                f"must be a non-empty string of {TEXT_RULE}, at most {limit} characters "
                "(DAR_MAX_INPUT_CHARS): the user's message",
                max_length=limit,
                non_blank=True,
            ),
            "content": {
                "type": "array",
                "minItems": 1,
                "maxItems": 100,
                "items": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"enum": list(MESSAGE_BLOCK_TYPES)}},
                },
                "description": "must be a non-empty list of Messages API content blocks a "
                f"user may send ({', '.join(MESSAGE_BLOCK_TYPES)}; e.g. "
                '{"type": "text", "text": "..."}), at most DAR_MAX_INPUT_CHARS characters as '
                "JSON in all; send text or content, not both",
            },
            "policy": {
                "enum": list(MESSAGE_POLICIES),
                "description": "must be enqueue (default: delivered at the next step "
                "boundary), reject (409 while the run is inside a step) or interrupt",
            },
        },
    }


def signal_schema() -> JsonObj:
    """``POST /api/runs/{id}/signals/{name}``: the payload ``steps.wait_for`` returns."""
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "payload": {
                "description": "any JSON: what the run's steps.wait_for(name) returns; absent "
                "for null"
            }
        },
    }


def resume_schema(settings: Settings) -> JsonObj:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "tokenBudget": _whole(1, settings.max_token_budget, "DAR_MAX_TOKEN_BUDGET"),
            "timeoutSeconds": _whole(1, settings.max_timeout_seconds, "DAR_MAX_TIMEOUT_SECONDS"),
        },
    }


def fork_schema(settings: Settings, *, any_json_input: bool = False) -> JsonObj:
    """``POST /api/runs/{id}/fork``: where to fork from, and what to change."""
    submission = submission_schema(settings, any_json_input=any_json_input)["properties"]
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["fromSeq"],
        "properties": {
            "fromSeq": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_SEQ,
                "description": "must be the seq of the first step the fork executes itself "
                "(steps before it are copied from the run, never executed again), a whole "
                f"number from 1 to {MAX_SEQ}",
            },
            "input": {
                **submission["input"],
                "description": "the fork's input instead of the run's: "
                + submission["input"]["description"],
            },
            "model": submission["model"],
            "toolResult": {
                "type": ["object", "null"],
                "additionalProperties": False,
                "required": ["seq", "output"],
                "properties": {
                    "seq": {"type": "integer", "minimum": 1, "maximum": MAX_SEQ},
                    "output": {},
                },
                "description": 'must be {"seq": k, "output": ...}: the result of the copied '
                "step k (a TOOL step of an agent loop, a STEP or SIDE_EFFECT step of a durable "
                f"function; k below fromSeq) replaced by output, any JSON of {TEXT_RULE}",
            },
            "tokenBudget": submission["tokenBudget"],
            "timeoutSeconds": submission["timeoutSeconds"],
            "replayModel": {
                "type": "boolean",
                "description": "must be true or false: true answers each model step from the "
                "run's recorded response while the request is byte-identical to the recorded "
                "one, and calls the model from the first request that differs",
            },
            "reuseApprovals": {
                "type": "boolean",
                "description": "must be true or false: true keeps the run's decisions on the "
                "approval at fromSeq and the approved approvals before it (the fork runs the "
                "steps they authorise without asking; needs a token with approve and each "
                "approval's role); false or absent: the fork asks again for each of them "
                "before it runs anything after it",
            },
        },
    }


def decision_schema() -> JsonObj:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "comment": {
                **_text(
                    f"must be a string of {TEXT_RULE}, at most {MAX_COMMENT_CHARS} characters",
                    max_length=MAX_COMMENT_CHARS,
                ),
                "type": ["string", "null"],
            },
            "payloadHash": {
                "type": ["string", "null"],
                "pattern": "^[0-9a-f]{64}$",
                "description": "must be the approval's payloadHash as shown (64 hex digits); "
                "the decision is refused (409) if the payload changed since",
            },
        },
    }


def resolution_schema() -> JsonObj:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["action"],
        "properties": {
            "action": {
                "enum": list(RESOLVE_ACTIONS),
                "description": f"must be one of {', '.join(RESOLVE_ACTIONS)}",
            },
            "output": {
                "description": "the tool's result (required with supply_result): any JSON of "
                f"{TEXT_RULE}, nested at most {MAX_JSON_DEPTH} deep",
            },
            "isError": {"type": "boolean", "description": "must be true or false"},
            "reason": {
                **_text(
                    f"must be a string of {TEXT_RULE}, at most {MAX_REASON_CHARS} characters",
                    max_length=MAX_REASON_CHARS,
                ),
                "type": ["string", "null"],
            },
        },
        # supply_result needs the output it supplies.
        "if": {"properties": {"action": {"const": "supply_result"}}},
        "then": {"required": ["output"]},
    }


@lru_cache(maxsize=64)
def _validator(schema_json: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(schema_json))


def _field(error: ValidationError) -> str:
    path = list(error.absolute_path)
    if error.validator == "required" and not path:
        missing = [r for r in error.validator_value if r not in error.instance]
        return str(missing[0]) if missing else "body"
    return str(path[0]) if path else "body"


def validate(body: Any, schema: JsonObj) -> None:
    """Raise a 400 naming the first field of ``body`` that ``schema`` refuses, with the
    field's description as the message."""
    validator = _validator(json.dumps(schema, sort_keys=True))
    errors = sorted(validator.iter_errors(body), key=lambda e: (list(e.absolute_path), e.path))
    if not errors:
        return
    error = errors[0]
    properties: JsonObj = schema.get("properties", {})
    if error.validator == "additionalProperties" and not error.absolute_path:
        unknown = sorted(set(body) - set(properties))[0]
        raise ApiError(
            400,
            f"unknown field {unknown!r}; allowed fields: {', '.join(properties)}",
            code="unknown_field",
            field=unknown,
        )
    field = _field(error)
    if error.validator == "required":
        raise invalid(field, "is required: " + properties.get(field, {}).get("description", ""))
    described = properties.get(field, {}).get("description") or error.message
    if error.validator == "maxLength" and isinstance(error.instance, str):
        raise invalid(
            field,
            f"is {len(error.instance)} characters; the limit is {error.validator_value}; "
            + described,
        )
    raise invalid(field, described)


# -- hostile text and depth, anywhere in a JSON value --------------------------------------


_Node = tuple[Any, Any] | None
"""Where a value sits, as ``(parent node, key or index)``: the dotted path is spelt out only
when an error names it, never for every value walked."""


def _path(node: _Node, root: str) -> str:
    parts: list[Any] = []
    while node is not None:
        node, key = node
        parts.append(key)
    where = root
    for key in reversed(parts):
        if isinstance(key, int):
            where = f"{where}[{key}]"
        else:
            where = f"{where}.{key}" if where else str(key)
    return where or "body"


_ESCAPED_UNSAFE = re.compile(rb"\\u(?:0000|[dD][89abcdefABCDEF])")
"""In a UTF-8 JSON text a string holds NUL or a surrogate only through a ``\\u`` escape
(a raw control character is invalid JSON, a raw surrogate invalid UTF-8)."""


def may_hold_unsafe_text(raw: bytes) -> bool:
    """False when the JSON text ``raw`` cannot decode to a string with NUL or an unpaired
    surrogate: a scan of the bytes (C speed) that spares the walk over every string."""
    return b"\x00" in raw or _ESCAPED_UNSAFE.search(raw) is not None


def check_json(value: Any, field: str = "", *, text: bool = True) -> None:
    """Refuse (400, naming the place) text PostgreSQL cannot store or UTF-8 cannot encode, and
    nesting deeper than :data:`MAX_JSON_DEPTH`, anywhere in ``value``. ``text=False`` checks
    the depth only (the caller knows no string can be unsafe: :func:`may_hold_unsafe_text`)."""
    stack: list[tuple[Any, int, _Node]] = [(value, 0, None)]
    while stack:
        item, depth, node = stack.pop()
        if depth >= MAX_JSON_DEPTH and isinstance(item, (dict, list)) and item:
            first = next(iter(item)) if isinstance(item, dict) else 0
            raise invalid(_path((node, first), field), f"is nested more than {MAX_JSON_DEPTH} deep")
        if isinstance(item, dict):
            for key, child in item.items():
                if text and _UNSAFE.search(key):
                    raise invalid(_path((node, key), field), f"must be {TEXT_RULE}")
                if text or isinstance(child, (dict, list)):
                    stack.append((child, depth + 1, (node, key)))
        elif isinstance(item, list):
            for i, child in enumerate(item):
                if text or isinstance(child, (dict, list)):
                    stack.append((child, depth + 1, (node, i)))
        elif text and isinstance(item, str) and _UNSAFE.search(item):
            raise invalid(_path(node, field), f"must be {TEXT_RULE}")


def check_text(value: str, field: str) -> None:
    if _UNSAFE.search(value):
        raise invalid(field, f"must be {TEXT_RULE}")
