"""The chaos checker's durable-function invariants can fail: two consistent fabricated runs of
``chaos-durable`` (one approved, one rejected and compensated) pass, and each violation planted
in them is reported under the right invariant. No services needed."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest

from db.records import RunStatus, Step, StepKind, StepStatus, Usage
from tests.chaos import checker
from tests.chaos.checker import (
    ApprovalRow,
    AuditRow,
    Decision,
    EffectRow,
    Evidence,
    Fault,
    ModelCall,
    check,
)
from tests.chaos.durable_agents import AGENT, prompt
from tests.chaos.test_checker import at, make_run, make_step

OK = uuid.UUID("00000000-0000-0000-0000-0000000000d1")
NO = uuid.UUID("00000000-0000-0000-0000-0000000000d2")
TAGS = {OK: "d001", NO: "d002"}
APPROVAL = {OK: uuid.UUID("00000000-0000-0000-0000-0000000000a1"),
            NO: uuid.UUID("00000000-0000-0000-0000-0000000000a2")}  # fmt: skip
USAGE = {OK: (Usage(300, 10), Usage(301, 10)), NO: (Usage(302, 10), Usage(303, 10))}


def _done(run: uuid.UUID, key: str, effect: int) -> dict[str, Any]:
    return {"run": str(run), "key": key, "effect": effect}


def _steps(run: uuid.UUID, first_effect: int) -> list[Step]:
    """reserve, prepare (note, advise with two model calls, stamp), charge: one claim per
    top-level step (epochs 1, 2, 3), children under their parent's."""
    e = first_effect
    u1, u2 = USAGE[run]

    def step(seq: int, kind: StepKind, key: str, epoch: int, **changes: Any) -> Step:
        return make_step(seq, kind, run_id=run, step_key=key, lease_epoch=epoch, **changes)

    return [
        step(1, StepKind.STEP, "reserve:0", 1, response=_done(run, "reserve:0", e)),
        step(2, StepKind.STEP, "prepare:0", 2, response=["a1", "a2"], finished_at=at(7)),
        step(3, StepKind.STEP, "prepare:0/note:0", 2,
             response=_done(run, "prepare:0/note:0", e + 1)),
        step(4, StepKind.LLM, "prepare:0/advise:0", 2, response=["a1", "a2"]),
        step(5, StepKind.LLM, "prepare:0/advise:0/llm:0", 2, usage=u1,
             request_id=f"req_{run.hex[-2:]}_1", response=[{"type": "text", "text": "a1"}]),
        step(6, StepKind.LLM, "prepare:0/advise:0/llm:1", 2, usage=u2,
             request_id=f"req_{run.hex[-2:]}_2", response=[{"type": "text", "text": "a2"}]),
        step(7, StepKind.STEP, "prepare:0/stamp:0", 2,
             response=_done(run, "prepare:0/stamp:0", e + 2)),
        step(8, StepKind.STEP, "charge:0", 3, response=_done(run, "charge:0", e + 3)),
    ]  # fmt: skip


def _effect(id: int, run: uuid.UUID, key: str, kind: str, when: float) -> EffectRow:
    return EffectRow(id, run, key, kind, at(when))


def _calls(run: uuid.UUID) -> list[ModelCall]:
    return [
        ModelCall(
            request_id=f"req_{run.hex[-2:]}_{n}",
            messages=[{"role": "user", "content": prompt(TAGS[run], n)}],
            status=200,
            content=[{"type": "text", "text": f"a{n}"}],
            usage={"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
            received_at=at(4).timestamp(),
        )
        for n, usage in ((1, USAGE[run][0]), (2, USAGE[run][1]))
    ]


def _run(run: uuid.UUID, status: RunStatus, epoch: int) -> Any:
    u1, u2 = USAGE[run]
    usage = Usage(u1.input_tokens + u2.input_tokens, u1.output_tokens + u2.output_tokens)
    return make_run(
        id=run,
        agent=AGENT,
        status=status,
        input={"tag": TAGS[run]},
        tokens_used=usage.total,
        usage=usage,
        cost_usd=Decimal(0),
        lease_epoch=epoch,
    )


def good_evidence() -> Evidence:
    ok = [
        *_steps(OK, 1),
        make_step(9, StepKind.APPROVAL, run_id=OK, step_key="ship:0", lease_epoch=5,
                  response=_done(OK, "ship:0", 5), finished_at=at(12)),
    ]  # fmt: skip
    no = [
        *_steps(NO, 11),
        make_step(9, StepKind.APPROVAL, run_id=NO, step_key="ship:0", lease_epoch=4,
                  status=StepStatus.REJECTED, finished_at=at(10)),
        make_step(10, StepKind.COMPENSATION, run_id=NO, step_key="compensate:charge:0",
                  lease_epoch=5, finished_at=at(13)),
        make_step(11, StepKind.COMPENSATION, run_id=NO, step_key="compensate:prepare:0/note:0",
                  lease_epoch=6, finished_at=at(14)),
        make_step(12, StepKind.COMPENSATION, run_id=NO, step_key="compensate:reserve:0",
                  lease_epoch=7, finished_at=at(15)),
    ]  # fmt: skip
    effects = [
        _effect(1, OK, "reserve:0", "reserve", 0.7),
        _effect(2, OK, "prepare:0/note:0", "note", 2.7),
        _effect(3, OK, "prepare:0/stamp:0", "stamp", 6.7),
        _effect(4, OK, "charge:0", "charge", 7.7),
        _effect(5, OK, "ship:0", "ship", 11.7),
        _effect(11, NO, "reserve:0", "reserve", 0.7),
        _effect(12, NO, "prepare:0/note:0", "note", 2.7),
        _effect(13, NO, "prepare:0/stamp:0", "stamp", 6.7),
        _effect(14, NO, "charge:0", "charge", 7.7),
        _effect(15, NO, "compensate:charge:0", "refund", 12.7),
        _effect(16, NO, "compensate:prepare:0/note:0", "unnote", 13.7),
        _effect(17, NO, "compensate:reserve:0", "release", 14.7),
    ]
    return Evidence(
        runs=[_run(OK, RunStatus.SUCCEEDED, 6), _run(NO, RunStatus.FAILED, 8)],
        steps={OK: ok, NO: no},
        comments=[],
        calls=_calls(OK) + _calls(NO),
        faults=[],
        known_workers=frozenset({"worker-A", "worker-B"}),
        effects=effects,
        approvals=[
            ApprovalRow(APPROVAL[OK], OK, "ship:0", "APPROVED", "anonymous"),
            ApprovalRow(APPROVAL[NO], NO, "ship:0", "REJECTED", "anonymous"),
        ],
        audits=[
            AuditRow(OK, None, "cancel"),  # not a decision: ignored
            AuditRow(OK, APPROVAL[OK], "approve"),
            AuditRow(NO, APPROVAL[NO], "reject"),
        ],
        decisions=[
            Decision(APPROVAL[OK], OK, "approve", (("approve", 200), ("reject", 409))),
            Decision(APPROVAL[NO], NO, "reject", (("reject", 200),)),
        ],
    )


# -- mutations ----------------------------------------------------------------------------------


def change_step(ev: Evidence, run: uuid.UUID, key: str, **changes: Any) -> Evidence:
    steps = [dataclasses.replace(s, **changes) if s.step_key == key else s for s in ev.steps[run]]
    return dataclasses.replace(ev, steps={**ev.steps, run: steps})


def change_run(ev: Evidence, run: uuid.UUID, **changes: Any) -> Evidence:
    return dataclasses.replace(
        ev, runs=[dataclasses.replace(r, **changes) if r.id == run else r for r in ev.runs]
    )


def add_effect(ev: Evidence, run: uuid.UUID, key: str, kind: str) -> Evidence:
    row = EffectRow(100 + len(ev.effects), run, key, kind, at(1))
    return dataclasses.replace(ev, effects=[*ev.effects, row])


def drop_effect(ev: Evidence, run: uuid.UUID, key: str) -> Evidence:
    kept = [e for e in ev.effects if (e.run_id, e.key) != (run, key)]
    return dataclasses.replace(ev, effects=kept)


def extra_call(ev: Evidence, run: uuid.UUID) -> Evidence:
    call = dataclasses.replace(_calls(run)[1], request_id="req_repeat")
    return dataclasses.replace(ev, calls=[*ev.calls, call])


def hit(ev: Evidence, run: uuid.UUID) -> Evidence:
    fault = Fault("crash_point:after_model_response", "worker-C", 0.0, frozenset({run}))
    return dataclasses.replace(ev, faults=[fault])


def parked_on(ev: Evidence, key: str) -> Evidence:
    """The approved run stopped NEEDS_ATTENTION with ``key`` in doubt (and what followed it
    never ran)."""
    ev = change_run(ev, OK, status=RunStatus.NEEDS_ATTENTION)
    ev = change_step(ev, OK, key, status=StepStatus.STARTED, finished_at=None)
    if "/" in key:  # the open step around it was recorded PAUSED
        ev = change_step(ev, OK, key.rsplit("/", 1)[0], status=StepStatus.PAUSED)
    seq = next(s.seq for s in ev.steps[OK] if s.step_key == key)
    steps = [s for s in ev.steps[OK] if s.seq <= seq]
    later = {s.step_key for s in ev.steps[OK] if s.seq > seq}
    effects = [e for e in ev.effects if not (e.run_id == OK and e.key in later)]
    return dataclasses.replace(
        ev,
        steps={**ev.steps, OK: steps},
        effects=effects,
        approvals=[a for a in ev.approvals if a.run_id != OK],
        audits=[a for a in ev.audits if a.run_id != OK],
        decisions=[d for d in ev.decisions if d.run_id != OK],
    )


MUTATIONS: dict[str, tuple[Callable[[Evidence], Evidence], str]] = {
    "an idempotent step's effect twice": (
        lambda ev: add_effect(ev, OK, "reserve:0", "reserve"),
        checker.EFFECTS,
    ),
    "a non-idempotent nested step re-run after a crash": (
        lambda ev: add_effect(ev, OK, "prepare:0/stamp:0", "stamp"),
        checker.EFFECTS,
    ),
    "the approved action twice": (
        lambda ev: add_effect(ev, OK, "ship:0", "ship"),
        checker.EFFECTS,
    ),
    "a completed step without its effect": (
        lambda ev: drop_effect(ev, OK, "charge:0"),
        checker.EFFECTS,
    ),
    "an effect of a step never recorded": (
        lambda ev: add_effect(ev, OK, "charge:1", "charge"),
        checker.EFFECTS,
    ),
    "an in-doubt non-idempotent step with two effects": (
        lambda ev: add_effect(parked_on(ev, "charge:0"), OK, "charge:0", "charge"),
        checker.EFFECTS,
    ),
    "an effect after its step was recorded": (
        lambda ev: dataclasses.replace(
            drop_effect(ev, OK, "charge:0"),
            effects=[
                *drop_effect(ev, OK, "charge:0").effects,
                _effect(4, OK, "charge:0", "charge", 99),
            ],
        ),
        checker.EFFECTS,
    ),
    "a compensation in a run that succeeded": (
        lambda ev: add_effect(ev, OK, "compensate:reserve:0", "release"),
        checker.COMPENSATION,
    ),
    "a compensation twice": (
        lambda ev: add_effect(ev, NO, "compensate:reserve:0", "release"),
        checker.COMPENSATION,
    ),
    "a compensation before the failure": (
        lambda ev: change_step(
            change_step(ev, NO, "compensate:charge:0", seq=9), NO, "ship:0", seq=10
        ),
        checker.COMPENSATION,
    ),
    "a compensation with no failure at all": (
        lambda ev: change_step(ev, NO, "ship:0", status=StepStatus.DONE),
        checker.COMPENSATION,
    ),
    "a failed run leaving a completed step uncompensated": (
        lambda ev: change_step(
            drop_effect(ev, NO, "compensate:reserve:0"),
            NO,
            "compensate:reserve:0",
            status=StepStatus.STARTED,
        ),
        checker.COMPENSATION,
    ),
    "an approval decided twice": (
        lambda ev: dataclasses.replace(
            ev, audits=[*ev.audits, AuditRow(OK, APPROVAL[OK], "reject")]
        ),
        checker.APPROVALS,
    ),
    "an approval decided otherwise than the campaign decided": (
        lambda ev: dataclasses.replace(
            ev, decisions=[dataclasses.replace(ev.decisions[0], verb="reject"), ev.decisions[1]]
        ),
        checker.APPROVALS,
    ),
    "the opposite decision accepted afterwards": (
        lambda ev: dataclasses.replace(
            ev,
            decisions=[
                dataclasses.replace(ev.decisions[0], again=(("reject", 200),)),
                ev.decisions[1],
            ],
        ),
        checker.APPROVALS,
    ),
    "an approval left undecided": (
        lambda ev: dataclasses.replace(
            ev,
            approvals=[dataclasses.replace(ev.approvals[0], status="PENDING"), ev.approvals[1]],
        ),
        checker.APPROVALS,
    ),
    "a rejected action that ran": (
        lambda ev: change_step(
            add_effect(ev, NO, "ship:0", "ship"), NO, "ship:0", status=StepStatus.REJECTED
        ),
        checker.APPROVALS,
    ),
    "a repeated model call with no fault": (
        lambda ev: extra_call(ev, OK),
        checker.MODEL_REPEATS,
    ),
    "every recorded call made again after one crash": (
        lambda ev: hit(
            dataclasses.replace(
                ev,
                calls=[
                    *ev.calls,
                    *(
                        dataclasses.replace(c, request_id=c.request_id + "_again")
                        for c in _calls(OK)
                    ),
                ],
            ),
            OK,
        ),
        checker.MODEL_REPEATS,
    ),
    "billed tokens nowhere, with no fault": (
        lambda ev: extra_call(ev, OK),
        checker.BILLED,
    ),
    "unrecorded tokens that match no call": (
        lambda ev: change_run(hit(extra_call(ev, OK), OK), OK, unrecorded_tokens=5),
        checker.BILLED,
    ),
    "a call's tokens recorded twice": (
        lambda ev: change_run(ev, OK, unrecorded_tokens=310),
        checker.BILLED,
    ),
    "NEEDS_ATTENTION on an idempotent step": (
        lambda ev: parked_on(ev, "reserve:0"),
        checker.TERMINAL_OK,
    ),
    "two top-level steps under one claim": (
        lambda ev: change_step(ev, OK, "charge:0", lease_epoch=2),
        checker.FENCING,
    ),
    "a child written under a newer claim than its parent": (
        lambda ev: change_step(ev, OK, "prepare:0/note:0", lease_epoch=3),
        checker.FENCING,
    ),
    "a child in doubt inside a completed step": (
        lambda ev: change_step(ev, OK, "prepare:0/stamp:0", status=StepStatus.STARTED),
        checker.FENCING,
    ),
    "a token counter off": (
        lambda ev: change_run(ev, NO, tokens_used=1),
        checker.TOKENS,
    ),
}


def test_consistent_durable_runs_pass() -> None:
    assert check(good_evidence()) == []


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_planted_durable_violation_is_reported(name: str) -> None:
    mutate, invariant = MUTATIONS[name]
    violations = check(mutate(good_evidence()))
    assert invariant in {v.invariant for v in violations}, violations


def test_a_non_idempotent_step_in_doubt_may_park_the_run() -> None:
    for key in ("charge:0", "prepare:0/stamp:0"):
        assert check(parked_on(good_evidence(), key)) == [], key


def test_a_call_lost_with_its_worker_must_be_covered_by_its_estimate() -> None:
    """Issue 26.3: the call a crash cut (311 tokens) is counted by the run's next admission
    as an estimate, an upper bound; without it the checker reports the loss."""
    lost = hit(extra_call(good_evidence(), OK), OK)
    assert {v.invariant for v in check(lost)} == {"lost-calls-estimated"}
    for estimate in (311, 900):
        covered = change_run(
            lost, OK, unrecorded_tokens=estimate, unrecorded_estimated_tokens=estimate
        )
        assert check(covered) == [], estimate
    short = change_run(lost, OK, unrecorded_tokens=300, unrecorded_estimated_tokens=300)
    assert {v.invariant for v in check(short)} == {"lost-calls-estimated"}


def test_a_fenced_out_call_counted_as_unrecorded_passes() -> None:
    ev = change_run(hit(extra_call(good_evidence(), OK), OK), OK, unrecorded_tokens=311)
    assert check(ev) == []
