"""The chaos checker: the invariants of docs/DESIGN asserted over what a chaos campaign left
behind, the database (runs, steps, the acme comments written by the tool with a real side
effect) and the fake Messages API's request log.

It is pure: :func:`check` takes an :class:`Evidence` and returns the violations, so it can be
fed a fabricated data set (``tests/chaos/test_checker.py`` does, to prove it can fail).

What "a fault could hit a run" means, used to bound repeated model calls: every injected
fault records the runs whose in-flight step it may have interrupted (the runs its victim
held when it died or stopped, every live run for a PostgreSQL restart, none for a Redis
restart or a duplicated message). A repeated model call is one whose response was never
checkpointed; each such call must be paid for by one of those faults.

Durable-function runs (``tests/chaos/durable_agents.py``) are checked by :func:`check_durable`
over their step rows, the ``chaos_effect`` rows their steps and compensations wrote, their
approval, the audit trail and the decisions the campaign made through REST.
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from db.records import Run, RunStatus, Step, StepKind, StepStatus
from runtime.pipeline.replay import model_step_key, replay, tool_step_key
from tests.chaos import durable_agents

# Times compared across clocks (PostgreSQL's now() and this process's time.time(), one host)
CLOCK_SLACK_SECONDS = 0.25


@dataclass(frozen=True)
class Comment:
    """A row of ``acme_comment``: the side effect of one ``add_comment`` call."""

    id: int
    ticket_id: int
    body: str
    idempotency_key: str
    created_at: datetime


@dataclass(frozen=True)
class ModelCall:
    """One request received by the fake Messages API and what it answered."""

    request_id: str
    """The ``request-id`` header the fake answered with (``req_fake_0001``...), which the
    runtime stores on the model step it checkpoints."""
    messages: list[dict[str, Any]]
    status: int
    content: list[dict[str, Any]] | None
    """The response's content blocks (``None`` when the answer was not a message)."""
    usage: Mapping[str, int]
    received_at: float
    """``time.time()`` when the request arrived."""

    @property
    def run_input(self) -> Any:
        return self.messages[0].get("content") if self.messages else None

    @property
    def usage_total(self) -> int:
        return sum(int(v) for v in self.usage.values())


@dataclass(frozen=True)
class Fault:
    """One injected fault, as the harness recorded it."""

    kind: str
    target: str
    at: float
    """``time.time()`` when the fault struck."""
    repeat_runs: frozenset[uuid.UUID] = frozenset()
    """Runs whose in-flight model call this fault may have cut between response and
    checkpoint: each may show one repeated model call because of it."""
    disturbed: frozenset[uuid.UUID] = frozenset()
    """Runs whose progress this fault interrupted (recovery time is measured for them)."""
    detail: str = ""
    until: float | None = None
    """When the fault ended (SIGCONT, server back), for faults that last."""


@dataclass(frozen=True)
class EffectRow:
    """A row of ``chaos_effect``: the effect of one execution of a durable step's body or of a
    compensation, keyed by that step's key."""

    id: int
    run_id: uuid.UUID
    key: str
    kind: str
    at: datetime


@dataclass(frozen=True)
class ApprovalRow:
    id: uuid.UUID
    run_id: uuid.UUID
    step_key: str
    status: str
    decided_by: str | None = None


@dataclass(frozen=True)
class AuditRow:
    """A row of ``audit_event`` (the API records approve/reject there, with the decision)."""

    run_id: uuid.UUID
    approval_id: uuid.UUID | None
    action: str


@dataclass(frozen=True)
class Decision:
    """What the campaign decided for one approval through REST."""

    approval_id: uuid.UUID
    run_id: uuid.UUID
    verb: str
    """``approve`` or ``reject``: the first POST that was answered 200."""
    again: tuple[tuple[str, int], ...] = ()
    """Each POST sent after that one: (verb, HTTP status it finally got). The same verb must
    get 200 (idempotent, nothing recorded again), the other one 409."""


@dataclass(frozen=True)
class DurableSpec:
    """What the chaos durable function does (defaults: tests/chaos/durable_agents.py)."""

    agent: str = durable_agents.AGENT
    effects: Mapping[str, bool] = field(default_factory=lambda: dict(durable_agents.EFFECTS))
    """Step name -> idempotent, for each step whose body writes one effect row."""
    compensations: Mapping[str, tuple[str, bool]] = field(
        default_factory=lambda: dict(durable_agents.COMPENSATIONS)
    )
    """Compensated step name -> (the effect kind of its compensation, idempotent)."""


@dataclass
class Evidence:
    runs: list[Run]
    steps: dict[uuid.UUID, list[Step]]
    comments: list[Comment]
    calls: list[ModelCall]
    faults: list[Fault]
    known_workers: frozenset[str]
    side_effect_tool: str = "add_comment"
    non_idempotent_tools: frozenset[str] = frozenset()
    """Tools whose interruption may legitimately park a run NEEDS_ATTENTION."""
    lease_losses: Mapping[uuid.UUID, int] = field(default_factory=dict)
    """Lease losses found in the workers' logs, per run: the heartbeat's ``lease lost``, and
    a step the fence refused for any other reason than the heartbeat's finding (reported,
    and each allows a repeat and a claim that produced nothing unless a fault that hit the
    run explains it: a live worker can lose a lease it could not renew)."""
    lease_loss_times: Mapping[uuid.UUID, Sequence[tuple[str, float]]] | None = None
    """The same losses as (worker, ``time.time()`` of the log line), when known: a loss no
    fault that hit the run explains allows a repeat even when faults hit it (a SIGSTOP whose
    attribution missed the run). Without them, a run some fault hit gets no allowance for
    its logged losses."""
    durable: DurableSpec = field(default_factory=DurableSpec)
    effects: list[EffectRow] = field(default_factory=list)
    approvals: list[ApprovalRow] = field(default_factory=list)
    audits: list[AuditRow] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)


@dataclass(frozen=True)
class Violation:
    invariant: str
    run_id: uuid.UUID | None
    detail: str

    def __str__(self) -> str:
        run = f" run={self.run_id}" if self.run_id else ""
        return f"[{self.invariant}]{run}: {self.detail}"


TERMINAL_OK = "terminal"
UNIQUE_KEYS = "unique-step-keys"
SEQ = "seq-without-gaps"
TOOL_RESULTS = "one-result-per-tool-use"
SIDE_EFFECTS = "side-effects-exactly-once"
MODEL_REPEATS = "model-calls-repeat-only-per-crash"
CALL_MATCH = "steps-match-the-api-log"
FENCING = "no-fenced-out-write"
TOKENS = "token-counters"
CLAIMS = "one-claim-per-step"
EFFECTS = "effects-exactly-once"
COMPENSATION = "compensation-at-most-once-after-a-failure"
APPROVALS = "approval-decided-once"
BILLED = "billed-tokens-recorded"
LOST_COVERED = "lost-calls-estimated"
COST = "recorded-as-billed"
KILLS = ("kill_worker", "kill_pool_child", "crash_point", "worker_exit_on_broker_loss")
"""Faults that kill a process (a crash point's kind is ``crash_point:<point>``)."""


def check(ev: Evidence) -> list[Violation]:
    out: list[Violation] = []
    calls_by_input: dict[str, list[ModelCall]] = defaultdict(list)
    for call in ev.calls:
        calls_by_input[json.dumps(call.run_input, sort_keys=True)].append(call)
    comments_by_key: dict[str, list[Comment]] = defaultdict(list)
    for c in ev.comments:
        comments_by_key[c.idempotency_key].append(c)
    side_effect_keys: set[str] = set()

    for call in ev.calls:
        if call.status != 200:
            out.append(
                Violation(
                    CALL_MATCH,
                    None,
                    f"the fake API answered {call.request_id} with {call.status}: the runtime "
                    "sent a request the API rejects (an invalid conversation?)",
                )
            )

    durable_runs = [r for r in ev.runs if r.agent == ev.durable.agent]
    out += check_durable(ev, durable_runs)
    for run in ev.runs:
        if run.agent == ev.durable.agent:
            continue
        steps = sorted(ev.steps.get(run.id, []), key=lambda s: s.seq)
        calls = calls_by_input.get(json.dumps(run.input, sort_keys=True), [])
        out += _check_terminal(ev, run, steps)
        out += _check_keys_and_seq(run, steps)
        out += _check_tools(run, steps)
        out += _check_side_effects(ev, run, steps, comments_by_key, side_effect_keys)
        out += _check_model_calls(ev, run, steps, calls)
        out += _check_fencing(ev, run, steps)
        out += _check_tokens(run, steps, calls)
        out += _check_lost_covered(ev, run, steps, calls)
        out += _check_cost(ev, run, calls)

    for key, rows in comments_by_key.items():
        if key not in side_effect_keys:
            out.append(
                Violation(
                    SIDE_EFFECTS,
                    None,
                    f"acme_comment {[c.id for c in rows]} with idempotency key {key!r} belongs "
                    f"to no recorded {ev.side_effect_tool} step: a side effect of a call the "
                    "run never checkpointed",
                )
            )
    return out


def _check_terminal(ev: Evidence, run: Run, steps: list[Step]) -> list[Violation]:
    if run.status is RunStatus.SUCCEEDED:
        last = steps[-1] if steps else None
        if last is None or last.kind is not StepKind.MODEL or last.stop_reason != "end_turn":
            return [
                Violation(
                    TERMINAL_OK,
                    run.id,
                    "SUCCEEDED, but its last step is not a model turn that ended "
                    f"(last: {last and (last.seq, str(last.kind), last.stop_reason)})",
                )
            ]
        return []
    if run.status is RunStatus.NEEDS_ATTENTION:
        started = [s for s in steps if s.status is StepStatus.STARTED]
        if started and all(s.tool_name in ev.non_idempotent_tools for s in started):
            return []
    return [
        Violation(
            TERMINAL_OK,
            run.id,
            f"status {run.status} (expected SUCCEEDED, or NEEDS_ATTENTION only on an "
            f"interrupted non-idempotent tool); error={run.error!r}, "
            f"lease_epoch={run.lease_epoch}, locked_by={run.locked_by}, steps={len(steps)}",
        )
    ]


def _check_keys_and_seq(run: Run, steps: list[Step]) -> list[Violation]:
    out = []
    dup = [k for k, n in Counter(s.step_key for s in steps).items() if n > 1]
    if dup:
        out.append(Violation(UNIQUE_KEYS, run.id, f"step keys recorded more than once: {dup}"))
    seqs = [s.seq for s in steps]
    if seqs != list(range(1, len(steps) + 1)):
        out.append(Violation(SEQ, run.id, f"seq is {seqs}, expected 1..{len(steps)}"))
    model_keys = [s.step_key for s in steps if s.kind is StepKind.MODEL]
    expected = [model_step_key(i) for i in range(1, len(model_keys) + 1)]
    if model_keys != expected:
        out.append(Violation(UNIQUE_KEYS, run.id, f"model step keys {model_keys} != {expected}"))
    return out


def _tool_uses(step: Step) -> list[dict[str, Any]]:
    content = step.response if isinstance(step.response, list) else []
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_use"]


def _check_tools(run: Run, steps: list[Step]) -> list[Violation]:
    """Every tool_use of a checkpointed model turn has exactly one tool step, DONE, keyed by
    its id, between that turn and the next; no tool step answers anything else."""
    out = []
    turn: Step | None = None
    uses: dict[str, dict[str, Any]] = {}
    answered: Counter[str] = Counter()

    def close_turn() -> None:
        if turn is None:
            return
        for use_id in uses:
            if answered[use_id] != 1:
                out.append(
                    Violation(
                        TOOL_RESULTS,
                        run.id,
                        f"tool_use {use_id} of seq={turn.seq} has {answered[use_id]} tool "
                        "steps (expected exactly 1)",
                    )
                )

    for s in steps:
        if s.kind is StepKind.MODEL:
            close_turn()
            turn, answered = s, Counter()
            uses = {u["id"]: u for u in _tool_uses(s)} if s.stop_reason == "tool_use" else {}
            if s.status is not StepStatus.DONE:
                out.append(Violation(TOOL_RESULTS, run.id, f"model step seq={s.seq} {s.status}"))
            continue
        use = uses.get(s.tool_use_id or "")
        if use is None:
            out.append(
                Violation(
                    TOOL_RESULTS,
                    run.id,
                    f"tool step seq={s.seq} ({s.tool_use_id}) answers no tool_use of the model "
                    "turn before it",
                )
            )
            continue
        answered[s.tool_use_id or ""] += 1
        if s.step_key != tool_step_key(s.tool_use_id or ""):
            out.append(Violation(TOOL_RESULTS, run.id, f"tool step seq={s.seq} key {s.step_key}"))
        if s.tool_name != use.get("name"):
            out.append(
                Violation(
                    TOOL_RESULTS, run.id, f"tool step seq={s.seq} ran {s.tool_name}, "
                    f"the model asked for {use.get('name')}"
                )
            )  # fmt: skip
        if s.status is not StepStatus.DONE and run.status is RunStatus.SUCCEEDED:
            out.append(
                Violation(
                    TOOL_RESULTS,
                    run.id,
                    f"tool step seq={s.seq} {s.tool_name} is {s.status}: {s.error or s.response}",
                )
            )
    close_turn()
    return out


def _response_json(step: Step) -> Any:
    if isinstance(step.response, str):
        try:
            return json.loads(step.response)
        except ValueError:
            return None
    return step.response


def _check_side_effects(
    ev: Evidence,
    run: Run,
    steps: list[Step],
    comments_by_key: Mapping[str, list[Comment]],
    seen_keys: set[str],
) -> list[Violation]:
    """Each side-effecting tool step left exactly one effect, with the input the model gave,
    made after the model turn that asked for it was committed and before its record."""
    out = []
    by_seq = {s.seq: s for s in steps}
    for s in steps:
        if s.kind is not StepKind.TOOL or s.tool_name != ev.side_effect_tool:
            continue
        key = f"{run.id}/{s.tool_use_id}"  # the tool's ctx.idempotency_key
        seen_keys.add(key)
        rows = comments_by_key.get(key, [])
        if len(rows) != 1:
            out.append(
                Violation(
                    SIDE_EFFECTS,
                    run.id,
                    f"{s.tool_name} seq={s.seq} (key {key}) left {len(rows)} comments, "
                    "expected exactly 1",
                )
            )
            continue
        row = rows[0]
        model = next(
            (by_seq[q] for q in range(s.seq - 1, 0, -1) if by_seq[q].kind is StepKind.MODEL),
            None,
        )
        use = next((u for u in _tool_uses(model) if u.get("id") == key), None) if model else None
        if use is not None:
            want = use.get("input") or {}
            if (row.ticket_id, row.body) != (want.get("ticket_id"), want.get("text")):
                out.append(
                    Violation(
                        SIDE_EFFECTS,
                        run.id,
                        f"comment {row.id} is ({row.ticket_id}, {row.body!r}), the tool_use "
                        f"asked for ({want.get('ticket_id')}, {want.get('text')!r})",
                    )
                )
        result = _response_json(s)
        if isinstance(result, dict) and result.get("comment_id") != row.id:
            out.append(
                Violation(
                    SIDE_EFFECTS,
                    run.id,
                    f"{s.tool_name} seq={s.seq} recorded comment_id={result.get('comment_id')}, "
                    f"the row for its key is {row.id}",
                )
            )
        if model is not None and model.finished_at and row.created_at < model.finished_at:
            out.append(
                Violation(
                    FENCING,
                    run.id,
                    f"comment {row.id} was written at {row.created_at}, before the model turn "
                    f"that asked for it was committed ({model.finished_at})",
                )
            )
        if s.finished_at and row.created_at > s.finished_at:
            out.append(
                Violation(
                    FENCING,
                    run.id,
                    f"comment {row.id} was written at {row.created_at}, after its tool step "
                    f"seq={s.seq} was recorded ({s.finished_at}): the recorded result is not "
                    "the one of the effect",
                )
            )
    return out


def _faults_on(ev: Evidence, run_id: uuid.UUID) -> list[Fault]:
    return [f for f in ev.faults if run_id in f.repeat_runs]


LOSS_LOGGED_WITHIN_SECONDS = 5.0
"""A worker that was stopped, or cut off from PostgreSQL, logs the leases it lost within a
few heartbeats of running again."""


def _explains(f: Fault, worker: str, at: float) -> bool:
    """Whether fault ``f`` (which hit the run) explains a lease loss ``worker`` logged at
    ``at``: a fault that leaves the worker alive but unable to renew (stopped: that worker;
    PostgreSQL away: any worker) and ended shortly before. A killed worker logs nothing."""
    alive = (f.kind == "sigstop_past_lease" and f.target == worker) or f.target == "postgres"
    end = f.until if f.until is not None else f.at
    return alive and f.at - 1.0 <= at <= end + LOSS_LOGGED_WITHIN_SECONDS


def _unexplained_losses(ev: Evidence, run_id: uuid.UUID, faults: list[Fault]) -> int:
    """The run's logged lease losses that no fault on it explains: each may have cut a call
    between response and checkpoint, as a fault would."""
    times = ev.lease_loss_times.get(run_id) if ev.lease_loss_times is not None else None
    if times is None:
        return ev.lease_losses.get(run_id, 0) if not faults else 0
    return sum(1 for worker, at in times if not any(_explains(f, worker, at) for f in faults))


def _check_model_calls(
    ev: Evidence, run: Run, steps: list[Step], calls: list[ModelCall]
) -> list[Violation]:
    """Each model step is a call the API answered, for the history checkpointed before it;
    calls beyond the model steps are repeats, and each must be paid for by a fault."""
    out = []
    by_request = {c.request_id: c for c in calls}
    model_steps = [s for s in steps if s.kind is StepKind.MODEL]
    for s in model_steps:
        call = by_request.get(s.request_id or "")
        if call is None:
            out.append(
                Violation(
                    CALL_MATCH,
                    run.id,
                    f"model step seq={s.seq} has request id {s.request_id!r}, which the fake "
                    "API never answered for this run",
                )
            )
            continue
        if call.content != s.response:
            out.append(
                Violation(
                    CALL_MATCH,
                    run.id,
                    f"model step seq={s.seq} recorded a response different from the one "
                    f"{call.request_id} returned",
                )
            )
        if call.usage_total != s.usage.total:
            out.append(
                Violation(
                    TOKENS,
                    run.id,
                    f"model step seq={s.seq} recorded {s.usage.total} tokens, "
                    f"{call.request_id} billed {call.usage_total}",
                )
            )
        history = replay(run.input, [p for p in steps if p.seq < s.seq]).messages
        if call.messages != history:
            out.append(
                Violation(
                    FENCING,
                    run.id,
                    f"model step seq={s.seq} was produced by a request whose conversation "
                    f"({len(call.messages)} messages) is not the history checkpointed before "
                    f"it ({len(history)} messages): a write from a stale view",
                )
            )
        before = [p for p in steps if p.seq < s.seq and p.finished_at is not None]
        if before:
            prev_done = before[-1].finished_at.timestamp()  # type: ignore[union-attr]
            if call.received_at < prev_done - CLOCK_SLACK_SECONDS:
                out.append(
                    Violation(
                        FENCING,
                        run.id,
                        f"model step seq={s.seq} checkpoints {call.request_id}, sent "
                        f"{prev_done - call.received_at:.2f}s before seq={before[-1].seq} was "
                        "committed",
                    )
                )
    answered = [c for c in calls if c.status == 200]
    repeats = len(answered) - len(model_steps)
    faults = _faults_on(ev, run.id)
    losses = _unexplained_losses(ev, run.id, faults)
    allowed = len(faults) + losses
    if repeats > allowed:
        turns = Counter(sum(1 for m in c.messages if m.get("role") == "assistant") for c in calls)
        out.append(
            Violation(
                MODEL_REPEATS,
                run.id,
                f"{len(answered)} model calls for {len(model_steps)} model steps: {repeats} "
                f"repeated, but only {len(faults)} fault(s) hit this run "
                f"({', '.join(f'{f.kind}@{f.target}' for f in faults) or 'none'}) and "
                f"{losses} unplanned lease loss(es); calls per turn: {dict(sorted(turns.items()))}",
            )
        )
    if repeats < 0:
        out.append(
            Violation(CALL_MATCH, run.id, f"{len(model_steps)} model steps, {len(answered)} calls")
        )
    return out


def _check_fencing(ev: Evidence, run: Run, steps: list[Step]) -> list[Violation]:
    """One claim, one step: each step is written under a newer lease epoch than the step
    before it and no newer than the run's; by a known worker; in commit order."""
    out = []
    for prev, s in itertools.pairwise(steps):
        if s.lease_epoch <= prev.lease_epoch:
            out.append(
                Violation(
                    FENCING,
                    run.id,
                    f"seq={s.seq} was written under lease epoch {s.lease_epoch}, not newer than "
                    f"seq={prev.seq}'s {prev.lease_epoch}: two steps under one claim, or a "
                    "write by a fenced-out worker",
                )
            )
        if prev.finished_at and s.finished_at and s.finished_at < prev.finished_at:
            out.append(
                Violation(
                    FENCING,
                    run.id,
                    f"seq={s.seq} was committed ({s.finished_at}) before seq={prev.seq} "
                    f"({prev.finished_at})",
                )
            )
    for s in steps:
        if s.lease_epoch > run.lease_epoch:
            out.append(
                Violation(
                    FENCING,
                    run.id,
                    f"seq={s.seq} carries lease epoch {s.lease_epoch}, beyond the run's "
                    f"{run.lease_epoch}",
                )
            )
        if s.worker not in ev.known_workers:
            out.append(Violation(FENCING, run.id, f"seq={s.seq} written by {s.worker!r}"))
    faults = _faults_on(ev, run.id)
    losses = _unexplained_losses(ev, run.id, faults)
    if run.status.terminal:
        wasted = run.lease_epoch - len(steps) - 1
        if wasted > len(faults) + losses:
            out.append(
                Violation(
                    CLAIMS,
                    run.id,
                    f"{run.lease_epoch} claims for {len(steps)} steps and its end: {wasted} "
                    f"claim(s) produced nothing, but only {len(faults)} fault(s) hit the run "
                    f"({', '.join(f'{f.kind}@{f.target}' for f in faults) or 'none'}); a "
                    "duplicated or stale message claimed it, a second chain of messages ran, "
                    "or a fault went unattributed; step epochs: "
                    f"{[s.lease_epoch for s in steps]}",
                )
            )
    if steps and run.status.terminal and run.lease_epoch <= steps[-1].lease_epoch:
        out.append(
            Violation(
                FENCING,
                run.id,
                f"the run ended under lease epoch {run.lease_epoch}, the epoch of its last "
                f"step seq={steps[-1].seq}: ending it took no claim of its own",
            )
        )
    return out


def subset_sums(values: Sequence[int]) -> set[int]:
    sums = {0}
    for v in values:
        sums |= {s + v for s in sums}
    return sums


def _check_counters(run: Run, steps: list[Step]) -> list[Violation]:
    """The run's counters are the sums of its steps'."""
    out = []
    fields = (
        ("tokens_used", run.tokens_used, sum(s.usage.total for s in steps)),
        ("input_tokens", run.usage.input_tokens, sum(s.usage.input_tokens for s in steps)),
        ("output_tokens", run.usage.output_tokens, sum(s.usage.output_tokens for s in steps)),
        (
            "cache_creation_input_tokens",
            run.usage.cache_creation_input_tokens,
            sum(s.usage.cache_creation_input_tokens for s in steps),
        ),
        (
            "cache_read_input_tokens",
            run.usage.cache_read_input_tokens,
            sum(s.usage.cache_read_input_tokens for s in steps),
        ),
        ("cost_usd", run.cost_usd, sum((s.cost_usd for s in steps), Decimal(0))),
    )
    for name, on_run, summed in fields:
        if on_run != summed:
            out.append(Violation(TOKENS, run.id, f"run.{name}={on_run}, its steps sum to {summed}"))
    return out


def _check_tokens(run: Run, steps: list[Step], calls: list[ModelCall]) -> list[Violation]:
    """The run's counters are the sums of its steps'; unrecorded tokens are calls that were
    billed but never became a step (some of them: a killed worker records nothing)."""
    out = _check_counters(run, steps)
    recorded = {s.request_id for s in steps if s.kind is StepKind.MODEL}
    unmatched = [c.usage_total for c in calls if c.status == 200 and c.request_id not in recorded]
    exact = exact_unrecorded(run)
    # with too many calls to enumerate their sums: the bound alone
    ok = exact in subset_sums(unmatched) if len(unmatched) <= 16 else 0 <= exact <= sum(unmatched)
    if not ok:
        out.append(
            Violation(
                TOKENS,
                run.id,
                f"unrecorded_tokens={run.unrecorded_tokens} (of which estimated "
                f"{run.unrecorded_estimated_tokens}) is not the total of any set of the "
                f"run's billed-but-unrecorded calls {unmatched}",
            )
        )
    return out


def exact_unrecorded(run: Run) -> int:
    """The part of the run's unrecorded tokens the API counted (the rest is estimates of
    calls lost with their worker)."""
    return run.unrecorded_tokens - run.unrecorded_estimated_tokens


def lost_tokens(run: Run, steps: list[Step], calls: list[ModelCall]) -> int:
    """Tokens the API billed for the run that neither a step row nor an exact unrecorded
    count holds: the calls lost with their worker."""
    billed = sum(c.usage_total for c in calls if c.status == 200)
    return billed - sum(s.usage.total for s in steps) - exact_unrecorded(run)


def _check_lost_covered(
    ev: Evidence, run: Run, steps: list[Step], calls: list[ModelCall]
) -> list[Violation]:
    """Issue 26.3: every call lost with its worker is covered by the estimate its admission
    wrote down, which the run's next admission counted (an upper bound: it may exceed the
    call, never fall short of it). Not judged for a run that lived through a Redis restart
    (the admission records are in Redis) or that ended before another model call."""
    lost = lost_tokens(run, steps, calls)
    if lost <= run.unrecorded_estimated_tokens:
        return []
    began, ended = run.created_at.timestamp(), (run.finished_at or run.updated_at).timestamp()
    if any(f.kind == "restart_redis" and began <= f.at <= ended for f in ev.faults):
        return []
    if run.status is not RunStatus.SUCCEEDED:
        return []  # a lost call may not have been followed by another admission of the run
    return [
        Violation(LOST_COVERED, run.id, f"{lost} billed tokens are lost, but only "
                  f"{run.unrecorded_estimated_tokens} were counted as estimates")
    ]  # fmt: skip


def _check_cost(ev: Evidence, run: Run, calls: list[ModelCall]) -> list[Violation]:
    """Issue 35.4: what the run records (``tokens_used + unrecorded_tokens``) is what the
    API billed for it when no process was killed while it ran (a worker stopped past its
    lease, a database or broker away: the fenced-out or owed calls' real counts replace any
    estimate of them); when one was, the estimates of the calls lost with it may exceed
    those calls, never more than the estimates themselves (anything beyond is a call counted
    twice). Not judged for a run that lived through a Redis restart: the call records the
    estimates come from are in Redis."""
    billed = sum(c.usage_total for c in calls if c.status == 200)
    recorded = run.tokens_used + run.unrecorded_tokens
    estimated = run.unrecorded_estimated_tokens
    began, ended = run.created_at.timestamp(), (run.finished_at or run.updated_at).timestamp()
    during = [
        f
        for f in ev.faults
        if run.id in f.repeat_runs or run.id in f.disturbed or began - 1.0 <= f.at <= ended
    ]
    if any(f.kind == "restart_redis" for f in during):
        return []
    if not any(f.kind.split(":")[0] in KILLS for f in during):
        if recorded == billed:
            return []
        return [
            Violation(COST, run.id, f"no process was killed while it ran, yet it records "
                      f"{recorded} tokens (of which {estimated} estimated) and the API billed "
                      f"{billed}")
        ]  # fmt: skip
    if recorded - billed > estimated:
        return [
            Violation(COST, run.id, f"it records {recorded} tokens, {recorded - billed} more "
                      f"than the API billed ({billed}), beyond its estimates ({estimated}): a "
                      "call counted twice")
        ]  # fmt: skip
    return []


# -- durable functions --------------------------------------------------------------------------

COMPENSATE_PREFIX = "compensate:"
FAILED_ENDS = (RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TIMED_OUT)
TAG_RE = re.compile(r"\[chaos (\w+)\]")


def step_name(key: str) -> str:
    """``prepare:0/note:0`` -> ``note``; ``compensate:charge:0`` -> ``compensate:charge``."""
    return key.rsplit("/", 1)[-1].rsplit(":", 1)[0]


def compensated_key(step: Step) -> str | None:
    if step.kind is not StepKind.COMPENSATION:
        return None
    return step.step_key.removeprefix(COMPENSATE_PREFIX)


def call_tag(call: ModelCall) -> str | None:
    found = TAG_RE.search(str(call.run_input))
    return found.group(1) if found else None


def run_tag(run: Run) -> str | None:
    return str(run.input.get("tag")) if isinstance(run.input, dict) else None


def check_durable(ev: Evidence, runs: list[Run]) -> list[Violation]:
    """Over the durable function's runs: effects exactly once, compensations at most once and
    only after a failure, each approval decided once, every billed token recorded; plus the
    step log's own shape (keys, seq, nesting, fences, counters)."""
    out: list[Violation] = []
    ids = {r.id for r in runs}
    effects: dict[uuid.UUID, dict[str, list[EffectRow]]] = defaultdict(lambda: defaultdict(list))
    for e in ev.effects:
        effects[e.run_id][e.key].append(e)
        if e.run_id not in ids:
            out.append(
                Violation(EFFECTS, e.run_id, f"chaos_effect {e.id} ({e.kind} {e.key!r}) belongs "
                          "to no run of the durable function")
            )  # fmt: skip
    calls: dict[str, list[ModelCall]] = defaultdict(list)
    for c in ev.calls:
        tag = call_tag(c)
        if tag is not None:
            calls[tag].append(c)
    approvals: dict[uuid.UUID, list[ApprovalRow]] = defaultdict(list)
    for a in ev.approvals:
        approvals[a.run_id].append(a)
    known = {a.id for a in ev.approvals}
    for d in ev.decisions:
        if d.approval_id not in known:
            out.append(
                Violation(APPROVALS, d.run_id, f"the campaign decided approval {d.approval_id}, "
                          "which is not in the database")
            )  # fmt: skip
    for run in runs:
        steps = sorted(ev.steps.get(run.id, []), key=lambda s: s.seq)
        mine = effects.get(run.id, {})
        out += _durable_shape(ev, run, steps)
        out += _durable_terminal(ev, run, steps)
        out += _durable_effects(ev, run, steps, mine)
        out += _durable_compensations(ev, run, steps, mine)
        out += _durable_approval(ev, run, steps, approvals.get(run.id, []), mine)
        out += _check_counters(run, steps)
        out += _durable_billed(ev, run, steps, calls.get(run_tag(run) or "", []))
        out += _check_lost_covered(ev, run, steps, calls.get(run_tag(run) or "", []))
        out += _check_cost(ev, run, calls.get(run_tag(run) or "", []))
    return out


def _non_idempotent(spec: DurableSpec, step: Step) -> bool:
    target = compensated_key(step)
    if target is not None:
        comp = spec.compensations.get(step_name(target))
        return comp is not None and not comp[1]
    return spec.effects.get(step_name(step.step_key)) is False


def _durable_shape(ev: Evidence, run: Run, steps: list[Step]) -> list[Violation]:
    """Unique keys, seq 1..n, nesting (a child's parent is recorded, a completed step has
    nothing in doubt inside it) and fences: one claim per top-level step (epochs strictly
    increase along them), a child written under its parent's claim or an earlier one, no row
    newer than the run, known workers."""
    out = []
    dup = [k for k, n in Counter(s.step_key for s in steps).items() if n > 1]
    if dup:
        out.append(Violation(UNIQUE_KEYS, run.id, f"step keys recorded more than once: {dup}"))
    seqs = [s.seq for s in steps]
    if seqs != list(range(1, len(steps) + 1)):
        out.append(Violation(SEQ, run.id, f"seq is {seqs}, expected 1..{len(steps)}"))
    by_key = {s.step_key: s for s in steps}
    for s in steps:
        if "/" in s.step_key and s.kind is not StepKind.COMPENSATION:
            parent = by_key.get(s.step_key.rsplit("/", 1)[0])
            if parent is None:
                out.append(Violation(UNIQUE_KEYS, run.id, f"{s.step_key} has no parent row"))
            elif parent.status is StepStatus.DONE and s.status is not StepStatus.DONE:
                out.append(
                    Violation(FENCING, run.id, f"{s.step_key} is {s.status} inside "
                              f"{parent.step_key}, which is DONE")
                )  # fmt: skip
            elif s.lease_epoch > parent.lease_epoch:
                out.append(
                    Violation(FENCING, run.id, f"{s.step_key} (epoch {s.lease_epoch}) was written "
                              f"under a newer claim than its parent (epoch {parent.lease_epoch})")
                )  # fmt: skip
        if s.lease_epoch > run.lease_epoch:
            out.append(
                Violation(FENCING, run.id, f"seq={s.seq} carries lease epoch {s.lease_epoch}, "
                          f"beyond the run's {run.lease_epoch}")
            )  # fmt: skip
        if s.worker not in ev.known_workers:
            out.append(Violation(FENCING, run.id, f"seq={s.seq} written by {s.worker!r}"))
    top = [s for s in steps if "/" not in s.step_key or s.kind is StepKind.COMPENSATION]
    for prev, s in itertools.pairwise(top):
        if s.lease_epoch <= prev.lease_epoch:
            out.append(
                Violation(FENCING, run.id, f"{s.step_key} (seq={s.seq}) was written under lease "
                          f"epoch {s.lease_epoch}, not newer than {prev.step_key}'s "
                          f"{prev.lease_epoch}: two steps under one claim, or a stale write")
            )  # fmt: skip
    return out


def _durable_terminal(ev: Evidence, run: Run, steps: list[Step]) -> list[Violation]:
    """SUCCEEDED with every step done; FAILED only after a rejection (or a step's error);
    NEEDS_ATTENTION only on an interrupted step that is not idempotent."""
    started = [s for s in steps if s.status is StepStatus.STARTED]
    rejected = any(s.status is StepStatus.REJECTED for s in steps)
    errors = [s for s in steps if s.status is StepStatus.ERROR]
    why = ""
    if run.status is RunStatus.SUCCEEDED:
        undone = [f"{s.step_key}={s.status}" for s in steps if s.status is not StepStatus.DONE]
        if undone or not steps:
            why = f"SUCCEEDED with steps not done: {undone}"
        elif any(s.kind is StepKind.COMPENSATION for s in steps):
            why = "SUCCEEDED, yet compensations ran"
    elif run.status is RunStatus.FAILED:
        if not (rejected or errors):
            why = "FAILED with no rejected approval and no failed step"
        elif started:
            why = f"FAILED with steps left in doubt: {[s.step_key for s in started]}"
    elif run.status is RunStatus.NEEDS_ATTENTION:
        if not started or not all(_non_idempotent(ev.durable, s) for s in started):
            why = (
                "NEEDS_ATTENTION, but not on an interrupted step that is not idempotent "
                f"(STARTED: {[s.step_key for s in started]})"
            )
    else:
        why = f"status {run.status}"
    if not why:
        return []
    return [Violation(TERMINAL_OK, run.id, f"{why}; error={run.error!r}, steps={len(steps)}")]


def _durable_effects(
    ev: Evidence, run: Run, steps: list[Step], effects: Mapping[str, list[EffectRow]]
) -> list[Violation]:
    """A completed effect step left exactly one effect row, an interrupted one at most one,
    any other none; every row belongs to a step recorded STARTED or DONE, of its kind, and
    was written before that step's record."""
    out = []
    by_key = {s.step_key: s for s in steps}
    for key, rows in effects.items():
        if len(rows) > 1:
            invariant = COMPENSATION if key.startswith(COMPENSATE_PREFIX) else EFFECTS
            out.append(
                Violation(invariant, run.id, f"{key!r} has {len(rows)} effects "
                          f"({[(r.id, r.kind) for r in rows]}): executed more than once")
            )  # fmt: skip
        s = by_key.get(key)
        if s is None or s.status not in (StepStatus.DONE, StepStatus.STARTED):
            out.append(
                Violation(EFFECTS, run.id, f"effect {rows[0].id} ({rows[0].kind} {key!r}) "
                          f"belongs to no step recorded STARTED or DONE "
                          f"({s.status if s else 'no row'})")
            )  # fmt: skip
            continue
        target = compensated_key(s)
        comp = ev.durable.compensations.get(step_name(target)) if target else None
        kind = comp[0] if comp else step_name(key)
        if any(r.kind != kind for r in rows):
            out.append(Violation(EFFECTS, run.id, f"{key!r} is a {kind} step, its effect is "
                                 f"{[r.kind for r in rows]}"))  # fmt: skip
        if s.status is StepStatus.DONE and s.finished_at and rows[0].at > s.finished_at:
            out.append(
                Violation(EFFECTS, run.id, f"effect {rows[0].id} of {key!r} was written at "
                          f"{rows[0].at}, after its step was recorded ({s.finished_at})")
            )  # fmt: skip
    for s in steps:
        compensation = s.kind is StepKind.COMPENSATION
        if not compensation and step_name(s.step_key) not in ev.durable.effects:
            continue
        rows = effects.get(s.step_key, [])
        if s.status is StepStatus.DONE and len(rows) != 1:
            out.append(
                Violation(EFFECTS, run.id, f"{s.step_key} is DONE with {len(rows)} effects, "
                          "expected exactly 1")
            )  # fmt: skip
        result = _response_json(s)
        if (
            s.status is StepStatus.DONE
            and len(rows) == 1
            and isinstance(result, dict)
            and result.get("effect") != rows[0].id
        ):
            out.append(
                    Violation(EFFECTS, run.id, f"{s.step_key} recorded effect "
                              f"{result.get('effect')}, the row for its key is {rows[0].id}")
                )  # fmt: skip
    return out


def _durable_compensations(
    ev: Evidence, run: Run, steps: list[Step], effects: Mapping[str, list[EffectRow]]
) -> list[Violation]:
    """Compensations only in a run that failed, after the failure, of completed compensable
    steps, each at most once; a run that ended FAILED compensated every completed step."""
    out = []
    by_key = {s.step_key: s for s in steps}
    comps = [s for s in steps if s.kind is StepKind.COMPENSATION]
    comp_rows = [k for k in effects if k.startswith(COMPENSATE_PREFIX)]
    failed_states = (StepStatus.REJECTED, StepStatus.ERROR)
    failures = [
        s.seq for s in steps if s.status in failed_states and s.kind is not StepKind.COMPENSATION
    ]
    if comps or comp_rows:
        failed = run.status in FAILED_ENDS or (
            run.status is RunStatus.NEEDS_ATTENTION
            and any(c.status is StepStatus.STARTED for c in comps)
        )
        if not failed or not failures:
            out.append(
                Violation(COMPENSATION, run.id, f"compensated ({[c.step_key for c in comps]}, "
                          f"effects {comp_rows}) in a run that is {run.status} "
                          f"{'after no failure' if not failures else ''}")
            )  # fmt: skip
    first_failure = min(failures, default=None)
    for c in comps:
        if first_failure is not None and c.seq < first_failure:
            out.append(
                Violation(COMPENSATION, run.id, f"{c.step_key} (seq={c.seq}) ran before the "
                          f"failure (seq={first_failure})")
            )  # fmt: skip
        target = by_key.get(compensated_key(c) or "")
        if target is None or target.status is not StepStatus.DONE:
            out.append(
                Violation(COMPENSATION, run.id, f"{c.step_key} undoes a step that did not "
                          f"complete ({target.status if target else 'no row'})")
            )  # fmt: skip
        elif step_name(target.step_key) not in ev.durable.compensations:
            out.append(Violation(COMPENSATION, run.id, f"{c.step_key}: nothing to undo"))
    if run.status is RunStatus.FAILED:
        for s in steps:
            if (
                s.status is StepStatus.DONE
                and s.kind is not StepKind.COMPENSATION
                and step_name(s.step_key) in ev.durable.compensations
            ):
                c = by_key.get(COMPENSATE_PREFIX + s.step_key)
                if c is None or c.status is not StepStatus.DONE:
                    out.append(
                        Violation(COMPENSATION, run.id, f"the run FAILED but {s.step_key} was "
                                  f"not compensated ({c.status if c else 'no row'})")
                    )  # fmt: skip
    return out


def _durable_approval(
    ev: Evidence,
    run: Run,
    steps: list[Step],
    approvals: list[ApprovalRow],
    effects: Mapping[str, list[EffectRow]],
) -> list[Violation]:
    """One approval per approval step, decided (APPROVED or REJECTED) as the campaign decided
    it, with exactly one decision in the audit trail; a repeated POST changed nothing; the
    approved action ran at most once, a rejected one never."""
    out = []
    step = next((s for s in steps if s.kind is StepKind.APPROVAL), None)
    if run.status is RunStatus.SUCCEEDED and step is None:
        out.append(Violation(APPROVALS, run.id, "SUCCEEDED without its approval step"))
    if step is None and approvals:
        out.append(Violation(APPROVALS, run.id, f"{len(approvals)} approval(s), no approval step"))
    if step is not None and len(approvals) != 1:
        out.append(Violation(APPROVALS, run.id, f"{len(approvals)} approvals for {step.step_key}"))
    audits: dict[uuid.UUID | None, list[AuditRow]] = defaultdict(list)
    for e in ev.audits:
        if e.run_id == run.id and e.action in ("approve", "reject"):
            audits[e.approval_id].append(e)
    decisions = {d.approval_id: d for d in ev.decisions}
    for a in approvals:
        verb = {"APPROVED": "approve", "REJECTED": "reject"}.get(a.status)
        if verb is None:
            out.append(Violation(APPROVALS, run.id, f"approval {a.id} ended {a.status}, undecided"))
            continue
        trail = [e.action for e in audits.get(a.id, [])]
        if trail != [verb]:
            out.append(
                Violation(APPROVALS, run.id, f"approval {a.id} is {a.status}; its audit trail "
                          f"records {trail or 'no decision'} (expected exactly one {verb!r})")
            )  # fmt: skip
        d = decisions.get(a.id)
        if d is None or d.verb != verb:
            out.append(
                Violation(APPROVALS, run.id, f"approval {a.id} is {a.status}; the campaign "
                          f"decided {d.verb if d else 'nothing'}")
            )  # fmt: skip
        for again, status in d.again if d else ():
            want = 200 if again == verb else 409
            if status != want:
                out.append(
                    Violation(APPROVALS, run.id, f"{again} of approval {a.id} (already {verb}d) "
                              f"was answered {status}, expected {want}")
                )  # fmt: skip
        if step is None:
            continue
        if a.step_key != step.step_key:
            out.append(
                Violation(APPROVALS, run.id, f"approval for {a.step_key}, not {step.step_key}")
            )
        ran = len(effects.get(step.step_key, []))
        if verb == "reject" and (step.status is not StepStatus.REJECTED or ran):
            out.append(
                Violation(APPROVALS, run.id, f"rejected, yet {step.step_key} is {step.status} "
                          f"with {ran} effect(s)")
            )  # fmt: skip
        if verb == "approve" and step.status not in (StepStatus.DONE, StepStatus.STARTED):
            out.append(
                Violation(APPROVALS, run.id, f"approved, yet {step.step_key} is {step.status}")
            )
    for d in ev.decisions:
        if d.run_id == run.id and not any(a.id == d.approval_id for a in approvals):
            out.append(Violation(APPROVALS, run.id, f"decided approval {d.approval_id} is gone"))
    return out


def bounded_subset_sums(values: Sequence[int], most: int) -> set[int]:
    """Sums of at most ``most`` of ``values``."""
    by_size: list[set[int]] = [{0}]
    for v in values:
        for k in range(min(most, len(by_size)), 0, -1):
            if k == len(by_size):
                by_size.append(set())
            by_size[k] |= {s + v for s in by_size[k - 1]}
    return set().union(*by_size)


def _durable_billed(
    ev: Evidence, run: Run, steps: list[Step], calls: list[ModelCall]
) -> list[Violation]:
    """Each recorded model call is a call the API answered for this run; calls beyond the
    recorded ones are repeats, one per fault at most; and every billed token is in a step row
    or in ``unrecorded_tokens``, except those of the calls a fault could have cut (at most one
    per fault)."""
    out = []
    answered = [c for c in calls if c.status == 200]
    by_request = {c.request_id: c for c in answered}
    recorded = [s for s in steps if s.request_id]
    for s in recorded:
        call = by_request.get(s.request_id or "")
        if call is None:
            out.append(
                Violation(CALL_MATCH, run.id, f"{s.step_key} has request id {s.request_id!r}, "
                          "which the fake API never answered for this run")
            )  # fmt: skip
        elif call.content != s.response:
            out.append(
                Violation(CALL_MATCH, run.id, f"{s.step_key} recorded a response that is not "
                          f"{call.request_id}'s")
            )  # fmt: skip
    faults = _faults_on(ev, run.id)
    allowed = len(faults) + _unexplained_losses(ev, run.id, faults)
    repeats = len(answered) - len(recorded)
    if repeats > allowed:
        out.append(
            Violation(MODEL_REPEATS, run.id, f"{len(answered)} model calls for {len(recorded)} "
                      f"recorded: {repeats} repeated, but only {allowed} fault(s) or lost "
                      f"lease(s) could have cut one")
        )  # fmt: skip
    billed = sum(c.usage_total for c in answered)
    in_rows = sum(s.usage.total for s in steps)
    missing = billed - in_rows - exact_unrecorded(run)
    if missing not in bounded_subset_sums([c.usage_total for c in answered], allowed):
        out.append(
            Violation(BILLED, run.id, f"billed {billed} tokens in {len(answered)} calls; step "
                      f"rows record {in_rows} and unrecorded_tokens={run.unrecorded_tokens}: "
                      f"{missing} unaccounted for, not the tokens of at most {allowed} call(s) "
                      "a fault could have cut")
        )  # fmt: skip
    return out


# -- reporting ------------------------------------------------------------------------------


def cost_line(ev: Evidence) -> str:
    """What the API billed against what the runs hold: step rows, exact unrecorded counts,
    and estimates of calls lost with their worker (issue 26.3)."""
    billed = sum(c.usage_total for c in ev.calls if c.status == 200)
    rows = sum(s.usage.total for v in ev.steps.values() for s in v)
    exact = sum(exact_unrecorded(r) for r in ev.runs)
    estimated = sum(r.unrecorded_estimated_tokens for r in ev.runs)
    lost = billed - rows - exact
    covered = "covered" if lost <= estimated else "NOT covered"
    return (
        f"cost: billed {billed} tokens; step rows {rows}, exact unrecorded {exact}; lost with "
        f"their worker {lost}, estimated {estimated} ({covered}; the estimates exceed the lost "
        f"calls by {estimated - lost}: a ~33% input margin, and the output at the call's "
        "max_tokens, per lost call: an upper bound)"
    )


def recovery_seconds(
    fault: Fault, runs: Iterable[Run], steps: Mapping[uuid.UUID, list[Step]]
) -> dict[uuid.UUID, float | None]:
    """For each run the fault disturbed: seconds from the fault to the run's next committed
    step (or its end), ``None`` if neither came."""
    by_id = {r.id: r for r in runs}
    out: dict[uuid.UUID, float | None] = {}
    for run_id in sorted(fault.disturbed):
        run = by_id.get(run_id)
        times = [
            s.finished_at.timestamp()
            for s in steps.get(run_id, [])
            if s.finished_at is not None and s.finished_at.timestamp() > fault.at
        ]
        if run is not None and run.finished_at is not None:
            times.append(run.finished_at.timestamp())
        later = [t for t in times if t > fault.at]
        out[run_id] = min(later) - fault.at if later else None
    return out


def report(ev: Evidence, start: float) -> str:
    lines = ["faults injected (t from the start of the campaign; recovery = fault -> next "
             "committed step of each run it disturbed):"]  # fmt: skip
    lines.append(f"  {'t(s)':>6}  {'fault':<34} {'target':<10} {'runs':>4}  recovery (s)")
    for f in sorted(ev.faults, key=lambda f: f.at):
        rec = recovery_seconds(f, ev.runs, ev.steps)
        times = " ".join(f"{v:.1f}" if v is not None else "never" for v in rec.values()) or "-"
        extra = f"  [{f.detail}]" if f.detail else ""
        lines.append(
            f"  {f.at - start:6.1f}  {f.kind:<34} {f.target:<10} {len(f.disturbed):>4}  "
            f"{times}{extra}"
        )
    kinds = Counter(f.kind.split(":")[0] for f in ev.faults)
    lines.append("  totals: " + ", ".join(f"{k}={n}" for k, n in sorted(kinds.items())))
    all_rec = [v for f in ev.faults for v in recovery_seconds(f, ev.runs, ev.steps).values() if v]
    if all_rec:
        all_rec.sort()
        lines.append(
            f"  recovery: n={len(all_rec)} median={all_rec[len(all_rec) // 2]:.1f}s "
            f"max={all_rec[-1]:.1f}s"
        )
    n_steps = sum(len(v) for v in ev.steps.values())
    n_model = sum(1 for v in ev.steps.values() for s in v if s.kind is StepKind.MODEL)
    statuses = Counter(str(r.status) for r in ev.runs)
    lines.append(
        f"runs={len(ev.runs)} {dict(statuses)} steps={n_steps} model_steps={n_model} "
        f"model_calls={len(ev.calls)} repeated_calls={len(ev.calls) - n_model} "
        f"comments={len(ev.comments)} unrecorded_tokens="
        f"{sum(r.unrecorded_tokens for r in ev.runs)}"
    )
    lines.append(cost_line(ev))
    durable = [r for r in ev.runs if r.agent == ev.durable.agent]
    if durable:
        ids = {r.id for r in durable}
        d_steps = sum(len(ev.steps.get(i, [])) for i in ids)
        hits = Counter(f.kind for f in ev.faults for i in f.repeat_runs | f.disturbed if i in ids)
        comps = Counter(e.kind for e in ev.effects if e.key.startswith(COMPENSATE_PREFIX))
        verbs = Counter(d.verb for d in ev.decisions)
        again = Counter(f"{v}->{code}" for d in ev.decisions for v, code in d.again)
        lines.append(
            f"durable runs={len(durable)} {dict(Counter(str(r.status) for r in durable))} "
            f"steps={d_steps} effects={len(ev.effects)} compensations={dict(comps)} "
            f"decisions={dict(verbs)} repeated_posts={dict(again)}"
        )
        lines.append(f"  fault hits on durable runs: {dict(sorted(hits.items())) or 'none'}")
    if ev.lease_losses:
        lines.append(
            "leases their live holder lost, as its heartbeat or the fence found (post-commit "
            "false alarms excluded): "
            + ", ".join(f"{str(k)[:8]}x{v}" for k, v in ev.lease_losses.items())
        )
    return "\n".join(lines)
