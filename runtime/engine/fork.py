"""Forks: a new run whose history is a copy of another run's steps before a chosen step,
with edits, continuing from that step on the normal engine.

Nothing before the fork point runs again: its rows are copied (``origin = 'copied'``, no
tokens billed, what the original paid kept apart) and the agent loop or the durable function
replays them like any recorded step. What makes that safe is decided here, once, before
anything is written:

- only completed steps are copied (``DONE``, ``ERROR``, ``REJECTED``): a step in flight, in
  doubt, waiting or being retried stays the original's business. A child run's step is
  completed once the parent has recorded the child's result: a fork copies it and never
  runs that child again (its timeline links to the original's child); a child still working
  is the original's, and a fork from its step starts a child of its own;
- the fork point is never inside a step (between a durable step and the steps nested in it);
- an edited result belongs to a copied step (``toolResult.seq`` below ``fromSeq``).

A decision authorises its effects once: without ``reuse_approval`` the fork asks again for
every approval it copies as approved (before running anything after it) or starts at; the
approval of an action that failed is never copied as a decision.

At run time: a copied approval whose payload the edits changed is asked again
(:mod:`runtime.durable.execution`), copied steps are never compensated by the fork
(:mod:`runtime.durable.compensation`), and with ``replay_model`` model steps are answered
from the original's recorded responses while the requests stay byte-identical
(:func:`runtime.pipeline.modelcall.recorded_answer`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from db.errors import DarError
from db.records import NewAudit, NewFork, Run, Step, StepEdit, StepKind, StepStatus
from db.store import RunStore, SubmitQuota
from runtime.agents import Agent, AgentRegistry, UnknownAgent
from runtime.config import Settings
from runtime.tools import render_output

COPYABLE = frozenset({StepStatus.DONE, StepStatus.ERROR, StepStatus.REJECTED})
"""Completed steps: the only ones a fork copies."""

EDITABLE = {
    StepKind.TOOL: "a tool's result (agent loop)",
    StepKind.STEP: "a step's result (durable function)",
    StepKind.SIDE_EFFECT: "a side effect's result (durable function)",
}

_UNSET: Any = object()


class ForkRefused(DarError):
    """The fork cannot be made as asked."""

    def __init__(self, field: str, message: str, *, conflict: bool = False) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.conflict = conflict
        """The request is well formed but the run's state refuses it (409, not 400)."""


@dataclass(frozen=True)
class ForkRequest:
    from_seq: int
    input: Any = _UNSET
    """The fork's input; the original's when not given."""
    model: str | None = None
    tool_result: tuple[int, Any] | None = None
    """``(seq, output)``: the result of the copied step ``seq`` replaced by ``output``."""
    token_budget: int | None = None
    timeout_seconds: int | None = None
    replay_model: bool = False
    submitted_by: str | None = None
    audit: NewAudit | None = None
    quota: SubmitQuota | None = None
    """The submitter's quota (a fork is a submit), checked atomically with the insert."""
    idempotency_key: str | None = None
    """A retry with this key and the same ``request_hash`` gets the fork made first."""
    request_hash: str | None = None
    reuse_approval: bool = False
    """Keep the source's decisions on the approval at ``from_seq`` and the approved ones
    before it (:class:`NewFork`); otherwise the fork asks again for each."""

    @property
    def edits_input(self) -> bool:
        return self.input is not _UNSET


def fork_run(
    store: RunStore,
    agents: AgentRegistry,
    settings: Settings,
    source_id: uuid.UUID,
    request: ForkRequest,
) -> tuple[Run, bool]:
    """Create the fork (QUEUED; the caller sends its first message when ``created``).
    Returns ``(run, created)``: ``created`` is ``False`` for a retry with an idempotency key
    seen before (:class:`IdempotencyConflict` when its request differed). Raises
    :class:`ForkRefused` (naming the request's field) or :class:`RunNotFound`."""
    source = store.get_run(source_id)
    try:
        agent = agents.get(source.agent)
    except UnknownAgent:
        raise ForkRefused(
            "agent",
            f"run {source_id} ran the agent {source.agent!r}, which is not registered here: "
            "a fork runs the original's code",
            conflict=True,
        ) from None
    loop = isinstance(agent, Agent)
    run_input = request.input if request.edits_input else source.input
    if request.edits_input:
        _check_input(run_input, loop, settings)

    def check(run: Run, steps: list[Step]) -> tuple[StepEdit, ...]:
        copied = _check_fork_point(run, steps, request.from_seq)
        if request.tool_result is None:
            return ()
        return (_edit(copied, request.from_seq, *request.tool_result, settings),)

    new = NewFork(
        source=source_id,
        from_seq=request.from_seq,
        input=run_input,
        model=request.model or source.model,
        token_budget=request.token_budget or source.token_budget,
        timeout_seconds=request.timeout_seconds
        or source.timeout_seconds
        or settings.default_timeout_seconds,
        replay_model=request.replay_model,
        submitted_by=request.submitted_by,
        audit=request.audit,
        idempotency_key=request.idempotency_key,
        request_hash=request.request_hash,
        reuse_approval=request.reuse_approval,
    )
    return store.fork_run(new, check, quota=request.quota)


def _check_input(value: Any, loop: bool, settings: Settings) -> None:
    if loop and not (isinstance(value, str) and value.strip()):
        raise ForkRefused("input", "must be a non-empty string for an agent-loop run")
    if value is None:
        raise ForkRefused("input", "must be any JSON but null for a durable function")
    size = len(value) if isinstance(value, str) else len(json.dumps(value))
    if size > settings.max_input_chars:
        raise ForkRefused(
            "input",
            f"is {size} characters; the limit is {settings.max_input_chars} (DAR_MAX_INPUT_CHARS)",
        )


def _check_fork_point(run: Run, steps: list[Step], from_seq: int) -> list[Step]:
    """The steps to copy; refuses a fork point past the end, after a step that has not
    completed, or inside a step."""
    last = max((s.seq for s in steps), default=0)
    if not 1 <= from_seq <= last + 1:
        raise ForkRefused(
            "fromSeq",
            f"run {run.id} has steps 1 to {last}: fromSeq must be from 1 to {last + 1} "
            f"(got {from_seq})",
        )
    copied = [s for s in steps if s.seq < from_seq]
    for s in copied:
        if s.status not in COPYABLE:
            child = s.response.get("runId") if isinstance(s.response, dict) else None
            waits = (
                f" (it waits for child run {child}: fork once that child has ended, to "
                f"reuse its result, or from seq {s.seq} to start it again in the fork)"
                if s.kind is StepKind.CHILD and child
                else ""
            )
            raise ForkRefused(
                "fromSeq",
                f"step {s.seq} ({s.step_key}) of run {run.id} is {s.status}, not completed: "
                f"a fork copies only completed steps; fork from seq {s.seq} or earlier{waits}",
                conflict=True,
            )
    for later in (s for s in steps if s.seq >= from_seq):
        parent = next((c for c in copied if later.step_key.startswith(c.step_key + "/")), None)
        if parent is not None:
            raise ForkRefused(
                "fromSeq",
                f"seq {from_seq} is inside step {parent.step_key} (seq {parent.seq}), whose "
                f"nested step {later.step_key} is seq {later.seq}: fork from seq "
                f"{parent.seq}, or from after its last nested step",
            )
    return copied


def _edit(copied: list[Step], from_seq: int, seq: int, output: Any, settings: Settings) -> StepEdit:
    target = next((s for s in copied if s.seq == seq), None)
    if target is None:
        raise ForkRefused(
            "toolResult",
            f"seq {seq} is not a copied step: only the result of a step before fromSeq "
            f"({from_seq}) can be edited",
        )
    if target.kind not in EDITABLE:
        kinds = "; ".join(f"{k} ({what})" for k, what in EDITABLE.items())
        raise ForkRefused(
            "toolResult",
            f"step {seq} ({target.step_key}) is of kind {target.kind}; an edit replaces {kinds}",
        )
    if target.kind is StepKind.TOOL:
        # As a tool's own output reaches the model: text, anything else as JSON, capped.
        return StepEdit(seq, render_output(output, settings.max_tool_output_chars))
    return StepEdit(seq, output)
