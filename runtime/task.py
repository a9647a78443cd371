"""One task: what a program (the agent loop, a durable function) gets for the run it holds.

A :class:`Task` lives for one claim. It carries the services of the executor (store, model
client, settings, pricing, metrics), the claim that fences every write, and the lease the
heartbeat renews. Its methods are the ways a task may end: a checkpoint hands the lease on
(:meth:`checkpoint`), a durable timer parks the run (:meth:`schedule`), :meth:`finish` ends
it or parks it for a human. Each is one fenced transaction, and each is the only way to do
that thing, for every kind of step.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from db.errors import LeaseLost
from db.records import Claim, Dispatch, NewStep, RunStatus, Step, Usage
from db.store import RunStore
from runtime.config import Settings
from runtime.flow import FlowControl, Grant
from runtime.guard import Stop, guard
from runtime.heartbeat import HeldLease
from runtime.llm.base import LlmClient
from runtime.logctx import error_text
from runtime.mcp.client import McpClients
from runtime.metrics import Metrics
from runtime.pipeline import Found, look_up
from runtime.pricing import PriceTable
from runtime.prompthash import PromptHashes
from runtime.replay import ReplayCache
from runtime.tracing import run_span

if TYPE_CHECKING:  # runtime.live imports redis (and ssl): not before gevent patches it
    from runtime.live import LiveChannel

log = logging.getLogger(__name__)


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


@dataclass(frozen=True, slots=True)
class StepResult:
    outcome: Outcome
    dispatch: Dispatch | None = None
    status: RunStatus | None = None
    wakes: tuple[Dispatch, ...] = ()
    """Runs woken because this step freed their concurrency-key slot: send these too."""


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


def short(run_id: uuid.UUID) -> str:
    return str(run_id)[:8]


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
    def log(self) -> dict[str, Step]:
        """The run's steps by key, as this task read them."""
        if self._log is None or self._log[0] is not self.steps:
            self._log = (self.steps, {s.step_key: s for s in self.steps})
        return self._log[1]

    def look_up(self, key: str) -> Found:
        """Is the step ``key`` recorded, in doubt, or new? (:func:`runtime.pipeline.look_up`)"""
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

    # -- ending the task --------------------------------------------------------------------

    def checkpoint(self, rows: list[NewStep]) -> StepResult:
        """Record ``rows`` (their tokens added to the run) and hand the lease on, in one
        transaction; the returned message runs the next step."""
        self.ensure_lease()
        dispatch = self.store.record_steps(self.claim, rows)
        return StepResult(Outcome.CONTINUE, dispatch=dispatch)

    def record_model(self, row: NewStep, *, child: bool) -> Dispatch | None:
        """Record a model call (its tokens added to the run): as the task's step, handing
        the lease on in the same statement; or, with ``child``, inside the running step."""
        if child:
            self.store.record_child(self.claim, row)
            return None
        return self.store.checkpoint_model(self.claim, row)

    def record_replayed(self, row: NewStep, original: Step, *, hand_over: bool) -> Dispatch | None:
        """Record a model step a fork answered from the original's ``original`` row; with
        ``hand_over`` it is the task's step and the lease is handed on."""
        self.ensure_lease()
        return self.store.record_replayed(self.claim, row, original, hand_over=hand_over)

    # -- records that do not end the task -----------------------------------------------------

    def start(self, row: NewStep) -> None:
        """Write a step with an effect ``STARTED``, before its code runs."""
        self.store.start_step(self.claim, row)

    def record_child(self, row: NewStep) -> None:
        """Record a step nested in the running one (the task goes on)."""
        self.store.record_child(self.claim, row)

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
        self.ensure_lease()
        return self.store.suspend_for_approval(
            self.claim,
            row,
            role=role,
            payload=payload,
            timeout_seconds=timeout_seconds,
            timeout_policy=timeout_policy,
            discard_copied=discard_copied,
        )

    def schedule(
        self,
        delay_seconds: float,
        reason: str,
        *,
        rows: list[NewStep] | None = None,
        model_attempts: int = 0,
        admission: bool = False,
    ) -> StepResult:
        """A durable timer: record ``rows`` (if any), release the lease, come back in
        ``delay_seconds``. No thread and no lease wait; a countdown message is sent when the
        wait is short, the reaper sends one when it is due otherwise."""
        self.ensure_lease()
        if rows:
            dispatch = self.store.record_steps(
                self.claim,
                rows,
                delay_seconds=delay_seconds,
                reason=reason,
                model_attempts=model_attempts,
            )
        else:
            dispatch = self.store.schedule(
                self.claim,
                delay_seconds,
                reason=reason,
                model_attempts=model_attempts,
                admission=admission,
            )
        send = delay_seconds <= self.settings.max_countdown_seconds
        return StepResult(Outcome.WAITING, dispatch=dispatch if send else None)

    def finish(
        self, status: RunStatus, *, result: Any = None, error: str | None = None
    ) -> StepResult:
        """End the run with ``status`` (or park it NEEDS_ATTENTION), releasing the lease."""
        self.store.finish(self.claim, status, result=result, error=error)
        run = self.store.get_run(self.claim.run_id)
        if run.finished_at is not None:
            if self.services.metrics is not None:
                took = (run.finished_at - run.created_at).total_seconds()
                self.services.metrics.run_finished(str(run.status), took)
            run_span(str(run.id), run.agent, str(run.status), run.created_at, run.finished_at)
        detail = f" reason={error_text(error)}" if error else ""
        log.info("run=%s %s tokens=%d%s", self.rid, run.status, run.tokens_used, detail)
        return StepResult(Outcome.FINISHED, status=run.status)

    def needs_attention(self, reason: str) -> StepResult:
        return self.finish(RunStatus.NEEDS_ATTENTION, error=reason)

    def observe(self, kind: str, outcome: str, started: float) -> None:
        if self.services.metrics is not None:
            self.services.metrics.step(kind, outcome, time.monotonic() - started)
