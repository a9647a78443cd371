"""The simple kinds of a durable function's step, each a small object driven by the one
advance (:meth:`runtime.durable.execution.Execution.advance`).

The advance does what every kind shares: the key (``name:n``), the strict replay of the
order, the look-up in the step log, a recorded result given back (:meth:`SimpleKind.replay`)
or a recorded error raised again, the guard. A kind only says what its recorded row gives
back and how it runs when it has no result yet (:meth:`SimpleKind.run`, which records
through the checkpoint and ends the task, or gives its value). What the pipeline declares of
the kind (its row, the rule after a crash, billing) is its row in
:data:`runtime.pipeline.kinds.KINDS`.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol

from db.errors import InvalidTransition, RunNotFound
from db.records import NewStep, Step, StepStatus
from runtime.durable.errors import InfrastructureError, VersionUnsupported
from runtime.pipeline.checkpoint import Outcome, StepResult
from runtime.pipeline.codec import encode
from runtime.pipeline.kinds import KINDS, StepKind

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from runtime.pipeline.checkpoint import Task

log = logging.getLogger(__name__)


class Advancing(Protocol):
    """What a kind sees of the execution advancing it
    (:class:`runtime.durable.execution.Execution`)."""

    task: Task

    @property
    def run_id(self) -> uuid.UUID: ...

    def take_seq(self) -> int: ...

    def engine_call(self) -> AbstractContextManager[None]: ...

    def end(self, result: StepResult) -> NoReturn: ...

    def park(
        self, rows: list[NewStep], delay: float, reason: str, signal: str | None = None
    ) -> None: ...


class SimpleKind:
    """A kind of top-level step: what it is, its name, what replay gives back, how it runs.
    Subclasses are frozen dataclasses holding the call's arguments."""

    kind: ClassVar[StepKind]
    api: ClassVar[str]
    """How users call it (for the error that it belongs at the top level)."""
    marker: ClassVar[bool] = False
    """A marker the run's history may predate (``steps.version``): such a run keeps the old
    branch (:meth:`predates`) instead of diverging."""

    @property
    def name(self) -> str:
        """The step's name: its key is ``name:n``."""
        raise NotImplementedError

    def replay(self, row: Step) -> Any:
        """What its recorded (``DONE``) row gives back."""
        return None

    def run(self, at: At) -> Any:
        """Run it (no result recorded yet): record through the checkpoint and end the task,
        or give its value."""
        raise NotImplementedError

    def predates(self) -> Any:
        """A marker's value for a run whose history predates it."""
        raise NotImplementedError


@dataclass
class At:
    """One step being advanced, as its kind sees it: its key and row, and the records that
    end the task (each through the checkpoint)."""

    ex: Advancing
    key: str
    row: Step | None
    kind: StepKind
    _seq: int | None = None

    @property
    def now(self) -> datetime:
        return self.ex.task.claim.db_now

    @property
    def seq(self) -> int:
        """Its row's seq, or one taken for it (once)."""
        if self.row is not None:
            return self.row.seq
        if self._seq is None:
            self._seq = self.ex.take_seq()
        return self._seq

    def new(self, status: StepStatus, **fields: Any) -> NewStep:
        """Its row with ``status`` (attempt 1 unless given)."""
        fields.setdefault("attempt", 1)
        return NewStep(self.seq, self.key, KINDS[self.kind].row, status, **fields)

    def checkpoint(self, rows: list[NewStep]) -> NoReturn:
        """Record ``rows`` and hand the lease on: the task ends."""
        with self.ex.engine_call():
            self.ex.end(self.ex.task.checkpoint(rows))

    def park(
        self, rows: list[NewStep], delay: float, reason: str, signal: str | None = None
    ) -> None:
        """Record ``rows`` and park on a timer (the task ends); returns only when ``signal``
        is already there to consume."""
        self.ex.park(rows, delay, reason, signal)

    def until_deadline(self) -> float:
        run = self.ex.task.claim.run
        return max(0.0, (run.deadline_at - self.now).total_seconds()) + 1.0

    def end(self, result: StepResult) -> NoReturn:
        self.ex.end(result)


@dataclass(frozen=True)
class Sleep(SimpleKind):
    """``steps.sleep(seconds)``: a durable timer, ``PENDING`` with its time, then ``DONE``."""

    seconds: float
    kind: ClassVar[StepKind] = StepKind.SLEEP
    api: ClassVar[str] = "steps.sleep"

    @property
    def name(self) -> str:
        return "sleep"

    def run(self, at: At) -> NoReturn:
        if at.row is None:
            until = at.now + timedelta(seconds=self.seconds)
            pending = at.new(StepStatus.PENDING, response={"until": until.isoformat()})
            at.park([pending], self.seconds, f"{at.key} sleeping until {until.isoformat()}")
        until = datetime.fromisoformat(at.row.response["until"])  # type: ignore[union-attr]
        if until > at.now:  # claimed early (an operator, a test kit): back to sleep
            at.park([], (until - at.now).total_seconds(), f"{at.key} sleeping until {until}")
        log.info("run=%s seq=%d WAIT %s done", at.ex.task.rid, at.seq, at.key)
        at.checkpoint([at.new(StepStatus.DONE, latency_ms=0)])


@dataclass(frozen=True)
class Send(SimpleKind):
    """``steps.send(run_id, name, payload)``: the signal inserted (and its target woken) in
    the transaction that records the step, under the step's idempotency key."""

    target: uuid.UUID
    signal: str
    payload: Any
    kind: ClassVar[StepKind] = StepKind.SEND
    api: ClassVar[str] = "steps.send"

    @property
    def name(self) -> str:
        return f"send.{self.signal}"

    def run(self, at: At) -> NoReturn:
        row = at.new(StepStatus.DONE, latency_ms=0,
                     response={"runId": str(self.target), "signal": self.signal})  # fmt: skip
        try:
            with at.ex.engine_call():
                dispatch, woken = at.ex.task.send_signal(
                    row, target=self.target, name=self.signal, payload=encode(self.payload),
                    idempotency_key=f"{at.ex.run_id}/{at.key}",
                )  # fmt: skip
        except InfrastructureError as e:
            if not isinstance(e.error, RunNotFound | InvalidTransition):
                raise
            at.checkpoint([at.new(StepStatus.ERROR, error=f"StepError: {e.error}")])
        log.info("run=%s seq=%d SEND %s to run=%s", at.ex.task.rid, at.seq, at.key,
                 str(self.target)[:8])  # fmt: skip
        at.end(StepResult(Outcome.CONTINUE, dispatch=dispatch, wakes=(woken,) if woken else ()))


@dataclass(frozen=True)
class Version(SimpleKind):
    """``steps.version(name, minimum, maximum)``: the code version a run took, recorded once;
    a run whose history predates the marker stays on the old branch (``minimum``)."""

    marker_name: str
    minimum: int
    maximum: int
    run_id: uuid.UUID
    kind: ClassVar[StepKind] = StepKind.VERSION
    api: ClassVar[str] = "steps.version()"
    marker: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return self.marker_name

    def replay(self, row: Step) -> int:
        recorded = int(row.response)
        if not self.minimum <= recorded <= self.maximum:
            raise VersionUnsupported(
                f"run {self.run_id} recorded version {recorded} of {self.name!r}; this code "
                f"supports {self.minimum} to {self.maximum}"
            )
        return recorded

    def run(self, at: At) -> NoReturn:
        at.checkpoint([at.new(StepStatus.DONE, response=self.maximum, latency_ms=0)])

    def predates(self) -> int:
        return self.minimum


@dataclass(frozen=True)
class WaitFor(SimpleKind):
    """``steps.wait_for(name, timeout=...)``: the signal consumed in the transaction that
    records the step (delivered once); parked, holding nothing, until it comes or times out."""

    signal: str
    timeout: float | None
    kind: ClassVar[StepKind] = StepKind.SIGNAL_WAIT
    api: ClassVar[str] = "steps.wait_for"

    @property
    def name(self) -> str:
        return f"signal.{self.signal}"

    def replay(self, row: Step) -> Any:
        return row.response

    def run(self, at: At) -> NoReturn:
        reason = f"{at.key} waiting for signal {self.signal!r}"
        while True:
            with at.ex.engine_call():
                consumed = at.ex.task.consume_signal(
                    self.signal, at.new(StepStatus.DONE, latency_ms=0)
                )
            if consumed is not None:
                log.info("run=%s seq=%d WAIT %s: signal received", at.ex.task.rid, at.seq, at.key)
                at.end(StepResult(Outcome.CONTINUE, dispatch=consumed[1]))
            if at.row is None:
                later = timedelta(seconds=self.timeout) if self.timeout is not None else None
                until = at.now + later if later is not None else None
                waiting = {"signal": self.signal, "until": until.isoformat() if until else None}
                pending = at.new(StepStatus.PENDING, response=waiting)
                delay = self.timeout if self.timeout is not None else at.until_deadline()
                at.park([pending], delay, reason, signal=self.signal)
                continue  # it came meanwhile: consume it
            raw_until = (at.row.response or {}).get("until")
            until = datetime.fromisoformat(raw_until) if raw_until else None
            if until is not None and until <= at.now:
                log.info("run=%s seq=%d WAIT %s timed out", at.ex.task.rid, at.seq, at.key)
                why = f"within {self.timeout:g}s" if self.timeout is not None else ""
                error = f"SignalTimeout: no signal {self.signal!r} {why or f'before {raw_until}'}"
                at.checkpoint([at.new(StepStatus.ERROR, error=error)])
            delay = (until - at.now).total_seconds() if until else at.until_deadline()
            at.park([], delay, reason, signal=self.signal)
