"""Errors a durable function may see, and the two ways the engine unwinds it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from db.errors import DarError

if TYPE_CHECKING:
    from db.records import NewStep
    from runtime.pipeline.checkpoint import StepResult
    from runtime.pipeline.guard import Stop


class StepError(DarError):
    """A step failed; on replay its recorded error is raised again, as this exception."""

    def __init__(self, step_key: str, message: str) -> None:
        super().__init__(f"step {step_key} failed: {message}")
        self.step_key = step_key
        self.error = message


class StepTimeout(StepError):
    """A step ran longer than its ``steps.timeout(...)`` and stopped."""


class SignalTimeout(StepError):
    """``steps.wait_for(name, timeout=...)``: no signal came before the timeout."""


class ChildRunFailed(StepError):
    """``steps.child(...)``: the child run ended FAILED, CANCELLED or TIMED_OUT."""


class ApprovalRejected(DarError):
    """The approver rejected the step (or its timeout policy is REJECT)."""

    def __init__(self, step_key: str, decided_by: str | None, comment: str | None) -> None:
        who = decided_by or "the timeout policy"
        super().__init__(f"{step_key} rejected by {who}" + (f": {comment}" if comment else ""))
        self.step_key = step_key
        self.decided_by = decided_by
        self.comment = comment


class ApprovalMismatch(DarError):
    """What the code would run now differs from what was approved."""


class NonDeterministicReplay(DarError):
    """The code called a different sequence of steps than the history records."""


class VersionUnsupported(DarError):
    """A run in flight recorded a version the current code no longer supports."""


class DurableConfigError(DarError):
    """A durable function is misused (an undeclared approval role, an approval inside a step)."""


class Yield(BaseException):
    """Unwinds the user's function after this task's one step was checkpointed (or the run
    was parked or ended). A BaseException so that no ``except Exception`` can swallow it."""

    def __init__(self, result: StepResult) -> None:
        super().__init__("step checkpointed")
        self.result = result


class InfrastructureError(BaseException):
    """The engine failed underneath the function (the database went away, a connection
    dropped). Not the function's failure: nothing is compensated and nothing recorded; the
    task fails and the step is tried again by the next one. A BaseException so the function
    cannot mistake it for its own error."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


class Pause(BaseException):
    """Raised through a step's body to interrupt it cleanly: a model call inside it must wait
    on a durable timer, or the guard stopped the run. The open steps are recorded PAUSED."""

    def __init__(
        self,
        reason: str,
        *,
        delay_seconds: float | None = None,
        model_attempts: int = 0,
        stop: Stop | None = None,
        wakeable: bool = False,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.delay_seconds = delay_seconds
        self.model_attempts = model_attempts
        self.stop = stop
        self.wakeable = wakeable
        """A wake may bring the timer forward (a wait for capacity, asked again)."""
        self.rows: list[NewStep] = []
        """The PAUSED rows of the steps it passed through, innermost first."""
