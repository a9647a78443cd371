"""Request validation: each rule names the field and the limit, so the caller knows what
to fix."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from flask import Request

from api.errors import ApiError, invalid
from runtime.agents import Agent, AgentRegistry
from runtime.config import Settings

MIN_COST_BUDGET = 0.0001

SUBMIT_FIELDS = (
    "input",
    "tokenBudget",
    "costBudgetUsd",
    "timeoutSeconds",
    "model",
    "maxSteps",
    "agent",
)


def json_body(request: Request) -> dict[str, Any]:
    if not request.is_json:
        raise ApiError(
            415,
            "send the body as JSON with the header Content-Type: application/json",
            code="unsupported_media_type",
        )
    raw = request.get_data(cache=True)
    try:
        body = json.loads(raw or b"null")
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


def _int_field(
    body: dict[str, Any], name: str, default: int, low: int, high: int, setting: str
) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type: 300.0 is the whole number 300
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be a whole number, got {json.dumps(value)}")
    if not low <= value <= high:
        raise invalid(name, f"must be between {low} and {high} ({setting}), got {value}")
    return value


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


def parse_submission(body: dict[str, Any], settings: Settings, agents: AgentRegistry) -> Submission:
    unknown = sorted(set(body) - set(SUBMIT_FIELDS))
    if unknown:
        raise ApiError(
            400,
            f"unknown field {unknown[0]!r}; allowed fields: {', '.join(SUBMIT_FIELDS)}",
            code="unknown_field",
            field=unknown[0],
        )
    agent_name = body.get("agent", settings.default_agent)
    if not isinstance(agent_name, str) or agent_name not in agents:
        raise invalid(
            "agent", f"unknown agent {agent_name!r}; known agents: {', '.join(agents.names())}"
        )
    agent = agents.get(agent_name)

    if "input" not in body:
        raise invalid("input", "is required: the question or task for the agent")
    text = body["input"]
    durable = not isinstance(agent, Agent)
    size = len(text) if isinstance(text, str) else len(json.dumps(text))
    if durable:
        if text is None:
            raise invalid("input", f"is required: the JSON input of {agent_name!r}")
    elif not isinstance(text, str) or not text.strip():
        raise invalid("input", "must be a non-empty string")
    if size > settings.max_input_chars:
        raise invalid(
            "input",
            f"is {size} characters; the limit is {settings.max_input_chars} (DAR_MAX_INPUT_CHARS)",
        )
    agent_model = agent.model if isinstance(agent, Agent) else None
    model = body.get("model") or agent_model or settings.default_model
    if not isinstance(model, str) or len(model) > 200:
        raise invalid("model", "must be a model name such as claude-sonnet-4-5")
    token_budget = _int_field(
        body,
        "tokenBudget",
        settings.default_token_budget,
        1,
        settings.max_token_budget,
        "DAR_MAX_TOKEN_BUDGET",
    )
    timeout = _int_field(
        body,
        "timeoutSeconds",
        settings.default_timeout_seconds,
        1,
        settings.max_timeout_seconds,
        "DAR_MAX_TIMEOUT_SECONDS",
    )
    max_steps = _int_field(
        body, "maxSteps", agent.max_steps or settings.default_max_steps, 1, 10_000, "at most 10000"
    )
    cost_budget = body.get("costBudgetUsd")
    if cost_budget is not None and (
        isinstance(cost_budget, bool)
        or not isinstance(cost_budget, int | float)
        or not MIN_COST_BUDGET <= cost_budget <= 100_000
    ):
        raise invalid(
            "costBudgetUsd",
            f"must be a number of US dollars from {MIN_COST_BUDGET} to 100000",
        )
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return Submission(
        agent=agent_name,
        input=text,
        model=model,
        max_steps=max_steps,
        token_budget=token_budget,
        timeout_seconds=timeout,
        request_hash=hashlib.sha256(canonical.encode()).hexdigest(),
        cost_budget_usd=Decimal(str(cost_budget)) if cost_budget is not None else None,
    )
