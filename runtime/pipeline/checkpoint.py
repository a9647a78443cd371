"""One task: what a program (the agent loop, a durable function) gets for the run it holds.

A :class:`Task` lives for one claim. It carries the services of the executor (store, model
client, settings, pricing, metrics), the claim that fences every write, and the lease the
heartbeat renews. Its methods are the ways a task may end: a checkpoint hands the lease on
(:meth:`checkpoint`), a durable timer parks the run (:meth:`schedule`), :meth:`finish` ends
it or parks it for a human. Each is one fenced transaction, and each is the only way to do
that thing, for every kind of step.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from db.errors import DatabaseUnavailable, LeaseLost
from db.records import Claim, Dispatch, NewRun, NewStep, Run, RunStatus, Step, StepStatus, Usage
from db.store import RunStore
from runtime.admission.flow_control import Answered, FlowControl, Grant
from runtime.config import Settings
from runtime.llm.base import LlmClient
from runtime.llm.pricing import PriceTable
from runtime.mcp.client import McpClients
from runtime.observe.logctx import error_text
from runtime.observe.metrics import Metrics
from runtime.observe.tracing import run_span
from runtime.pipeline.guard import Stop, guard
from runtime.pipeline.heartbeat import HeldLease
from runtime.pipeline.kinds import Found, look_up, waits_for_a_run
from runtime.pipeline.prompthash import PromptHashes
from runtime.pipeline.replay import ReplayCache

if (
    TYPE_CHECKING
):  # runtime.observe.live_channel imports redis (and ssl): not before gevent patches it
    from contextlib import AbstractContextManager

    from runtime.observe.live_channel import LiveChannel

log = logging.getLogger(__name__)
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
P = TypeVar("P", bound="Place")
P_contra = TypeVar("P_contra", bound="Place", contravariant=True)


class Outcome(enum.StrEnum):
    CONTINUE = "CONTINUE"
    """A step was committed; send ``dispatch`` to run the next one."""
    FINISHED = "FINISHED"
    """The run ended (or is parked for a human); nothing to send."""
    DROPPED = "DROPPED"
    """The message was stale or duplicated, or the run is held by a live lease: nothing ran."""
    WAITING = "WAITING"
    """The run is parked on a durable timer or for a decision; ``dispatch`` (if any) is sent
    with its delay."""
    REROUTED = "REROUTED"
    """The run is of a version this worker does not serve: nothing ran; ``dispatch`` is sent
    again, to the queue of the run's own version (runtime.engine.deployment)."""


@dataclass(frozen=True, slots=True)
class StepResult:
    outcome: Outcome
    dispatch: Dispatch | None = None
    status: RunStatus | None = None
    wakes: tuple[Dispatch, ...] = ()
    """Runs woken because this step freed their concurrency-key slot: send these too."""
    ends_next: bool = False
    """The step's answer ended the conversation: the run's next task only ends it (the
    executor may do that at once, see :meth:`runtime.engine.driver.Driver.drive`)."""


@dataclass(frozen=True)
class Services:
    """What every task of one executor shares."""

    store: RunStore
    llm: LlmClient
    settings: Settings
    pricing: PriceTable
    metrics: Metrics | None
    worker: str
    mcp: McpClients | None = None
    """This process's MCP sessions (``None``: no agent here uses MCP servers)."""
    live: LiveChannel | None = None
    """The live stream's Redis side: text deltas out, cancel flags in (``None``: off)."""
    flow: FlowControl | None = None
    """Fleet-wide admission of model calls (``None``: DAR_MODEL_LIMITS is not set)."""
    replays: ReplayCache | None = None
    """This process's replays of the runs it drives (``None``: replay every step in full)."""
    hashes: PromptHashes | None = None
    """This process's prompt hashes, incremental per run (``None``: hash every body whole)."""
    run_defaults: Callable[[str], tuple[str | None, int | None]] | None = None
    """An agent's own model and step cap by its name (for the child runs a run starts;
    ``None``: children take the parent's model and DAR_DEFAULT_MAX_STEPS)."""

    def child_model_and_steps(self, agent: str, parent_model: str) -> tuple[str, int]:
        """The model and step cap of a child run of ``agent``: the agent's own, else the
        parent's model and the configured default step cap."""
        model, max_steps = self.run_defaults(agent) if self.run_defaults else (None, None)
        return model or parent_model, max_steps or self.settings.default_max_steps


def short(run_id: uuid.UUID) -> str:
    return str(run_id)[:8]


def plus(a: Usage, b: Usage) -> Usage:
    """``a`` and ``b`` added up, count by count."""
    return Usage(
        a.input_tokens + b.input_tokens,
        a.output_tokens + b.output_tokens,
        a.cache_creation_input_tokens + b.cache_creation_input_tokens,
        a.cache_read_input_tokens + b.cache_read_input_tokens,
    )


@dataclass(frozen=True, slots=True)
class Earlier(Generic[T_co]):
    """What a write returned, found after the fact: an earlier try did commit."""

    value: T_co


@dataclass
class Task:
    services: Services
    claim: Claim
    lease: HeldLease
    steps: list[Step]
    spent: Usage = field(default_factory=Usage)
    """Tokens recorded by this task so far (model calls inside a step), for the guard."""
    spent_cost: Decimal = field(default_factory=Decimal)
    admission: Grant | None = None
    """Flow-control admission held by the model call about to be made (settled after it)."""
    stop_reason: str | None = None
    """Why the engine stops this run early, marked by this task (:meth:`begin_stop`)."""
    answered: Answered | None = None
    """The admission of the answered model call not yet recorded: it is settled, and its
    record in flow control (the estimate a crash would leave) erased, once the answer is
    recorded."""
    _log: tuple[list[Step], dict[str, Step]] | None = field(default=None, repr=False)

    @property
    def store(self) -> RunStore:
        return self.services.store

    @property
    def settings(self) -> Settings:
        return self.services.settings

    @property
    def run_id(self) -> uuid.UUID:
        return self.claim.run_id

    @property
    def rid(self) -> str:
        return short(self.claim.run_id)

    @property
    def stopping(self) -> str | None:
        """Why the engine is stopping this run early while its compensations run, one per
        task (``None``: it is not). Kept on the run (:meth:`begin_stop`), so every task of
        the unwinding knows it, whatever the run's counters say by then."""
        if self.stop_reason is not None:
            return self.stop_reason
        run = self.claim.run
        return run.error if run.status is RunStatus.RUNNING and run.error else None

    def begin_stop(self, reason: str) -> None:
        """Mark the run as stopping for ``reason``: no new step runs, its compensations do,
        then it ends FAILED."""
        self.durably("the run's stop", lambda: self.store.begin_stop(self.claim, reason))
        self.stop_reason = reason

    @property
    def log(self) -> dict[str, Step]:
        """The run's steps by key, as this task read them."""
        if self._log is None or self._log[0] is not self.steps:
            self._log = (self.steps, {s.step_key: s for s in self.steps})
        return self._log[1]

    def look_up(self, key: str) -> Found:
        """Is the step ``key`` recorded, in doubt, or new?
        (:func:`runtime.pipeline.kinds.look_up`)"""
        return look_up(self.log, key)

    @property
    def next_seq(self) -> int:
        return max((s.seq for s in self.steps), default=0) + 1

    # -- the lease ------------------------------------------------------------------------

    def ensure_lease(self) -> None:
        """Stop before writing when the heartbeat already knows the run was taken over (the
        fence would refuse the write anyway; this only saves the work)."""
        if self.lease.lost.is_set():
            raise LeaseLost(self.claim.run_id, "heartbeat found the lease taken over")

    # -- the guard ------------------------------------------------------------------------

    def guard(self, *, steps_taken: int, next_is_model: bool) -> Stop | None:
        """Cancellation, deadline, token and cost budget, step cap: checked before every
        step (the budget and the cap before model steps), with what this task spent."""
        run = self.claim.run
        if self.spent.total:
            run = replace(
                run,
                tokens_used=run.tokens_used + self.spent.total,
                cost_usd=run.cost_usd + self.spent_cost,
            )
        return guard(
            run, now=self.claim.db_now, steps_taken=steps_taken, next_is_model=next_is_model
        )

    # -- every record: across a database blip ---------------------------------------------

    def durably(
        self,
        what: str,
        write: Callable[[], T],
        committed: Callable[[], Earlier[T] | None] | None = None,
    ) -> T:
        """Run ``write``, a fenced record of this task, across a database blip.

        - The database is away (PostgreSQL restarting, a dropped connection: the store
          raises :class:`~db.errors.DatabaseUnavailable`): the write is tried again, with backoff,
          for as long as the lease lasts, so a step that ran is not run again because the
          database blinked while it was recorded. Before each new try ``committed()`` says
          whether an earlier try did commit (its answer lost with the connection): its
          :class:`Earlier` result is then the write's.
        - Any other error (bad data, a bug) is raised at once: trying again cannot help.
        - The fence refuses it: ``LeaseLost`` goes on.
        """
        give_up = time.monotonic() + self.settings.lease_seconds
        delay = 0.1
        retried = False
        while True:
            try:
                self.ensure_lease()
                if retried and committed is not None:
                    earlier = committed()
                    if earlier is not None:
                        self.store.step_logs.forget(self.run_id)  # it missed the lost write
                        return earlier.value
                return write()
            except Exception as e:
                left = give_up - time.monotonic()
                if not isinstance(e, DatabaseUnavailable) or left <= 0:
                    raise
                pause = min(delay, left)  # the last try lands on the deadline, not before it
                log.warning(
                    "run=%s the database is away while recording %s (%s); trying again in %.1fs",
                    self.rid,
                    what,
                    type(e).__name__,
                    pause,
                    extra={"run_id": str(self.run_id), "event": "checkpoint.retry"},
                )
                time.sleep(pause)
                delay = min(delay * 2, 2.0)
                retried = True

    def wrote(self, row: NewStep) -> Step | None:
        """``row`` as an earlier try of this task committed it, if it did: this run's own row
        (a fork's copy of its source's row carries the source's epoch, maybe equal to ours),
        written under this lease, with the status written."""
        found = self.store.step_by_key(self.run_id, row.step_key)
        if (
            found is None
            or found.origin is not None
            or found.lease_epoch != self.claim.epoch
            or found.status != row.status
        ):
            return None
        return found

    def _handed_on(self, rows: list[NewStep], delay: float = 0.0) -> Earlier[Dispatch] | None:
        """The message an earlier, committed try of a checkpoint of ``rows`` handed on to."""
        if not rows or self.wrote(rows[-1]) is None:
            return None
        token = self.store.get_run(self.run_id).dispatch_token
        return Earlier(Dispatch(self.run_id, token, delay))

    def _wrote_child(self, row: NewStep) -> Earlier[None] | None:
        return Earlier(None) if self.wrote(row) is not None else None

    def _released(self, check: Callable[[Run], bool]) -> Run | None:
        """The run, when an earlier try of a write that releases the lease committed."""
        run = self.store.get_run(self.run_id)
        held = run.locked_by is not None or run.lease_epoch != self.claim.epoch
        return run if not held and check(run) else None

    # -- ending the task --------------------------------------------------------------------

    def checkpoint(self, rows: list[NewStep]) -> StepResult:
        """Record ``rows`` (their tokens added to the run) and hand the lease on, in one
        transaction; the returned message runs the next step."""
        dispatch = self.durably(
            rows[-1].step_key,
            functools.partial(self.store.record_steps, self.claim, rows),  # no frame of its own
            lambda: self._handed_on(rows),
        )
        return StepResult(Outcome.CONTINUE, dispatch=dispatch)

    def record_replayed(self, row: NewStep, original: Step, *, hand_over: bool) -> Dispatch | None:
        """Record a model step a fork answered from the original's ``original`` row; with
        ``hand_over`` it is the task's step and the lease is handed on."""

        def earlier() -> Earlier[Dispatch | None] | None:
            return self._handed_on([row]) if hand_over else self._wrote_child(row)

        return self.durably(
            row.step_key,
            lambda: self.store.record_replayed(self.claim, row, original, hand_over=hand_over),
            earlier,
        )

    # -- records that do not end the task -----------------------------------------------------

    def start(self, row: NewStep) -> None:
        """Write a step with an effect ``STARTED``, before its code runs (writing it again
        rewrites the same row: nothing to check)."""
        self.durably(row.step_key, lambda: self.store.start_step(self.claim, row))

    def record_child(self, row: NewStep) -> None:
        """Record a step nested in the running one (the task goes on)."""
        self.durably(
            row.step_key,
            lambda: self.store.record_child(self.claim, row),
            lambda: self._wrote_child(row),
        )

    def suspend_for_approval(
        self,
        row: NewStep,
        *,
        role: str,
        payload: Any,
        timeout_seconds: float,
        timeout_policy: str,
        discard_copied: bool,
    ) -> uuid.UUID:
        """Record the ``PENDING`` approval ``row`` and park the run for its decision."""

        def earlier() -> Earlier[uuid.UUID] | None:
            if self.wrote(row) is None:
                return None
            approvals = self.store.list_approvals(status=None, run_id=self.run_id)
            found = next((a.id for a in approvals if a.step_key == row.step_key), None)
            return None if found is None else Earlier(found)

        return self.durably(
            row.step_key,
            lambda: self.store.suspend_for_approval(
                self.claim,
                row,
                role=role,
                payload=payload,
                timeout_seconds=timeout_seconds,
                timeout_policy=timeout_policy,
                discard_copied=discard_copied,
            ),
            earlier,
        )

    # -- records of the kinds that wait or start other runs --------------------------------
    # Messages, signals (consumed and sent), child runs (started) and the parkings that wait
    # for them are records like any other: each is one fenced transaction, tried again
    # across a database blip within the lease, and an earlier try that committed (its answer
    # lost with the connection) is recognised from the row it wrote.

    def _took(self, row: NewStep) -> tuple[Any, Dispatch] | None:
        """The step ``row`` (by its key and status), as an earlier try of this task
        committed it (its recorded response), with the message that try handed on to."""
        written = self.wrote(row)
        if written is None:
            return None
        token = self.store.get_run(self.run_id).dispatch_token
        return written.response, Dispatch(self.run_id, token)

    def deliver_message(self, row: NewStep) -> Dispatch | None:
        """Deliver the oldest message posted to the run as the step ``row`` (its ``response``
        the message's content), handing the lease on; ``None`` when there is none."""

        def earlier() -> Earlier[Dispatch | None] | None:
            took = self._took(row)
            return None if took is None else Earlier(took[1])

        return self.durably(
            row.step_key,
            lambda: self.store.deliver_message(
                self.claim, lambda content: replace(row, response=content)
            ),
            earlier,
        )

    def consume_signal(self, name: str, row: NewStep) -> tuple[Any, Dispatch] | None:
        """Consume the oldest pending signal ``name`` as the step ``row`` (its ``response``
        the signal's payload), handing the lease on; ``None`` when there is none."""

        def earlier() -> Earlier[tuple[Any, Dispatch] | None] | None:
            took = self._took(row)
            return None if took is None else Earlier(took)

        return self.durably(
            row.step_key,
            lambda: self.store.consume_signal(
                self.claim, name, lambda payload: replace(row, response=payload)
            ),
            earlier,
        )

    def send_signal(
        self, row: NewStep, *, target: uuid.UUID, name: str, payload: Any, idempotency_key: str
    ) -> tuple[Dispatch, Dispatch | None]:
        """``steps.send``: the signal for ``target``, the sender's step ``row`` and the wake of
        the target (when it is parked) in one transaction, handing the lease on. Returns the
        sender's next message and the target's (``None``: not parked, or the earlier try's
        wake, which the reaper sends)."""

        def earlier() -> Earlier[tuple[Dispatch, Dispatch | None]] | None:
            took = self._took(row)
            return None if took is None else Earlier((took[1], None))

        return self.durably(
            row.step_key,
            lambda: self.store.send_signal(
                self.claim,
                row,
                target=target,
                name=name,
                payload=payload,
                idempotency_key=idempotency_key,
            ),
            earlier,
        )

    def budget_left(self) -> int:
        """The run's token budget not yet spent: recorded, unrecorded, and this task's."""
        run = self.claim.run
        return run.token_budget - run.tokens_used - run.unrecorded_tokens - self.spent.total

    def child_run(
        self,
        started_as: str,
        agent: str,
        value: Any,
        *,
        token_budget: int,
        timeout_seconds: int | None,
    ) -> tuple[NewRun, uuid.UUID]:
        """A child run of this run for its step ``started_as``, and its id: both derived from
        the parent and the step (a crash never starts two), its model and step cap the
        agent's own (else the parent's model and the default cap), the parent's tenant and
        submitter, at most the time left to the parent's deadline. One definition for
        ``steps.child`` and the agent loop's sub-agents."""
        parent = self.claim.run
        seconds_left = int((parent.deadline_at - self.claim.db_now).total_seconds())
        model, max_steps = self.services.child_model_and_steps(agent, parent.model)
        new = NewRun(
            agent=agent,
            input=value,
            model=model,
            max_steps=max_steps,
            token_budget=token_budget,
            timeout_seconds=max(1, min(timeout_seconds or seconds_left, seconds_left)),
            submitted_by=parent.submitted_by,
            tenant=parent.tenant,
            idempotency_key=f"child:{parent.id}/{started_as}",
            parent_run_id=parent.id,
        )
        return new, uuid.uuid5(parent.id, started_as)

    def start_children(
        self, started: list[tuple[NewStep, NewRun, uuid.UUID]], recheck: float, reason: str
    ) -> list[Dispatch]:
        """Start child runs with their ``PENDING`` steps and park the run for them, in one
        transaction; the children's first messages."""

        def earlier() -> Earlier[list[Dispatch]] | None:
            if self.wrote(started[-1][0]) is None:
                return None
            runs = [self.store.get_run(child_id) for _, _, child_id in started]
            return Earlier([Dispatch(r.id, r.dispatch_token) for r in runs])

        return self.durably(
            started[-1][0].step_key,
            lambda: self.store.start_children(self.claim, started, recheck, reason),
            earlier,
        )

    def park(
        self, rows: list[NewStep], delay_seconds: float, reason: str, *, signal: str | None
    ) -> Dispatch | None:
        """Record ``rows`` and park the run for a signal (or only a timer: ``signal`` None),
        holding nothing; ``None`` when the signal is there already (consume it)."""

        def earlier() -> Earlier[Dispatch | None] | None:
            if rows:
                handed = self._handed_on(rows, delay_seconds)
                return None if handed is None else Earlier(handed.value)
            run = self._released(lambda r: r.wait_reason == reason)
            return None if run is None else Earlier(Dispatch(run.id, run.dispatch_token))

        return self.durably(
            rows[-1].step_key if rows else reason,
            lambda: self.store.wait_for_signal(
                self.claim, rows, signal=signal, delay_seconds=delay_seconds, reason=reason
            ),
            earlier,
        )

    def park_for_child(self, child_id: uuid.UUID, delay_seconds: float, reason: str) -> bool:
        """Park the run until its child ``child_id`` ends (``delay_seconds`` as a fallback);
        ``False`` when the child has ended already (read its result now)."""

        def earlier() -> Earlier[Dispatch | None] | None:
            run = self._released(lambda r: r.wait_reason == reason)
            return None if run is None else Earlier(Dispatch(run.id, run.dispatch_token))

        parked = self.durably(
            reason,
            lambda: self.store.park_for_child(self.claim, child_id, delay_seconds, reason),
            earlier,
        )
        return parked is not None

    def schedule(
        self,
        delay_seconds: float,
        reason: str,
        *,
        rows: list[NewStep] | None = None,
        model_attempts: int = 0,
        admission: bool = False,
        wakeable: bool = False,
    ) -> StepResult:
        """A durable timer: record ``rows`` (if any), release the lease, come back in
        ``delay_seconds``. No thread and no lease wait; a countdown message is sent when the
        wait is short, the reaper sends one when it is due otherwise. The timer is a floor
        no wake crosses (a server's retry-after, a backoff), unless ``wakeable`` (a wait for
        capacity: a concurrency-key slot, flow control's admission, asked again when woken)."""
        if rows:
            dispatch = self.durably(
                rows[-1].step_key,
                lambda: self.store.record_steps(
                    self.claim,
                    rows,
                    delay_seconds=delay_seconds,
                    reason=reason,
                    model_attempts=model_attempts,
                    wakeable=wakeable,
                ),
                lambda: self._handed_on(rows, delay_seconds),
            )
        else:

            def earlier() -> Earlier[Dispatch] | None:
                run = self._released(lambda r: r.wait_reason == reason)
                if run is None:
                    return None
                return Earlier(Dispatch(self.run_id, run.dispatch_token, delay_seconds))

            dispatch = self.durably(
                "a timer",
                lambda: self.store.schedule(
                    self.claim,
                    delay_seconds,
                    reason=reason,
                    model_attempts=model_attempts,
                    admission=admission,
                    wakeable=wakeable,
                ),
                earlier,
            )
        send = delay_seconds <= self.settings.max_countdown_seconds
        return StepResult(Outcome.WAITING, dispatch=dispatch if send else None)

    def finish(
        self, status: RunStatus, *, result: Any = None, error: str | None = None
    ) -> StepResult:
        """End the run with ``status`` (or park it NEEDS_ATTENTION), releasing the lease."""

        def earlier() -> Earlier[Run] | None:
            ended = self._released(lambda r: r.status is not RunStatus.RUNNING)
            return Earlier(ended) if ended is not None else None

        run = self.durably(
            f"the run's end ({status})",
            lambda: self.store.finish(self.claim, status, result=result, error=error),
            earlier,
        )
        if run.finished_at is not None:
            if self.services.metrics is not None:
                took = (run.finished_at - run.created_at).total_seconds()
                self.services.metrics.run_finished(str(run.status), took)
            run_span(str(run.id), run.agent, str(run.status), run.created_at, run.finished_at)
        detail = f" reason={error_text(error)}" if error else ""
        log.info("run=%s %s tokens=%d%s", self.rid, run.status, run.tokens_used, detail)
        if (
            run.status.terminal
            and run.status is not RunStatus.SUCCEEDED
            and any(waits_for_a_run(s) for s in self.steps)
        ):  # a parent that ends early ends the child it waits for (and its children)
            self.durably("-", lambda: self.store.cancel_children(run.id))
        wakes: tuple[Dispatch, ...] = ()
        if run.parent_run_id is not None and run.status.terminal:  # its parent waits for it
            parent = run.parent_run_id
            woken = self.durably("-", lambda: self.store.wake(parent))
            wakes = (woken,) if woken is not None else ()
        return StepResult(Outcome.FINISHED, status=run.status, wakes=wakes)

    def wake(self, run_id: uuid.UUID, *, send: bool = True) -> Dispatch | None:
        """Wake another run parked on what this task freed (a concurrency-key slot): its
        message to send (``send`` false: the reaper's next sweep sends it), or ``None`` when
        it is not parked any more. Not fenced by this task's lease: the other run's wake is
        due whoever holds this one."""
        return self.store.wake(run_id, send=send)

    def needs_attention(self, reason: str) -> StepResult:
        return self.finish(RunStatus.NEEDS_ATTENTION, error=reason)

    def observe(self, kind: str, outcome: str, started: float) -> None:
        if self.services.metrics is not None:
            self.services.metrics.step(kind, outcome, time.monotonic() - started)


# -- the one advance ------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """What a kind's run gives the advance to record: ``rows`` through the checkpoint, in the
    transaction that hands the lease on (the task ends); or, with ``goes_on``, a record inside
    the running step, after which the task goes on with ``value``."""

    rows: list[NewStep]
    write: Callable[[], Dispatch | None] | None = None
    """How ``rows`` are recorded when not by :meth:`Task.checkpoint`: a billed model call's
    record (:func:`runtime.pipeline.modelcall.record_billed`: counted even when refused; a
    failed call the provider billed, :func:`runtime.pipeline.modelcall.record_failed`), or
    a fork's replayed answer's (:meth:`Task.record_replayed`)."""
    ends_next: bool = False
    """The step ended the conversation (:attr:`StepResult.ends_next`)."""
    then: Callable[[], None] | None = None
    """What the kind says once its record is committed (its log line, its metric)."""
    goes_on: bool = False
    """``write`` records ``rows`` inside the running step (a model call inside ``steps.llm``):
    the advance commits it, says so (``then``) and gives back ``value``; the task goes on."""
    value: Any = None
    """What the advance gives back after a record that ``goes_on``."""

    def __post_init__(self) -> None:
        assert not self.goes_on or self.write is not None, "a record inside a step writes"


class Place(Protocol):
    """One step being advanced, as the advance reads it: what the log holds of its key."""

    @property
    def row(self) -> Step | None: ...


class Kind(Protocol[P_contra]):
    """A kind of step, as the one advance drives it (the durable functions' kinds:
    :mod:`runtime.durable.simple`; the agent loop's: :mod:`runtime.agentloop.loop`)."""

    def settled(self, at: P_contra) -> bool:
        """Its recorded row answers the call: given back (``DONE``) or its error raised."""
        ...

    def replay(self, at: P_contra) -> Any:
        """What its recorded ``DONE`` row gives back."""
        ...

    def failed(self, at: P_contra) -> BaseException:
        """The error its settled, not ``DONE``, row raises again."""
        ...

    def run(self, at: P_contra) -> Any:
        """Run it: a :class:`Record` to commit, or its value, or the task's end of its own."""
        ...

    def predates(self) -> Any:
        """A marker's value for a run whose history predates it."""
        ...


class Program(Generic[P]):
    """A program over the step log (a durable function's execution, the agent loop): every
    step of every kind goes through its one :meth:`advance`. What differs per program is
    how it places a step (its key, its order) and guards it; per kind, the kind object."""

    task: Task

    def locate(self, step: Any) -> P | None:
        """The step's key and what the log says of it (``None``: a marker the run's history
        predates: nothing runs, nothing is recorded)."""
        raise NotImplementedError

    def guard_step(self, step: Any, at: P) -> None:
        """The guard before a step runs (it may end the task)."""

    def engine_call(self) -> AbstractContextManager[None]:
        """Around the engine's own work (a durable function tells it from its own failure)."""
        return contextlib.nullcontext()

    def end(self, result: StepResult) -> Any:
        """End the task with ``result`` (a durable function unwinds; the loop returns it)."""
        return result

    def advance(self, step: Kind[P]) -> Any:
        """Advance a step of any kind: placed and looked up; a recorded answer given back (or
        its error raised again); else guarded, and the kind runs: what it gives to record is
        committed here, ending the task; or it gives its value (a nested step), or ends the
        task of its own. A record inside the running step (:attr:`Record.goes_on`) is
        committed here too, and its value given back."""
        at = self.locate(step)
        if at is None:
            return step.predates()
        if step.settled(at):
            if at.row is not None and at.row.status is StepStatus.DONE:
                return step.replay(at)
            raise step.failed(at)
        self.guard_step(step, at)
        done = step.run(at)
        if not isinstance(done, Record):
            return done
        with self.engine_call():
            if done.write is None:
                ended = self.task.checkpoint(done.rows)
            else:
                ended = StepResult(Outcome.CONTINUE, dispatch=done.write())
        if done.then is not None:
            done.then()
        if done.goes_on:
            return done.value
        return self.end(replace(ended, ends_next=True) if done.ends_next else ended)
