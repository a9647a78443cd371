"""``steps.approval(role).run(name, fn, *args)``: a kind of the one protocol
(:mod:`runtime.durable.simple`), driven by the one advance.

The request is recorded ``PENDING`` with the run's suspension (no lease, no slot); once
approved, what runs is exactly what was approved (the step key and arguments, hashed) as an
approved action through the step container's body (:func:`runtime.durable.container.body`).
A fork whose edits changed what would be approved asks the approver again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from db.records import RunStatus, Step, StepStatus
from runtime.durable.api import ApprovalBuilder
from runtime.durable.container import Plain, body
from runtime.durable.errors import ApprovalMismatch, ApprovalRejected, StepError
from runtime.durable.notify import notify_approval
from runtime.durable.simple import At, SimpleKind
from runtime.pipeline.checkpoint import Outcome, StepResult
from runtime.pipeline.codec import decode, encode
from runtime.pipeline.kinds import State, StepKind

log = logging.getLogger(__name__)

_APPROVED = (StepStatus.APPROVED, StepStatus.STARTED, StepStatus.PAUSED)


def digest_of(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Approval(SimpleKind):
    builder: ApprovalBuilder
    step_name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    type: Any
    idempotent: bool
    kind: ClassVar[StepKind] = StepKind.APPROVAL
    api: ClassVar[str] = "steps.approval"

    @property
    def name(self) -> str:
        return self.step_name

    def misplaced(self, nested: bool) -> str | None:
        return "an approval cannot be asked for inside another step" if nested else None

    def payload(self, key: str) -> dict[str, Any]:
        return {"stepKey": key, "input": encode(list(self.args))}

    def _copied_changed(self, at: At) -> bool:
        """A fork copied this decision, but its edits changed what would be approved: the
        decision was not about this payload, so the approver is asked again."""
        rec = at.row
        return rec is not None and rec.origin is not None and rec.input_hash != self._digest(at)

    def _digest(self, at: At) -> str:
        return digest_of(self.payload(at.key))

    def settled(self, at: At) -> bool:
        if self._copied_changed(at):
            return False
        rec = at.row
        mismatch = (
            rec is not None and rec.status in _APPROVED and rec.input_hash != self._digest(at)
        )
        return at.found.state is State.RECORDED or mismatch

    def replay(self, at: At) -> Any:
        assert at.row is not None
        value = decode(at.row.response, self.type)
        at.ex.compensations.completed(at.key, value, None)
        return value

    def failed(self, at: At) -> BaseException:
        rec = at.row
        assert rec is not None
        if rec.status is StepStatus.REJECTED:
            approval = _approval_record(at)
            return ApprovalRejected(
                at.key,
                approval.decided_by if approval else None,
                approval.comment if approval else None,
            )
        if rec.status is StepStatus.ERROR:
            return StepError(at.key, rec.error or "approval failed")
        return ApprovalMismatch(
            f"{at.key} was approved for input hash {rec.input_hash}, but the code would now "
            f"run it with {self._digest(at)}: what runs must be what was approved"
        )

    def run(self, at: At) -> Any:
        rec = at.row
        if self._copied_changed(at):
            self._suspend(at, copied=rec)
        if rec is not None and rec.status in _APPROVED:
            thunk = functools.partial(self.fn, *self.args)
            return body(
                at,
                StepKind.APPROVED_ACTION,
                thunk,
                self.type,
                Plain(idempotent=self.idempotent),
                input_hash=self._digest(at),
            )
        self._suspend(at)

    def _suspend(self, at: At, copied: Step | None = None) -> NoReturn:
        ex, key, builder = at.ex, at.key, self.builder
        payload, digest = self.payload(key), self._digest(at)
        row = at.new(StepStatus.PENDING, input_hash=digest, attempt=0)
        with ex.engine_call():
            approval_id = ex.task.suspend_for_approval(
                row,
                role=builder.role,
                payload=payload,
                timeout_seconds=builder.timeout_seconds,
                timeout_policy=builder.policy,
                discard_copied=copied is not None,
            )
        log.info("run=%s seq=%d APPROVAL %s waiting for %s", ex.task.rid, at.seq, key, builder.role)
        notify_approval(ex.task, ex.agent, approval_id, key, builder, payload, digest)
        at.end(StepResult(Outcome.WAITING, status=RunStatus.WAITING))


def _approval_record(at: At) -> Any:
    with at.ex.engine_call():
        approvals = at.task.store.list_approvals(status=None, run_id=at.ex.run_id)
    return next((a for a in approvals if a.step_key == at.key), None)
