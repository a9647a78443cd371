"""Model calls a step's own code makes: a tool that runs another agent, a durable step's body
that calls a model through its own client, a framework's tool that delegates to a nested
agent. The engine does not see those calls; the code that makes them reports each one with
:func:`record_usage`, and it is counted against the run like every other model call.

Each report is recorded at once, as a row inside the running step (``<step key>/usage:n``,
kind ``LLM``, with the model, tokens and the cost priced from ``DAR_PRICES``; a model the
table does not price at the highest known rate), and its tokens and cost are added to the run
in the same statement. So:

- a step that completed is replayed from its row; its body does not run, and nothing it
  reported is counted again;
- a step run again (a retry, an idempotent step after a crash) counts what every attempt
  reported, each under the attempt that made it: each was billed;
- the guard (token and cost budgets) sees it before the next model call, and the metrics
  count it by model.

A report is made where the engine runs a step's code: :func:`current` holds the running
step's recorder (a ``contextvars`` variable: it follows the code onto the step pool's threads;
code that hands work to an event loop of its own carries it with :func:`carry`).
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from db.errors import DatabaseUnavailable, LeaseLost
from db.records import NewStep, Run, StepStatus, Usage
from db.records import StepKind as RowKind
from runtime.pipeline.checkpoint import Task, plus

log = logging.getLogger(__name__)

NAME = "usage"
"""The name of the rows inside a step: ``<step key>/usage:n``."""


class NotInStep(RuntimeError):
    """:func:`record_usage` was called where no step of this runtime is running."""


@dataclass
class StepUsage:
    """The recorder of the step whose code is running: one per execution of its body."""

    task: Task
    key: str
    attempt: int
    take_seq: Callable[[], int]
    """A fresh ``seq`` for each row (the caller's allocator: the rows share the run's)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _n: int | None = field(default=None, repr=False)
    recorded: Usage = field(default_factory=Usage)
    """What this execution of the body reported so far."""

    def _next_n(self) -> int:
        if self._n is None:
            # after those of earlier executions of this step (a crash, a retry): each of them
            # was billed, none is replaced
            prefix = f"{self.key}/{NAME}:"
            self._n = sum(1 for k in self.task.log if k.startswith(prefix))
        n = self._n
        self._n += 1
        return n

    def record(self, model: str, usage: Usage, request_id: str | None = None) -> None:
        task = self.task
        with self._lock:
            cost = task.services.pricing.cost(model, usage)
            row = NewStep(
                seq=self.take_seq(),
                step_key=f"{self.key}/{NAME}:{self._next_n()}",
                kind=RowKind.LLM,
                status=StepStatus.DONE,
                attempt=self.attempt,
                model=model or None,
                usage=usage,
                cost_usd=cost,
                latency_ms=0,
                request_id=request_id,
            )
            try:
                task.record_child(row)
            except (LeaseLost, DatabaseUnavailable):
                # refused (the run was taken over) or not written (the database away past
                # the lease): billed whoever holds the run now, so counted as the run's
                # unrecorded tokens, unless a try did write the row (as record_billed does)
                task.store.record_unrecorded_usage(
                    task.run_id, usage, cost, unless_step=(row.step_key, task.claim.epoch)
                )
                raise
            task.spent = plus(task.spent, usage)
            task.spent_cost += cost
            self.recorded = plus(self.recorded, usage)
        if task.services.metrics is not None:
            task.services.metrics.model_call(model or "unknown", usage, cost)
        log.info(
            "run=%s %s model call inside the step: model=%s in=%d out=%d",
            task.rid,
            row.step_key,
            model or "?",
            usage.input_tokens,
            usage.output_tokens,
        )


_current: contextvars.ContextVar[StepUsage | None] = contextvars.ContextVar(
    "dar_step_usage", default=None
)


def current() -> StepUsage | None:
    """The recorder of the step whose code runs here (``None``: no step's code)."""
    return _current.get()


@contextmanager
def carry(recorder: StepUsage | None) -> Iterator[None]:
    """Make ``recorder`` the current one here (code of a step, run elsewhere)."""
    token = _current.set(recorder)
    try:
        yield
    finally:
        _current.reset(token)


def seq_after(task: Task, seq: int) -> Callable[[], int]:
    """An allocator of seqs past every row of the run's log and past ``seq`` (for a step
    recorded by a program that allocates no other seq while its body runs). The log is
    scanned at the first report, not per step: most steps report nothing."""
    state: dict[str, int] = {}

    def take() -> int:
        n = state.get("next") or max(seq, max((s.seq for s in task.steps), default=0)) + 1
        state["next"] = n + 1
        return n

    return take


def record_usage(
    model: str,
    usage: Usage | None = None,
    *,
    input_tokens: int = 0,
    output_tokens: int = 0,
    cache_creation_input_tokens: int = 0,
    cache_read_input_tokens: int = 0,
    request_id: str | None = None,
) -> None:
    """Count a model call that code running inside a step made itself (a tool calling a
    model through its own client, a nested agent) against the run: its tokens, its cost
    (``model`` priced from ``DAR_PRICES``; an unpriced model at the highest known rate), the
    budgets, the metrics. Recorded at once with the step (``<step key>/usage:n``): a replay
    of the completed step does not count it again; a step run again counts each attempt's.

    ``usage``, or the counts one by one (``input_tokens`` without the cache's, as the
    Messages API reports them). Raises :class:`NotInStep` outside a step's code."""
    recorder = _current.get()
    if recorder is None:
        raise NotInStep(
            "record_usage counts a model call made by a step's code: call it inside a tool, "
            "a durable step's body (steps.run, @step) or a framework agent's tool"
        )
    if usage is None:
        usage = Usage(
            input_tokens=int(input_tokens),
            output_tokens=int(output_tokens),
            cache_creation_input_tokens=int(cache_creation_input_tokens),
            cache_read_input_tokens=int(cache_read_input_tokens),
        )
    if (
        min(
            usage.input_tokens,
            usage.output_tokens,
            usage.cache_creation_input_tokens,
            usage.cache_read_input_tokens,
        )
        < 0
    ):
        raise ValueError("record_usage takes token counts of 0 or more")
    if not usage.total:
        return
    recorder.record(str(model or ""), usage, request_id)


def unrecorded_in_tree(child: Run) -> int:
    """The tokens a child run's whole tree was billed beyond its counts by direction
    (``child.usage``): its own unrecorded tokens (cut, fenced-out or lost calls) and those its
    own children's results brought in (counted in its ``tokens_used``, in no direction). Its
    step in the parent carries them as ``unrecorded_tokens``, so usage rolls up whole through
    every level of a tree (its cost already does: ``cost_usd + unrecorded_cost_usd``)."""
    return child.tokens_used + child.unrecorded_tokens - child.usage.total
