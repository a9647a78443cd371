"""The guard (seed 000, invariant 6): cancellation, deadline, token budget, step cap."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from db.records import Run, RunStatus, Usage
from runtime.pipeline.guard import Stop, guard

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


def make_run(**overrides: Any) -> Run:
    fields: dict[str, Any] = {
        "id": uuid.UUID("00000000-0000-4000-8000-000000000002"),
        "agent": "acme-tickets",
        "status": RunStatus.RUNNING,
        "input": "Which acme tickets are overdue?",
        "model": "claude-sonnet-4-5",
        "max_steps": 50,
        "token_budget": 10_000,
        "tokens_used": 0,
        "usage": Usage(),
        "cost_usd": Decimal(0),
        "cost_budget_usd": None,
        "unrecorded_tokens": 0,
        "unrecorded_cost_usd": Decimal(0),
        "deadline_at": NOW + timedelta(minutes=5),
        "run_at": NOW,
        "wait_reason": None,
        "locked_by": "worker-A",
        "locked_until": NOW + timedelta(seconds=15),
        "lease_epoch": 1,
        "dispatch_token": uuid.UUID("00000000-0000-4000-8000-000000000003"),
        "claims_without_progress": 1,
        "cancel_requested": False,
        "result": None,
        "error": None,
        "submitted_by": None,
        "created_at": NOW - timedelta(minutes=1),
        "updated_at": NOW,
        "finished_at": None,
    }
    fields.update(overrides)
    # Fields added to the record later, which the guard does not read: a neutral value.
    neutral = {"int": 0, "Decimal": Decimal(0), "str": "", "bool": False}
    for f in dataclasses.fields(Run):
        if f.name not in fields:
            kind = str(f.type)
            fields[f.name] = None if "None" in kind else neutral[kind]
    return Run(**fields)


@pytest.mark.parametrize("next_is_model", [True, False])
def test_a_healthy_run_continues(next_is_model: bool) -> None:
    run = make_run(tokens_used=9_999, max_steps=50)
    assert guard(run, now=NOW, steps_taken=49, next_is_model=next_is_model) is None


@pytest.mark.parametrize("next_is_model", [True, False])
def test_cancellation_stops_any_step(next_is_model: bool) -> None:
    stop = guard(
        make_run(cancel_requested=True), now=NOW, steps_taken=3, next_is_model=next_is_model
    )
    assert stop == Stop(RunStatus.CANCELLED, "cancelled by request")


@pytest.mark.parametrize("next_is_model", [True, False])
def test_the_deadline_stops_any_step(next_is_model: bool) -> None:
    run = make_run(deadline_at=NOW)
    stop = guard(run, now=NOW, steps_taken=3, next_is_model=next_is_model)
    assert stop is not None
    assert stop.status is RunStatus.TIMED_OUT
    assert "deadline" in stop.reason
    late = guard(run, now=NOW + timedelta(seconds=1), steps_taken=3, next_is_model=next_is_model)
    assert late is not None
    assert late.status is RunStatus.TIMED_OUT
    early = guard(
        run, now=NOW - timedelta(microseconds=1), steps_taken=3, next_is_model=next_is_model
    )
    assert early is None


def test_token_budget_stops_a_model_step_once_spent() -> None:
    at_budget = make_run(token_budget=1_000, tokens_used=1_000)
    stop = guard(at_budget, now=NOW, steps_taken=4, next_is_model=True)
    assert stop is not None
    assert stop.status is RunStatus.FAILED
    assert "token budget" in stop.reason
    assert "1000 of 1000" in stop.reason
    over = make_run(token_budget=1_000, tokens_used=1_450)
    stop = guard(over, now=NOW, steps_taken=4, next_is_model=True)
    assert stop is not None
    assert stop.status is RunStatus.FAILED
    under = make_run(token_budget=1_000, tokens_used=999)
    assert guard(under, now=NOW, steps_taken=4, next_is_model=True) is None


def test_unrecorded_tokens_count_against_the_budget() -> None:
    # A billed model call whose checkpoint was refused is still money spent.
    run = make_run(token_budget=1_000, tokens_used=600, unrecorded_tokens=400)
    stop = guard(run, now=NOW, steps_taken=2, next_is_model=True)
    assert stop is not None
    assert stop.status is RunStatus.FAILED
    assert "1000 of 1000" in stop.reason
    assert (
        guard(
            make_run(token_budget=1_000, tokens_used=600, unrecorded_tokens=399),
            now=NOW,
            steps_taken=2,
            next_is_model=True,
        )
        is None
    )


def test_cost_budget_stops_a_model_step_once_spent() -> None:
    run = make_run(cost_budget_usd=Decimal("0.50"), cost_usd=Decimal("0.50"))
    stop = guard(run, now=NOW, steps_taken=2, next_is_model=True)
    assert stop is not None
    assert stop.status is RunStatus.FAILED
    assert "cost budget" in stop.reason
    assert guard(run, now=NOW, steps_taken=2, next_is_model=False) is None
    partly_unrecorded = make_run(
        cost_budget_usd=Decimal("0.50"),
        cost_usd=Decimal("0.30"),
        unrecorded_cost_usd=Decimal("0.20"),
    )
    stop = guard(partly_unrecorded, now=NOW, steps_taken=2, next_is_model=True)
    assert stop is not None
    assert stop.status is RunStatus.FAILED
    under = make_run(cost_budget_usd=Decimal("0.50"), cost_usd=Decimal("0.4999"))
    assert guard(under, now=NOW, steps_taken=2, next_is_model=True) is None


def test_no_cost_budget_means_no_cost_limit() -> None:
    run = make_run(cost_budget_usd=None, cost_usd=Decimal("1000"))
    assert guard(run, now=NOW, steps_taken=2, next_is_model=True) is None


def test_step_cap_stops_a_model_step() -> None:
    run = make_run(max_steps=6)
    stop = guard(run, now=NOW, steps_taken=6, next_is_model=True)
    assert stop is not None
    assert stop.status is RunStatus.FAILED
    assert "step cap" in stop.reason
    assert "maxSteps 6" in stop.reason
    assert guard(run, now=NOW, steps_taken=5, next_is_model=True) is None


def test_budget_and_cap_are_checked_only_before_model_steps() -> None:
    # A tool step spends no tokens: the tools of the turn that crossed the budget still
    # run, so the model's tool_use blocks get their results in the log.
    spent = make_run(token_budget=1_000, tokens_used=5_000, max_steps=3)
    assert guard(spent, now=NOW, steps_taken=10, next_is_model=False) is None
    stop = guard(spent, now=NOW, steps_taken=10, next_is_model=True)
    assert stop is not None
    assert stop.status is RunStatus.FAILED


def test_cancellation_wins_over_every_other_reason() -> None:
    run = make_run(
        cancel_requested=True,
        deadline_at=NOW - timedelta(seconds=1),
        token_budget=10,
        tokens_used=50,
        max_steps=1,
    )
    stop = guard(run, now=NOW, steps_taken=5, next_is_model=True)
    assert stop is not None
    assert stop.status is RunStatus.CANCELLED


def test_the_deadline_wins_over_budget_and_cap() -> None:
    run = make_run(
        deadline_at=NOW - timedelta(seconds=1), token_budget=10, tokens_used=50, max_steps=1
    )
    stop = guard(run, now=NOW, steps_taken=5, next_is_model=True)
    assert stop is not None
    assert stop.status is RunStatus.TIMED_OUT


def simulate(
    run: Run, turns: list[tuple[int, int]], *, now: datetime = NOW
) -> tuple[Run, list[str], Stop | None]:
    """Drive the guard the way the driver does, one step at a time: each turn is a model
    step spending ``tokens`` followed by ``tools`` tool steps (which spend nothing).
    Returns the run after the last step, the kinds of steps executed, and the stop."""
    executed: list[str] = []
    plan: list[tuple[str, int]] = []
    for tokens, tools in turns:
        plan.append(("MODEL", tokens))
        plan.extend([("TOOL", 0)] * tools)
    for kind, tokens in plan:
        stop = guard(run, now=now, steps_taken=len(executed), next_is_model=kind == "MODEL")
        if stop is not None:
            return run, executed, stop
        executed.append(kind)
        run = dataclasses.replace(run, tokens_used=run.tokens_used + tokens)
    return run, executed, None


def test_overshoot_is_at_most_one_model_step() -> None:
    # Budget 1000; each turn spends 300 tokens in its model step and runs one tool.
    run = make_run(token_budget=1_000, max_steps=1_000)
    final, executed, stop = simulate(run, [(300, 1)] * 10)
    assert stop is not None
    assert stop.status is RunStatus.FAILED
    # Model steps 1-3 leave 900 used; step 4 (started under budget) crosses to 1200;
    # its tool still runs; the fifth model step is refused.
    assert executed == ["MODEL", "TOOL"] * 4
    assert final.tokens_used == 1_200
    assert final.tokens_used - final.token_budget < 300, "overshoot is under one model step"


@pytest.mark.parametrize(
    ("budget", "spend"),
    [(1_000, 300), (1_000, 1_000), (1_000, 999), (1_000, 5_000), (50_000, 2_226), (1, 1)],
)
def test_the_run_stops_at_the_first_model_step_after_the_budget_is_crossed(
    budget: int, spend: int
) -> None:
    run = make_run(token_budget=budget, max_steps=10_000)
    final, executed, stop = simulate(run, [(spend, 2)] * 100)
    assert stop is not None
    assert stop.status is RunStatus.FAILED
    model_steps = executed.count("MODEL")
    # Every executed model step started under budget...
    assert (model_steps - 1) * spend < budget
    # ...and the refused one was the first to start at or over it.
    assert model_steps * spend >= budget
    assert final.tokens_used == model_steps * spend
    assert final.tokens_used - budget < spend
    assert executed[-1] == "TOOL", "the tools of the crossing turn still ran"


def test_step_cap_overshoot_is_bounded_by_the_tools_of_one_turn() -> None:
    run = make_run(max_steps=5, token_budget=10**9)
    _, executed, stop = simulate(run, [(10, 3)] * 10)
    assert stop is not None
    assert stop.status is RunStatus.FAILED
    assert "step cap" in stop.reason
    # turn 1 is steps 1-4, turn 2 starts at step 5 (4 taken < 5) and runs its 3 tools;
    # the third model step would be step 9 and is refused.
    assert executed == ["MODEL", "TOOL", "TOOL", "TOOL"] * 2


def test_cost_overshoot_is_at_most_one_model_step() -> None:
    run = make_run(cost_budget_usd=Decimal("0.50"), token_budget=10**9, max_steps=10**6)
    per_step = Decimal("0.12")
    calls = 0
    for _ in range(100):
        if guard(run, now=NOW, steps_taken=calls, next_is_model=True) is not None:
            break
        calls += 1
        run = dataclasses.replace(run, cost_usd=run.cost_usd + per_step)
    else:
        raise AssertionError("the cost budget never stopped the run")
    assert calls == 5, "0.00, 0.12, 0.24, 0.36 and 0.48 start under $0.50; 0.60 does not"
    assert run.cost_usd == Decimal("0.60")
    assert run.cost_budget_usd is not None
    assert run.cost_usd - run.cost_budget_usd < per_step
