"""Request validation: each rule names the field and the limit, so the caller knows what
to fix. Bodies are checked against the JSON Schemas of :mod:`api.schemas`, the ones the
OpenAPI document publishes."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from flask import Request

from api.errors import ApiError, invalid
from api.schemas import (
    MAX_JSON_DEPTH,
    MIN_COST_BUDGET,
    check_json,
    check_text,
    may_hold_unsafe_text,
    submission_schema,
    validate,
)
from runtime.agents import Agent, AgentRegistry
from runtime.config import Settings

__all__ = ["MIN_COST_BUDGET", "SUBMIT_FIELDS", "Submission", "json_body", "parse_submission"]

SUBMIT_FIELDS = (
    "input",
    "tokenBudget",
    "costBudgetUsd",
    "timeoutSeconds",
    "model",
    "maxSteps",
    "agent",
    "concurrencyKey",
    "priority",
)


def json_body(request: Request, *, limit_input: int | None = None) -> dict[str, Any]:
    """The body as a JSON object whose every string is storable and whose nesting is at
    most :data:`~api.schemas.MAX_JSON_DEPTH` deep; 400 or 415 otherwise.

    Cheapest first: the body's size (Flask refuses one over ``DAR_MAX_BODY_BYTES`` before it
    is read), the parse (C), ``input``'s size when ``limit_input`` is given, and only then the
    walk over the value (Python), which a scan of the raw bytes spares when no string can
    hold NUL or a surrogate. A body refused for its size costs no walk."""
    if not request.is_json:
        raise ApiError(
            415,
            "send the body as JSON with the header Content-Type: application/json",
            code="unsupported_media_type",
        )
    raw = request.get_data(cache=True)
    try:
        body = json.loads(raw or b"null")
    except RecursionError:
        raise ApiError(
            400, f"the body is nested more than {MAX_JSON_DEPTH} deep", code="invalid_json"
        ) from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    if limit_input is not None and "input" in body:
        check_input_size(body["input"], limit_input)
    check_json(body, text=may_hold_unsafe_text(raw))
    return body


def input_size(value: Any) -> int:
    """What ``DAR_MAX_INPUT_CHARS`` counts: a string's characters, other JSON's text."""
    if isinstance(value, str):
        return len(value)
    try:
        return len(json.dumps(value))
    except (RecursionError, ValueError):
        return sys.maxsize


def check_input_size(value: Any, limit: int) -> None:
    size = input_size(value)
    if size > limit:
        raise invalid("input", f"is {size} characters; the limit is {limit} (DAR_MAX_INPUT_CHARS)")


def optional_json_body(request: Request) -> dict[str, Any]:
    """:func:`json_body`, or ``{}`` when the request has no body at all. A body announced
    but not read (a chunked one no server in front buffered) is a 400, never "no body": a
    decision read without its ``payloadHash`` pin would approve what nobody saw."""
    if request.get_data(cache=True):
        return json_body(request)
    announced = request.headers.get("Transfer-Encoding") or (request.content_length or 0) > 0
    if announced:
        raise ApiError(
            400,
            "the request's body could not be read (Transfer-Encoding: "
            f"{request.headers.get('Transfer-Encoding', '-')}); send it with a Content-Length",
            code="unreadable_body",
        )
    return {}


def whole(value: Any) -> int | None:
    """A schema-valid ``integer`` as an int (JSON has one number type: 300.0 is 300)."""
    return None if value is None else int(value)


@dataclass(frozen=True)
class Submission:
    agent: str
    input: Any
    model: str
    max_steps: int
    token_budget: int
    timeout_seconds: int
    request_hash: str
    cost_budget_usd: Decimal | None = None
    concurrency_key: str | None = None
    priority: int = 0


def parse_submission(body: dict[str, Any], settings: Settings, agents: AgentRegistry) -> Submission:
    if "input" in body:  # size first: the schema's checks cost time in proportion to it
        check_input_size(body["input"], settings.max_input_chars)
    names = agents.names()
    durable_names = [n for n in names if not isinstance(agents.get(n), Agent)]
    validate(body, submission_schema(settings, names, any_json_input=bool(durable_names)))
    agent_name = body.get("agent", settings.default_agent)
    if agent_name not in agents:  # the default agent is always registered; be precise anyway
        raise invalid(
            "agent", f"unknown agent {agent_name!r}; known agents: {', '.join(agents.names())}"
        )
    agent = agents.get(agent_name)
    text = body["input"]
    durable = not isinstance(agent, Agent)
    if not durable and not (isinstance(text, str) and text.strip()):
        raise invalid("input", f"must be a non-empty string for the agent {agent_name!r}")
    agent_model = agent.model if isinstance(agent, Agent) else None
    model = body.get("model") or agent_model or settings.model_default
    token_budget = whole(body.get("tokenBudget")) or settings.default_token_budget
    timeout = whole(body.get("timeoutSeconds")) or settings.default_timeout_seconds
    max_steps = whole(body.get("maxSteps")) or agent.max_steps or settings.default_max_steps
    cost_budget = body.get("costBudgetUsd")
    return Submission(
        agent=agent_name,
        input=text,
        model=model,
        max_steps=max_steps,
        token_budget=token_budget,
        timeout_seconds=timeout,
        request_hash=request_hash(body),
        cost_budget_usd=Decimal(str(cost_budget)) if cost_budget is not None else None,
        concurrency_key=body.get("concurrencyKey"),
        priority=whole(body.get("priority")) or 0,
    )


def request_hash(value: Any) -> str:
    """What makes two requests with one Idempotency-Key the same request: their JSON, keys
    in any order."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def idempotency_key(req: Request) -> str | None:
    """The request's ``Idempotency-Key`` header, checked: 1 to 200 characters of text."""
    key = req.headers.get("Idempotency-Key")
    if key is not None and not (0 < len(key) <= 200):
        raise invalid("Idempotency-Key", "must be 1 to 200 characters")
    if key is not None:
        check_text(key, "Idempotency-Key")
        if ENGINE_KEY.match(key):
            raise invalid(
                "Idempotency-Key",
                "must not start with 'child:' or a run id and '/': those keys are the "
                "runtime's own (the children and sends of runs); choose another",
            )
    return key


ENGINE_KEY = re.compile(
    r"^(?:child:|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}/)"
)
"""The namespace of the idempotency keys the engine derives: a child run's
(``child:<parent>/<step>``) and a ``steps.send``'s (``<sender run>/<step>``). A client's
``Idempotency-Key`` cannot reach it, so a submit cannot pose as a parent's child and a signal
cannot take the place of a run's send."""
