"""The chaos checker can fail: a consistent fabricated data set passes, and each kind of
violation planted in it is reported under the right invariant. No services needed."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from db.records import Run, RunStatus, Step, StepKind, StepStatus, Usage
from runtime.pipeline.replay import replay
from tests.chaos import checker
from tests.chaos.checker import Comment, Evidence, Fault, ModelCall, check

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
RUN_ID = uuid.UUID("00000000-0000-0000-0000-0000000000aa")
INPUT = "[chaos t1] Remind the owners of the overdue acme tickets."


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _build(cls: type[Any], values: dict[str, object]) -> Any:
    """An instance of a records dataclass from ``values``; fields added to it later get a
    neutral value from their annotation (0, False, None), so these tests keep building."""
    neutral: dict[str, object] = {"int": 0, "bool": False, "Decimal": Decimal(0)}
    kwargs = {
        f.name: values[f.name] if f.name in values else neutral.get(str(f.type))
        for f in dataclasses.fields(cls)
    }
    return cls(**kwargs)


def make_run(**changes: object) -> Run:
    values: dict[str, object] = {
        "id": RUN_ID,
        "agent": "acme-tickets",
        "status": RunStatus.SUCCEEDED,
        "input": INPUT,
        "model": "claude-sonnet-4-5",
        "max_steps": 50,
        "token_budget": 100_000,
        "tokens_used": 235,
        "usage": Usage(220, 15),
        "cost_usd": Decimal("0.002"),
        "unrecorded_tokens": 0,
        "unrecorded_cost_usd": Decimal(0),
        "deadline_at": at(600),
        "run_at": at(0),
        "lease_epoch": 4,
        "dispatch_token": uuid.uuid4(),
        "result": "done",
        "created_at": at(0),
        "updated_at": at(4),
        "finished_at": at(4),
    }
    run: Run = _build(Run, {**values, **changes})
    return run


def make_step(seq: int, kind: StepKind, **changes: object) -> Step:
    values: dict[str, object] = {
        "run_id": RUN_ID,
        "seq": seq,
        "step_key": "",
        "kind": kind,
        "status": StepStatus.DONE,
        "usage": Usage(),
        "cost_usd": Decimal(0),
        "latency_ms": 10,
        "worker": "worker-A",
        "lease_epoch": seq,
        "started_at": at(seq - 0.5),
        "finished_at": at(seq),
    }
    step: Step = _build(Step, {**values, **changes})
    return step


USE = {"type": "tool_use", "id": "toolu_1", "name": "add_comment",
       "input": {"ticket_id": 101, "text": "please look"}}  # fmt: skip


def good_steps() -> list[Step]:
    return [
        make_step(
            1,
            StepKind.MODEL,
            step_key="model:1",
            response=[{"type": "text", "text": "chaos reply 1"}, USE],
            stop_reason="tool_use",
            usage=Usage(100, 10),
            cost_usd=Decimal("0.001"),
            request_id="req_fake_0001",
        ),
        make_step(
            2,
            StepKind.TOOL,
            step_key="tool:toolu_1",
            tool_name="add_comment",
            tool_use_id="toolu_1",
            response=json.dumps({"ticket_id": 101, "comment_id": 7, "created": True}),
            worker="worker-B",
        ),
        make_step(
            3,
            StepKind.MODEL,
            step_key="model:2",
            response=[{"type": "text", "text": "chaos reply 2: done."}],
            stop_reason="end_turn",
            usage=Usage(120, 5),
            cost_usd=Decimal("0.001"),
            request_id="req_fake_0002",
        ),
    ]


def call_for(steps: list[Step], seq: int, request_id: str, received: float) -> ModelCall:
    step = next(s for s in steps if s.seq == seq)
    return ModelCall(
        request_id=request_id,
        messages=replay(INPUT, [s for s in steps if s.seq < seq]).messages,
        status=200,
        content=step.response,
        usage={"input_tokens": step.usage.input_tokens, "output_tokens": step.usage.output_tokens},
        received_at=received,
    )


def good_evidence() -> Evidence:
    steps = good_steps()
    return Evidence(
        runs=[make_run()],
        steps={RUN_ID: steps},
        comments=[Comment(7, 101, "please look", f"{RUN_ID}/toolu_1", at(1.5))],
        calls=[
            call_for(steps, 1, "req_fake_0001", at(0.5).timestamp()),
            call_for(steps, 3, "req_fake_0002", at(2.5).timestamp()),
        ],
        faults=[],
        known_workers=frozenset({"worker-A", "worker-B"}),
    )


def with_steps(ev: Evidence, steps: list[Step]) -> Evidence:
    return dataclasses.replace(ev, steps={RUN_ID: steps})


def replace_step(ev: Evidence, which: int, **changes: object) -> Evidence:
    return with_steps(
        ev,
        [dataclasses.replace(s, **changes) if s.seq == which else s for s in ev.steps[RUN_ID]],  # type: ignore[arg-type]
    )


def repeat_turn_2(ev: Evidence) -> Evidence:
    """One more billed call for turn 2 that never became a step."""
    extra = dataclasses.replace(ev.calls[1], request_id="req_fake_0003")
    return dataclasses.replace(ev, calls=[*ev.calls, extra])


def test_a_consistent_data_set_passes() -> None:
    assert check(good_evidence()) == []


MUTATIONS: dict[str, tuple[Callable[[Evidence], Evidence], str]] = {
    "duplicated step key": (
        lambda ev: replace_step(ev, 3, step_key="model:1"),
        checker.UNIQUE_KEYS,
    ),
    "seq gap": (lambda ev: replace_step(ev, 3, seq=4), checker.SEQ),
    "tool_use without a result": (
        lambda ev: with_steps(
            ev, [ev.steps[RUN_ID][0], dataclasses.replace(ev.steps[RUN_ID][2], seq=2)]
        ),
        checker.TOOL_RESULTS,
    ),
    "tool step left STARTED": (
        lambda ev: replace_step(ev, 2, status=StepStatus.STARTED),
        checker.TOOL_RESULTS,
    ),
    "tool step answering nothing": (
        lambda ev: replace_step(ev, 2, tool_use_id="toolu_9", step_key="tool:toolu_9"),
        checker.TOOL_RESULTS,
    ),
    "side effect twice": (
        lambda ev: dataclasses.replace(
            ev,
            comments=[*ev.comments, Comment(8, 101, "please look", f"{RUN_ID}/toolu_1", at(1.6))],
        ),
        checker.SIDE_EFFECTS,
    ),
    "side effect missing": (
        lambda ev: dataclasses.replace(ev, comments=[]),
        checker.SIDE_EFFECTS,
    ),
    "orphan side effect": (
        lambda ev: dataclasses.replace(
            ev, comments=[*ev.comments, Comment(9, 102, "x", f"{RUN_ID}/toolu_never", at(1.6))]
        ),
        checker.SIDE_EFFECTS,
    ),
    "side effect before its model turn was committed": (
        lambda ev: dataclasses.replace(
            ev, comments=[Comment(7, 101, "please look", f"{RUN_ID}/toolu_1", at(0.7))]
        ),
        checker.FENCING,
    ),
    "repeated model call with no fault": (repeat_turn_2, checker.MODEL_REPEATS),
    "two repeats for one fault": (
        lambda ev: dataclasses.replace(
            repeat_turn_2(repeat_turn_2(ev)),
            faults=[Fault("kill_worker", "worker-A", 0.0, repeat_runs=frozenset({RUN_ID}))],
        ),
        checker.MODEL_REPEATS,
    ),
    "rejected request": (
        lambda ev: dataclasses.replace(
            ev, calls=[*ev.calls, dataclasses.replace(ev.calls[0], status=400, content=None)]
        ),
        checker.CALL_MATCH,
    ),
    "checkpointed response differs from the API's": (
        lambda ev: replace_step(ev, 3, response=[{"type": "text", "text": "forged"}]),
        checker.CALL_MATCH,
    ),
    "step under the previous step's epoch (stale writer)": (
        lambda ev: replace_step(ev, 2, lease_epoch=1),
        checker.FENCING,
    ),
    "step epoch beyond the run's": (
        lambda ev: replace_step(ev, 3, lease_epoch=9),
        checker.FENCING,
    ),
    "step written by an unknown worker": (
        lambda ev: replace_step(ev, 2, worker="intruder"),
        checker.FENCING,
    ),
    "model step from a stale history": (
        lambda ev: dataclasses.replace(
            ev,
            calls=[
                ev.calls[0],
                dataclasses.replace(
                    ev.calls[1], messages=replay(INPUT, ev.steps[RUN_ID][:1]).messages
                ),
            ],
        ),
        checker.FENCING,
    ),
    "request sent before the previous step committed": (
        lambda ev: dataclasses.replace(
            ev, calls=[ev.calls[0], dataclasses.replace(ev.calls[1], received_at=at(1).timestamp())]
        ),
        checker.FENCING,
    ),
    "token counter off": (
        lambda ev: dataclasses.replace(ev, runs=[make_run(tokens_used=236)]),
        checker.TOKENS,
    ),
    "unrecorded tokens with no unrecorded call": (
        lambda ev: dataclasses.replace(ev, runs=[make_run(unrecorded_tokens=50)]),
        checker.TOKENS,
    ),
    "run still running": (
        lambda ev: dataclasses.replace(ev, runs=[make_run(status=RunStatus.RUNNING)]),
        checker.TERMINAL_OK,
    ),
    "idempotent tool parked for a human": (
        lambda ev: replace_step(
            dataclasses.replace(ev, runs=[make_run(status=RunStatus.NEEDS_ATTENTION)]),
            2,
            status=StepStatus.STARTED,
        ),
        checker.TERMINAL_OK,
    ),
    "claims that produced nothing, with no fault": (
        lambda ev: dataclasses.replace(ev, runs=[make_run(lease_epoch=6)]),
        checker.CLAIMS,
    ),
    "run ended with no claim of its own": (
        lambda ev: dataclasses.replace(ev, runs=[make_run(lease_epoch=3)]),
        checker.FENCING,
    ),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_planted_violation_is_reported(name: str) -> None:
    mutate, invariant = MUTATIONS[name]
    violations = check(mutate(good_evidence()))
    assert invariant in {v.invariant for v in violations}, violations


def test_a_repeat_paid_for_by_a_fault_and_its_unrecorded_tokens_pass() -> None:
    ev = repeat_turn_2(good_evidence())
    billed = ev.calls[-1].usage_total
    ev = dataclasses.replace(
        ev,
        runs=[make_run(unrecorded_tokens=billed)],
        faults=[Fault("sigstop_past_lease", "worker-A", 0.0, repeat_runs=frozenset({RUN_ID}))],
    )
    assert check(ev) == []


def _during_the_run(kind: str) -> Fault:
    return Fault(kind, "worker-A", at(2.0).timestamp(), repeat_runs=frozenset({RUN_ID}))


def test_with_no_process_killed_the_run_records_exactly_what_was_billed() -> None:
    """Issue 35.4: a worker stopped past its lease is not killed: the estimate of its call
    counted meanwhile must have been replaced by the call's real count."""
    ev = repeat_turn_2(good_evidence())
    billed = ev.calls[-1].usage_total
    stopped = [_during_the_run("sigstop_past_lease")]
    exact = make_run(unrecorded_tokens=billed)
    ev = dataclasses.replace(ev, runs=[exact], faults=stopped)
    assert check(ev) == []
    left = make_run(unrecorded_tokens=billed + 500, unrecorded_estimated_tokens=500)
    violations = check(dataclasses.replace(ev, runs=[left]))
    assert {v.invariant for v in violations} == {checker.COST}, violations


def test_with_a_process_killed_estimates_may_exceed_the_lost_call_never_more() -> None:
    ev = repeat_turn_2(good_evidence())  # turn 2 answered twice: the first lost with A
    lost = ev.calls[-1].usage_total
    killed = [_during_the_run("kill_worker")]
    over = make_run(unrecorded_tokens=lost + 500, unrecorded_estimated_tokens=lost + 500)
    assert check(dataclasses.replace(ev, runs=[over], faults=killed)) == []
    twice = make_run(unrecorded_tokens=lost + 500, unrecorded_estimated_tokens=400)
    violations = check(dataclasses.replace(ev, runs=[twice], faults=killed))
    assert checker.COST in {v.invariant for v in violations}, violations


def _stopped(at: float, until: float, worker: str = "worker-A") -> Fault:
    return Fault("sigstop_past_lease", worker, at, repeat_runs=frozenset({RUN_ID}), until=until)


def _paid(ev: Evidence) -> Evidence:
    """``ev`` with its repeated calls' tokens counted as the run's unrecorded tokens."""
    extra = sum(c.usage_total for c in ev.calls[2:])
    return dataclasses.replace(ev, runs=[make_run(unrecorded_tokens=extra)])


def test_a_lease_loss_no_fault_explains_pays_for_a_repeat_beside_a_fault() -> None:
    """Stopped twice, the harness attributed only the first stop to the run (its lease was
    not renewed within the window the harness looks at): the second stop's lease loss,
    logged by the worker when it ran again, pays for the second repeat."""
    ev = _paid(repeat_turn_2(repeat_turn_2(good_evidence())))
    ev = dataclasses.replace(
        ev,
        faults=[_stopped(100.0, 110.0)],
        lease_losses={RUN_ID: 2},
        lease_loss_times={RUN_ID: [("worker-A", 110.5), ("worker-B", 150.2)]},
    )
    assert check(ev) == []


def test_a_lease_loss_a_fault_explains_pays_for_nothing_more() -> None:
    """The stop's own lease loss (logged by the stopped worker just after SIGCONT) is the
    fault's, not a second allowance: two repeats for one stop still fail."""
    ev = _paid(repeat_turn_2(repeat_turn_2(good_evidence())))
    ev = dataclasses.replace(
        ev,
        faults=[_stopped(100.0, 110.0)],
        lease_losses={RUN_ID: 1},
        lease_loss_times={RUN_ID: [("worker-A", 110.5)]},
    )
    assert checker.MODEL_REPEATS in {v.invariant for v in check(ev)}


def test_a_repeat_with_neither_a_fault_nor_a_lease_loss_still_fails() -> None:
    ev = dataclasses.replace(
        _paid(repeat_turn_2(good_evidence())), lease_losses={}, lease_loss_times={}
    )
    assert checker.MODEL_REPEATS in {v.invariant for v in check(ev)}
    # nor does another worker's loss of another run pay for it
    other = uuid.uuid4()
    ev = dataclasses.replace(
        ev, lease_losses={other: 1}, lease_loss_times={other: [("worker-B", 10.0)]}
    )
    assert checker.MODEL_REPEATS in {v.invariant for v in check(ev)}


def test_a_non_idempotent_tool_may_park_the_run() -> None:
    ev = replace_step(
        dataclasses.replace(good_evidence(), runs=[make_run(status=RunStatus.NEEDS_ATTENTION)]),
        2,
        status=StepStatus.STARTED,
    )
    ev = dataclasses.replace(ev, non_idempotent_tools=frozenset({"add_comment"}))
    assert checker.TERMINAL_OK not in {v.invariant for v in check(ev)}


def test_recovery_is_measured_to_the_next_committed_step() -> None:
    ev = good_evidence()
    fault = Fault("kill_worker", "worker-A", at(1.2).timestamp(), disturbed=frozenset({RUN_ID}))
    assert checker.recovery_seconds(fault, ev.runs, ev.steps) == {RUN_ID: pytest.approx(0.8)}


# -- lease losses only the fence saw (issue 36; the long campaign's seed 795611) ------------------

# Lines as a saturated worker logged them (tests/e2e/test_starved_heartbeat.py, before the
# heartbeat had its own thread): a run taken over while its claim's answer was unread, whose
# step then met the fence with no heartbeat line; and a loss the heartbeat noticed first.
_FENCED_LOG = f"""\
2026-12-07 15:37:19,546 WARNING worker-A run=11c16127-cc0b-4c4f-adf1-94a50a582dd4 lease lost: \
another worker took it over
2026-12-07 15:37:21,344 WARNING worker-A run={str(RUN_ID)[:8]} taken over while this worker was \
away (a call of lease 2 is in flight): no model call from here
2026-12-07 15:37:21,344 WARNING worker-A run={str(RUN_ID)[:8]} step abandoned, nothing written: \
lease on run {RUN_ID} lost: a newer claim of the run is calling the model
2026-12-07 15:37:21,397 WARNING worker-A run=11c16127 step abandoned, nothing written: lease on \
run 11c16127-cc0b-4c4f-adf1-94a50a582dd4 lost: heartbeat found the lease taken over
2026-12-07 15:38:02,100 WARNING worker-B run=22d7aa01-0000-4000-8000-000000000001 lease lost: \
another worker took it over
2026-12-07 15:38:02,150 WARNING worker-B run=22d7aa01 step abandoned, nothing written: lease on \
run 22d7aa01-0000-4000-8000-000000000001 lost: checkpoint refused by the fence
"""


def test_a_lease_only_the_fence_saw_lost_is_found_in_the_log_once() -> None:
    from tests.chaos.harness import fenced_out_losses, heartbeat_losses

    noticed = uuid.UUID("11c16127-cc0b-4c4f-adf1-94a50a582dd4")
    raced = uuid.UUID("22d7aa01-0000-4000-8000-000000000001")
    assert [(w, r) for w, r, _, _ in heartbeat_losses(_FENCED_LOG)] == [
        ("worker-A", noticed),
        ("worker-B", raced),
    ]
    # A loss the heartbeat logged is not counted again from its step's line (whether the
    # step gave up on the heartbeat's flag or wrote first and met the fence); the loss only
    # the fence saw is found.
    assert [(w, r) for w, r, _, _ in fenced_out_losses(_FENCED_LOG)] == [("worker-A", RUN_ID)]


def test_a_claim_wasted_by_a_lease_only_the_fence_saw_lost_is_paid_for() -> None:
    """The pattern of run 390ffd28 (seed 795611): one claim more than its steps and its end,
    no fault on the run. A live worker lost that claim's lease (its process starved past the
    lease): the fence's line in its log pays for the claim; without it the check fails."""
    from tests.chaos.harness import fenced_out_losses

    wasted = dataclasses.replace(good_evidence(), runs=[make_run(lease_epoch=5)])
    assert checker.CLAIMS in {v.invariant for v in check(wasted)}
    losses = [(w, t) for w, r, t, _ in fenced_out_losses(_FENCED_LOG) if r == RUN_ID]
    paid = dataclasses.replace(
        wasted, lease_losses={RUN_ID: len(losses)}, lease_loss_times={RUN_ID: losses}
    )
    assert check(paid) == []
