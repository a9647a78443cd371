"""Compensations (sagas): undo completed steps when a durable function fails or is stopped.

When the function raises, or the guard stops the run (cancel, deadline, budget, step cap),
the compensations of its completed steps run in reverse order, **one per task**, each a step
with an effect of its own (``compensate:<key>``, STARTED first, lease-checked, in-doubt rules
of :mod:`runtime.pipeline.effects`), then the run ends with the failure's or the guard's status. A
step that fails for good first has the completed steps nested in it undone, the same way, before
its error reaches the function.

A compensation is found again in a later task by replaying the call that declared it (a
top-level ``steps.run(..., compensate=...)`` or ``steps.compensate``), or from the reference
its step row keeps (a module-level function, or a ``@step(compensate=...)``): a closure
declared inside another step cannot be found once that step is not re-entered, and is
recorded as a failed compensation saying so.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import typing
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from db.records import NewStep, RunStatus, Step, StepKind, StepStatus
from runtime.durable.api import is_idempotent, resolve_compensation
from runtime.durable.errors import DurableConfigError, Yield
from runtime.pipeline import effects, kinds
from runtime.pipeline.checkpoint import StepResult, Task
from runtime.pipeline.codec import decode
from runtime.pipeline.kinds import State


class Execution(Protocol):
    """What compensating needs of the function's execution."""

    task: Task

    @property
    def recorded(self) -> dict[str, Step]: ...

    def take_seq(self) -> int: ...

    def end(self, result: StepResult) -> NoReturn: ...

    def engine_call(self) -> contextlib.AbstractContextManager[None]: ...


log = logging.getLogger(__name__)

PREFIX = "compensate:"


def _argument_type(fn: Callable[[Any], Any]) -> Any:
    try:
        params = list(inspect.signature(fn).parameters)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError):
        return Any
    return hints.get(params[0], Any) if params else Any


class Compensations:
    def __init__(self, execution: Execution) -> None:
        self.execution = execution
        self.registered: dict[str, tuple[Callable[[Any], Any], Any]] = {}
        self.last: tuple[str, Any] | None = None

    # -- registering, as the function replays ----------------------------------------------

    def completed(self, key: str, value: Any, compensate: Callable[[Any], Any] | None) -> None:
        self.last = (key, value)
        if compensate is not None:
            self.registered[key] = (compensate, value)

    def attach_to_last(self, fn: Callable[[Any], Any]) -> None:
        if self.last is None:
            raise DurableConfigError("steps.compensate() needs a completed step before it")
        key, value = self.last
        self.registered.setdefault(key, (fn, value))

    # -- running ----------------------------------------------------------------------------

    def pending(self, parent: str | None = None) -> list[Step]:
        """Completed steps still to undo, latest first (those nested in ``parent`` only)."""
        recorded = self.execution.recorded
        out = [
            s
            for s in recorded.values()
            if s.status is StepStatus.DONE
            and not kinds.is_compensation(s)
            # A fork's copied steps were executed by the original run: their effects are
            # the original's, and a fork never undoes them.
            and s.origin is None
            and (s.compensation is not None or s.step_key in self.registered)
            and (parent is None or s.step_key.startswith(parent + "/"))
            and not self._compensated(s.step_key)
        ]
        return sorted(out, key=lambda s: s.seq, reverse=True)

    def _compensated(self, key: str) -> bool:
        return self.execution.task.look_up(PREFIX + key).state is State.RECORDED

    def undo_children(self, parent: str) -> None:
        """Before a failed step's error reaches the function: undo what completed inside it
        (ends the task while any is left)."""
        rows = self.pending(parent)
        if rows:
            with self.execution.engine_call():
                self.execution.end(self._run_one(rows[0]))

    def unwind(self, status: RunStatus, message: str) -> StepResult:
        """The next compensation (one per task), or, when none is left, the end of the run."""
        rows = self.pending()
        if rows:
            return self._run_one(rows[0])
        done, failed = [], []
        for s in sorted(self.execution.recorded.values(), key=lambda s: s.seq):
            if not kinds.is_compensation(s):
                continue
            name = s.step_key.removeprefix(PREFIX).rsplit(":", 1)[0]
            if s.status is StepStatus.DONE:
                done.append(name)
            elif s.status is StepStatus.ERROR:
                failed.append(f"{name}: {s.error}")
        if done:
            message += f" (compensated: {', '.join(done)})"
        if failed:
            message += f" (compensation failed: {'; '.join(failed)})"
        copied = [
            s.step_key.rsplit(":", 1)[0]
            for s in sorted(self.execution.recorded.values(), key=lambda s: s.seq)
            if s.origin is not None
            and s.status is StepStatus.DONE
            and "/" not in s.step_key
            and (s.compensation is not None or s.step_key in self.registered)
        ]
        if copied:
            message += f" (not compensated, copied from the original run: {', '.join(copied)})"
        return self.execution.task.finish(status, error=message)

    def _run_one(self, target: Step) -> StepResult:
        execution = self.execution
        task = execution.task
        key = PREFIX + target.step_key
        lookup = task.look_up(key)
        rec = lookup.row
        seq = rec.seq if rec is not None else execution.take_seq()
        attempt = (rec.attempt + 1) if rec is not None else 1
        found = self.registered.get(target.step_key)
        if found is not None:
            fn, value = found
        else:
            resolved = resolve_compensation(target.compensation)
            if resolved is None:
                row = NewStep(
                    seq,
                    key,
                    StepKind.COMPENSATION,
                    StepStatus.ERROR,
                    attempt=attempt,
                    error=(
                        f"the compensation of {target.step_key} cannot be found in this process "
                        f"({target.compensation or 'none recorded'}): a compensation of a nested "
                        "step must be a module-level function or declared with "
                        "@step(compensate=...)"
                    ),
                )
                return task.checkpoint([row])
            fn, value = resolved, decode(target.response, _argument_type(resolved))
        effect = effects.Effect(
            key=key,
            kind=kinds.StepKind.COMPENSATION,
            seq=seq,
            fn=lambda _ctx: fn(value),
            label=f"compensation of {target.step_key} (seq={seq})",
            idempotent=is_idempotent(fn),
            attempt=attempt,
        )
        verdict = effects.run_effect(task, effect, lookup)
        stopped = effects.unsettled(task, verdict)
        if stopped is not None:
            return stopped
        error = None
        if isinstance(verdict, effects.Raised):
            error = f"{type(verdict.error).__name__}: {verdict.error}"
        row = effects.row(effect, verdict, error=error)
        log.info("run=%s seq=%d COMPENSATION %s %s", task.rid, seq, target.step_key, row.status)
        return task.checkpoint([row])


class _Recorded:
    """The execution of a function this process cannot run (its agent is not registered
    here): its completed steps' compensations are found from the references their rows
    keep."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self._next_seq = task.next_seq

    @property
    def recorded(self) -> dict[str, Step]:
        return self.task.log

    def take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def end(self, result: StepResult) -> NoReturn:
        raise Yield(result)

    def engine_call(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def unwind_recorded(task: Task, status: RunStatus, reason: str) -> StepResult:
    """Stop a run whose function cannot run here (an unknown agent): the next compensation
    its rows name (one per task), or the end of the run."""
    try:
        return Compensations(_Recorded(task)).unwind(status, reason)
    except Yield as y:
        return y.result
