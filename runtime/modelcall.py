"""One model call, for every kind of step that makes one: the agent loop's model step and each
model call inside a durable ``steps.llm``.

Written once here: the strict-budget refusal, the attempts already made (persisted on the run
across durable timers, so the total stays capped), the crash points, the price, the metrics,
and the rule that a billed call is counted against the run even when its checkpoint is
refused (:func:`record_billed`). What to record and when is the caller's: the agent loop
checkpoints the call as its step, a durable step records it as a child step at once.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeVar

from db.errors import LeaseLost
from db.records import Usage
from runtime.faults import crash_point
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.retry import prior_attempts, reset_prior_attempts
from runtime.task import Task

T = TypeVar("T")


@dataclass(frozen=True)
class Answer:
    request: LlmRequest
    body: dict[str, Any]
    response: LlmResponse
    cost: Decimal
    latency_ms: int

    @property
    def model(self) -> str:
        return self.response.model or self.request.model


def estimate_tokens(body: dict[str, Any]) -> int:
    """A deliberately high estimate of a request's input tokens (about 3 characters per
    token; real English text averages nearer 4)."""
    return len(json.dumps(body, separators=(",", ":"), ensure_ascii=False)) // 3 + 1


def prompt_hash(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def strict_budget_refusal(task: Task, request: LlmRequest, body: dict[str, Any]) -> str | None:
    """With DAR_STRICT_BUDGET, refuse a call whose worst case could cross a budget."""
    if not task.settings.strict_budget:
        return None
    run = task.claim.run
    worst_in = estimate_tokens(body)
    worst = Usage(input_tokens=worst_in, output_tokens=request.max_tokens)
    spent = run.tokens_used + run.unrecorded_tokens + task.spent.total
    if spent + worst.total > run.token_budget:
        return (
            f"strict budget: the next model call could use up to {worst.total} tokens "
            f"({worst_in} in, {request.max_tokens} out) and {spent} of "
            f"{run.token_budget} are spent"
        )
    if run.cost_budget_usd is not None:
        cost = run.cost_usd + run.unrecorded_cost_usd + task.spent_cost
        worst_cost = task.services.pricing.cost(request.model, worst)
        if cost + worst_cost > run.cost_budget_usd:
            return (
                f"strict budget: the next model call could cost up to ${worst_cost:.4f} "
                f"and ${cost:.4f} of ${run.cost_budget_usd:.4f} is spent"
            )
    return None


def send(task: Task, request: LlmRequest, body: dict[str, Any] | None = None) -> Answer:
    """Call the model (the client's retries inside, capped across timers). Raises the
    client's :class:`~runtime.llm.base.LlmError` (or ``RetryLater``) unchanged."""
    body = body if body is not None else request.to_json()
    crash_point("before_model_call")
    started = time.monotonic()
    token = prior_attempts(task.claim.run.model_attempts)
    try:
        response = task.services.llm.send(request)
    except Exception:
        task.observe("MODEL", "error", started)
        raise
    finally:
        reset_prior_attempts(token)
    latency_ms = int((time.monotonic() - started) * 1000)
    crash_point("after_model_response")
    model = response.model or request.model
    cost = task.services.pricing.cost(model, response.usage)
    if task.services.metrics is not None:  # billed, whatever happens to the checkpoint
        task.services.metrics.model_call(model, response.usage, cost)
        task.services.metrics.step("MODEL", "ok", latency_ms / 1000)
    return Answer(request, body, response, cost, latency_ms)


def record_billed(task: Task, answer: Answer, write: Callable[[], T]) -> T:
    """Run ``write`` (the fenced record of a billed call); when the fence refuses it, count
    the call against the run anyway: the money was spent whoever holds the run now."""
    try:
        task.ensure_lease()
        result = write()
    except LeaseLost:
        task.store.record_unrecorded_usage(task.run_id, answer.response.usage, answer.cost)
        raise
    u, r = task.spent, answer.response.usage
    task.spent = Usage(
        u.input_tokens + r.input_tokens,
        u.output_tokens + r.output_tokens,
        u.cache_creation_input_tokens + r.cache_creation_input_tokens,
        u.cache_read_input_tokens + r.cache_read_input_tokens,
    )
    task.spent_cost += answer.cost
    return result
