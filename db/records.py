"""Records read from the store: frozen dataclasses and string enums."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any


class RunStatus(enum.StrEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    WAITING = "WAITING"
    """Suspended for a human (an approval): no lease, no worker slot."""
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"
    NEEDS_ATTENTION = "NEEDS_ATTENTION"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset(
    {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TIMED_OUT}
)


class StepKind(enum.StrEnum):
    MODEL = "MODEL"
    TOOL = "TOOL"
    STEP = "STEP"
    LLM = "LLM"
    SIDE_EFFECT = "SIDE_EFFECT"
    APPROVAL = "APPROVAL"
    COMPENSATION = "COMPENSATION"
    VERSION = "VERSION"
    TOOLSET = "TOOLSET"
    """The MCP tools a run offers, fixed at its first model step (runtime.mcp.toolset)."""
    WAIT = "WAIT"
    """A durable timer or a wait for a signal (``steps.sleep``, ``steps.wait_for``)."""
    SEND = "SEND"
    """``steps.send``: a signal to another run, inserted with the step's record."""
    CHILD = "CHILD"
    """``steps.child``: a child run, inserted with the step's record; its result when it ends."""
    MESSAGE = "MESSAGE"
    """A message posted to an agent-loop run, delivered as a user turn at a step boundary."""


class StepStatus(enum.StrEnum):
    STARTED = "STARTED"
    DONE = "DONE"
    ERROR = "ERROR"
    RETRYING = "RETRYING"
    PENDING = "PENDING"
    APPROVED = "APPROVED"
    REJECTED = "REJECTED"
    PAUSED = "PAUSED"
    """Interrupted cleanly (a durable timer inside its body): entered again, not in doubt."""


class StepOrigin(enum.StrEnum):
    """How a fork's step row came to be without the fork executing it."""

    COPIED = "copied"
    """Copied from the original run (a step before the fork point)."""
    EDITED = "edited"
    """Copied, with its result replaced by the fork's edit."""
    REPLAYED = "replayed"
    """A model step answered from the original's recorded response (the request matched)."""


class ApprovalStatus(enum.StrEnum):
    PENDING = "PENDING"
    APPROVED = "APPROVED"
    REJECTED = "REJECTED"
    EXPIRED = "EXPIRED"
    CANCELLED = "CANCELLED"


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @property
    def total(self) -> int:
        """Tokens counted against the budget: everything the model read or wrote."""
        return (
            self.input_tokens
            + self.output_tokens
            + self.cache_creation_input_tokens
            + self.cache_read_input_tokens
        )


@dataclass(frozen=True, slots=True)
class Run:
    id: uuid.UUID
    agent: str
    status: RunStatus
    input: Any
    model: str
    max_steps: int
    token_budget: int
    tokens_used: int
    usage: Usage
    cost_usd: Decimal
    cost_budget_usd: Decimal | None
    unrecorded_tokens: int
    unrecorded_cost_usd: Decimal
    deadline_at: datetime
    run_at: datetime
    wait_reason: str | None
    locked_by: str | None
    locked_until: datetime | None
    lease_epoch: int
    dispatch_token: uuid.UUID
    claims_without_progress: int
    cancel_requested: bool
    result: Any
    error: str | None
    submitted_by: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    model_attempts: int = 0
    """Model attempts made for the step in flight, across durable timers."""
    tenant: str = ""
    timeout_seconds: int | None = None
    forked_from_run: uuid.UUID | None = None
    """A fork's original run (its steps before ``forked_from_seq`` are copies of that run's)."""
    forked_from_seq: int | None = None
    replay_model: bool = False
    """A fork answering model steps from the original's recorded responses while they match."""
    concurrency_key: str | None = None
    """At most DAR_KEY_CONCURRENCY runs of one key are inside a step at once."""
    priority: int = 0
    """Higher first, among the runs waiting for a key slot or a model's rate limit."""
    schedule_id: uuid.UUID | None = None
    """The schedule whose tick started it."""
    parent_run_id: uuid.UUID | None = None
    """The run whose ``steps.child`` started it."""
    unrecorded_estimated_tokens: int = 0
    """The part of ``unrecorded_tokens`` that is an estimate (an upper bound): model calls
    lost with their worker, estimated from the request before it was sent."""
    messages_pending: int = 0
    """Messages posted to this agent-loop run, not delivered yet."""
    deployment: str | None = None
    """The version of the code the run started on (runtime.engine.deployment); ``None``:
    stored before versions, driven by any worker."""


@dataclass(frozen=True, slots=True)
class Claim:
    """A run this worker now holds: the fence for every write it makes."""

    run: Run
    worker: str
    epoch: int
    db_now: datetime
    status_changes: int | None = None
    """The run's count of status changes when claimed (``run.status_changes``): see
    :mod:`db.steplog`. ``None``: unknown, the step log is read whole."""

    @property
    def run_id(self) -> uuid.UUID:
        return self.run.id


@dataclass(frozen=True, slots=True)
class Step:
    run_id: uuid.UUID
    seq: int
    step_key: str
    kind: StepKind
    status: StepStatus
    tool_name: str | None
    tool_use_id: str | None
    model: str | None
    prompt_hash: str | None
    response: Any
    stop_reason: str | None
    usage: Usage
    cost_usd: Decimal
    latency_ms: int | None
    request_id: str | None
    error: str | None
    resolution: str | None
    attempt: int
    input_hash: str | None
    worker: str | None
    lease_epoch: int
    started_at: datetime
    finished_at: datetime | None
    compensation: str | None = None
    origin: StepOrigin | None = None
    """In a fork: how the row came to be without being executed (``None``: executed)."""
    original_tokens: int | None = None
    """What the original run was billed for this step (copied and replayed rows)."""
    original_cost_usd: Decimal | None = None


@dataclass(frozen=True, slots=True)
class NewRun:
    agent: str
    input: Any
    model: str
    max_steps: int
    token_budget: int
    timeout_seconds: int
    cost_budget_usd: Decimal | None = None
    idempotency_key: str | None = None
    request_hash: str | None = None
    submitted_by: str | None = None
    tenant: str = ""
    concurrency_key: str | None = None
    priority: int = 0
    schedule_id: uuid.UUID | None = None
    parent_run_id: uuid.UUID | None = None
    deployment: str | None = None
    """The version it starts on; ``None``: the storing process's (a child: its parent's)."""


@dataclass(frozen=True, slots=True)
class NewSchedule:
    """A schedule to create: what each of its runs gets, and when it ticks."""

    agent: str
    input: Any
    model: str
    max_steps: int
    token_budget: int
    timeout_seconds: int
    cron: str
    timezone: str
    overlap: str
    catch_up: str
    first_tick_at: datetime
    cost_budget_usd: Decimal | None = None
    priority: int = 0
    tenant: str = ""
    created_by: str | None = None


@dataclass(frozen=True, slots=True)
class Schedule:
    id: uuid.UUID
    tenant: str
    agent: str
    input: Any
    model: str
    max_steps: int
    token_budget: int
    timeout_seconds: int
    cost_budget_usd: Decimal | None
    priority: int
    cron: str
    timezone: str
    overlap: str
    """``skip``, ``queue`` or ``allow``: a tick while an earlier run of it is live."""
    catch_up: str
    """``none``, ``latest`` or ``all``: the ticks missed while nothing ran."""
    next_tick_at: datetime
    created_by: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ScheduleTick:
    schedule_id: uuid.UUID
    tick_at: datetime
    status: str
    """``STARTED`` (its run is ``run_id``), ``SKIPPED`` or ``QUEUED`` (overlap)."""
    run_id: uuid.UUID | None
    created_at: datetime
    reason: str | None = None
    """Why a SKIPPED tick started no run when its overlap policy would have: its creator over
    a limit, or its token revoked or expired."""


@dataclass(frozen=True, slots=True)
class TreeSpend:
    """A run tree's budget as one of its runs' model calls sees it, under the tree's lock
    (:meth:`db.store.RunStore.hold_tree_budget`)."""

    root: uuid.UUID
    token_budget: int
    cost_budget_usd: Decimal | None
    spent: int
    """Every run of the tree, recorded and unrecorded, each token once; with this run's
    holds of earlier leases (calls lost with their worker)."""
    cost: Decimal
    held: int
    """The worst cases of the other runs' model calls in flight."""
    held_cost: Decimal
    in_flight: int
    """How many of the other runs' model calls are in flight (held under their run's
    current lease: a hold of an earlier lease, or of a parked run, is a lost call)."""


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A drive_run message to send: the run and the token it must carry, and how long to
    hold it back (a durable timer's countdown)."""

    run_id: uuid.UUID
    token: uuid.UUID
    delay_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class NewStep:
    """A step row to record (STARTED before an effect, or its result in a checkpoint)."""

    seq: int
    step_key: str
    kind: StepKind
    status: StepStatus
    response: Any = None
    error: str | None = None
    attempt: int = 0
    input_hash: str | None = None
    model: str | None = None
    prompt_hash: str | None = None
    usage: Usage = Usage()
    cost_usd: Decimal = Decimal(0)
    latency_ms: int | None = None
    request_id: str | None = None
    tool_name: str | None = None
    tool_use_id: str | None = None
    compensation: str | None = None
    stop_reason: str | None = None
    request: Any = None
    """The full model request, kept only with DAR_STORE_REQUESTS."""
    unrecorded_tokens: int = 0
    """A child run's result: the tokens the child was billed without a row of its own (cut
    or lost calls), added to the run's ``tokens_used`` with ``usage`` (in no direction)."""


@dataclass(frozen=True, slots=True)
class Approval:
    id: uuid.UUID
    run_id: uuid.UUID
    step_key: str
    role: str
    status: ApprovalStatus
    payload: Any
    payload_hash: str
    timeout_policy: str
    requested_at: datetime
    expires_at: datetime
    decided_by: str | None
    decided_at: datetime | None
    comment: str | None
    copied_from: uuid.UUID | None = None
    """A fork's copy of the decision the run ``copied_from`` recorded (not made for the fork)."""


@dataclass(frozen=True, slots=True)
class NewAudit:
    """An action a person took on a run through the API, recorded in the same transaction
    as the action itself."""

    actor: str
    action: str
    tenant: str = ""
    detail: Any = None
    approval_id: uuid.UUID | None = None


@dataclass(frozen=True, slots=True)
class AuditEvent:
    id: int
    at: datetime
    run_id: uuid.UUID | None
    """``None`` for a schedule's own entries (``schedule_id``)."""
    approval_id: uuid.UUID | None
    tenant: str
    actor: str
    action: str
    detail: Any
    schedule_id: uuid.UUID | None = None


@dataclass(frozen=True, slots=True)
class HourCount:
    """Runs that ended in one UTC hour with one final status."""

    at: datetime
    status: str
    n: int


@dataclass(frozen=True, slots=True)
class HourCost:
    """Recorded cost of one model's steps in one UTC hour."""

    at: datetime
    model: str
    usd: Decimal


@dataclass(frozen=True, slots=True)
class HourLatency:
    """Step durations of one kind in one UTC hour."""

    at: datetime
    kind: str
    p50_ms: float
    p95_ms: float
    n: int


@dataclass(frozen=True, slots=True)
class Stats:
    """The console's overview over a window: what ended, what it cost, how long steps took."""

    finished: list[HourCount]
    cost: list[HourCost]
    latency: list[HourLatency]


@dataclass(frozen=True, slots=True)
class StepEdit:
    """A fork's edit of a copied step: its result replaced."""

    seq: int
    response: Any
    status: StepStatus = StepStatus.DONE
    error: str | None = None


@dataclass(frozen=True, slots=True)
class NewFork:
    """A fork to create: a new run whose steps before ``from_seq`` are copies of the
    source's, continuing from ``from_seq`` on the engine."""

    source: uuid.UUID
    from_seq: int
    input: Any
    model: str
    token_budget: int
    timeout_seconds: int
    replay_model: bool = False
    submitted_by: str | None = None
    audit: NewAudit | None = None
    idempotency_key: str | None = None
    """As a submit's: unique per tenant (the fork's tenant is the source's); a retry with the
    same key and ``request_hash`` gets the fork made first."""
    request_hash: str | None = None
    reuse_approval: bool = False
    """Keep the source's decisions: the approval at ``from_seq`` and the approved approvals
    before it (copied, labelled) stand instead of being asked again. Without it the fork asks
    again for each of them before it runs anything after them (a decision authorises its
    effects once). The caller checks that the forker holds ``approve`` and each approval's
    role, and asked for it explicitly (``reuseApprovals``)."""


@dataclass(frozen=True, slots=True)
class ReadyRuns:
    """The autoscaling signal (``count_ready_runs``): runs a worker could take now that none
    holds, how long the oldest of them has waited, and the runs inside a step."""

    ready: int
    oldest_seconds: float
    in_step: int


@dataclass(frozen=True, slots=True)
class DeploymentWorker:
    """A worker process and the version it serves (its heartbeat's row)."""

    worker: str
    deployment: str
    started_at: datetime
    last_seen: datetime
    live: bool


@dataclass(frozen=True, slots=True)
class Deployment:
    """A version: the workers that serve it and its runs in flight, by status."""

    deployment: str | None
    workers: tuple[DeploymentWorker, ...]
    runs: dict[str, int]

    @property
    def live_workers(self) -> int:
        return sum(1 for w in self.workers if w.live)

    @property
    def in_flight(self) -> int:
        return sum(self.runs.values())
