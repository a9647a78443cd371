"""Replay (seed 000): the conversation rebuilt from the ordered step rows, no database."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from db.records import Step, StepKind, StepStatus, Usage
from runtime.pipeline.replay import ReplayCache, model_step_key, replay, tool_step_key

RUN_ID = uuid.UUID("00000000-0000-4000-8000-000000000001")
T0 = datetime(2025, 1, 1, tzinfo=UTC)
QUESTION = "Which acme tickets are overdue?"


def _with_neutral_defaults(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """Fill fields this test does not care about (added to the record later) with a neutral
    value for their type: None when optional, else zero."""
    neutral = {"int": 0, "Decimal": Decimal(0), "str": "", "bool": False}
    out = dict(values)
    for f in dataclasses.fields(cls):
        if f.name not in out:
            kind = str(f.type)
            out[f.name] = None if "None" in kind else neutral[kind]
    return out


class Log:
    """Builds the step rows of one run as the driver writes them: seq 1, 2, 3, ..."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.turns = 0

    def _add(self, **fields: Any) -> Step:
        base: dict[str, Any] = {
            "run_id": RUN_ID,
            "seq": len(self.steps) + 1,
            "tool_name": None,
            "tool_use_id": None,
            "model": None,
            "prompt_hash": None,
            "response": None,
            "stop_reason": None,
            "usage": Usage(),
            "cost_usd": Decimal(0),
            "latency_ms": None,
            "request_id": None,
            "error": None,
            "worker": "worker-A",
            "lease_epoch": 1,
            "started_at": T0,
            "finished_at": None,
        }
        base.update(fields)
        step = Step(**_with_neutral_defaults(Step, base))
        self.steps.append(step)
        return step

    def model(self, content: list[dict[str, Any]], stop_reason: str | None) -> Step:
        self.turns += 1
        return self._add(
            step_key=model_step_key(self.turns),
            kind=StepKind.MODEL,
            status=StepStatus.DONE,
            model="claude-sonnet-4-5",
            response=content,
            stop_reason=stop_reason,
            usage=Usage(100, 20),
            latency_ms=1200,
            finished_at=T0,
        )

    def tool(
        self,
        tool_use_id: str,
        name: str,
        status: StepStatus = StepStatus.DONE,
        output: Any = "ok",
    ) -> Step:
        finished = status is not StepStatus.STARTED
        return self._add(
            step_key=tool_step_key(tool_use_id),
            kind=StepKind.TOOL,
            status=status,
            tool_name=name,
            tool_use_id=tool_use_id,
            response=output if finished else None,
            error=output if status is StepStatus.ERROR else None,
            latency_ms=41 if finished else None,
            finished_at=T0 if finished else None,
        )


def use(tool_use_id: str, name: str = "list_tickets", **tool_input: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id, "name": name, "input": tool_input}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def result(tool_use_id: str, content: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content}


def test_no_steps_is_just_the_user_input() -> None:
    c = replay(QUESTION, [])
    assert c.messages == [{"role": "user", "content": QUESTION}]
    assert c.pending == []
    assert c.stop_reason is None
    assert c.model_turns == 0
    assert not c.finished
    assert c.final_text is None


def test_first_message_is_the_user_input_then_the_assistant_turn() -> None:
    log = Log()
    log.model([text("Let me look."), use("toolu_1", status="open")], "tool_use")
    c = replay(QUESTION, log.steps)
    assert c.messages[0] == {"role": "user", "content": QUESTION}
    assert c.messages[1]["role"] == "assistant"
    assert len(c.messages) == 2


def test_assistant_content_blocks_are_kept_exactly_as_returned() -> None:
    # Blocks the runtime does not interpret (thinking with its signature, citations,
    # server tools) must go back byte for byte, in their order.
    content = [
        {"type": "thinking", "thinking": "The user wants overdue tickets.", "signature": "EqQB"},
        {"type": "redacted_thinking", "data": "c2VjcmV0"},
        {
            "type": "text",
            "text": "Checking the tickets.",
            "citations": [{"type": "char_location", "cited_text": "x", "start_char_index": 0}],
        },
        {"type": "tool_use", "id": "toolu_1", "name": "list_tickets", "input": {"overdue": True}},
    ]
    original = copy.deepcopy(content)
    log = Log()
    log.model(content, "tool_use")
    log.tool("toolu_1", "list_tickets", output="[]")
    c = replay(QUESTION, log.steps)
    assert c.messages[1] == {"role": "assistant", "content": original}
    assert content == original, "replay must not modify the stored response"


def test_one_tool_turn_then_the_final_answer() -> None:
    log = Log()
    log.model([use("toolu_1", overdue=True)], "tool_use")
    log.tool("toolu_1", "list_tickets", output='[{"id": 101}]')
    log.model([text("Ticket 101 is overdue.")], "end_turn")
    c = replay(QUESTION, log.steps)
    assert c.messages == [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [use("toolu_1", overdue=True)]},
        {"role": "user", "content": [result("toolu_1", '[{"id": 101}]')]},
        {"role": "assistant", "content": [text("Ticket 101 is overdue.")]},
    ]
    assert c.finished
    assert c.pending == []
    assert c.stop_reason == "end_turn"
    assert c.final_text == "Ticket 101 is overdue."
    assert c.model_turns == 2


def test_final_text_joins_the_text_blocks_of_the_last_turn_only() -> None:
    log = Log()
    log.model([text("Looking."), use("toolu_1")], "tool_use")
    log.tool("toolu_1", "list_tickets")
    log.model(
        [text("Two are "), {"type": "thinking", "thinking": "t"}, text("overdue.")], "end_turn"
    )
    c = replay(QUESTION, log.steps)
    assert c.finished
    assert c.final_text == "Two are overdue."


def test_not_finished_after_tool_use_with_all_results_in() -> None:
    log = Log()
    log.model([use("toolu_1")], "tool_use")
    log.tool("toolu_1", "list_tickets")
    c = replay(QUESTION, log.steps)
    assert not c.finished
    assert c.pending == []
    assert c.stop_reason == "tool_use"
    assert c.final_text is None
    # The next work is a model call: the conversation ends with the results.
    assert c.messages[-1] == {"role": "user", "content": [result("toolu_1", "ok")]}


def test_not_finished_while_a_tool_is_pending() -> None:
    log = Log()
    log.model([use("toolu_1")], "tool_use")
    c = replay(QUESTION, log.steps)
    assert not c.finished
    assert c.pending == [use("toolu_1")]
    assert c.final_text is None
    assert c.messages[-1]["role"] == "assistant"


@pytest.mark.parametrize("n", [2, 3])
def test_parallel_results_of_one_turn_form_one_user_message_in_the_order_run(n: int) -> None:
    ids = [f"toolu_{i}" for i in range(1, n + 1)]
    log = Log()
    log.model([text("Checking several things.")] + [use(i) for i in ids], "tool_use")
    ran = list(reversed(ids))  # the tools ran in a different order than requested
    for i in ran:
        log.tool(i, "list_tickets", output=f"out-{i}")
    log.model([text("Done.")], "end_turn")
    c = replay(QUESTION, log.steps)
    user_messages = [m for m in c.messages[1:] if m["role"] == "user"]
    assert len(user_messages) == 1, "all results of one turn go in ONE user message"
    assert c.messages[2] == {"role": "user", "content": [result(i, f"out-{i}") for i in ran]}
    assert [m["role"] for m in c.messages] == ["user", "assistant", "user", "assistant"]
    assert c.finished


def test_each_turn_gets_its_own_user_message() -> None:
    log = Log()
    log.model([use("toolu_1"), use("toolu_2")], "tool_use")
    log.tool("toolu_1", "list_tickets", output="a")
    log.tool("toolu_2", "list_tickets", output="b")
    log.model([use("toolu_3")], "tool_use")
    log.tool("toolu_3", "list_tickets", output="c")
    c = replay(QUESTION, log.steps)
    assert [m["role"] for m in c.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert c.messages[2]["content"] == [result("toolu_1", "a"), result("toolu_2", "b")]
    assert c.messages[4]["content"] == [result("toolu_3", "c")]
    assert c.model_turns == 2


@pytest.mark.parametrize("n", [2, 3])
def test_results_are_flushed_only_once_every_tool_use_has_one(n: int) -> None:
    ids = [f"toolu_{i}" for i in range(1, n + 1)]
    log = Log()
    log.model([use(i) for i in ids], "tool_use")
    for done, i in enumerate(ids[:-1], start=1):
        log.tool(i, "list_tickets", output=f"out-{i}")
        c = replay(QUESTION, log.steps)
        assert len(c.messages) == 2, f"no partial user message after {done} of {n} results"
        assert c.messages[-1]["role"] == "assistant"
        assert c.pending == [use(j) for j in ids[done:]]
    log.tool(ids[-1], "list_tickets", output=f"out-{ids[-1]}")
    c = replay(QUESTION, log.steps)
    assert c.pending == []
    assert c.messages[-1] == {"role": "user", "content": [result(i, f"out-{i}") for i in ids]}


@pytest.mark.parametrize(
    ("uses", "finished_first"),
    [
        (["toolu_a", "toolu_b"], "toolu_a"),
        (["toolu_a", "toolu_b"], "toolu_b"),
        (["toolu_a", "toolu_b", "toolu_c"], "toolu_b"),
    ],
)
def test_a_started_tool_is_pending_and_no_partial_message_is_emitted(
    uses: list[str], finished_first: str
) -> None:
    log = Log()
    log.model([text("Parallel calls."), *[use(u) for u in uses]], "tool_use")
    log.tool(finished_first, "list_tickets", output="first")
    started = next(u for u in uses if u != finished_first)
    log.tool(started, "list_tickets", status=StepStatus.STARTED)  # the worker died here
    c = replay(QUESTION, log.steps)
    unfinished = [u for u in uses if u != finished_first]
    assert [p["id"] for p in c.pending] == unfinished
    assert c.pending[0]["id"] == started, "the STARTED tool is the next work"
    assert c.pending[0] == use(started)
    assert len(c.messages) == 2
    assert c.messages[-1]["role"] == "assistant"
    assert all(not (m["role"] == "user" and isinstance(m["content"], list)) for m in c.messages), (
        "no tool_result may be sent before every tool_use of the turn has one"
    )
    assert not c.finished


def test_an_error_tool_step_is_a_result_with_is_error_true() -> None:
    log = Log()
    log.model([use("toolu_1"), use("toolu_2", name="missing")], "tool_use")
    log.tool("toolu_1", "list_tickets", output="fine")
    log.tool("toolu_2", "missing", status=StepStatus.ERROR, output="error: unknown tool")
    c = replay(QUESTION, log.steps)
    ok, failed = c.messages[2]["content"]
    assert failed == {
        "type": "tool_result",
        "tool_use_id": "toolu_2",
        "content": "error: unknown tool",
        "is_error": True,
    }
    assert ok["tool_use_id"] == "toolu_1"
    assert ok.get("is_error", False) is False


def test_a_tool_result_without_output_has_empty_content() -> None:
    log = Log()
    log.model([use("toolu_1")], "tool_use")
    log.tool("toolu_1", "list_tickets", output=None)
    c = replay(QUESTION, log.steps)
    assert c.messages[2]["content"] == [result("toolu_1", "")]


def test_every_tool_result_follows_its_tool_use() -> None:
    log = Log()
    log.model([use("toolu_1"), use("toolu_2")], "tool_use")
    log.tool("toolu_2", "list_tickets")
    log.tool("toolu_1", "list_tickets")
    log.model([use("toolu_3")], "tool_use")
    log.tool("toolu_3", "list_tickets")
    log.model([text("done")], "end_turn")
    c = replay(QUESTION, log.steps)
    # The Messages API rule: each user message of tool_results answers exactly the
    # tool_use blocks of the assistant message just before it.
    for prev, msg in itertools.pairwise(c.messages):
        if msg["role"] == "user" and isinstance(msg["content"], list):
            asked = {b["id"] for b in prev["content"] if b["type"] == "tool_use"}
            answered = {b["tool_use_id"] for b in msg["content"]}
            assert prev["role"] == "assistant"
            assert asked == answered
    roles = [m["role"] for m in c.messages]
    assert all(a != b for a, b in itertools.pairwise(roles)), "roles alternate"


def test_step_keys_are_deterministic() -> None:
    assert model_step_key(1) == "model:1"
    assert model_step_key(7) == "model:7"
    assert tool_step_key("toolu_01Ab") == "tool:toolu_01Ab"
    assert model_step_key(1) != model_step_key(2)
    assert tool_step_key("toolu_1") != model_step_key(1)


def test_model_turns_counts_model_steps_so_the_next_key_is_stable() -> None:
    log = Log()
    log.model([use("toolu_1"), use("toolu_2")], "tool_use")
    log.tool("toolu_1", "list_tickets")
    log.tool("toolu_2", "list_tickets")
    log.model([use("toolu_3")], "tool_use")
    log.tool("toolu_3", "list_tickets")
    c = replay(QUESTION, log.steps)
    assert c.model_turns == 2
    # The driver keys its next model step with the following turn: replaying the same log
    # again gives the same key, so a repeated attempt lands on the same row.
    assert model_step_key(c.model_turns + 1) == "model:3"
    assert replay(QUESTION, log.steps).model_turns == 2
    assert [s.step_key for s in log.steps] == [
        "model:1",
        "tool:toolu_1",
        "tool:toolu_2",
        "model:2",
        "tool:toolu_3",
    ]


def test_replay_is_a_pure_function_of_the_log() -> None:
    log = Log()
    log.model([use("toolu_1")], "tool_use")
    log.tool("toolu_1", "list_tickets", output="x")
    log.model([text("answer")], "end_turn")
    first = replay(QUESTION, log.steps)
    second = replay(QUESTION, log.steps)
    assert first == second
    assert first.messages[-1] == {"role": "assistant", "content": [text("answer")]}


@pytest.mark.parametrize("stop", ["end_turn", "stop_sequence"])
def test_finished_only_after_a_finishing_stop(stop: str) -> None:
    log = Log()
    log.model([text("The answer.")], stop)
    c = replay(QUESTION, log.steps)
    assert c.finished
    assert c.final_text == "The answer."


@pytest.mark.parametrize("stop", ["tool_use", "pause_turn", "max_tokens", "refusal"])
def test_not_finished_after_any_other_stop(stop: str) -> None:
    log = Log()
    log.model([text("Partial")], stop)
    c = replay(QUESTION, log.steps)
    assert not c.finished
    assert c.final_text is None
    assert c.stop_reason == stop


def test_a_paused_turn_is_continued_in_the_same_assistant_message() -> None:
    first = [
        text("Searching."),
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
    ]
    second = [text(" Found it.")]
    log = Log()
    log.model(first, "pause_turn")
    paused = replay(QUESTION, log.steps)
    assert paused.pending == []
    assert paused.messages[-1] == {"role": "assistant", "content": first}
    log.model(second, "end_turn")
    c = replay(QUESTION, log.steps)
    assert c.messages == [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first + second},
    ]
    assert c.finished
    assert c.final_text == "Searching. Found it."
    assert c.model_turns == 2
    assert first == [
        text("Searching."),
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
    ], "the stored response is not modified by the merge"


def test_a_tool_use_cut_off_by_max_tokens_is_never_pending() -> None:
    log = Log()
    log.model([text("I will look"), use("toolu_cut", status="op")], "max_tokens")
    c = replay(QUESTION, log.steps)
    assert c.pending == [], "a truncated tool call is not executed"
    assert not c.finished
    assert c.last_turn_has_tool_use


def test_last_turn_has_tool_use() -> None:
    log = Log()
    log.model([text("Only words.")], "max_tokens")
    assert not replay(QUESTION, log.steps).last_turn_has_tool_use
    log2 = Log()
    log2.model([use("toolu_1")], "tool_use")
    log2.tool("toolu_1", "list_tickets")
    assert not replay(QUESTION, log2.steps).last_turn_has_tool_use, "the results came after"


# -- the per-process cache: a step replays only its new rows -----------------------------


def _long_log() -> Log:
    """Every kind of row in turn: parallel tools, a tool that is STARTED then DONE (the row
    replaced under its key), an error, a paused turn continued, the final answer."""
    log = Log()
    log.model([use("toolu_1"), use("toolu_2")], "tool_use")
    log.tool("toolu_1", "list_tickets", output="a")
    log.tool("toolu_2", "list_tickets", output="b")
    log.model([text("thinking")], "pause_turn")
    log.model([use("toolu_3")], "tool_use")
    log.tool("toolu_3", "list_tickets", status=StepStatus.ERROR, output="boom")
    log.model([use("toolu_4")], "tool_use")
    log.tool("toolu_4", "list_tickets", status=StepStatus.STARTED)
    log.model([text("done")], "end_turn")
    return log


def _growing(log: Log) -> list[list[Step]]:
    """The step lists a worker sees, step after step; a STARTED row is replaced by its DONE
    row in place (same key, same seq), as the step log cache does."""
    out: list[list[Step]] = []
    current: list[Step] = []
    for step in log.steps:
        current = [*current, step]
        out.append(current)
        if step.status is StepStatus.STARTED:
            done = dataclasses.replace(step, status=StepStatus.DONE, response="late")
            current = [*current[:-1], done]
            out.append(current)
    return out


def test_the_cache_replays_every_prefix_exactly_as_a_full_replay() -> None:
    cache = ReplayCache()
    for steps in _growing(_long_log()):
        assert cache.replay(RUN_ID, QUESTION, steps) == replay(QUESTION, steps)
    assert cache.hits >= 8, "a growing log continues from the cached fold"
    assert cache.misses == 2, "the first step, and the STARTED row replaced by its DONE row"


def test_a_conversation_handed_out_is_not_changed_by_later_steps() -> None:
    cache = ReplayCache()
    lists = _growing(_long_log())
    handed = [cache.replay(RUN_ID, QUESTION, steps) for steps in lists]
    snapshots = [copy.deepcopy(c) for c in handed]
    for steps in lists:  # the same steps again, and more, through the same cache
        cache.replay(RUN_ID, QUESTION, steps)
    assert handed == snapshots


def test_rows_read_again_from_the_database_are_replayed_in_full() -> None:
    cache = ReplayCache()
    log = _long_log()
    cache.replay(RUN_ID, QUESTION, log.steps[:4])
    reread = [dataclasses.replace(s) for s in log.steps[:6]]  # equal rows, new objects
    reread[1] = dataclasses.replace(reread[1], response="changed by an operator")
    assert cache.replay(RUN_ID, QUESTION, reread) == replay(QUESTION, reread)
    assert cache.misses == 2


def test_runs_do_not_share_folds_and_the_cache_is_bounded() -> None:
    cache = ReplayCache(capacity=2)
    log = _long_log()
    other = uuid.UUID(int=2)
    cache.replay(RUN_ID, QUESTION, log.steps[:3])
    assert cache.replay(other, "another question", log.steps[:3]) == replay(
        "another question", log.steps[:3]
    )
    cache.replay(uuid.UUID(int=3), QUESTION, log.steps[:1])
    assert cache.replay(RUN_ID, QUESTION, log.steps[:4]) == replay(QUESTION, log.steps[:4])
    assert cache.misses == 4, "the oldest run's fold was dropped"
