"""``steps.child(agent, input)``: another agent as its own run, waited for; a kind of the one
protocol (:mod:`runtime.durable.simple`), driven by the one advance. The child run is
inserted in the transaction that records the step ``PENDING`` (a parent crash never starts it
twice); the parent waits parked, holding nothing, and is woken when the child ends; the
child's tokens and cost come with its result."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from db.records import RunStatus, StepStatus
from runtime.durable.simple import At, SimpleKind
from runtime.pipeline import usage
from runtime.pipeline.checkpoint import Outcome, Record, StepResult
from runtime.pipeline.codec import encode
from runtime.pipeline.kinds import StepKind

log = logging.getLogger(__name__)

RECHECK_SECONDS = 30.0
"""A parent waiting for its child is woken when the child ends; should that wake be lost, it
looks again after this long."""


@dataclass(frozen=True)
class Child(SimpleKind):
    agent: str
    value: Any
    token_budget: int | None
    timeout_seconds: int | None
    kind: ClassVar[StepKind] = StepKind.CHILD
    api: ClassVar[str] = "steps.child"

    @property
    def name(self) -> str:
        return f"child.{self.agent}"

    def replay(self, at: At) -> Any:
        return at.row.response  # type: ignore[union-attr]

    def _recheck(self, at: At) -> float:
        """Until the fallback look, or the run's deadline if sooner (its guard ends it)."""
        return min(RECHECK_SECONDS, at.until_deadline())

    def run(self, at: At) -> Record:
        task, key, rec = at.task, at.key, at.row
        if rec is None or rec.status is StepStatus.RETRYING:
            # RETRYING: its child was cancelled when this run ended early, and the run was
            # resumed: a child of its own attempt, never the one cancelled (issue 35 U9)
            attempt = 1 if rec is None else rec.attempt + 1
            started_as = key if attempt == 1 else f"{key}#{attempt}"
            left = task.budget_left()
            if left <= 0:
                no_budget = "ChildRunFailed: no token budget left for a child run"
                return Record([at.new(StepStatus.ERROR, attempt=attempt, error=no_budget)])
            new, child_id = task.child_run(
                started_as,
                self.agent,
                encode(self.value),
                token_budget=min(self.token_budget or left, left),
                timeout_seconds=self.timeout_seconds,
            )
            pending = at.new(
                StepStatus.PENDING,
                attempt=attempt,
                response={"runId": str(child_id), "agent": self.agent},
            )
            reason = f"{key} waiting for child run {str(child_id)[:8]}"
            with at.ex.engine_call():
                [first] = task.start_children([(pending, new, child_id)], self._recheck(at), reason)
            log.info(
                "run=%s seq=%d CHILD %s started run=%s", task.rid, at.seq, key, str(child_id)[:8]
            )
            at.end(StepResult(Outcome.WAITING, wakes=(first,)))
        child_id = uuid.UUID(rec.response["runId"])
        with at.ex.engine_call():
            parked = task.park_for_child(
                child_id, self._recheck(at), f"{key} waiting for child run {str(child_id)[:8]}"
            )
        if parked:
            at.end(StepResult(Outcome.WAITING))
        with at.ex.engine_call():
            child = task.store.get_run(child_id)
        cost = child.cost_usd + child.unrecorded_cost_usd
        counted: dict[str, Any] = {
            "attempt": rec.attempt,
            "usage": child.usage,
            "cost_usd": cost,
            "unrecorded_tokens": usage.unrecorded_in_tree(child),
        }
        if child.status is RunStatus.SUCCEEDED:
            row = at.new(StepStatus.DONE, response=child.result, **counted)
        else:
            row = at.new(
                StepStatus.ERROR,
                **counted,
                error=f"ChildRunFailed: child run {child_id} ended {child.status}: "
                f"{child.error or 'no error recorded'}",
            )
        log.info(
            "run=%s seq=%d CHILD %s: run=%s %s",
            task.rid,
            rec.seq,
            key,
            str(child_id)[:8],
            child.status,
        )
        return Record([row])
