"""One model call, for every kind of step that makes one: the agent loop's model step and each
model call inside a durable ``steps.llm``.

Written once here: the strict-budget refusal, the attempts already made (persisted on the run
across durable timers, so the total stays capped), the crash points, the price, the metrics,
and the rule that a billed call is counted against the run even when its checkpoint is
refused (:func:`record_billed`). What to record and when is the caller's: the agent loop
checkpoints the call as its step, a durable step records it as a child step at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError

from db.errors import LeaseLost
from db.records import NewStep, Step, StepKind, StepStatus, Usage
from runtime.faults import crash_point
from runtime.flow import Refusal
from runtime.keys import tenant_key
from runtime.llm.base import LlmError, LlmRequest, LlmResponse
from runtime.llm.billing import Meter, metering
from runtime.llm.live import ModelCallCancelled, live_call
from runtime.llm.retry import prior_attempts, reset_prior_attempts
from runtime.prompthash import prompt_hash as prompt_hash
from runtime.task import Task

T = TypeVar("T")
log = logging.getLogger(__name__)


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


def request_hash(task: Task, body: dict[str, Any]) -> str:
    """:func:`prompt_hash` of the body of the run's model call (incremental on a worker)."""
    hashes = task.services.hashes
    return prompt_hash(body) if hashes is None else hashes.hash(task.run_id, body)


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


@dataclass(frozen=True)
class Wait:
    """Admission refused: wait ``delay_seconds`` on a durable timer, then ask again."""

    delay_seconds: float
    reason: str
    """For the run's ``wait_reason``: ``rate limit: input tokens/min for claude-...``."""


def admit(task: Task, request: LlmRequest, body: dict[str, Any]) -> Wait | None:
    """Ask flow control (limits learned from the API's headers, DAR_MODEL_LIMITS) to admit
    this call with its estimated input tokens and its ``max_tokens``. ``None``: go ahead
    (the admission is held on the task and settled by :func:`send`); a :class:`Wait`: end
    the task on a durable timer instead."""
    flow = task.services.flow
    if flow is None:
        return None
    run = task.claim.run
    decision = flow.admit(
        request.model,
        estimate_tokens(body),
        request.max_tokens,
        waiter=str(run.id),
        priority=run.priority,
        key=tenant_key(run.tenant, run.concurrency_key) if run.concurrency_key else None,
    )
    if isinstance(decision, Refusal):
        return Wait(decision.delay_seconds, decision.reason)
    task.admission = decision
    return None


def settle(
    task: Task, response: LlmResponse | None, refusal: tuple[tuple[str, str], ...] = ()
) -> None:
    """Settle the task's flow-control admission with what the call used (``None``: failed;
    ``refusal``: the failed call's rate-limit headers, which teach the limit)."""
    grant, task.admission = task.admission, None
    flow = task.services.flow
    if grant is None or flow is None:
        return
    if response is None:  # the API refused or failed: nothing billed, the request counted
        flow.settle(grant, 0, 0, billed=False, headers=refusal)
        return
    u = response.usage
    flow.settle(
        grant,
        u.input_tokens + u.cache_creation_input_tokens,  # cache reads do not count
        u.output_tokens,
        headers=response.rate_limits,
    )


def send(
    task: Task, request: LlmRequest, body: dict[str, Any] | None = None, *, key: str | None = None
) -> Answer:
    """Call the model (the client's retries inside, capped across timers). Raises the
    client's :class:`~runtime.llm.base.LlmError` (or ``RetryLater``) unchanged. Settles the
    task's flow-control admission (:func:`admit`), if any, with the actual usage.

    With the step's ``key`` and a live channel, a streaming client's text goes to the run's
    live stream and a cancel aborts the call: :class:`ModelCallCancelled` is raised after
    the usage the stream reported is recorded on the run."""
    body = body if body is not None else request.to_json()
    crash_point("before_model_call")
    started = time.monotonic()
    token = prior_attempts(task.claim.run.model_attempts)
    response: LlmResponse | None = None
    refusal: tuple[tuple[str, str], ...] = ()
    try:
        with live_scope(task, key), metering(_lost_attempts(task)):
            response = task.services.llm.send(request)
    except ModelCallCancelled as e:
        cost = task.services.pricing.cost(request.model, e.usage)
        task.store.record_unrecorded_usage(task.run_id, e.usage, cost)
        task.observe("MODEL", "cancelled", started)
        raise
    except LlmError as e:
        refusal = e.rate_limits  # a 429 says the limit and what remains: learn them
        task.observe("MODEL", "error", started)
        raise
    except Exception:
        task.observe("MODEL", "error", started)
        raise
    finally:
        reset_prior_attempts(token)
        settle(task, response, refusal)
    latency_ms = int((time.monotonic() - started) * 1000)
    crash_point("after_model_response")
    model = response.model or request.model
    cost = task.services.pricing.cost(model, response.usage)
    if task.services.metrics is not None:  # billed, whatever happens to the checkpoint
        task.services.metrics.model_call(model, response.usage, cost)
        task.services.metrics.step("MODEL", "ok", latency_ms / 1000)
    return Answer(request, body, response, cost, latency_ms)


def _lost_attempts(task: Task) -> Meter:
    """The meter of this run's model call: an attempt billed with no response (abandoned at
    its time limit and answered later, a stream cut mid-way) counts as unrecorded tokens."""
    store, pricing, metrics, run_id = (
        task.store,
        task.services.pricing,
        task.services.metrics,
        task.run_id,
    )

    def meter(usage: Usage, model: str, why: str) -> None:
        cost = pricing.cost(model, usage)
        store.record_unrecorded_usage(run_id, usage, cost)
        if metrics is not None:
            metrics.model_call(model, usage, cost)
        log.info(
            "run=%s model call billed %d tokens with no answer (%s): counted as unrecorded",
            run_id,
            usage.total,
            why,
            extra={"run_id": str(run_id), "event": "llm.billed_lost", "action": "recorded"},
        )

    return meter


@contextlib.contextmanager
def live_scope(task: Task, key: str | None) -> Iterator[None]:
    """While a model call of step ``key`` is in flight: its live call (text deltas out, a
    cancel in), read with ``current_live_call()``; nothing without a live channel."""
    channel = task.services.live
    if channel is None or key is None:
        yield
        return
    from runtime.live import RedisLiveCall  # imports redis: only where a channel exists

    store, run_id = task.store, task.run_id
    with channel.watch(run_id) as watched:
        call = RedisLiveCall(
            channel, run_id, key, lambda: store.run_event_seq(run_id) or 0, watched
        )
        with live_call(call):
            yield


def transient_db_error(e: BaseException) -> bool:
    """The database went away (a restart, a dropped connection): worth trying again."""
    return isinstance(e, OperationalError) or (
        isinstance(e, DBAPIError) and e.connection_invalidated
    )


def record_billed(
    task: Task,
    answer: Answer,
    write: Callable[[], T],
    *,
    key: str,
    committed: Callable[[], T],
) -> T:
    """Run ``write``, the fenced record of the billed call whose step key is ``key``.

    - The fence refuses it (the run was taken over): the call is counted against the run
      anyway (the money was spent whoever holds the run now) and ``LeaseLost`` goes on.
    - The database is away (PostgreSQL restarting, a dropped connection): an answer that
      arrived is not thrown away; the write is tried again, with backoff, for as long as the
      lease lasts. Before each new try the step row is looked up: when an earlier try did
      commit (the connection dropped after the commit), ``committed()`` is returned instead.
    """
    give_up = time.monotonic() + task.settings.lease_seconds
    delay = 0.1
    retried = False
    while True:
        try:
            task.ensure_lease()
            if retried:
                row = task.store.step_by_key(task.run_id, key)
                if row is not None and row.lease_epoch == task.claim.epoch:
                    task.store.step_logs.forget(task.run_id)
                    result = committed()
                    break
            result = write()
            break
        except LeaseLost:
            task.store.record_unrecorded_usage(task.run_id, answer.response.usage, answer.cost)
            raise
        except Exception as e:
            left = give_up - time.monotonic()
            if not transient_db_error(e) or left <= 0:
                raise
            pause = min(delay, left)  # the last try lands on the deadline, not before it
            log.warning(
                "run=%s the database is away while recording %s (%s); trying again in %.1fs",
                task.rid,
                key,
                type(e).__name__,
                pause,
                extra={"run_id": str(task.run_id), "event": "checkpoint.retry"},
            )
            time.sleep(pause)
            delay = min(delay * 2, 2.0)
            retried = True
    u, r = task.spent, answer.response.usage
    task.spent = Usage(
        u.input_tokens + r.input_tokens,
        u.output_tokens + r.output_tokens,
        u.cache_creation_input_tokens + r.cache_creation_input_tokens,
        u.cache_read_input_tokens + r.cache_read_input_tokens,
    )
    task.spent_cost += answer.cost
    return result


# -- forks: replaying recorded answers ------------------------------------------------------


def has_diverged(steps: list[Step]) -> bool:
    """Whether this run called the real model already: a fork replaying the model stops
    replaying at the first request that differs from the original's, for good."""
    return any(
        s.kind in (StepKind.MODEL, StepKind.LLM) and s.prompt_hash is not None and s.origin is None
        for s in steps
    )


def recorded_answer(
    task: Task, key: str, body: dict[str, Any], *, diverged: bool | None = None
) -> Step | None:
    """For a fork with ``replay_model``: the original's recorded model step ``key`` when its
    request was byte-identical to ``body`` (the prompt hashes match) and no request of the
    fork has differed yet (``diverged``; read from the task's steps when ``None``); ``None``
    means call the model. Costs nothing for a run that is not such a fork."""
    run = task.claim.run
    if not run.replay_model or run.forked_from_run is None:
        return None
    if diverged if diverged is not None else has_diverged(task.steps):
        return None
    original = task.store.step_by_key(run.forked_from_run, key)
    if (
        original is None
        or original.kind not in (StepKind.MODEL, StepKind.LLM)
        or original.status is not StepStatus.DONE
        or original.prompt_hash != prompt_hash(body)
    ):
        return None
    return original


def replayed_row(
    seq: int, key: str, body: dict[str, Any], original: Step, *, attempt: int = 0
) -> NewStep:
    """The row of a model step answered from ``original``: its response, no tokens billed."""
    return NewStep(
        seq=seq,
        step_key=key,
        kind=original.kind,
        status=StepStatus.DONE,
        response=original.response,
        attempt=attempt,
        model=original.model,
        prompt_hash=prompt_hash(body),
        latency_ms=0,
        request_id=original.request_id,
        stop_reason=original.stop_reason,
    )
