"""The guard: checked before every step, so a runaway run overshoots by at most one step."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from db.records import Run, RunStatus


@dataclass(frozen=True, slots=True)
class Stop:
    status: RunStatus
    reason: str


def guard(run: Run, *, now: datetime, steps_taken: int, next_is_model: bool) -> Stop | None:
    """Why the run must stop now, or ``None``.

    Cancellation and the deadline stop any step. The token budget and the step cap are
    checked before a model step, the only kind that spends tokens or extends the run: the
    step that crosses a limit completes, the next one does not start.
    """
    if run.cancel_requested:
        return Stop(RunStatus.CANCELLED, "cancelled by request")
    if now >= run.deadline_at:
        return Stop(RunStatus.TIMED_OUT, f"deadline {run.deadline_at.isoformat()} passed")
    if next_is_model:
        spent = run.tokens_used + run.unrecorded_tokens
        if spent >= run.token_budget:
            return Stop(
                RunStatus.FAILED,
                f"token budget exhausted: {spent} of {run.token_budget} tokens used",
            )
        cost = run.cost_usd + run.unrecorded_cost_usd
        if run.cost_budget_usd is not None and cost >= run.cost_budget_usd:
            return Stop(
                RunStatus.FAILED,
                f"cost budget exhausted: ${cost:.4f} of ${run.cost_budget_usd:.4f} spent",
            )
        if steps_taken >= run.max_steps:
            return Stop(
                RunStatus.FAILED,
                f"step cap reached: {steps_taken} steps of maxSteps {run.max_steps}",
            )
    return None
