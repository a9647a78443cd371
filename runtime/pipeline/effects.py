"""Steps with an effect: the one place that decides what runs again after a crash.

Every kind of step whose code may change the world goes through :func:`run_effect`: a tool call
of the agent loop, a durable ``steps.run`` / ``@step`` body, an approved action, a
compensation. The rule, written once:

1. The step is written ``STARTED`` (fenced) before its code runs; its key is its idempotency
   key (``ctx.idempotency_key``). An idempotent step's row is written only if it is still
   running after ``DAR_STARTED_ROW_AFTER_MS`` (250 ms): rule 2 runs it again after a crash
   whether or not the row exists, so the row tells the timeline and the live stream what is
   in progress and nothing else, and a quick idempotent call (most tool calls) costs one
   commit, not two.
2. A step found ``STARTED`` when a task begins is *in doubt*: its worker stopped between the
   effect and the record. It runs again only when it is declared idempotent, or an operator
   authorised exactly one more execution (``resolve`` with ``retry``); else its ``reconcile``
   hook is asked whether the effect happened; else the run stops ``NEEDS_ATTENTION`` for an
   operator, with the reason.
3. A step that runs past its timeout gets ``ctx.cancelled`` set and ``cancel_grace`` seconds
   to stop. If it returns, what it returned is recorded (the effect happened: saying "timed
   out" would invite a second one); if it raises, the timeout is recorded; if it is still
   running, it stays ``STARTED`` and rule 2 decides on the next task. A timed-out call is never
   recorded as failed while its code may still produce the effect.
4. A step whose code raises :class:`~runtime.tools.OutcomeUnknown` (it sent a request, an MCP
   call for one, and the answer never came) is in doubt at once, as if its worker had crashed
   there: when it is idempotent the error is recorded (the caller may call again); else its
   ``reconcile`` hook is asked; else the run stops ``NEEDS_ATTENTION``, the step left
   ``STARTED`` for the operator.
5. A step whose code raises :class:`~db.errors.DatabaseUnavailable` (it works on the runtime's
   own database, the demo's tools do, and that database is away: a restart, a failover) is
   not recorded: its failure is the runtime's, not an answer for the model or the function,
   and the database that would record it is away too. The task ends as if its worker had
   crashed there, on a short durable timer (:data:`AWAY_RETRY_SECONDS`): the next task finds
   the step in doubt (rule 2) when its ``STARTED`` row was written, new when it was not. A
   run whose step keeps finding the database away stops as any run that keeps stopping its
   worker (``DAR_MAX_CLAIMS_WITHOUT_PROGRESS``). Any other database error the code raises is
   its own failure, recorded as such (a tool's own database is not the runtime's).

The caller turns the verdict into its row (:func:`row`: what the row says is the kind's, how
it is built is written once here) or into the end of the task (:func:`unsettled`: in doubt,
still running, or the runtime's database away), and records it in the same transaction that
hands the lease on.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from db.errors import DatabaseUnavailable
from db.records import NewStep, Step, StepStatus
from runtime import native
from runtime.pipeline import usage
from runtime.pipeline.checkpoint import StepResult, Task
from runtime.pipeline.faults import crash_point
from runtime.pipeline.kinds import KINDS, Found, Policy, StepKind
from runtime.tools import OutcomeUnknown, Reconciled, ToolContext

log = logging.getLogger(__name__)

AWAY_RETRY_SECONDS = (1.0, 3.0)
"""Rule 5: a step whose code found the runtime's database away is tried again after a delay
drawn from this range (jittered: a fleet's runs do not all come back at once)."""

MAX_RECONCILE_ROUNDS = 3
"""In one task, how many times an effect whose answer was lost is reconciled ("not
happened") and run again before the run stops for an operator instead."""


@dataclass(frozen=True)
class Effect:
    key: str
    kind: StepKind
    seq: int
    fn: Callable[[ToolContext], Any]
    label: str
    """How messages name the step: ``tool 'send_email' (tool_use id ..., seq=4)``."""
    idempotent: bool = False
    reconcile: Callable[[ToolContext], Reconciled | None] | None = None
    timeout_seconds: float | None = None
    attempt: int = 1
    tool_name: str | None = None
    tool_use_id: str | None = None
    input_hash: str | None = None
    context_key: str | None = None
    """The key within the run the code sees (``ctx.key``; ``ctx.idempotency_key`` is
    ``<run id>/<it>``); the step key if unset."""
    take_seq: Callable[[], int] | None = None
    """Where the rows of model calls its code reports get their seqs (``record_usage``:
    :mod:`runtime.pipeline.usage`); past the run's log if unset."""

    @property
    def policy(self) -> Policy:
        return KINDS[self.kind]

    @property
    def reruns(self) -> bool:
        """Safe to run again after a crash: declared idempotent, or of a kind whose body has
        no effect of its own (``steps.llm``, ``steps.side_effect``)."""
        return self.idempotent or self.policy.always_reruns


@dataclass(frozen=True)
class Ran:
    value: Any
    latency_ms: int
    late: bool = False
    """It returned after its timeout (within the grace): the effect happened."""


@dataclass(frozen=True)
class Raised:
    error: Exception
    latency_ms: int
    timed_out: bool = False


@dataclass(frozen=True)
class WasReconciled:
    output: Any


@dataclass(frozen=True)
class InDoubt:
    reason: str


@dataclass(frozen=True)
class StillRunning:
    reason: str


@dataclass(frozen=True)
class Away:
    """Rule 5: the code found the runtime's database away; nothing is recorded."""

    reason: str


Verdict = Ran | Raised | WasReconciled | InDoubt | StillRunning | Away


def run_effect(task: Task, effect: Effect, found: Found) -> Verdict:
    """Run ``effect`` under the rules above; ``found`` is what the log says of its key."""
    if not effect.policy.has_effect:
        raise ValueError(f"a {effect.kind} step has no effect to execute (runtime.pipeline.kinds)")
    context = ToolContext(run_id=task.run_id, tool_use_id=effect.context_key or effect.key)
    if found.in_doubt is not None:
        decided = _in_doubt(task, effect, found.in_doubt, context)
        if decided is not None:
            return decided
    task.ensure_lease()
    row = NewStep(
        seq=effect.seq,
        step_key=effect.key,
        kind=effect.policy.row,
        status=StepStatus.STARTED,
        attempt=effect.attempt,
        tool_name=effect.tool_name,
        tool_use_id=effect.tool_use_id,
        input_hash=effect.input_hash,
    )
    # Only a step that runs on the step pool anyway (it has a timeout: every tool does) can be
    # watched while it runs; one without runs inline on the task's thread, its row first.
    after = task.settings.started_row_after_seconds
    deferred = (
        Deferred(after, task, row)
        if effect.reruns and effect.timeout_seconds is not None and after > 0
        else None
    )
    if deferred is None:
        task.start(row)
    crash_point("after_tool_start")
    # model calls its code makes itself are reported to this recorder (runtime.record_usage)
    recorder = usage.StepUsage(
        task, effect.key, effect.attempt, effect.take_seq or usage.seq_after(task, effect.seq)
    )
    with usage.carry(recorder):
        verdict = _away(effect, _run(task, effect, context, deferred))
        crash_point("after_tool_effect")
        if (
            isinstance(verdict, Raised)
            and isinstance(verdict.error, OutcomeUnknown)
            and not effect.reruns
        ):
            return _answer_lost(task, effect, context, verdict.error)
    return verdict


def _away(effect: Effect, verdict: Verdict) -> Verdict:
    """Rule 5: the code raised :class:`DatabaseUnavailable`: not its failure, nothing to
    record."""
    if isinstance(verdict, Raised) and isinstance(verdict.error, DatabaseUnavailable):
        return Away(
            f"{effect.label}: the runtime's database is away ({verdict.error}); nothing "
            "recorded; the step is taken up again"
        )
    return verdict


def _answer_lost(
    task: Task, effect: Effect, context: ToolContext, error: Exception, rounds: int = 1
) -> Verdict:
    """Rule 4: the effect's answer never came and it is not idempotent. When its reconcile
    hook says the effect had not happened, it runs again; a run whose answer is lost again
    is in doubt again, so the hook is asked again (never a plain failure: ``steps.retry``
    would run the effect once more without asking), up to :data:`MAX_RECONCILE_ROUNDS`."""
    if effect.reconcile is None:
        return InDoubt(
            f"{effect.label}: {error}; it is not declared idempotent, so it was not run "
            "again: check whether its effect happened, then resolve the run (supply_result, "
            "retry or fail)"
        )
    log.warning(
        "run=%s seq=%d %s: %s; asking its reconcile hook", task.rid, effect.seq, effect.label, error
    )
    decided = _reconciled(task, effect, context)
    if decided is not None:
        return decided
    again = _away(effect, _run(task, effect, context))
    if not (isinstance(again, Raised) and isinstance(again.error, OutcomeUnknown)):
        return again
    if rounds >= MAX_RECONCILE_ROUNDS:
        return InDoubt(
            f"{effect.label}: {again.error}; its answer was lost {rounds + 1} times, each time "
            "after its reconcile hook said the effect had not happened, so it was not run "
            "again: check whether its effect happened, then resolve the run (supply_result, "
            "retry or fail)"
        )
    return _answer_lost(task, effect, context, again.error, rounds + 1)


def _in_doubt(task: Task, effect: Effect, recorded: Step, context: ToolContext) -> Verdict | None:
    """``None``: run it again. Otherwise what to do instead."""
    if effect.reruns or recorded.resolution == "retry":
        why = "an operator authorised one retry" if not effect.reruns else "idempotent"
        log.info(
            "run=%s seq=%d %s was left started; running it again (%s)",
            task.rid,
            effect.seq,
            effect.label,
            why,
        )
        return None
    if effect.reconcile is None:
        return InDoubt(
            f"{effect.label} was started but its worker stopped before recording a result, "
            "and it is not declared idempotent, so it was not run again: check whether its "
            "effect happened, then resolve the run (supply_result, retry or fail)"
        )
    return _reconciled(task, effect, context)


def _reconciled(task: Task, effect: Effect, context: ToolContext) -> Verdict | None:
    """Ask the effect's reconcile hook: ``None`` when the effect had not happened."""
    reconcile = effect.reconcile
    assert reconcile is not None
    try:
        answer = _run(
            task,
            Effect(
                effect.key,
                effect.kind,
                effect.seq,
                reconcile,
                effect.label,
                timeout_seconds=effect.timeout_seconds,
            ),
            context,
        )
    except Exception as e:  # pragma: no cover - _run returns Raised for user errors
        answer = Raised(e, 0)
    if isinstance(answer, Raised | StillRunning):
        detail = (
            f"{type(answer.error).__name__}: {answer.error}"
            if isinstance(answer, Raised)
            else "it did not return"
        )
        return InDoubt(
            f"{effect.label} was left started and its reconcile hook failed ({detail}); "
            "resolve the run (supply_result, retry or fail)"
        )
    if isinstance(answer, Ran) and isinstance(answer.value, Reconciled):
        log.info(
            "run=%s seq=%d %s reconciled: the effect had happened",
            task.rid,
            effect.seq,
            effect.label,
        )
        return WasReconciled(answer.value.output)
    log.info(
        "run=%s seq=%d %s reconciled: the effect had not happened: running it",
        task.rid,
        effect.seq,
        effect.label,
    )
    return None


def unsettled(task: Task, verdict: Verdict) -> StepResult | None:
    """How the task ends when the step's outcome is not known: in doubt, the run stops for
    an operator; still running past its grace, a timer comes back to decide; the runtime's
    database away (rule 5), a timer comes back to run it again. ``None``: the verdict is a
    result or an error, to be recorded (:func:`row`)."""
    if isinstance(verdict, InDoubt):
        return task.needs_attention(verdict.reason)
    if isinstance(verdict, Away):
        delay = random.uniform(*AWAY_RETRY_SECONDS)
        log.warning("run=%s %s in %.1fs", task.rid, verdict.reason, delay)
        return task.schedule(delay, verdict.reason)
    if isinstance(verdict, StillRunning):
        log.warning("run=%s %s", task.rid, verdict.reason)
        return task.schedule(task.settings.cancel_grace_seconds, verdict.reason)
    return None


def row(
    effect: Effect,
    verdict: Verdict,
    *,
    status: StepStatus | None = None,
    response: Any = None,
    error: str | None = None,
    compensation: str | None = None,
) -> NewStep:
    """The row that records ``verdict`` of ``effect``: ``DONE``, or ``ERROR`` when it raised
    (unless ``status`` says otherwise); ``response`` and ``error`` as the kind renders them."""
    if status is None:
        status = StepStatus.ERROR if isinstance(verdict, Raised) else StepStatus.DONE
    return NewStep(
        seq=effect.seq,
        step_key=effect.key,
        kind=effect.policy.row,
        status=status,
        response=response,
        error=error,
        attempt=effect.attempt,
        latency_ms=verdict.latency_ms if isinstance(verdict, Ran | Raised) else 0,
        tool_name=effect.tool_name,
        tool_use_id=effect.tool_use_id,
        input_hash=effect.input_hash,
        compensation=compensation,
    )


@dataclass(frozen=True)
class Deferred:
    """The ``STARTED`` row of an idempotent step, written once it has run ``after`` seconds."""

    after: float
    task: Task
    row: NewStep

    def write(self, context: ToolContext) -> None:
        try:
            self.task.start(self.row)
        except BaseException:
            context.cancelled.set()  # the lease is gone: the code may stop, its result is moot
            raise


def _run(
    task: Task, effect: Effect, context: ToolContext, deferred: Deferred | None = None
) -> Verdict:
    """The step's own code, with its timeout and cancellation. A crash (a ``BaseException``:
    a lost lease, a simulated crash, a durable function unwinding) propagates.

    While it runs, a cancel of the run (``POST /cancel``, seen through the live channel's
    flag) sets ``ctx.cancelled``: the code may stop early; the guard ends the run after."""
    channel = task.services.live
    if channel is None:
        return _run_limited(task, effect, context, deferred)
    with channel.watch(task.run_id) as watched:
        watched.aborts.append(context.cancelled.set)
        return _run_limited(task, effect, context, deferred)


def _run_limited(
    task: Task, effect: Effect, context: ToolContext, deferred: Deferred | None
) -> Verdict:
    started = time.monotonic()

    def took() -> int:
        return int((time.monotonic() - started) * 1000)

    timeout = effect.timeout_seconds
    if timeout is None:
        try:
            return Ran(effect.fn(context), took())
        except Exception as e:
            return Raised(e, took())
    context = ToolContext(
        run_id=context.run_id,
        tool_use_id=context.tool_use_id,
        cancelled=context.cancelled,
        deadline=started + timeout,
    )
    # A native OS thread, also under gevent: a body blocking in C stalls no model call.
    future = native.submit(effect.fn, context)
    # (The code's own TimeoutError is an exception like any other: done-ness decides.)
    if deferred is not None and not native.wait(future, min(deferred.after, timeout)):
        deferred.write(context)
    native.wait(future, started + timeout - time.monotonic())
    late = not future.done()
    if late:
        if native.cancel(future):  # never started (the pool was busy): it never will
            return Raised(TimeoutError(f"did not start within {timeout:g}s"), took(), True)
        context.cancelled.set()
        grace = task.settings.cancel_grace_seconds
        native.wait(future, grace)
        if not future.done():
            return StillRunning(
                f"{effect.label} ran past its {timeout:g}s timeout and did not stop within "
                f"{grace:g}s of being cancelled; it may still produce its effect"
            )
    error = future.exception()
    if error is not None:
        if not isinstance(error, Exception):
            raise error  # a crash, a lost lease, the function unwinding
        return Raised(error, took(), timed_out=late)
    if late:
        log.warning(
            "run=%s seq=%d %s returned after its %gs timeout; its result is recorded",
            task.rid,
            effect.seq,
            effect.label,
            timeout,
        )
    return Ran(future.result(), took(), late=late)
