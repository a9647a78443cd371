"""The one protocol of a durable function's step kinds, and the simple kinds (sleep, send,
a version marker, a signal wait): each kind a small object driven by the one advance
(:meth:`runtime.pipeline.checkpoint.Program.advance`, the agent loop's too), as
:class:`runtime.durable.execution.Execution` places and guards its steps.

The advance does what every kind shares: the key (``name:n``, ``parent/name:n``), the strict
replay of the order, the look-up in the step log, a recorded result given back
(:meth:`SimpleKind.replay`) or a recorded error raised again (:meth:`SimpleKind.failed`), the
guard, and the checkpoint of what the kind's run gives it to record (:class:`Record`). A kind
only says what its recorded row gives back and how it runs when it has no answer yet
(:meth:`SimpleKind.run`: a :class:`Record` for the advance to commit, its value, or an end of
the task of its own: a timer, a park). What the pipeline declares of the kind (its row, the
rule after a crash, billing) is its row in :data:`runtime.pipeline.kinds.KINDS`. The step
container (``steps.run``, ``steps.llm``, ``steps.side_effect``, ``steps.tool``) is in
:mod:`runtime.durable.container`; the approval, the framework's call and the child run in
:mod:`runtime.durable.approval`, :mod:`runtime.durable.billed`, :mod:`runtime.durable.child`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol

from db.errors import InvalidTransition, RunNotFound
from db.records import NewStep, RunStatus, Step, StepStatus
from runtime.durable.errors import (
    ChildRunFailed,
    InfrastructureError,
    SignalTimeout,
    StepError,
    StepTimeout,
    VersionUnsupported,
)
from runtime.pipeline.checkpoint import Outcome, Record, StepResult
from runtime.pipeline.codec import encode
from runtime.pipeline.kinds import KINDS, Found, State, StepKind

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from runtime.pipeline.checkpoint import Task
    from runtime.tools import ToolContext

log = logging.getLogger(__name__)


class Registry(Protocol):
    """The compensations a replay registers
    (:class:`runtime.durable.compensation.Compensations`)."""

    def completed(self, key: str, value: Any, compensate: Callable[[Any], Any] | None) -> None: ...

    def undo_children(self, parent: str) -> None: ...


class Advancing(Protocol):
    """What a kind sees of the execution advancing it
    (:class:`runtime.durable.execution.Execution`)."""

    task: Task
    agent: Any
    stack: list[Any]
    """The steps whose bodies are running (:class:`runtime.durable.container.Frame`)."""
    model_diverged: bool | None

    @property
    def compensations(self) -> Registry: ...

    @property
    def run_id(self) -> uuid.UUID: ...

    @property
    def default_max_tokens(self) -> int: ...

    def take_seq(self) -> int: ...

    def engine_call(self) -> AbstractContextManager[None]: ...

    def end(self, result: StepResult) -> NoReturn: ...

    def stop(self, status: RunStatus, reason: str) -> NoReturn: ...

    def park(
        self, rows: list[NewStep], delay: float, reason: str, signal: str | None = None
    ) -> None: ...

    def current_context(self) -> ToolContext | None: ...


def recorded_error(key: str, row: Step) -> StepError:
    """A recorded ``ERROR`` row's error, raised again on replay as its kind's exception."""
    message = row.error or "unknown error"
    for prefix, error in _ERRORS.items():
        if message.startswith(prefix):
            return error(key, message)
    return StepError(key, message)


_ERRORS: dict[str, type[StepError]] = {
    "StepTimeout:": StepTimeout,
    "SignalTimeout:": SignalTimeout,
    "ChildRunFailed:": ChildRunFailed,
}


class SimpleKind:
    """A kind of step: what it is, its name, what replay gives back, how it runs.
    Subclasses are frozen dataclasses holding the call's arguments."""

    kind: ClassVar[StepKind]
    api: ClassVar[str]
    """How users call it (for the error that it belongs at the top level)."""
    nests: ClassVar[bool] = False
    """It may be called inside another step (else only at the top level)."""
    marker: ClassVar[bool] = False
    """A marker the run's history may predate (``steps.version``): such a run keeps the old
    branch (:meth:`predates`) instead of diverging."""

    @property
    def name(self) -> str:
        """The step's name: its key is ``name:n``."""
        raise NotImplementedError

    def misplaced(self, nested: bool) -> str | None:
        """Why it cannot be called here (``None``: it can)."""
        if nested and not self.nests:
            return f"{self.api} belongs at the top level, not inside a step"
        return None

    def settled(self, at: At) -> bool:
        """Its row answers the call (given back, or its error raised again): recorded."""
        return at.found.state is State.RECORDED

    def replay(self, at: At) -> Any:
        """What its recorded (``DONE``) row gives back."""
        return None

    def failed(self, at: At) -> BaseException:
        """The error its settled, not ``DONE``, row raises again."""
        assert at.row is not None
        return recorded_error(at.key, at.row)

    def run(self, at: At) -> Any:
        """Run it (no answer recorded yet): a :class:`Record` for the advance to commit, or
        its value, or end the task of its own (a timer, a park)."""
        raise NotImplementedError

    def predates(self) -> Any:
        """A marker's value for a run whose history predates it."""
        raise NotImplementedError


@dataclass
class At:
    """One step being advanced, as its kind sees it: its key, what the log says of it, and
    the records that end the task (each through the checkpoint)."""

    ex: Advancing
    key: str
    found: Found
    kind: StepKind
    _seq: int | None = None

    @property
    def row(self) -> Step | None:
        return self.found.row

    @property
    def nested(self) -> bool:
        """Inside another step's body."""
        return bool(self.ex.stack)

    @property
    def task(self) -> Task:
        return self.ex.task

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

    def run(self, at: At) -> Record:
        if at.row is None:
            until = at.now + timedelta(seconds=self.seconds)
            pending = at.new(StepStatus.PENDING, response={"until": until.isoformat()})
            at.park([pending], self.seconds, f"{at.key} sleeping until {until.isoformat()}")
        until = datetime.fromisoformat(at.row.response["until"])  # type: ignore[union-attr]
        if until > at.now:  # claimed early (an operator, a test kit): back to sleep
            at.park([], (until - at.now).total_seconds(), f"{at.key} sleeping until {until}")
        log.info("run=%s seq=%d WAIT %s done", at.ex.task.rid, at.seq, at.key)
        return Record([at.new(StepStatus.DONE, latency_ms=0)])


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

    def run(self, at: At) -> Record:
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
            return Record([at.new(StepStatus.ERROR, error=f"StepError: {e.error}")])
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

    def replay(self, at: At) -> int:
        recorded = int(at.row.response)  # type: ignore[union-attr]
        if not self.minimum <= recorded <= self.maximum:
            raise VersionUnsupported(
                f"run {self.run_id} recorded version {recorded} of {self.name!r}; this code "
                f"supports {self.minimum} to {self.maximum}"
            )
        return recorded

    def run(self, at: At) -> Record:
        return Record([at.new(StepStatus.DONE, response=self.maximum, latency_ms=0)])

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

    def replay(self, at: At) -> Any:
        return at.row.response  # type: ignore[union-attr]

    def run(self, at: At) -> Record:
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
                return Record([at.new(StepStatus.ERROR, error=error)])
            delay = (until - at.now).total_seconds() if until else at.until_deadline()
            at.park([], delay, reason, signal=self.signal)
