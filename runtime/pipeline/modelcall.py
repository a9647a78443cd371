"""One model call, for every kind of step that makes one: the agent loop's model step, each
model call inside a durable ``steps.llm``, a framework's model request (``steps.model_call``).

The sequence is written once, :func:`call`: a fork's recorded answer, the strict-budget
refusal, admission (flow control), the call (the attempts already made persisted on the run
across durable timers, so the total stays capped; crash points; the live stream), its
classification (a retry later, a cancel, a deadline), the price and the metrics, and the
record's write, with the rule that a billed call is counted against the run even when its
checkpoint is refused (:func:`record_billed`). The write is given back (:class:`Made`), never
made here: the caller's advance commits it, as every step's record
(:meth:`runtime.pipeline.checkpoint.Program.advance`). Whether the record is the task's step
or a child of the running step is the kind's (``runtime.pipeline.kinds.KINDS``); what the
outcome means for the run is the caller's.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeVar

from db.errors import DatabaseUnavailable, LeaseLost
from db.records import (
    Dispatch,
    NewStep,
    RunStatus,
    Step,
    StepStatus,
    TreeSpend,
    Usage,
)
from runtime.admission.concurrency_keys import tenant_key
from runtime.admission.flow_control import Answered, Grant, Refusal, Superseded
from runtime.llm.base import LlmError, LlmRequest, LlmResponse
from runtime.llm.billing import Meter, metering
from runtime.llm.live_call import ModelCallCancelled, ModelCallInterrupted, live_call
from runtime.llm.retry import RetryLater, prior_attempts, reset_prior_attempts
from runtime.pipeline import kinds
from runtime.pipeline.checkpoint import Earlier, Task, plus
from runtime.pipeline.faults import crash_point
from runtime.pipeline.prompthash import prompt_hash as prompt_hash

if TYPE_CHECKING:
    from runtime.observe.live_channel import RedisLiveCall

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


def lost_call_estimate(task: Task, request: LlmRequest, body: dict[str, Any]) -> Usage:
    """What a call is counted as if its worker dies in it (its admission writes it down; the
    run's next admission counts it, and the call's own answer, if it comes after all,
    replaces it): an upper bound, as budgets need, its input estimated high from the
    request (:func:`estimate_tokens`) and its output at ``max_tokens``. (Twice the run's
    longest answer so far was tried: the long chaos campaign found lost calls above it.)"""
    return Usage(input_tokens=estimate_tokens(body), output_tokens=request.max_tokens)


def request_hash(task: Task, body: dict[str, Any]) -> str:
    """:func:`prompt_hash` of the body of the run's model call (incremental on a worker)."""
    hashes = task.services.hashes
    return prompt_hash(body) if hashes is None else hashes.hash(task.run_id, body)


LEAST_CHARS_PER_TOKEN = 6
"""For a lower bound of a request's input tokens: text tokenises at ~4 characters per token
(English), JSON and code at fewer; hardly any text at more than 6."""


def least_tokens(body: dict[str, Any]) -> int:
    """A deliberately low estimate of a request's input tokens: a call is refused on it
    (its input alone past the budget) only when it would surely cross the budget."""
    return len(json.dumps(body, separators=(",", ":"), ensure_ascii=False)) // LEAST_CHARS_PER_TOKEN


def strict_budget_refusal(task: Task, request: LlmRequest, body: dict[str, Any]) -> str | None:
    """Refuse a call whose input alone would surely cross the token budget (always: the
    check after a call cannot take back a million-character input), and with
    DAR_STRICT_BUDGET one whose worst case could cross a budget."""
    run = task.claim.run
    least_in = least_tokens(body)
    spent_now = run.tokens_used + run.unrecorded_tokens + task.spent.total
    if spent_now + least_in > run.token_budget:
        return (
            f"token budget: the next model call's input alone is at least {least_in} tokens "
            f"and {spent_now} of {run.token_budget} are spent (not sent)"
        )
    if not task.settings.strict_budget:
        return None
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


# -- a budget shared down a run tree --------------------------------------------------------

TREE_WAIT_SECONDS = 0.5
"""A child run's model call that does not fit its tree's budget beside the calls in flight
asks again after this long, on a durable timer (holding no thread and no lease)."""


@dataclass(frozen=True)
class TreeRefusal:
    """The tree's budget ends the run (``strict``: the strict budget's refusal)."""

    reason: str


def share_tree_budget(
    task: Task, request: LlmRequest, body: dict[str, Any], key: str
) -> Wait | TreeRefusal | bool:
    """A child run's model call and its tree's budget (the root's), shared by every run of
    the tree. The call may start when the tree's spend, the worst cases of the tree's other
    calls in flight and its own worst case (``estimate_tokens`` + ``max_tokens``, and its
    price) fit the budget; or, when none fits, if no other call of the tree is in flight and
    the tree is under its budget (not with DAR_STRICT_BUDGET). So only a call started alone
    can cross the budget: the tree passes it by at most one step. Admitted (``True``), the
    call's worst case is held until :func:`release_tree_budget`; a call that must wait for
    the calls in flight comes back on a durable timer (:class:`Wait`); a tree at its budget
    ends the run (:class:`TreeRefusal`). A run with no parent is its tree's root: its own
    budget is the tree's and it makes no call while its children work (``False``: nothing
    asked, not a statement)."""
    run = task.claim.run
    if run.parent_run_id is None:
        return False
    worst = Usage(input_tokens=estimate_tokens(body), output_tokens=request.max_tokens)
    worst_cost = task.services.pricing.cost(request.model, worst)
    strict = task.settings.strict_budget

    def exhausted(t: TreeSpend) -> bool:
        over_cost = t.cost_budget_usd is not None and t.cost >= t.cost_budget_usd
        return t.spent >= t.token_budget or over_cost

    def fits(t: TreeSpend) -> bool:
        if t.spent + t.held + worst.total > t.token_budget:
            return False
        budget = t.cost_budget_usd
        return budget is None or t.cost + t.held_cost + worst_cost <= budget

    def admit(t: TreeSpend) -> bool:
        return not exhausted(t) and (fits(t) or (t.in_flight == 0 and not strict))

    spend, admitted = task.store.hold_tree_budget(task.claim, key, worst.total, worst_cost, admit)
    if admitted:
        return True
    root = str(spend.root)[:8]
    if exhausted(spend):
        if spend.spent >= spend.token_budget:
            return TreeRefusal(
                f"token budget of the run tree exhausted: {spend.spent} of "
                f"{spend.token_budget} tokens used by run {root} and its children"
            )
        return TreeRefusal(
            f"cost budget of the run tree exhausted: ${spend.cost:.4f} of "
            f"${spend.cost_budget_usd:.4f} spent by run {root} and its children"
        )
    if spend.in_flight == 0:  # strict: the call could cross the budget on its own
        return TreeRefusal(
            f"strict budget: the next model call could use up to {worst.total} tokens "
            f"and the run tree of run {root} has used {spend.spent} of {spend.token_budget}"
        )
    return Wait(
        TREE_WAIT_SECONDS,
        f"run tree budget: {spend.in_flight} model call(s) of the tree in flight hold "
        f"{spend.held} tokens; {spend.spent} of {spend.token_budget} spent",
    )


def release_tree_budget(task: Task) -> None:
    """The call held against its tree's budget is counted on its run (or was never made):
    its hold goes. A failure here is logged: the hold is then dropped with the run's next
    call or its end, counted as spent meanwhile (never less than the truth)."""
    try:
        task.store.release_tree_budget(task.run_id, task.claim.epoch)
    except Exception:
        log.warning(
            "run=%s the model call's hold on its tree's budget was not released (kept until "
            "the run's next call or its end)",
            task.rid,
            exc_info=True,
        )


def admit(task: Task, request: LlmRequest, body: dict[str, Any], key: str) -> Wait | None:
    """Ask flow control (limits learned from the API's headers, DAR_MODEL_LIMITS) to admit
    this call of step ``key`` with its estimated input tokens and its ``max_tokens``.
    ``None``: go ahead (the admission is held on the task and settled by :func:`send`); a
    :class:`Wait`: end the task on a durable timer instead."""
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
        run=str(run.id),
        step=(key, task.claim.epoch),
        estimate=lost_call_estimate(task, request, body),
    )
    if isinstance(decision, Superseded):
        # taken over while away (stopped, paused): the call in flight is the new holder's
        log.warning(
            "run=%s taken over while this worker was away (a call of lease %d is in flight): "
            "no model call from here",
            task.rid,
            decision.epoch,
            extra={"run_id": str(task.run_id), "event": "llm.superseded"},
        )
        if task.claim.run.parent_run_id is not None:
            release_tree_budget(task)  # no call: nothing of it to hold against the tree
        raise LeaseLost(task.run_id, "a newer claim of the run is calling the model")
    if decision is not None and decision.lost is not None and recorded(task, decision.lost_step):
        # its worker died between the checkpoint and erasing the record: its row counts it
        log.info(
            "run=%s the previous model call was recorded (step %s): its record outlived its "
            "worker, nothing more counted",
            task.rid,
            decision.lost_step[0] if decision.lost_step else "?",
            extra={"run_id": str(task.run_id), "event": "llm.lost_call", "action": "recorded"},
        )
    elif decision is not None and decision.lost is not None:
        # The run's previous call was admitted and never recorded: its worker died in it.
        # The API billed it; count its estimate. When that crosses a budget, come back at
        # once so the guard ends the run before this call is made (a budget is never crossed
        # because a call was lost); else go on with this call, in this same claim.
        lost = decision.lost
        cost = task.services.pricing.cost(request.model, lost)
        task.store.record_unrecorded_usage(task.run_id, lost, cost, estimated_tokens=lost.total)
        log.warning(
            "run=%s a model call was lost with its worker: %d tokens counted (estimate)",
            task.rid,
            lost.total,
            extra={"run_id": str(task.run_id), "event": "llm.lost_call", "action": "estimated"},
        )
        spent = run.tokens_used + run.unrecorded_tokens + task.spent.total + lost.total
        cost_now = run.cost_usd + run.unrecorded_cost_usd + task.spent_cost + cost
        over = spent >= run.token_budget or (
            run.cost_budget_usd is not None and cost_now >= run.cost_budget_usd
        )
        if over:
            if not isinstance(decision, Refusal):
                task.admission = decision
                settle(task, None)
            return Wait(0.0, "a model call lost with its worker was counted; checking the budget")
    if isinstance(decision, Refusal):
        return Wait(decision.delay_seconds, decision.reason)
    task.admission = decision
    return None


def recorded(task: Task, step: tuple[str, int] | None) -> bool:
    """Whether the step (key, lease epoch) of a call found unsettled has its row in the run's
    step log, written under that epoch: the call was recorded after all."""
    if step is None:
        return False
    found = task.log.get(step[0])
    return found is not None and found.origin is None and found.lease_epoch == step[1]


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
        charged = flow.settle(grant, 0, 0, billed=False, headers=refusal)
        if charged is not None:  # counted as lost, but nothing was billed: take it back
            replace_estimate(task, charged, Usage(), grant.limit.match)
        return
    u = response.usage
    # settled when the answer is recorded (record_billed): one script then settles it and
    # erases its record, which stays until then (the estimate a crash would leave)
    task.answered = Answered(
        grant,
        u.input_tokens + u.cache_creation_input_tokens,  # cache reads do not count
        u.output_tokens,
        response.rate_limits,
    )


def _settle_answered(task: Task, *, keep_record: bool) -> tuple[Grant | None, Usage | None]:
    """Settle the answered call's admission (``keep_record``: its record stays, to be erased
    by :meth:`FlowControl.forget`); returns its grant and the estimate a later admission
    counted as lost meanwhile, if one did."""
    answered, task.answered = task.answered, None
    flow = task.services.flow
    if answered is None or flow is None:
        return None, None
    charged = flow.settle(
        answered.grant,
        answered.input_tokens,
        answered.output_tokens,
        headers=answered.headers,
        keep_record=keep_record,
    )
    return answered.grant, charged


def replace_estimate(task: Task, estimate: Usage, actual: Usage, model: str) -> None:
    """The call counted as lost (``estimate``) was not: ``actual`` replaces it in the run's
    unrecorded tokens (``actual`` itself is counted by whoever recorded it elsewhere: pass
    ``Usage()`` then)."""
    pricing = task.services.pricing
    cost = pricing.cost(model, actual) - pricing.cost(model, estimate)
    task.store.record_unrecorded_usage(
        task.run_id, _minus(actual, estimate), cost, estimated_tokens=-estimate.total
    )


def _minus(actual: Usage, estimate: Usage) -> Usage:
    """``actual`` in place of ``estimate`` (an estimate holds no cache tokens)."""
    return Usage(
        actual.input_tokens - estimate.input_tokens,
        actual.output_tokens - estimate.output_tokens,
        actual.cache_creation_input_tokens,
        actual.cache_read_input_tokens,
    )


def send(
    task: Task,
    request: LlmRequest,
    body: dict[str, Any] | None = None,
    *,
    key: str | None = None,
    make: Callable[[], LlmResponse] | None = None,
    interruptible: bool = False,
) -> Answer:
    """Call the model (the client's retries inside, capped across timers). Raises the
    client's :class:`~runtime.llm.base.LlmError` (or ``RetryLater``) unchanged. Settles the
    task's flow-control admission (:func:`admit`), if any, with the actual usage.

    ``make`` makes the call instead of the run's client (a framework's own model request,
    answered as an :class:`LlmResponse`).

    With the step's ``key`` and a live channel, a streaming client's text goes to the run's
    live stream and a cancel aborts the call: :class:`ModelCallCancelled` is raised after
    the usage the stream reported is recorded on the run. With ``interruptible`` (the agent
    loop's model call), a message posted with ``policy: "interrupt"`` aborts it the same way:
    :class:`ModelCallInterrupted` is raised, its usage recorded, its attempt retracted on the
    live stream."""
    body = body if body is not None else request.to_json()
    crash_point("before_model_call")
    started = time.monotonic()
    token = prior_attempts(task.claim.run.model_attempts)
    response: LlmResponse | None = None
    refusal: tuple[tuple[str, str], ...] = ()
    live: RedisLiveCall | None = None
    try:
        with (
            live_scope(task, key, interruptible=interruptible) as live,
            metering(_lost_attempts(task)),
        ):
            response = make() if make is not None else task.services.llm.send(request)
    except ModelCallCancelled as e:
        cost = task.services.pricing.cost(request.model, e.usage)
        task.store.record_unrecorded_usage(
            task.run_id, e.usage, cost, estimated_tokens=e.estimated_tokens
        )
        if live is not None and live.interrupted.is_set():
            live.retract()  # clients drop the cut attempt's text now
            task.observe("MODEL", "interrupted", started)
            log.info(
                "run=%s MODEL %s interrupted by a message: %d tokens billed, counted",
                task.rid,
                key,
                e.usage.total,
            )
            raise ModelCallInterrupted(
                str(e), usage=e.usage, request_id=e.request_id, estimated_tokens=e.estimated_tokens
            ) from e
        task.observe("MODEL", "cancelled", started)
        raise
    except LlmError as e:
        refusal = e.rate_limits  # a 429 says the limit and what remains: learn them
        task.observe("MODEL", "error", started)
        raise
    except Exception as e:
        task.observe("MODEL", "error", started)
        billed = getattr(e, "billed", None)  # a failure the provider billed (BilledFailure)
        usage = getattr(billed, "usage", None)
        if isinstance(usage, Usage) and getattr(e, "estimated", True) is False:
            # settled as an answer: its record stays until its error row counts it
            model = str(getattr(billed, "model", None) or request.model)
            response = LlmResponse([], None, usage, model)
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

    def meter(usage: Usage, model: str, why: str, *, estimated: bool = False) -> None:
        cost = pricing.cost(model, usage)
        store.record_unrecorded_usage(
            run_id, usage, cost, estimated_tokens=usage.total if estimated else 0
        )
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
def live_scope(
    task: Task, key: str | None, *, interruptible: bool = False
) -> Iterator[RedisLiveCall | None]:
    """While a model call of step ``key`` is in flight: its live call (text deltas out, a
    cancel, or with ``interruptible`` an interrupt, in), read with ``current_live_call()``;
    nothing (``None``) without a live channel."""
    channel = task.services.live
    if channel is None or key is None:
        yield None
        return
    from runtime.observe.live_channel import (
        RedisLiveCall,  # imports redis: only where a channel exists
    )

    store, run_id = task.store, task.run_id
    with channel.watch(run_id, interruptible=interruptible) as watched:
        call = RedisLiveCall(
            channel, run_id, key, lambda: store.run_event_seq(run_id) or 0, watched
        )
        with live_call(call):
            yield call


def _forget(task: Task) -> None:
    """The answered call's row is written: settle its admission and erase its record, in one
    script. An admission that took the record first came after this row (it holds the run,
    so the row was written before its claim) and so counted nothing (:func:`recorded`):
    what the settle returns is not ours to take back."""
    _settle_answered(task, keep_record=False)


def _count_unrecorded(task: Task, answer: Answer, row: NewStep) -> None:
    """The answered call's row was refused (the run was taken over) or never written (the
    database away past the lease): count the call as the run's unrecorded tokens, now or when
    the database answers (:class:`db.owed.OwedUsage`), unless a try did commit its row.

    The exact count replaces an estimate of the call, never both. The run's next admission
    counts the estimate when it finds the call's record before the record is erased, and
    the record is erased only once the exact count is written (a worker killed while it owes
    the count leaves the record, so the estimate still covers the call). An estimate counted
    before the settle here is taken back in this write; one counted later, by the erase that
    follows it. Both only where the count is (``unless_step``): a row of this step means the
    admission saw it and counted nothing."""
    grant, charged = _settle_answered(task, keep_record=True)
    store, pricing, flow = task.store, task.services.pricing, task.services.flow
    # an estimate is priced as the admission that counted it priced it: the request's model
    run_id, model, unless = task.run_id, answer.request.model, (row.step_key, task.claim.epoch)
    usage, cost, estimated = answer.response.usage, answer.cost, 0
    if charged is not None:
        usage, cost = _minus(usage, charged), cost - pricing.cost(model, charged)
        estimated = -charged.total

    def erase_record() -> None:
        late = flow.forget(grant) if flow is not None and grant is not None else None
        if late is None:
            return
        log.info(
            "run=%s the call's estimate (%d tokens) was counted as lost meanwhile: taken back",
            str(run_id)[:8],
            late.total,
            extra={"run_id": str(run_id), "event": "llm.lost_call", "action": "replaced"},
        )
        store.record_unrecorded_usage(
            run_id,
            _minus(Usage(), late),
            -pricing.cost(model, late),
            unless_step=unless,
            estimated_tokens=-late.total,
        )

    store.record_unrecorded_usage(
        run_id, usage, cost, unless_step=unless, estimated_tokens=estimated, then=erase_record
    )


def record_billed(
    task: Task,
    answer: Answer,
    write: Callable[[], T],
    *,
    row: NewStep,
    committed: Callable[[], T],
) -> T:
    """Run ``write``, the fenced record ``row`` of the billed call, durably
    (:meth:`~runtime.pipeline.checkpoint.Task.durably`: an answer that arrived is not thrown away
    because the database blinked; when an earlier try did commit, ``committed()`` is its result).
    When the fence refuses it (the run was taken over), the call is counted against the run
    anyway (the money was spent whoever holds the run now) and ``LeaseLost`` goes on."""
    try:
        result = task.durably(
            row.step_key,
            write,
            lambda: Earlier(committed()) if task.wrote(row) is not None else None,
        )
    except BaseException as e:
        if isinstance(e, LeaseLost | DatabaseUnavailable):
            # Taken over, or the lease is gone with the database still away: the call was
            # billed whoever holds the run now.
            _count_unrecorded(task, answer, row)
        elif isinstance(e, Exception):  # not recorded: settled, its record (estimate) kept
            _settle_answered(task, keep_record=True)
        raise
    _forget(task)  # recorded: no later admission may count it as lost
    task.spent = plus(task.spent, answer.response.usage)
    task.spent_cost += answer.cost
    return result


def record_failed(
    task: Task,
    request: LlmRequest,
    body: dict[str, Any],
    row: NewStep,
    usage: Usage,
    model: str,
    *,
    request_id: str | None = None,
    estimated: bool = False,
) -> Dispatch | None:
    """Record ``row``, the error of a call the provider billed all the same (a response that
    ended ``incomplete``), and hand the lease on: the write of the kind's
    :class:`~runtime.pipeline.checkpoint.Record`, which the advance commits. Its tokens and
    cost are the row's, counted on the run as any answer's (against the run even when the
    fence refuses the row, see :func:`record_billed`); with ``estimated`` (the usage could not
    be read: an upper bound) they are the run's estimated unrecorded tokens instead, beside a
    row without usage."""
    cost = task.services.pricing.cost(model, usage)
    if task.services.metrics is not None:
        task.services.metrics.model_call(model, usage, cost)
    if estimated:
        task.store.record_unrecorded_usage(task.run_id, usage, cost, estimated_tokens=usage.total)
        return task.checkpoint([row]).dispatch
    row = replace(row, usage=usage, cost_usd=cost, model=model, request_id=request_id)
    response = LlmResponse([], row.stop_reason, usage, model, request_id)
    answer = Answer(request, body, response, cost, row.latency_ms or 0)
    return record_billed(
        task,
        answer,
        lambda: task.store.record_steps(task.claim, [row]),
        row=row,
        committed=lambda: Dispatch(task.run_id, task.store.get_run(task.run_id).dispatch_token),
    )


# -- the whole sequence, for every kind of step that calls the model --------------------------


@dataclass(frozen=True)
class Made:
    """The call was made (or, in a fork, answered from the original) and is not recorded yet:
    the caller's advance records it with ``write`` (a made call's
    :func:`record_billed`: counted even when the fence refuses it; a replayed answer's
    :meth:`runtime.pipeline.checkpoint.Task.record_replayed`), then says so (``logged``)."""

    response: LlmResponse
    row: NewStep
    answer: Answer | None
    """What was paid for (``None``: answered from the original run, nothing billed)."""
    write: Callable[[], Dispatch | None]
    logged: Callable[[], None]


@dataclass(frozen=True)
class Later:
    """Not called now: come back on a durable timer (flow control, or the API asked for a
    retry later)."""

    delay_seconds: float
    reason: str
    model_attempts: int
    admission: bool
    """Refused capacity before it began (not a claim without progress)."""
    wakeable: bool = False
    """A wait for the fleet's capacity (flow control, the tree's budget), asked again when the
    run is woken (a message, a signal): a wake may bring it forward. A server's
    ``retry-after`` is a floor no wake crosses."""


@dataclass(frozen=True)
class Stopped:
    """The run ends here: refused by the strict budget, cancelled while the call was in
    flight, or a retry that would pass the deadline."""

    status: RunStatus
    reason: str


@dataclass(frozen=True)
class Failed:
    """The call itself failed for good: the client's :class:`LlmError`, or anything else the
    call raised. What it means is the caller's: the agent loop fails the run on an
    ``LlmError`` (anything else fails the task), a durable step's code sees the exception,
    a framework's call is recorded as its step's error."""

    error: Exception


@dataclass(frozen=True)
class Interrupted:
    """A message posted with ``policy: "interrupt"`` aborted the call (its billed tokens are
    recorded on the run): deliver the message, then make the step again."""

    usage: Usage


Outcome = Made | Later | Stopped | Failed | Interrupted


def call(
    task: Task,
    request: LlmRequest,
    *,
    kind: kinds.StepKind,
    key: str,
    seq: int,
    attempt: int = 1,
    body: dict[str, Any] | None = None,
    make: Callable[[], LlmResponse] | None = None,
    diverged: bool | None = None,
    guard: bool = False,
) -> Outcome:
    """One model call of a step of ``kind``, up to its record: a fork's recorded answer,
    the guard (with ``guard``: cancel, deadline, budget), the strict budget, admission, the
    call, its classification and its price. An answer (a fork's replayed one too) is given
    back :class:`Made`, its record (retried across a database blip; billed even when the
    fence refuses it) for the caller's advance to write
    (:class:`runtime.pipeline.checkpoint.Record`): this function writes no record of the call
    itself. An exception other than the call's own (:class:`Failed`) is the engine's: the
    database, the lease."""
    policy = kinds.KINDS[kind]
    assert policy.bills, f"a {kind} step does not call the model"
    body = body if body is not None else request.to_json()
    original = recorded_answer(task, key, body, diverged=diverged) if make is None else None
    if original is not None:  # a fork replaying the model, and the request is unchanged
        row = replayed_row(seq, key, body, original, attempt=attempt if policy.child else 0)
        response = LlmResponse(
            original.response or [],
            original.stop_reason,
            Usage(),
            original.model or request.model,
            original.request_id,
        )
        write = functools.partial(task.record_replayed, row, original, hand_over=not policy.child)
        logged = functools.partial(_logged_replayed, task, key, seq)
        return Made(response, row, None, write, logged)
    stop = task.guard(steps_taken=0, next_is_model=True) if guard else None
    if stop is not None:
        return Stopped(stop.status, stop.reason)
    refusal = strict_budget_refusal(task, request, body)
    if refusal:
        return Stopped(RunStatus.FAILED, refusal)
    shared = share_tree_budget(task, request, body, key)
    if isinstance(shared, TreeRefusal):
        return Stopped(RunStatus.FAILED, shared.reason)
    if isinstance(shared, Wait):
        return Later(shared.delay_seconds, shared.reason, task.claim.run.model_attempts, True, True)
    if not shared:
        return _admit_and_call(task, request, kind=kind, key=key, seq=seq, attempt=attempt,
                               body=body, make=make)  # fmt: skip
    try:
        outcome = _admit_and_call(task, request, kind=kind, key=key, seq=seq, attempt=attempt,
                                  body=body, make=make)  # fmt: skip
    except (LeaseLost, DatabaseUnavailable):
        # the call may be billed and not counted yet (owed, or the run taken over): the
        # hold stays until the run's next call or its end
        raise
    except Exception:
        release_tree_budget(task)
        raise
    # (a BaseException is the worker dying: the hold stays, a lost call of its lease)
    if isinstance(outcome, Made):  # its hold goes once its record is written
        return replace(outcome, write=functools.partial(_released_after, task, outcome.write))
    release_tree_budget(task)
    return outcome


def _released_after(task: Task, write: Callable[[], T]) -> T:
    """``write``, the record of a call held against its tree's budget, then the hold's
    release (as :func:`call` releases it at once after a call with no record to write)."""
    try:
        written = write()
    except (LeaseLost, DatabaseUnavailable):
        raise  # billed and not counted yet: the hold stays
    except Exception:
        release_tree_budget(task)
        raise
    release_tree_budget(task)
    return written


def _admit_and_call(
    task: Task,
    request: LlmRequest,
    *,
    kind: kinds.StepKind,
    key: str,
    seq: int,
    attempt: int,
    body: dict[str, Any],
    make: Callable[[], LlmResponse] | None,
) -> Outcome:
    """:func:`call` from flow control's admission on."""
    policy = kinds.KINDS[kind]
    wait = admit(task, request, body, key)
    if wait is not None:  # flow control: a durable timer, holding nothing
        return Later(wait.delay_seconds, wait.reason, task.claim.run.model_attempts, True, True)
    try:
        answer = send(task, request, body, key=key, make=make, interruptible=policy.interruptible)
    except RetryLater as e:
        return _later(task, key, e)
    except ModelCallInterrupted as e:
        return Interrupted(e.usage)
    except ModelCallCancelled:
        return Stopped(RunStatus.CANCELLED, "cancelled by request (model call aborted)")
    except Exception as e:  # the client's LlmError, or whatever the call itself raised
        return Failed(e)
    response = answer.response
    row = NewStep(
        seq=seq,
        step_key=key,
        kind=policy.row,
        status=StepStatus.DONE,
        response=response.content,
        attempt=attempt,
        model=answer.model,
        prompt_hash=request_hash(task, body),
        usage=response.usage,
        cost_usd=answer.cost,
        latency_ms=answer.latency_ms,
        request_id=response.request_id,
        stop_reason=response.stop_reason,
        request=body if task.settings.store_requests else None,
    )
    # recorded as the task's step, handing the lease on in the same statement, or inside the
    # running step; a try whose answer was lost committed: the run carries the token it set
    store_write = task.store.record_child if policy.child else task.store.checkpoint_model
    write = functools.partial(
        record_billed,
        task,
        answer,
        functools.partial(store_write, task.claim, row),  # no frame of its own
        row=row,
        committed=functools.partial(_handed_on, task, policy.child),
    )
    logged = functools.partial(_logged, task, kind, key, seq, answer)
    return Made(response, row, answer, write, logged)


def _handed_on(task: Task, child: bool) -> Dispatch | None:
    """What an earlier, committed try of a model call's record handed the lease on with."""
    return None if child else Dispatch(task.run_id, task.store.get_run(task.run_id).dispatch_token)


def _logged_replayed(task: Task, key: str, seq: int) -> None:
    log.info("run=%s seq=%d MODEL %s replayed (request unchanged)", task.rid, seq, key)


def _logged(task: Task, kind: kinds.StepKind, key: str, seq: int, answer: Answer) -> None:
    response = answer.response
    log.info(
        "run=%s seq=%d MODEL%s stop=%s in=%d out=%d latency=%dms",
        task.rid,
        seq,
        "" if kind is kinds.StepKind.MODEL else f" {key}",
        response.stop_reason,
        response.usage.input_tokens,
        response.usage.output_tokens,
        answer.latency_ms,
    )


def _later(task: Task, key: str, e: RetryLater) -> Outcome:
    """The API asked us to come back later: a durable timer, not a sleeping worker."""
    remaining = (task.claim.run.deadline_at - task.claim.db_now).total_seconds()
    if e.delay_seconds >= remaining:
        return Stopped(
            RunStatus.TIMED_OUT,
            f"model call failed ({e.error}) and the retry it asks for in "
            f"{e.delay_seconds:.1f}s would pass the run's deadline",
        )
    status = "I/O error" if e.status == -1 else f"HTTP {e.status}"
    log.info(
        "run=%s %s MODEL %s; waiting %.1fs on a durable timer",
        task.rid,
        key,
        status,
        e.delay_seconds,
    )
    reason = f"{key}: model call {status}; retrying in {e.delay_seconds:.1f}s"
    # back-pressure (429, 529): the API asked us to wait, not a claim without progress
    return Later(e.delay_seconds, reason, e.attempts, e.back_pressure)


def failure(e: LlmError) -> str:
    """A model call that failed for good, as the run's error."""
    rid = f" (request id {e.request_id})" if e.request_id else ""
    status = "I/O error or timeout" if e.status == -1 else f"HTTP {e.status}"
    return f"model call failed: {status}: {e}{rid}"


# -- forks: replaying recorded answers ------------------------------------------------------


def has_diverged(steps: list[Step]) -> bool:
    """Whether this run called the real model already: a fork replaying the model stops
    replaying at the first request that differs from the original's, for good."""
    return any(
        kinds.stored_as_a_model_call(s) and s.prompt_hash is not None and s.origin is None
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
        or not kinds.stored_as_a_model_call(original)
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
