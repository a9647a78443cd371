"""Every kind of step, and what differs between kinds: one table a reader can see whole.

Each step of a run, whatever its kind, goes the same way: looked up in the step log
(recorded, in doubt, or new), run (a step with an effect through :mod:`runtime.pipeline.effects`, a
model call through :mod:`runtime.pipeline.modelcall`), recorded through
:class:`runtime.pipeline.checkpoint.Task`, and stopped, when the run ends early, through one path
that runs its compensations. What differs per kind is the :class:`Policy` below, in :data:`KINDS`;
the engine reads it where it decides (the STARTED row, the in-doubt rule, the budget guard,
billing).

The docs' "What runs again after a crash" table (docs/durable/after-a-crash.md) is rendered
from :data:`KINDS` (``python -m runtime.pipeline`` prints it) and
``tests/unit/test_crash_table.py`` checks the two both ways, so they cannot drift.

**Adding a step kind** (a message, a signal, a child run, a framework's call): add a member
to :class:`StepKind`, its :class:`Policy` to :data:`KINDS` (the row kind it is stored as,
what is written before it runs, the rule after a crash), paste its row into the docs' table,
and make its code go through the pipeline: ``effects.run_effect`` for anything with an
effect, the model-call sequence for anything billed, ``Task`` to record. Every kind of a
durable function's step is an object behind the protocol of :mod:`runtime.durable.simple`,
and the agent loop's model turn and tool step are objects in :mod:`runtime.agentloop.loop`,
all driven by the one advance (``runtime.pipeline.checkpoint.Program.advance``); code
outside the kinds asks this table (or a helper below: :func:`turn_of`, :func:`in_history`,
:func:`is_compensation`, :func:`waits_for_a_run`, :func:`stored_as_a_model_call`)
rather than comparing a step's kind (``tests/unit/test_one_advance.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from db.records import Step, StepStatus
from db.records import StepKind as RowKind


class StepKind(enum.StrEnum):
    """What a step is, finer than the kind its row is stored as (:class:`RowKind`)."""

    MODEL = "MODEL"
    """The agent loop's model call, ``model:n``."""
    LLM_CALL = "LLM_CALL"
    """One model call inside ``steps.llm``, a child step ``…/llm:n``."""
    TOOL = "TOOL"
    """A Python ``@tool`` the agent loop's model asked for."""
    MCP_TOOL = "MCP_TOOL"
    """An MCP server's tool the agent loop's model asked for (in a durable function,
    ``steps.tool`` is a ``STEP`` whose body is the call)."""
    STEP = "STEP"
    """``steps.run`` or a call of a ``@step`` function."""
    LLM = "LLM"
    """The body of ``steps.llm``: it only calls the model (its calls are ``LLM_CALL``)."""
    SIDE_EFFECT = "SIDE_EFFECT"
    """``steps.side_effect``: a non-deterministic value recorded once."""
    APPROVAL = "APPROVAL"
    """``steps.approval(...)``: the request, waiting for a decision."""
    APPROVED_ACTION = "APPROVED_ACTION"
    """``steps.approval(...).run(fn)``: what runs once the request is approved."""
    COMPENSATION = "COMPENSATION"
    """``compensate:<key>``: the undo of a completed step, when the run fails later."""
    VERSION = "VERSION"
    """``steps.version``: the code version a run took."""
    TOOLSET = "TOOLSET"
    """The MCP tools an agent-loop run offers, fixed before its first model call."""
    FRAMEWORK_MODEL = "FRAMEWORK_MODEL"
    """``steps.model_call``: a framework's model request (Pydantic AI, the Agents SDK)."""
    SLEEP = "SLEEP"
    """``steps.sleep(seconds)``: a durable timer."""
    SIGNAL_WAIT = "SIGNAL_WAIT"
    """``steps.wait_for(name, timeout=...)``: waits for a signal sent to the run."""
    SEND = "SEND"
    """``steps.send(run_id, name, payload)``: a signal to another run."""
    CHILD = "CHILD"
    """``steps.child(agent, input)``: another agent as its own run, waited for."""
    MESSAGE = "MESSAGE"
    """A message posted to an agent-loop run (``POST /api/runs/{id}/messages``)."""
    SUBAGENT = "SUBAGENT"
    """A sub-agent the agent loop's model called as a tool: a child run, waited for."""


class Turn(enum.StrEnum):
    """What a kind's row adds to an agent-loop run's conversation (the replay asks here)."""

    NONE = "none"
    """Nothing: not part of the conversation (the tool set, a durable function's steps)."""
    ASSISTANT = "assistant"
    """The model's answer, as an assistant message."""
    TOOL_RESULT = "tool_result"
    """A ``tool_result`` block for the ``tool_use`` of the turn it answers."""
    USER = "user"
    """A user turn (a message posted to the run)."""


class Before(enum.StrEnum):
    """What is written before the step's code runs."""

    NOTHING = "nothing"
    STARTED = "`STARTED`"
    CHECKPOINT = "only its checkpoint"
    """The step is its one fenced transaction: it is there, or it never happened."""


class AfterCrash(enum.StrEnum):
    """What happens to a step a crash left unfinished."""

    CALLED_AGAIN = "called again"
    """A model call: at most one repeated, paid call per crash."""
    RUN_AGAIN = "run again"
    """Its body has no effect of its own: always safe to run again."""
    IDEMPOTENT_RECONCILE_ATTENTION = "idempotent: run again; else reconcile; else NEEDS_ATTENTION"
    """The one rule of :mod:`runtime.pipeline.effects` for a step with an effect."""
    NOTHING = "nothing to repeat"


@dataclass(frozen=True)
class Policy:
    """What one kind of step declares; everything else is the pipeline's."""

    name: str
    """How the docs' crash table names it (its first cell)."""
    key: str
    """Its step key, as the docs show it."""
    row: RowKind
    """The kind its row is stored as."""
    before: Before
    after_crash: AfterCrash
    replays_as: str
    """What a recorded row gives back on replay."""
    compensable: bool
    """A compensation may be declared for it (undone when the run fails later)."""
    bills: bool
    """It calls the model: its tokens and cost are recorded with it."""
    notes: str
    """The crash table row's last cell."""
    child: bool = False
    """Recorded inside the step that is running (the task goes on), not as the task's step."""
    interruptible: bool = False
    """A message posted with ``policy: "interrupt"`` aborts it in flight (its billed tokens
    recorded, its live attempt retracted); the message is delivered and the step made again."""
    turn: Turn = Turn.NONE
    """What its row adds to the agent loop's conversation (:func:`turn_of`)."""
    waits_for_a_run: bool = False
    """It starts another run and waits for its end, its row ``PENDING`` meanwhile
    (:func:`waits_for_a_run`): a parent that ends early ends that run."""

    @property
    def guarded_as_model(self) -> bool:
        """The guard checks the token budget and the step cap before it: it calls the
        model, or its body does."""
        return self.bills or self.row is RowKind.LLM

    @property
    def has_effect(self) -> bool:
        """It runs through the step executor (:func:`runtime.pipeline.effects.run_effect`)."""
        return self.before is Before.STARTED

    @property
    def always_reruns(self) -> bool:
        return self.after_crash is AfterCrash.RUN_AGAIN

    def readme_row(self) -> str:
        cells = [
            self.name,
            self.key,
            self.before.value,
            self.after_crash.value,
            "yes" if self.compensable else "no",
            "yes" if self.bills else "no",
            self.notes,
        ]
        return "| " + " | ".join(cells) + " |"


_EFFECT_RULE = AfterCrash.IDEMPOTENT_RECONCILE_ATTENTION

KINDS: dict[StepKind, Policy] = {
    StepKind.MODEL: Policy(
        name="agent-loop model call",
        key="`model:n`",
        row=RowKind.MODEL,
        before=Before.NOTHING,
        after_crash=AfterCrash.CALLED_AGAIN,
        replays_as="its recorded response, as an assistant message",
        compensable=False,
        bills=True,
        notes="at most one repeated, paid call per crash (the window between the response "
        "and its record); the attempts of a rate-limited call are capped across timers "
        '(`DAR_RETRY_MAX_ATTEMPTS`); a message posted with `policy: "interrupt"` aborts '
        "it (its billed tokens counted) and it is made again after the message",
        interruptible=True,
        turn=Turn.ASSISTANT,
    ),
    StepKind.LLM_CALL: Policy(
        name="`steps.llm` model call",
        key="`name:n/llm:n`",
        row=RowKind.LLM,
        before=Before.NOTHING,
        after_crash=AfterCrash.CALLED_AGAIN,
        replays_as="its recorded response, for the same attempt of its step",
        compensable=False,
        bills=True,
        notes="recorded the moment it returns; the same window and cap as the agent loop's",
        child=True,
    ),
    StepKind.TOOL: Policy(
        name="tool",
        key="`tool:<tool_use id>`",
        row=RowKind.TOOL,
        before=Before.STARTED,
        after_crash=_EFFECT_RULE,
        replays_as="its recorded output, as a tool_result block",
        compensable=False,
        bills=False,
        notes="`@tool(idempotent=True)`: run again with the same key; else `reconcile(ctx)` "
        "decides; else the run stops for an operator",
        turn=Turn.TOOL_RESULT,
    ),
    StepKind.MCP_TOOL: Policy(
        name="MCP tool",
        key="`tool:<tool_use id>`; `steps.tool` is a `steps.run` step `<server>__<tool>:n`",
        row=RowKind.TOOL,
        before=Before.STARTED,
        after_crash=_EFFECT_RULE,
        replays_as="its recorded result",
        compensable=False,
        bills=False,
        notes="idempotent when annotated `readOnlyHint` or `idempotentHint` (called again "
        "with the same `_meta` key, also once more on a fresh session when its server died "
        "mid-call); destructive or unannotated: a configured `reconcile` decides, else "
        "`NEEDS_ATTENTION`, also when the server died, answered HTTP 5xx or timed out; "
        "`DAR_MCP_TOOLS` (or `McpServer(tools=…)`) overrides per tool",
        turn=Turn.TOOL_RESULT,
    ),
    StepKind.STEP: Policy(
        name="`steps.run` / `@step`",
        key="`name:n`, `parent/name:n`",
        row=RowKind.STEP,
        before=Before.STARTED,
        after_crash=_EFFECT_RULE,
        replays_as="its recorded result, or its recorded error raised again",
        compensable=True,
        bills=False,
        notes="`idempotent=True` / `reconcile=` as for tools",
    ),
    StepKind.LLM: Policy(
        name="`steps.llm`",
        key="`name:n`",
        row=RowKind.LLM,
        before=Before.STARTED,
        after_crash=AfterCrash.RUN_AGAIN,
        replays_as="its recorded result; inside, its recorded model calls",
        compensable=True,
        bills=False,
        notes="its body only calls the model: the calls it recorded are replayed, the next "
        "one is made",
    ),
    StepKind.SIDE_EFFECT: Policy(
        name="`steps.side_effect`",
        key="`name:n`",
        row=RowKind.SIDE_EFFECT,
        before=Before.STARTED,
        after_crash=AfterCrash.RUN_AGAIN,
        replays_as="its recorded value",
        compensable=True,
        bills=False,
        notes="it only makes a value (a uuid, the time)",
    ),
    StepKind.APPROVAL: Policy(
        name="approval request",
        key="`name:n`",
        row=RowKind.APPROVAL,
        before=Before.CHECKPOINT,
        after_crash=AfterCrash.NOTHING,
        replays_as="its decision (or `ApprovalRejected`)",
        compensable=False,
        bills=False,
        notes="`PENDING` and the approval are written with the run's suspension",
    ),
    StepKind.APPROVED_ACTION: Policy(
        name="approved action (`steps.approval(...).run`)",
        key="`name:n`",
        row=RowKind.APPROVAL,
        before=Before.STARTED,
        after_crash=_EFFECT_RULE,
        replays_as="its recorded result",
        compensable=True,
        bills=False,
        notes="the approval stays decided; `idempotent=` on `.run`",
    ),
    StepKind.COMPENSATION: Policy(
        name="compensation",
        key="`compensate:<key>`",
        row=RowKind.COMPENSATION,
        before=Before.STARTED,
        after_crash=_EFFECT_RULE,
        replays_as="done (it is not run twice)",
        compensable=False,
        bills=False,
        notes="idempotent when marked `@idempotent` (`runtime.durable.idempotent`)",
    ),
    StepKind.VERSION: Policy(
        name="version marker",
        key="`name:n`",
        row=RowKind.VERSION,
        before=Before.CHECKPOINT,
        after_crash=AfterCrash.NOTHING,
        replays_as="the version it recorded",
        compensable=False,
        bills=False,
        notes="no code of the function runs in it",
    ),
    StepKind.TOOLSET: Policy(
        name="MCP tool set",
        key="`toolset`",
        row=RowKind.TOOLSET,
        before=Before.CHECKPOINT,
        after_crash=AfterCrash.NOTHING,
        replays_as="the tools every request of the run offers",
        compensable=False,
        bills=False,
        notes="listed again if never recorded (nothing was offered yet)",
    ),
    StepKind.FRAMEWORK_MODEL: Policy(
        name="framework model call (`steps.model_call`)",
        key="`model.request:n`, `model:n`",
        row=RowKind.LLM,
        before=Before.NOTHING,
        after_crash=AfterCrash.CALLED_AGAIN,
        replays_as="its recorded response, as the framework's own object",
        compensable=False,
        bills=True,
        notes="a Pydantic AI or Agents SDK model request; its usage is read from the "
        "framework's usage object and priced from `DAR_PRICES`; the same window as ours",
    ),
    StepKind.SLEEP: Policy(
        name="`steps.sleep`",
        key="`sleep:n`",
        row=RowKind.WAIT,
        before=Before.CHECKPOINT,
        after_crash=AfterCrash.NOTHING,
        replays_as="nothing, once its time has come",
        compensable=False,
        bills=False,
        notes="a durable timer (the run's `run_at`): `PENDING` with its wake-up time, then "
        "`DONE`; no thread, no lease meanwhile",
    ),
    StepKind.SIGNAL_WAIT: Policy(
        name="`steps.wait_for`",
        key="`signal.<name>:n`",
        row=RowKind.WAIT,
        before=Before.CHECKPOINT,
        after_crash=AfterCrash.NOTHING,
        replays_as="the signal's payload (or `SignalTimeout` raised again)",
        compensable=False,
        bills=False,
        notes="the signal is consumed in the transaction that records the step: delivered "
        "once; one sent before the wait is kept for it; no thread, no lease meanwhile",
    ),
    StepKind.SEND: Policy(
        name="`steps.send`",
        key="`send.<name>:n`",
        row=RowKind.SEND,
        before=Before.CHECKPOINT,
        after_crash=AfterCrash.NOTHING,
        replays_as="nothing (the signal was sent)",
        compensable=False,
        bills=False,
        notes="the signal is inserted in the transaction that records the step, under the "
        "step's idempotency key: exactly once across crashes",
    ),
    StepKind.CHILD: Policy(
        name="`steps.child`",
        key="`child.<agent>:n`",
        row=RowKind.CHILD,
        before=Before.CHECKPOINT,
        after_crash=AfterCrash.NOTHING,
        replays_as="the child's result (or `ChildRunFailed` raised again)",
        compensable=False,
        bills=False,
        notes="the child run is inserted in the transaction that records the step `PENDING`: "
        "a parent crash never starts it twice; the parent waits parked (no lease) and is "
        "woken when the child ends; the child's tokens and cost are added to the parent's "
        "with its result",
        waits_for_a_run=True,
    ),
    StepKind.MESSAGE: Policy(
        name="message",
        key="`message:n`",
        row=RowKind.MESSAGE,
        before=Before.CHECKPOINT,
        after_crash=AfterCrash.NOTHING,
        replays_as="a user turn (after the turn's tool results, in the same user message)",
        compensable=False,
        bills=False,
        notes="delivered at a step boundary: the posted message is consumed in the "
        "transaction that records the step, never lost, never twice; a run about to end "
        "`SUCCEEDED` with one pending goes on; a `SUCCEEDED` run that gets one is queued "
        "again",
        turn=Turn.USER,
    ),
    StepKind.SUBAGENT: Policy(
        name="sub-agent (agent loop)",
        key="`tool:<tool_use id>`",
        row=RowKind.CHILD,
        before=Before.CHECKPOINT,
        after_crash=AfterCrash.NOTHING,
        replays_as="the child's result (or its error), as a tool_result block",
        compensable=False,
        bills=False,
        notes="as `steps.child`: every sub-agent the model called in one turn is started in "
        "one transaction with its `PENDING` row (a crash never starts one twice; they run "
        "side by side, each with its share of the parent's remaining budget); the parent "
        "runs the turn's other tools, then waits parked and records each child's result as "
        "it ends",
        turn=Turn.TOOL_RESULT,
        waits_for_a_run=True,
    ),
}

# -- the one lookup --------------------------------------------------------------------------


class State(enum.StrEnum):
    """What the step log says of a step key."""

    NEW = "NEW"
    """No row: the step has not run."""
    RECORDED = "RECORDED"
    """Done, failed or rejected: replayed from its row, never run again."""
    IN_DOUBT = "IN_DOUBT"
    """``STARTED``: its worker stopped between the effect and its record; the kind's rule
    after a crash decides (:func:`runtime.pipeline.effects.run_effect`)."""
    OPEN = "OPEN"
    """Stopped at a known point (paused, waiting to be retried, waiting for or granted an
    approval): entered again, not in doubt."""


_STATES = {
    StepStatus.DONE: State.RECORDED,
    StepStatus.ERROR: State.RECORDED,
    StepStatus.REJECTED: State.RECORDED,
    StepStatus.STARTED: State.IN_DOUBT,
    StepStatus.PAUSED: State.OPEN,
    StepStatus.RETRYING: State.OPEN,
    StepStatus.PENDING: State.OPEN,
    StepStatus.APPROVED: State.OPEN,
}


@dataclass(frozen=True, slots=True)
class Found:
    """A step key looked up in the log: its state, and its row when it has one."""

    state: State
    row: Step | None = None

    @property
    def done(self) -> bool:
        return self.row is not None and self.row.status is StepStatus.DONE

    @property
    def in_doubt(self) -> Step | None:
        """The ``STARTED`` row the effect executor must decide about, if any."""
        return self.row if self.state is State.IN_DOUBT else None


NEW = Found(State.NEW)


def look_up(log: Mapping[str, Step], key: str) -> Found:
    """Is the step ``key`` recorded, in doubt, or new? Asked the same way by every kind."""
    row = log.get(key)
    return NEW if row is None else Found(_STATES[row.status], row)


_TURNS: dict[RowKind, Turn] = {
    policy.row: policy.turn for policy in KINDS.values() if policy.turn is not Turn.NONE
}


def turn_of(step: Step) -> Turn:
    """What the row ``step`` of an agent-loop run adds to its conversation, by its kind. A row
    recorded inside another step (``<key>/…``: a tool's usage report, ``runtime.record_usage``)
    adds nothing: it belongs to the step around it."""
    if "/" in step.step_key:
        return Turn.NONE
    return _TURNS.get(step.kind, Turn.NONE)


def in_history(step: Step) -> bool:
    """``step`` is one of a durable function's calls in its order (what strict replay
    compares): a top-level step, not a compensation (those run after, in reverse)."""
    return "/" not in step.step_key and not is_compensation(step)


def is_compensation(step: Step) -> bool:
    """``step`` is the undo of a completed step (``compensate:<key>``)."""
    return step.kind is KINDS[StepKind.COMPENSATION].row


_WAITING_ROWS = frozenset(policy.row for policy in KINDS.values() if policy.waits_for_a_run)
_BILLED_ROWS = frozenset(policy.row for policy in KINDS.values() if policy.bills)


def waits_for_a_run(step: Step) -> bool:
    """``step`` started another run (a child run, a sub-agent) and waits for its end."""
    return step.kind in _WAITING_ROWS and step.status is StepStatus.PENDING


def stored_as_a_model_call(step: Step) -> bool:
    """``step``'s row is of a kind a model call is stored as (a ``steps.llm`` body shares
    one: it has no prompt hash)."""
    return step.kind in _BILLED_ROWS


HEADER = (
    "| step kind | key | written before it runs | after a crash left it unfinished "
    "| compensable | bills tokens | notes |"
)


def crash_table() -> str:
    """The docs' crash table, one row per kind."""
    rows = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    rows += [policy.readme_row() for policy in KINDS.values()]
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover - prints the table to paste into the docs
    print(crash_table())
