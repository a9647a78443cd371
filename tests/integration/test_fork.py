"""Forks of agent-loop runs on the real engine and PostgreSQL: steps before the fork point are
copied, never executed again; the fork pays only for what it executes; edits reach the model;
``replay_model`` answers unchanged requests from the original's recorded responses."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import text

from db.records import Dispatch, Run, RunStatus, Step, StepKind, StepOrigin
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.engine.fork import ForkRefused, ForkRequest, fork_run
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import ToolContext, tool
from tests.support import drive_to_end, register_agent, submit

TURNS = 4
"""Four tool turns and a final answer: a 9-step run."""


class Lookup:
    """A tool with an effect we can count: every execution is recorded with its run."""

    def __init__(self) -> None:
        self.effects: list[tuple[uuid.UUID, str]] = []
        self.changed: dict[int, str] = {}

        @tool
        def lookup(n: int, ctx: ToolContext) -> str:
            """Look n up."""
            self.effects.append((ctx.run_id, ctx.tool_use_id))
            return self.changed.get(n, f"value-{n}")

        self.tool = lookup

    def by(self, run_id: uuid.UUID) -> list[str]:
        return [use for rid, use in self.effects if rid == run_id]


@pytest.fixture
def lookup(runtime: Runtime) -> Lookup:
    t = Lookup()
    register_agent(runtime.agents, t.tool)
    return t


def script_turns(llm: ScriptedLlm, first_seq: int, prefix: str, tokens: int) -> int:
    """Script the model steps of a 9-step run from ``first_seq`` on (odd seqs are model
    steps); returns how many calls were scripted."""
    calls = 0
    for seq in range(first_seq, 2 * TURNS + 2):
        if seq % 2 == 0:
            continue
        turn = (seq + 1) // 2
        if turn <= TURNS:
            llm.then_tool_use(f"{prefix}{turn}", "lookup", {"n": turn}, tokens, tokens // 10)
        else:
            llm.then_text(f"{prefix} done", tokens, tokens // 10)
        calls += 1
    return calls


def nine_step_run(runtime: Runtime, llm: ScriptedLlm) -> Run:
    script_turns(llm, 1, "toolu_", 100)
    run, dispatch = submit(runtime.store)
    drive_to_end(runtime.driver(), dispatch)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert len(runtime.store.steps(run.id)) == 9
    return done


def fork(runtime: Runtime, source: uuid.UUID, **kwargs: Any) -> Run:
    run, _ = fork_run(
        runtime.store, runtime.agents, runtime.settings, source, ForkRequest(**kwargs)
    )
    return run


def drive(runtime: Runtime, run: Run) -> tuple[Run, list[Step]]:
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    return runtime.store.get_run(run.id), runtime.store.steps(run.id)


def test_a_fork_at_every_seq_repeats_no_effect_and_pays_only_for_itself(
    runtime: Runtime, llm: ScriptedLlm, lookup: Lookup
) -> None:
    original = nine_step_run(runtime, llm)
    original_steps = runtime.store.steps(original.id)
    original_requests = list(llm.requests)
    tool_rows = {s.seq: s.tool_use_id for s in original_steps if s.kind is StepKind.TOOL}

    for n in range(1, 11):  # every seq, and "after the last"
        before = len(llm.requests)
        calls = script_turns(llm, n if n % 2 else n + 1, f"f{n}_", 7)
        forked = fork(runtime, original.id, from_seq=n)
        assert forked.forked_from_run == original.id
        assert forked.forked_from_seq == n
        done, steps = drive(runtime, forked)
        assert done.status is RunStatus.SUCCEEDED, (n, done.error)
        assert len(llm.requests) - before == calls, f"fork at {n}: one call per model step >= N"

        copied = [s for s in steps if s.seq < n]
        own = [s for s in steps if s.seq >= n]
        assert [s.origin for s in copied] == [StepOrigin.COPIED] * (n - 1)
        assert all(s.origin is None for s in own)
        # No tool before N ran again; each tool at or after N ran exactly once, in the fork.
        executed = lookup.by(forked.id)
        assert sorted(executed) == sorted(s.tool_use_id or "" for s in own if s.tool_name)
        assert not {tool_rows[seq] for seq in tool_rows if seq < n} & set(executed), n
        # The fork's tokens are only its own; the copies' cost is kept apart.
        assert done.tokens_used == sum(s.usage.total for s in own) == 7 * calls
        assert all(s.usage.total == 0 and s.cost_usd == 0 for s in copied)
        assert [s.original_tokens for s in copied] == [
            s.usage.total for s in original_steps[: n - 1]
        ]
        # Its history is exactly the original's: the first request it makes is the
        # original's request for the same turn (the tool is deterministic).
        if calls and n <= 9:
            turn = (n - 1) // 2 if n % 2 else n // 2
            assert llm.requests[before].messages == original_requests[turn].messages

    assert len(lookup.by(original.id)) == TURNS, "the original's effects happened once"
    assert runtime.store.get_run(original.id).tokens_used == original.tokens_used


def test_an_edited_tool_result_is_what_the_model_sees(
    runtime: Runtime, llm: ScriptedLlm, lookup: Lookup
) -> None:
    original = nine_step_run(runtime, llm)
    before = len(llm.requests)
    llm.then_text("saw the edit")
    forked = fork(runtime, original.id, from_seq=9, tool_result=(8, {"n": 4, "value": "EDITED"}))
    done, steps = drive(runtime, forked)
    assert done.status is RunStatus.SUCCEEDED
    assert done.result == "saw the edit"
    (request,) = llm.requests[before:]
    last = request.messages[-1]["content"][0]
    assert last == {
        "type": "tool_result",
        "tool_use_id": "toolu_4",
        "content": '{"n": 4, "value": "EDITED"}',
    }
    assert steps[7].origin is StepOrigin.EDITED
    assert steps[7].response == '{"n": 4, "value": "EDITED"}'
    assert lookup.by(forked.id) == [], "no tool ran: the edit replaced its result"
    assert runtime.store.steps(original.id)[7].response == "value-4", "the original is intact"


def test_replay_model_on_an_unchanged_fork_makes_no_model_call(
    runtime: Runtime, llm: ScriptedLlm, lookup: Lookup
) -> None:
    original = nine_step_run(runtime, llm)
    before = len(llm.requests)
    forked = fork(runtime, original.id, from_seq=1, replay_model=True)
    done, steps = drive(runtime, forked)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert len(llm.requests) == before, "every answer came from the recording"
    assert done.result == original.result
    assert done.tokens_used == 0
    assert done.cost_usd == 0
    models = [s for s in steps if s.kind is StepKind.MODEL]
    assert [s.origin for s in models] == [StepOrigin.REPLAYED] * 5
    assert [s.original_tokens for s in models] == [110] * 5
    assert len(lookup.by(forked.id)) == TURNS, "tools from the fork point run again"


def test_replay_model_calls_the_model_from_the_first_request_that_differs(
    runtime: Runtime, llm: ScriptedLlm, lookup: Lookup
) -> None:
    original = nine_step_run(runtime, llm)
    lookup.changed[2] = "a different value"  # the second tool's answer changes in the fork
    before = len(llm.requests)
    calls = script_turns(llm, 5, "new_", 7)
    forked = fork(runtime, original.id, from_seq=1, replay_model=True)
    done, steps = drive(runtime, forked)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert len(llm.requests) - before == calls == 3
    assert [s.origin for s in steps if s.kind is StepKind.MODEL] == [
        StepOrigin.REPLAYED,
        StepOrigin.REPLAYED,
        None,
        None,
        None,
    ]
    assert done.tokens_used == sum(s.usage.total for s in steps) == 3 * 7


def test_replay_model_with_another_model_calls_it(
    runtime: Runtime, llm: ScriptedLlm, lookup: Lookup
) -> None:
    original = nine_step_run(runtime, llm)
    before = len(llm.requests)
    llm.then_text("other model")
    forked = fork(runtime, original.id, from_seq=9, replay_model=True, model="claude-haiku-4-5")
    done, _ = drive(runtime, forked)
    assert done.status is RunStatus.SUCCEEDED
    assert done.model == "claude-haiku-4-5"
    (request,) = llm.requests[before:]
    assert request.model == "claude-haiku-4-5"


def test_a_fork_with_another_input_starts_over_from_it(
    runtime: Runtime, llm: ScriptedLlm, lookup: Lookup
) -> None:
    original = nine_step_run(runtime, llm)
    llm.then_text("a new answer")
    forked = fork(runtime, original.id, from_seq=1, input="find y instead")
    done, _ = drive(runtime, forked)
    assert done.input == "find y instead"
    assert llm.requests[-1].messages == [{"role": "user", "content": "find y instead"}]


def test_a_running_run_forks_from_a_completed_step_only(
    runtime: Runtime, llm: ScriptedLlm, lookup: Lookup
) -> None:
    llm.then_tool_use("toolu_1", "lookup", {"n": 1}, 100, 10)  # the original's first turn
    run, dispatch = submit(runtime.store)
    driver = runtime.driver()
    first = driver.drive(dispatch.run_id, dispatch.token)  # seq 1 (model) done
    assert first.dispatch is not None
    second = driver.drive(run.id, first.dispatch.token)  # seq 2 (tool) done
    assert second.outcome is Outcome.CONTINUE
    assert runtime.store.get_run(run.id).status is RunStatus.RUNNING

    # A tool step in flight (STARTED) is not copied: forking after it is refused.
    with runtime.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO run_step (run_id, seq, step_key, kind, status, lease_epoch) "
                "VALUES (:id, 3, 'tool:in-flight', 'TOOL', 'STARTED', 1)"
            ),
            {"id": run.id},
        )
    with pytest.raises(ForkRefused) as refused:
        fork(runtime, run.id, from_seq=4)
    assert refused.value.field == "fromSeq"
    assert refused.value.conflict
    assert "step 3 (tool:in-flight) " in str(refused.value)
    assert "is STARTED, not completed" in str(refused.value)
    with runtime.engine.begin() as conn:
        conn.execute(text("DELETE FROM run_step WHERE run_id = :id AND seq = 3"), {"id": run.id})

    llm_before = len(llm.requests)
    calls = script_turns(llm, 3, "f_", 7)
    forked = fork(runtime, run.id, from_seq=3)
    done, steps = drive(runtime, forked)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert len(llm.requests) - llm_before == calls
    assert [s.origin for s in steps[:2]] == [StepOrigin.COPIED] * 2
    assert lookup.by(forked.id) == ["f_2", "f_3", "f_4"]
    # The original goes on, untouched by its fork.
    script_turns(llm, 3, "toolu_", 100)
    assert second.dispatch is not None
    drive_to_end(driver, second.dispatch)
    rest = runtime.store.get_run(run.id)
    assert rest.status is RunStatus.SUCCEEDED
    assert lookup.by(run.id) == [f"toolu_{k}" for k in range(1, TURNS + 1)]


def test_bad_fork_points_and_edits_name_the_field(
    runtime: Runtime, llm: ScriptedLlm, lookup: Lookup
) -> None:
    original = nine_step_run(runtime, llm)
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"from_seq": 11}, "fromSeq", "fromSeq must be from 1 to 10 (got 11)"),
        ({"from_seq": 0}, "fromSeq", "fromSeq must be from 1 to 10"),
        ({"from_seq": 5, "tool_result": (6, "x")}, "toolResult", "seq 6 is not a copied step"),
        ({"from_seq": 5, "tool_result": (3, "x")}, "toolResult", "is of kind MODEL"),
        ({"from_seq": 5, "input": "  "}, "input", "must be a non-empty string"),
    ]
    for kwargs, field, message in cases:
        with pytest.raises(ForkRefused) as refused:
            fork(runtime, original.id, **kwargs)
        assert refused.value.field == field
        assert message in str(refused.value)
        assert not refused.value.conflict
    runtime.settings = replace(runtime.settings, max_input_chars=5)
    with pytest.raises(ForkRefused, match="input: is 6 characters; the limit is 5"):
        fork(runtime, original.id, from_seq=1, input="abcdef")
    assert len(runtime.store.list_runs()) == 1, "a refused fork creates nothing"
